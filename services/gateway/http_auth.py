"""Authentication and the request-body limits, enforced before a body is read.

`AuthBeforeBody` is a pure ASGI middleware: a request to anything but a public route
needs a known bearer key before a byte of its body is read (FastAPI parses a body before
it resolves a route's dependencies, so a dependency alone would let an anonymous client
make the gateway buffer and parse whatever it sends), a body may not exceed
`max_body_bytes` (a declared `Content-Length` is refused up front, a streamed body as soon
as it passes the limit), and the whole body must arrive within `body_timeout_s` of the
request's headers: a client that declares 1,000 bytes, sends 10 and stalls gets a 408 and
its connection closed, rather than holding a connection and a request slot for as long as
it likes (a thousand such sockets used to stall every request of the gateway). The
`require` dependency then checks each route's scope (read or admin) and is what the
OpenAPI document shows as the one security scheme.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.auth import ApiKey, ApiKeys
from services.common.auth import Scope as KeyScope
from services.common.errors import CoxswainError, InvalidRequestError, TooLargeError
from services.gateway.http_errors import error_body, error_response
from services.gateway.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="A Coxswain API key (read or admin scope).",
)


def require(keys: ApiKeys, scope: KeyScope) -> Any:
    """A FastAPI dependency: the request's `Authorization: Bearer` key must have `scope`
    (401/403 via `ApiKeys.check`, which the error handlers map)."""

    def check(
        request: Request,
        _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    ) -> ApiKey | None:
        return keys.check(request.headers.get("authorization"), scope)

    return Depends(check)


class AuthBeforeBody:
    """ASGI middleware: 401 for a path not in `public` (exact paths) without a known key,
    413 for a body over `max_body_bytes`, both before the app reads the body, and 408 (the
    connection closed) for a body not all there `body_timeout_s` after the request began.
    A route is authenticated unless listed, so one added later is never public by accident."""

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys,
        public: Collection[str],
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ):
        if max_body_bytes < 0:
            raise InvalidRequestError(f"max_body_bytes must be >= 0, got {max_body_bytes}")
        if not body_timeout_s > 0:
            raise InvalidRequestError(f"body_timeout_s must be > 0, got {body_timeout_s}")
        self.app, self.keys, self.public, self.max_body_bytes = app, keys, public, max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            if _route_path(scope) not in self.public:
                self.keys.check(headers.get("authorization"), "read")  # scope: the route's
            declared = _content_length(headers)
            if declared is not None and declared > self.max_body_bytes:
                raise self._too_large(f"the request body is {declared} bytes, more than")
        except CoxswainError as exc:
            await error_response(exc)(scope, receive, send)
            return
        received = 0
        body_complete = False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        started = False

        async def counted_receive() -> Message:
            nonlocal received, body_complete
            if body_complete:  # what follows the body is the disconnect, whenever it comes
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not all arrive within {self.body_timeout_s:g} s "
                    f"({received} bytes came): this server's limit (body_timeout_s)",
                    headers={"Connection": "close"},  # what else it sends is never read
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_complete = not message.get("more_body", False)
                if received > self.max_body_bytes:  # a streamed body: stop reading it here
                    raise HTTPException(413, str(self._too_large("the request body is over")))
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except HTTPException as exc:  # raised past the app's handlers (a route not FastAPI's)
            if started or exc.status_code not in (408, 413):
                raise
            code = TooLargeError.__name__ if exc.status_code == 413 else None
            body = error_body(exc.status_code, str(exc.detail), code)
            await JSONResponse(body, exc.status_code, exc.headers)(scope, receive, send)

    def _too_large(self, what: str) -> TooLargeError:
        return TooLargeError(
            f"{what} this server's limit of {self.max_body_bytes} bytes (max_body_bytes)"
        )


def _route_path(scope: Scope) -> str:
    """The path the app routes on: without the prefix it is mounted under (Serve's
    `route_prefix` arrives as `root_path`, which `path` includes)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


def _content_length(headers: Headers) -> int | None:
    value = headers.get("content-length")
    if value is None:
        return None
    try:
        length = int(value)
    except ValueError:
        length = -1
    if length < 0:
        raise InvalidRequestError(f"invalid Content-Length header: {value[:40]!r}")
    return length
