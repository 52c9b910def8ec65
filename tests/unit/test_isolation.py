"""The tests never attach to a Ray cluster running beside them (issue 12, item 21).

`make demo` leaves `coxswain up`'s cluster running; `make test` then ran 16 tests against it
because their `ray.init()` (no address) attaches to the last `ray start` cluster or to
`RAY_ADDRESS`. Every test starts Ray through `tests.local_ray.start_local_ray`, whose
`ray.init` says `address="local"`, and the session must not pass `RAY_ADDRESS` on to
subprocesses.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from tests import local_ray

TESTS = Path(__file__).resolve().parents[1]


def _ray_init_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "init"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "ray"
        ):
            yield node


def test_every_test_starts_its_own_local_ray_through_one_helper():
    calls = {}
    for path in sorted(TESTS.rglob("*.py")):
        for call in _ray_init_calls(ast.parse(path.read_text(), str(path))):
            calls[f"{path.relative_to(TESTS.parent)}:{call.lineno}"] = call
    # One place starts Ray (tests/local_ray.py, which also retries a slow start) ...
    assert {where.split(":")[0] for where in calls} == {"tests/local_ray.py"}, sorted(calls)
    # ... and it says address="local", so it never attaches to a cluster.
    for call in calls.values():
        address = {kw.arg: kw.value for kw in call.keywords}.get("address")
        assert isinstance(address, ast.Constant) and address.value == "local"
    # The fixtures really go through it.
    users = [p for p in TESTS.rglob("*.py") if "start_local_ray(" in p.read_text()]
    assert len(users) >= 8


def test_a_start_that_times_out_is_tried_again_and_other_errors_are_not(monkeypatch):
    ray = pytest.importorskip("ray")
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen ...")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(local_ray.time, "sleep", lambda s: None)
    local_ray.start_local_ray(num_cpus=1)
    assert len(calls) == 2 and calls[1]["address"] == "local" and calls[1]["num_cpus"] == 1

    def refuse(**kwargs):
        calls.append(kwargs)
        raise ValueError("When connecting to an existing cluster, num_cpus must not be provided")

    monkeypatch.setattr(ray, "init", refuse)
    calls.clear()
    with pytest.raises(ValueError, match="existing cluster"):
        local_ray.start_local_ray(num_cpus=1)
    assert len(calls) == 1


def test_the_session_passes_no_ray_address_on():
    assert "RAY_ADDRESS" not in os.environ
    assert os.environ.get("RAY_ENABLE_AUTO_CONNECT") == "0"
