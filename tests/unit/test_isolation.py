"""The tests never attach to a Ray cluster running beside them (issue 12, item 21).

`make demo` leaves `coxswain up`'s cluster running; `make test` then ran 16 tests against it
because their `ray.init()` (no address) attaches to the last `ray start` cluster or to
`RAY_ADDRESS`. Every `ray.init` under tests/ must say `address="local"`, and the session
must not pass `RAY_ADDRESS` on to subprocesses.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

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


def test_every_ray_init_in_the_tests_starts_its_own_local_ray():
    found, attaching = 0, []
    for path in sorted(TESTS.rglob("*.py")):
        for call in _ray_init_calls(ast.parse(path.read_text(), str(path))):
            found += 1
            address = {kw.arg: kw.value for kw in call.keywords}.get("address")
            if not (isinstance(address, ast.Constant) and address.value == "local"):
                attaching.append(f"{path.relative_to(TESTS.parent)}:{call.lineno}")
    assert found >= 4  # the scan really sees the fixtures
    assert not attaching, f'ray.init without address="local" attaches to a cluster: {attaching}'


def test_the_session_passes_no_ray_address_on():
    assert "RAY_ADDRESS" not in os.environ
    assert os.environ.get("RAY_ENABLE_AUTO_CONNECT") == "0"
