"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from tests.local_ray import start_local_ray


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray for one test module (2 CPUs' worth of slots over-subscribed to 4, so
    a trainer, its rollout actors and the driver fit)."""
    ray = pytest.importorskip("ray")
    start_local_ray(num_cpus=4)  # a Ray of its own, never a `coxswain up` cluster
    yield
    ray.shutdown()
