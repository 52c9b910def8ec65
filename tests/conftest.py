"""Shared fixtures: tiny real checkpoints (built once per session) and the HF oracle.

The tests must never touch a Ray cluster the user has running (the README's order is `make
demo`, which leaves `coxswain up`'s cluster up, then `make test`). `ray.init()` without an
address attaches to the last `ray start` cluster on the host or to `RAY_ADDRESS`, so every
test starts its own Ray through `tests.local_ray.start_local_ray`, which says
`address="local"` (tests/unit/test_isolation.py checks that nothing else calls `ray.init`),
and the session drops `RAY_ADDRESS` so that no subprocess a test starts (the `coxswain`
CLI, a trainer) inherits it. Ray's implicit `ray.init()` on a first `.remote()`
is switched off for the same reason: a test that forgets to start Ray fails rather than
attaching to whatever is running.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.engine.model.tiny import make_tiny_checkpoint

# At import, before any test module imports ray (Ray reads its auto-connect flag at import).
os.environ.pop("RAY_ADDRESS", None)
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def bf16_device(request) -> str:
    """Where a bf16 test runs: on CPU (the reference kernels: dtype paths, casts) and, where
    there is one, on CUDA (Triton kernels, graphs)."""
    return request.param


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(arch, **kw) -> Path`: a real HF checkpoint dir, cached per arguments."""
    cache: dict[tuple, Path] = {}

    def build(arch: str = "llama", **kw) -> Path:
        key = (arch, *sorted(kw.items()))
        if key not in cache:
            name = "-".join([arch, *(f"{k}{v}" for k, v in sorted(kw.items()))])
            cache[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(name), arch, **kw)
        return cache[key]

    return build
