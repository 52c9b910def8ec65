"""Bearer API keys with read-only and admin scopes, shared by the HTTP gateway and gRPC.

Several keys may be valid at once, so a key can be rotated without downtime: add the new
one, move clients over, remove the old one. Keys come from `COXSWAIN_API_KEYS`
(`name:scope:secret` items, comma-separated) or a file with one such item per line.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.common.errors import (
    InvalidRequestError,
    PermissionDeniedError,
    UnauthenticatedError,
)

Scope = Literal["read", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "admin")
ENV_VAR = "COXSWAIN_API_KEYS"


@dataclass(frozen=True)
class ApiKey:
    """One accepted key; `admin` may also do everything `read` may."""

    name: str
    scope: Scope
    secret: str = ""

    def __repr__(self) -> str:  # never log a secret
        return f"ApiKey(name={self.name!r}, scope={self.scope!r})"


class ApiKeys:
    """The set of accepted keys. An empty set means auth is off (local development only)."""

    def __init__(self, keys: list[ApiKey] | None = None):
        self.keys = list(keys or [])
        for k in self.keys:
            if k.scope not in SCOPES:
                raise InvalidRequestError(f"API key {k.name!r}: scope must be read or admin")
            if len(k.secret) < 16:
                raise InvalidRequestError(f"API key {k.name!r}: secret shorter than 16 chars")

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @classmethod
    def parse(cls, text: str) -> ApiKeys:
        """`name:scope:secret` items separated by commas or newlines; `#` starts a comment."""
        keys = []
        for raw in text.replace(",", "\n").splitlines():
            item = raw.split("#", 1)[0].strip()
            if not item:
                continue
            parts = item.split(":", 2)
            if len(parts) != 3:
                raise InvalidRequestError("an API key item must read name:scope:secret")
            name, scope, secret = (p.strip() for p in parts)
            keys.append(ApiKey(name, scope, secret))  # type: ignore[arg-type]
        return cls(keys)

    @classmethod
    def from_env(cls, path: str | Path | None = None) -> ApiKeys:
        """Keys from a file (when given or `COXSWAIN_API_KEYS_FILE` is set) or the env var."""
        path = path or os.environ.get(ENV_VAR + "_FILE")
        if path:
            return cls.parse(Path(path).read_text())
        return cls.parse(os.environ.get(ENV_VAR, ""))

    def check(self, authorization: str | None, scope: Scope = "read") -> ApiKey | None:
        """The key behind an `Authorization: Bearer <secret>` value, if its scope suffices.

        Raises UnauthenticatedError (missing or unknown key) or PermissionDeniedError (a
        read-only key on an admin operation). Returns None when auth is off.
        """
        if not self.enabled:
            return None
        token = _bearer(authorization)
        if token is None:
            raise UnauthenticatedError("missing bearer API key (Authorization: Bearer <key>)")
        match = None
        for k in self.keys:  # compare against every key: timing says nothing about which
            if hmac.compare_digest(k.secret.encode(), token.encode()):
                match = k
        if match is None:
            raise UnauthenticatedError("unknown API key")
        if scope == "admin" and match.scope != "admin":
            raise PermissionDeniedError(f"API key {match.name!r} is read-only: admin needed")
        return match


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    kind, _, token = value.strip().partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
