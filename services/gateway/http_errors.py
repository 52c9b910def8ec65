"""Errors as HTTP responses: one OpenAI-style body, `{"error": {"message", "type", "code"}}`.

Status codes come from `services.common.errors.http_status` and nowhere else; request
bodies that fail validation are 400 (OpenAI's code for them, where FastAPI says 422).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.errors import CoxswainError, UnauthenticatedError, http_status

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


def error_body(status: int, message: str, code: str | None = None) -> dict:
    """The error body every route answers with. A message quoting a client's lone surrogate
    shows it escaped (`\\ud800`): the response must still encode as UTF-8."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "code": code}}


def error_response(exc: BaseException) -> JSONResponse:
    """The response for an exception (4xx for the caller's mistakes, 5xx otherwise). Our own
    errors say what happened (a 503 names the replica that failed); anything else is a bug,
    logged here and answered without internals."""
    status = http_status(exc)
    if not isinstance(exc, CoxswainError):
        return JSONResponse(error_body(status, "internal server error"), status)
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, UnauthenticatedError) else None
    return JSONResponse(error_body(status, str(exc), type(exc).__name__), status, headers)


def validation_message(exc: RequestValidationError) -> str:
    """Pydantic's errors as one line: `body.temperature: Input should be >= 0; ...`."""
    parts = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e.get("loc", ()))
        parts.append(f"{where}: {e.get('msg', 'invalid')}" if where else e.get("msg", "invalid"))
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to the one error body."""

    @app.exception_handler(CoxswainError)
    async def coxswain_error(request: Request, exc: CoxswainError) -> JSONResponse:
        if http_status(exc) >= 500:
            log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, validation_message(exc), "InvalidRequestError"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), exc.status_code, exc.headers
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, "internal server error"), 500)
