"""The one exception hierarchy of Coxswain, mapped once to HTTP status codes.

Every error a user can cause is a `CoxswainError` whose message names the problem.
Servers map these to responses with `http_status`; nothing else decides status codes.
"""

from __future__ import annotations


class CoxswainError(Exception):
    """Base of every error Coxswain raises on purpose."""

    http_status = 500


class InvalidRequestError(CoxswainError, ValueError):
    """A request (prompt, sampling values, intervention spec) is malformed or out of range."""

    http_status = 400


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

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RequestNotFoundError(NotFoundError):
    """An operation named a request id the engine does not know."""


class DuplicateRequestError(InvalidRequestError):
    """A request id is already in use by an unfinished request."""


def http_status(exc: BaseException) -> int:
    """The HTTP status code for an exception: 4xx for the caller's mistakes, 500 otherwise."""
    return exc.http_status if isinstance(exc, CoxswainError) else 500
