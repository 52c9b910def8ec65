"""Shared fixtures: tiny real checkpoints (built once per session) and the HF oracle."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.model.tiny import make_tiny_checkpoint

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


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
