"""The patch store as a Ray actor: it serves gRPC from inside the actor, a client round-trips
a run through it, and the actor reports the same stats."""

from __future__ import annotations

import pytest
import torch

from services.patch_store.actor import start_patch_store_actor
from services.patch_store.client import PatchStoreClient

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_actor_serves_grpc_and_a_client_round_trips_a_run(local_ray):
    actor = start_patch_store_actor(2**20, max_message_bytes=2**20)
    address = ray.get(actor.address.remote(), timeout=60)
    rows = {(layer, "post_block"): torch.randn(3, 32).to(torch.bfloat16) for layer in (0, 1)}
    with PatchStoreClient(address, timeout_s=10) as client:
        client.wait_ready(timeout_s=10)
        assert client.health() == "SERVING"
        m = client.put_run("clean", rows, [4, 5, 6], model="tiny@1")
        assert m.keys == ((0, "post_block"), (1, "post_block"))
        got = client.get_rows("clean", [(1, "post_block", 6), (0, "post_block", 4)])
        expected = torch.stack([rows[(1, "post_block")][2], rows[(0, "post_block")][0]])
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    stats = ray.get(actor.stats.remote(), timeout=30)
    assert (stats["puts"], stats["hits"], stats["bytes"]) == (1, 1, 2 * 3 * 32 * 2)
    ray.get(actor.stop.remote(), timeout=30)
    ray.kill(actor)
