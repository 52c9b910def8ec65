"""The bearer-key dependency every authenticated HTTP route uses (the API routes and the
dashboard's data route), declared once so the OpenAPI document names one security scheme."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.common.auth import ApiKey, ApiKeys, Scope

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="A Coxswain API key (read or admin scope).",
)


def require(keys: ApiKeys, scope: Scope) -> Any:
    """A FastAPI dependency: the request's `Authorization: Bearer` key must have `scope`
    (401/403 via `ApiKeys.check`, which the error handlers map)."""

    def check(
        request: Request,
        _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    ) -> ApiKey | None:
        return keys.check(request.headers.get("authorization"), scope)

    return Depends(check)
