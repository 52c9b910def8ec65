"""What every converter of this package does with fields: build a message whose values may
not fit their fields (`checked`: the caller's fault, not a server error), and read an
optional field so that the schema's default applies when the message left it out
(`put_given`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.common.errors import InvalidRequestError


def checked(build: Callable[[], Any], what: str) -> Any:
    """Run a message builder, turning protobuf's TypeError/ValueError for a value that does
    not fit its field (a string for an int, an int past int32) into InvalidRequestError."""
    try:
        return build()
    except InvalidRequestError:
        raise
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{what} does not fit the wire format: {e}") from None


def put_given(d: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` only when the message gave a value, so the schema's default applies."""
    if value is not None:
        d[key] = value
