"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray for one test module (2 CPUs' worth of slots over-subscribed to 4, so
    a trainer, its rollout actors and the driver fit)."""
    ray = pytest.importorskip("ray")
    # address="local": a Ray of its own, never a `coxswain up` cluster on the same machine
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
