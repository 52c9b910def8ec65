"""The one exception hierarchy of Coxswain, mapped once to HTTP and once to gRPC status codes,
and unwrapped once from Ray.

Every error a user can cause is a `CoxswainError` whose message names the problem.
Servers map these to responses with `http_status` and `grpc_status` (gRPC servers through
`grpc_abort_args`, which bounds the message so it fits gRPC's metadata limit); gRPC clients
turn a status back into the same class with `error_from_grpc`. An error that crossed a Ray
call becomes the error it stands for with `unwrap_ray_error`, so users see the cause's
message, never Ray's traceback (pids, addresses, actor ids, file paths, ANSI colours).
Nothing else decides status codes.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


class CoxswainError(Exception):
    """Base of every error Coxswain raises on purpose."""

    http_status = 500
    grpc_code = "INTERNAL"  # a `grpc.StatusCode` member name; grpc is imported only on use


class InvalidRequestError(CoxswainError, ValueError):
    """A request (prompt, sampling values, intervention spec) is malformed or out of range."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"


class PromptTooLongError(InvalidRequestError):
    """A prompt does not fit the model's context or the KV cache."""


class CheckpointError(CoxswainError):
    """A checkpoint directory is missing files, tensors or holds inconsistent shapes."""

    http_status = 500


class UnsupportedArchitectureError(CheckpointError):
    """config.json names an architecture Coxswain has no implementation for."""


class NotFoundError(CoxswainError, KeyError):
    """An operation named a resource (a request, a registered vector, ...) that does not exist."""

    http_status = 404
    grpc_code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RequestNotFoundError(NotFoundError):
    """An operation named a request id the engine does not know."""


class ActionQueueFullError(CoxswainError):
    """A controller action could not be queued: the engine's bounded action queue is full."""

    http_status = 503
    grpc_code = "UNAVAILABLE"


class DuplicateRequestError(InvalidRequestError):
    """A request id is already in use by an unfinished request."""


class RunNotFoundError(NotFoundError):
    """An operation named a run id the patch store does not hold (never put, evicted, dropped)."""


class RunExistsError(InvalidRequestError):
    """A run id is already stored and the put did not ask to overwrite it."""

    http_status = 409
    grpc_code = "ALREADY_EXISTS"


class TooLargeError(InvalidRequestError):
    """A request or payload exceeds a configured size limit (message size, store byte budget)."""

    http_status = 413
    grpc_code = "RESOURCE_EXHAUSTED"


class PatchPassUnavailableError(InvalidRequestError):
    """A layered patching pass cannot run on this engine now (its message says why); a
    sweep that chose its executor automatically runs its cells as requests instead."""


class ServiceUnavailableError(CoxswainError):
    """A service Coxswain called did not answer in time or could not be reached."""

    http_status = 503
    grpc_code = "UNAVAILABLE"


class UnauthenticatedError(CoxswainError):
    """A route needs a bearer API key and none (or an unknown one) came with the call."""

    http_status = 401
    grpc_code = "UNAUTHENTICATED"


class PermissionDeniedError(CoxswainError):
    """The API key is valid but its scope does not allow this operation (admin needed)."""

    http_status = 403
    grpc_code = "PERMISSION_DENIED"


def http_status(exc: BaseException) -> int:
    """The HTTP status code for an exception: 4xx for the caller's mistakes, 500 otherwise."""
    return exc.http_status if isinstance(exc, CoxswainError) else 500


# gRPC: servers send the status code plus the class name in this trailing-metadata key, so a
# client re-raises the exact class (RunNotFoundError, not just NotFoundError).
GRPC_ERROR_METADATA_KEY = "coxswain-error"


def grpc_status(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code for an exception: INVALID_ARGUMENT, NOT_FOUND, ... or INTERNAL."""
    import grpc

    return grpc.StatusCode[exc.grpc_code if isinstance(exc, CoxswainError) else "INTERNAL"]


# gRPC sends a status message as trailing metadata, which a client refuses past 8 KiB (the
# caller then sees gRPC's own "metadata size exceeds" text): messages are cut well below.
MAX_ERROR_MESSAGE_CHARS = 1024
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def public_message(exc: BaseException, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str:
    """What a user is told about `exc`: its message without terminal colour codes, cut to
    `limit` characters (a huge id quoted back must not make the reply undeliverable)."""
    text = _ANSI.sub("", str(exc))
    return text if len(text) <= limit else text[: limit - 30] + f"... ({len(text)} characters)"


def grpc_abort_args(
    exc: BaseException,
) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """`(code, details, trailing_metadata)` to end a gRPC call with `exc`: our errors keep
    their message and name their class; anything else is INTERNAL, named by its type only
    (a bug's message may hold internals; the server logs it)."""
    if isinstance(exc, CoxswainError):
        metadata = ((GRPC_ERROR_METADATA_KEY, type(exc).__name__),)
        return grpc_status(exc), public_message(exc), metadata
    return grpc_status(exc), f"internal error ({type(exc).__name__})", ()


def unwrap_ray_error(exc: BaseException, what: str = "the engine replica") -> BaseException:
    """The error a Ray call's failure stands for, for users to see: our `CoxswainError`
    raised inside the task or actor (a `RayTaskError`'s cause), or a ServiceUnavailableError
    naming only `what` (the actor or replica called) and an exception type when it died,
    was cancelled, did not answer, or failed with anything else (logged here in full: a
    collective op under a dying rank raises plain RuntimeErrors whose text holds addresses).

    `RayTaskError` is checked first: Ray makes it a subclass of its cause's class, so a
    wrapped InvalidRequestError *is* an InvalidRequestError whose message is the traceback."""
    import ray.exceptions as rex

    for _ in range(8):  # a task that called a task: one RayTaskError per hop
        if not isinstance(exc, rex.RayTaskError):
            break
        cause = getattr(exc, "cause", None)
        if cause is None:
            return ServiceUnavailableError(f"{what} failed during the call: retry shortly")
        if not isinstance(cause, CoxswainError | rex.RayError):
            logging.getLogger(__name__).error("%s failed during a call", what, exc_info=cause)
            return ServiceUnavailableError(
                f"{what} failed during the call ({type(cause).__name__}): retry shortly"
            )
        exc = cause
    if isinstance(exc, CoxswainError) or not isinstance(exc, (rex.RayError, *_serve_errors())):
        return exc
    if isinstance(exc, rex.TaskCancelledError):
        return ServiceUnavailableError(f"the call to {what} was cancelled")
    if isinstance(exc, rex.GetTimeoutError):
        return ServiceUnavailableError(f"{what} did not answer in time: retry shortly")
    if isinstance(exc, rex.RayActorError | rex.ActorUnavailableError):
        return ServiceUnavailableError(
            f"{what} failed during the call; it is being replaced: retry shortly"
        )
    return ServiceUnavailableError(f"{what} is unavailable ({type(exc).__name__}): retry shortly")


def _serve_errors() -> tuple[type[BaseException], ...]:
    """Ray Serve's own errors (not RayErrors): only where Serve is loaded, as only Serve
    raises them (importing it elsewhere would cost a second)."""
    module = sys.modules.get("ray.serve.exceptions")
    return (module.RayServeException,) if module is not None else ()


# Statuses a server sends without naming a class (gRPC's own limits, transport failures).
_GRPC_FALLBACK: dict[str, type[CoxswainError]] = {
    "INVALID_ARGUMENT": InvalidRequestError,
    "OUT_OF_RANGE": InvalidRequestError,
    "NOT_FOUND": NotFoundError,
    "ALREADY_EXISTS": RunExistsError,
    "RESOURCE_EXHAUSTED": TooLargeError,
    "UNAVAILABLE": ServiceUnavailableError,
    "DEADLINE_EXCEEDED": ServiceUnavailableError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "PERMISSION_DENIED": PermissionDeniedError,
}


def error_from_grpc(code_name: str, message: str, error_name: str | None = None) -> CoxswainError:
    """The exception a gRPC status stands for: the class the server named (when it is one of
    ours with that status code), else the class for the code, else `CoxswainError`."""
    cls = _ERROR_CLASSES.get(error_name or "")
    if cls is None or cls.grpc_code != code_name:
        cls = _GRPC_FALLBACK.get(code_name, CoxswainError)
    return cls(f"{message} (gRPC {code_name})" if cls is CoxswainError else message)


def error_from_rpc(e: BaseException, where: str, *, limit_hint: str = "") -> CoxswainError:
    """The exception a failed gRPC call (`grpc.RpcError`, blocking or asyncio) stands for:
    the class the server named in trailing metadata, else the class for its status code.
    Unreachable and timed-out calls name `where` (e.g. "engine at host:port"); `limit_hint`
    is added when gRPC itself refused a message as too large (no class named)."""
    import grpc

    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    error_name = dict(trailing or ()).get(GRPC_ERROR_METADATA_KEY)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        details = f"{where}: {details}"
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and error_name is None and limit_hint:
        details = f"{where}: {details}; {limit_hint}"
    return error_from_grpc(code.name, details, error_name)


def _error_classes() -> dict[str, type[CoxswainError]]:
    found: dict[str, type[CoxswainError]] = {}
    todo: list[type[CoxswainError]] = [CoxswainError]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return {name: cls for name, cls in found.items() if cls.__module__ == __name__}


_ERROR_CLASSES = _error_classes()
