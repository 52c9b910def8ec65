"""Errors raised inside Ray actors reach users as the cause's message with the right status:
`unwrap_ray_error` takes a `RayTaskError` (which Ray makes a subclass of its cause's class,
with the whole remote traceback as its message) back to the cause, once per hop, and turns
a dead or cancelled actor into a clean 503 — no traceback, ANSI codes, pids, addresses,
actor ids or file paths in anything a user sees."""

from __future__ import annotations

import re
import time

import grpc
import pytest

from services.common.errors import (
    GRPC_ERROR_METADATA_KEY,
    InvalidRequestError,
    ServiceUnavailableError,
    grpc_abort_args,
    http_status,
    unwrap_ray_error,
)
from tests.local_ray import start_local_ray

ray = pytest.importorskip("ray")

LEAKS = re.compile(r"RayTaskError|Traceback|\x1b\[|pid=|ip=|\d+\.\d+\.\d+\.\d+|\.py\b|[0-9a-f]{24}")


@pytest.fixture(scope="module")
def local_ray():
    start_local_ray(num_cpus=1)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Refuser:
    def refuse(self) -> None:
        raise InvalidRequestError("temperature must be >= 0, got -1")

    def crash(self) -> None:
        raise ZeroDivisionError("a bug")

    def via(self, other) -> None:
        ray.get(other.refuse.remote())  # a second hop: RayTaskError inside RayTaskError

    def pid(self) -> int:
        import os

        return os.getpid()


def _raised(ref) -> BaseException:
    with pytest.raises(Exception) as err:
        ray.get(ref, timeout=60)
    return err.value


def _failure_once_dead(actor) -> BaseException:
    """What a call to a killed actor raises. `ray.kill` returns before the actor is gone, and
    a call made meanwhile may still be answered: call until one fails (bounded)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.pid.remote(), timeout=60)
        except Exception as e:
            return e
        time.sleep(0.05)
    raise AssertionError("the killed actor kept answering for 60 s")


def test_an_actors_invalid_request_error_comes_back_as_itself(local_ray):
    actor = Refuser.remote()
    for raised in (_raised(actor.refuse.remote()), _raised(Refuser.remote().via.remote(actor))):
        assert isinstance(raised, ray.exceptions.RayTaskError)
        # Ray's error *is* an InvalidRequestError, with the traceback as its message: checking
        # for our class first (the old gateway code) would show users that traceback
        assert isinstance(raised, InvalidRequestError) and LEAKS.search(str(raised))
        error = unwrap_ray_error(raised, "the engine replica")
        assert type(error) is InvalidRequestError
        assert str(error) == "temperature must be >= 0, got -1"
        assert http_status(error) == 400
        code, details, trailing = grpc_abort_args(error)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details == "temperature must be >= 0, got -1"
        assert dict(trailing)[GRPC_ERROR_METADATA_KEY] == "InvalidRequestError"


def test_any_other_failure_in_an_actor_is_a_503_that_names_only_its_type(local_ray):
    error = unwrap_ray_error(_raised(Refuser.remote().crash.remote()), "the engine replica")
    assert isinstance(error, ServiceUnavailableError) and http_status(error) == 503
    assert str(error) == (
        "the engine replica failed during the call (ZeroDivisionError): retry shortly"
    )
    code, details, _ = grpc_abort_args(error)
    assert code == grpc.StatusCode.UNAVAILABLE and details == str(error)


def test_a_bug_outside_ray_is_internal_and_names_only_its_type():
    code, details, trailing = grpc_abort_args(ZeroDivisionError("/srv/secret.py line 3"))
    assert code == grpc.StatusCode.INTERNAL and details == "internal error (ZeroDivisionError)"
    assert trailing == ()


def test_a_dead_actor_is_a_clean_503(local_ray):
    actor = Refuser.remote()
    ray.get(actor.pid.remote(), timeout=60)
    ray.kill(actor)
    error = unwrap_ray_error(_failure_once_dead(actor), "the controller")
    assert isinstance(error, ServiceUnavailableError) and http_status(error) == 503
    assert str(error).startswith("the controller failed during the call")
    assert not LEAKS.search(str(error)), str(error)
