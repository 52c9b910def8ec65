"""The in-process patch store: rows, LRU under a byte budget, leases, drops, metadata, metrics."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.common.errors import (
    InvalidRequestError,
    NotFoundError,
    RunExistsError,
    RunNotFoundError,
    TooLargeError,
    grpc_status,
    http_status,
)
from services.patch_store.store import Manifest, PatchStore

H = 16
POSITIONS = [0, 1, 2, 3]
RUN_BYTES = 2 * len(POSITIONS) * H * 4  # two (layer, site) pairs of float32


class Clock:
    """A clock the test moves by hand, so leases expire without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rows(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        (0, "post_block"): torch.randn(len(POSITIONS), H, generator=g).to(dtype),
        (3, "pre_attn"): torch.randn(len(POSITIONS), H, generator=g).to(dtype),
    }


def store_for(runs: int, clock: Clock | None = None) -> PatchStore:
    """A store whose budget holds exactly `runs` runs of `rows()`."""
    return PatchStore(runs * RUN_BYTES, clock=clock or Clock())


def held(store: PatchStore) -> list[str]:
    return [m.run_id for m in store.manifests()]


# -- rows in, rows out -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_get_rows_returns_the_stored_rows_bit_exact_in_their_dtype(dtype):
    store = store_for(4)
    r = rows(1, dtype)
    store.put_run("clean", r, [5, 6, 7, 8])
    keys = [(3, "pre_attn", 8), (0, "post_block", 5), (0, "post_block", 8), (3, "pre_attn", 6)]
    out = store.get_rows("clean", keys)
    assert out.dtype == dtype and out.shape == (4, H)
    expected = torch.stack(
        [
            r[(3, "pre_attn")][3],
            r[(0, "post_block")][0],
            r[(0, "post_block")][3],
            r[(3, "pre_attn")][1],
        ]
    )
    assert torch.equal(out, expected)
    assert store.get_rows("clean", []).shape == (0, H)


def test_the_store_keeps_its_own_copy_and_callers_get_their_own():
    store = store_for(2)
    r = rows()
    original = r[(0, "post_block")].clone()
    store.put_run("a", r, POSITIONS)
    r[(0, "post_block")].zero_()  # the caller reuses its buffer
    got = store.get_rows("a", [(0, "post_block", 0)])
    assert torch.equal(got[0], original[0])
    got.zero_()
    assert torch.equal(store.get_rows("a", [(0, "post_block", 0)])[0], original[0])


def test_unknown_run_is_run_not_found_404():
    store = store_for(2)
    with pytest.raises(RunNotFoundError, match="'ghost' is not in the patch store") as e:
        store.get_rows("ghost", [(0, "post_block", 0)])
    assert isinstance(e.value, NotFoundError)
    assert http_status(e.value) == 404 and grpc_status(e.value).name == "NOT_FOUND"


def test_a_missing_row_names_the_key_and_what_the_run_holds():
    store = store_for(2)
    store.put_run("clean", rows(), POSITIONS)
    with pytest.raises(InvalidRequestError) as e:
        store.get_rows("clean", [(0, "post_block", 1), (5, "post_block", 1)])
    msg = str(e.value)
    assert "(layer 5, site 'post_block', position 1) (key 1)" in msg
    assert "post_block at layers 0; pre_attn at layers 3" in msg and "positions [0-3]" in msg
    with pytest.raises(InvalidRequestError, match="no position 9"):
        store.get_rows("clean", [(3, "pre_attn", 9)])
    with pytest.raises(InvalidRequestError, match="no \\(layer 0, site 'pre_attn'\\)"):
        store.get_rows("clean", [(0, "pre_attn", 0)])
    with pytest.raises(InvalidRequestError, match="triple"):
        store.get_rows("clean", [(0, "post_block")])
    s = store.stats()
    assert (s["gets"], s["hits"], s["misses"]) == (4, 0, 4)


@pytest.mark.parametrize(
    ("bad_rows", "positions", "match"),
    [
        ({}, POSITIONS, "non-empty dict"),
        ({(0, "post_block"): torch.zeros(3, H)}, POSITIONS, r"\[num_positions=4, H\]"),
        ({(0, "post_block"): torch.zeros(4, H, dtype=torch.int32)}, POSITIONS, "not storable"),
        ({(0, "post_block"): torch.zeros(4, H), (1, "x"): torch.zeros(4, 8)}, POSITIONS, "share"),
        ({"post_block": torch.zeros(4, H)}, POSITIONS, "pairs"),
        ({(0, "post_block"): [[0.0] * H] * 4}, POSITIONS, "must be a tensor"),
        ({(0, "post_block"): torch.zeros(4, H)}, [0, 1, 1, 2], "positions repeat: 1"),
        ({(0, "post_block"): torch.zeros(4, H)}, [0, 1, -2, 3], "non-negative"),
    ],
)
def test_put_run_refuses_malformed_rows(bad_rows, positions, match):
    store = store_for(2)
    with pytest.raises(InvalidRequestError, match=match):
        store.put_run("bad", bad_rows, positions)
    assert store.stats()["runs"] == 0


def test_token_ids_must_cover_the_positions():
    store = store_for(2)
    with pytest.raises(InvalidRequestError, match="position 3 is past its 3 token ids"):
        store.put_run("r", rows(), POSITIONS, token_ids=[1, 2, 3])
    m = store.put_run("r", rows(), POSITIONS, token_ids=[1, 2, 3, 4, 5], model="tiny@abc")
    assert m.token_ids == (1, 2, 3, 4, 5) and m.model == "tiny@abc"


def test_put_over_an_existing_run_needs_overwrite_and_gives_a_new_version():
    store = store_for(3)
    first = store.put_run("r", rows(1), POSITIONS)
    store.lease("r", 60, "engine-0")  # on the bare id: the lease follows it to new contents
    with pytest.raises(RunExistsError, match="overwrite=True") as e:
        store.put_run("r", rows(2), POSITIONS)
    assert grpc_status(e.value).name == "ALREADY_EXISTS"
    m = store.put_run("r", rows(2), POSITIONS, overwrite=True)
    assert m.version > first.version and m.ref == f"r@{m.version}"
    assert m.holders == ("engine-0",)
    assert torch.equal(
        store.get_rows("r", [(0, "post_block", 2)])[0], rows(2)[(0, "post_block")][2]
    )
    # Nobody pinned the first version: it is gone, and reading it says so (never version 2).
    with pytest.raises(RunNotFoundError, match=f"overwritten by version {m.version}") as e:
        store.get_rows(first.ref, [(0, "post_block", 2)])
    assert http_status(e.value) == 404
    assert store.stats()["bytes"] == RUN_BYTES


def test_a_leased_version_outlives_an_overwrite_until_its_lease_ends():
    clock = Clock()
    store = store_for(3, clock)
    v1 = store.put_run("r", rows(1), POSITIONS)
    store.lease(v1.ref, 60, "sweep")
    store.lease("r", 60, "engine-0")
    v2 = store.put_run("r", rows(2), POSITIONS, overwrite=True)
    key = [(0, "post_block", 2)]
    # The holder reads the version it leased; everyone naming the run gets the new one.
    assert torch.equal(store.get_rows(v1.ref, key)[0], rows(1)[(0, "post_block")][2])
    assert torch.equal(store.get_rows("r", key)[0], rows(2)[(0, "post_block")][2])
    assert store.manifests(["r"])[0].holders == ("engine-0",)  # followed the run id
    assert store.manifests([v1.ref])[0].holders == ("sweep",)  # pinned version 1
    s = store.stats()
    assert (s["runs"], s["retired_versions"], s["bytes"]) == (1, 1, 2 * RUN_BYTES)
    assert store.release("r", "sweep")  # a bare run id releases the holder's every version
    with pytest.raises(RunNotFoundError, match=f"overwritten by version {v2.version}"):
        store.get_rows(v1.ref, key)
    assert (store.stats()["retired_versions"], store.stats()["bytes"]) == (0, RUN_BYTES)
    # An expired lease frees a kept version the same way.
    store.lease(v2.ref, 5, "sweep")
    store.put_run("r", rows(3), POSITIONS, overwrite=True)
    assert store.stats()["retired_versions"] == 1
    clock.now += 6
    assert (store.stats()["retired_versions"], store.stats()["bytes"]) == (0, RUN_BYTES)
    with pytest.raises(RunNotFoundError):
        store.get_rows(v2.ref, key)


def test_drop_run_drops_every_version_and_a_bare_version_ref_is_checked():
    store = store_for(3)
    v1 = store.put_run("r", rows(1), POSITIONS)
    store.lease(v1.ref, 60, "sweep")
    store.put_run("r", rows(2), POSITIONS, overwrite=True)
    assert store.drop_run("r") == 2 * RUN_BYTES
    with pytest.raises(RunNotFoundError, match="dropped by its owner"):
        store.get_rows(v1.ref, [(0, "post_block", 0)])
    with pytest.raises(InvalidRequestError, match="integer version"):
        store.get_rows("r@latest", [(0, "post_block", 0)])
    with pytest.raises(InvalidRequestError, match="contains '@'"):
        store.put_run("a@b", rows(), POSITIONS)


def test_a_restarted_store_says_a_run_it_lacks_was_lost_in_the_restart():
    old = store_for(2)
    v1 = old.put_run("r", rows(), POSITIONS)
    new = PatchStore(2 * RUN_BYTES, restarted=True)
    new.put_run("r", rows(1), POSITIONS)  # re-captured under the same id after the restart
    with pytest.raises(RunNotFoundError, match=r"patch store restarted at .* and lost it") as e:
        new.get_rows(v1.ref, [(0, "post_block", 0)])  # never the new run's rows
    assert http_status(e.value) == 404
    with pytest.raises(RunNotFoundError, match=r"restarted at .*every run stored before"):
        new.manifests(["gone"])


def test_a_run_larger_than_the_whole_budget_is_refused():
    store = PatchStore(RUN_BYTES - 1)
    with pytest.raises(
        TooLargeError, match=f"more than the patch store's whole budget of {RUN_BYTES - 1}"
    ):
        store.put_run("big", rows(), POSITIONS)
    assert store.stats()["runs"] == 0


# -- LRU under the byte budget -----------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_run_and_says_so():
    store = store_for(3)
    for name in "abc":
        store.put_run(name, rows(), POSITIONS)
    store.get_rows("a", [(0, "post_block", 0)])  # a is now the most recently used
    store.put_run("d", rows(), POSITIONS)
    assert sorted(held(store)) == ["a", "c", "d"]
    store.lease("c", 10, "h")  # a lease touches too
    store.release("c", "h")
    store.put_run("e", rows(), POSITIONS)
    assert sorted(held(store)) == ["c", "d", "e"]
    with pytest.raises(RunNotFoundError, match="evicted: least recently used"):
        store.get_rows("b", [(0, "post_block", 0)])
    s = store.stats()
    assert (s["evictions"], s["evicted_bytes"], s["bytes"]) == (2, 2 * RUN_BYTES, 3 * RUN_BYTES)


def test_manifests_do_not_touch_the_lru_order():
    store = store_for(2)
    store.put_run("a", rows(), POSITIONS)
    store.put_run("b", rows(), POSITIONS)
    store.manifests(["a"])
    store.put_run("c", rows(), POSITIONS)
    assert held(store) == ["b", "c"]


def test_leases_protect_from_eviction_and_expired_leases_do_not():
    clock = Clock()
    store = store_for(2, clock)
    store.put_run("leased", rows(), POSITIONS)
    assert store.lease("leased", 30, "engine-0") == clock.now + 30
    store.put_run("b", rows(), POSITIONS)
    store.put_run("c", rows(), POSITIONS)  # over budget: b goes, the older leased run stays
    assert held(store) == ["leased", "c"]
    clock.now += 31  # the lease ran out
    store.put_run("d", rows(), POSITIONS)
    assert held(store) == ["c", "d"]
    s = store.stats()
    assert (s["leases_granted"], s["leases_expired"], s["evictions"]) == (1, 1, 2)


def test_a_holder_refreshes_its_own_lease_and_release_reports_what_it_did():
    clock = Clock()
    store = store_for(2, clock)
    store.put_run("r", rows(), POSITIONS)
    store.lease("r", 10, "h1")
    clock.now += 8
    assert store.lease("r", 10, "h1") == clock.now + 10  # refreshed, not stacked
    store.lease("r", 5, "h2")
    m = store.manifests(["r"])[0]
    assert m.holders == ("h1", "h2") and m.leased_until == clock.now + 10
    assert store.release("r", "h1") is True
    assert store.release("r", "h1") is False  # already released
    assert store.release("gone", "h1") is False
    clock.now += 6  # h2's lease ran out
    assert store.manifests(["r"])[0].holders == ()
    assert store.manifests(["r"])[0].leased_until is None
    s = store.stats()
    assert (s["leases_granted"], s["leases_refreshed"], s["leases_released"]) == (2, 1, 1)
    assert s["leases_expired"] == 1 and s["leases_active"] == 0


@pytest.mark.parametrize(("ttl", "holder"), [(0, "h"), (-1, "h"), (float("inf"), "h"), (5, "")])
def test_lease_refuses_bad_ttl_or_holder(ttl, holder):
    store = store_for(1)
    store.put_run("r", rows(), POSITIONS)
    with pytest.raises(InvalidRequestError):
        store.lease("r", ttl, holder)
    with pytest.raises(RunNotFoundError):
        store.lease("missing", 5, "h")


def test_a_put_that_fits_only_by_evicting_leased_runs_is_refused_never_stored_over_budget():
    clock = Clock()
    store = store_for(2, clock)
    for name in "ab":
        store.put_run(name, rows(), POSITIONS)
        store.lease(name, 60, "engine-0")
    with pytest.raises(TooLargeError) as e:
        store.put_run("c", rows(), POSITIONS)  # nothing evictable
    assert str(e.value) == (
        f"run 'c' ({RUN_BYTES} bytes) does not fit the patch store's budget of {2 * RUN_BYTES} "
        f"bytes: leased runs hold {2 * RUN_BYTES} bytes of it, and a leased run is never "
        "evicted; release leases (each ends within 3600 s) or drop runs"
    )
    assert grpc_status(e.value).name == "RESOURCE_EXHAUSTED" and http_status(e.value) == 413
    assert held(store) == ["a", "b"]
    s = store.stats()
    assert s["bytes_over_budget"] == 0 and s["puts_refused"] == 1 and s["puts"] == 2
    assert s["evictions"] == 0 and s["leased_bytes"] == 2 * RUN_BYTES
    store.release("a", "engine-0")  # a is evictable again
    store.put_run("c", rows(), POSITIONS)
    assert held(store) == ["b", "c"] and store.stats()["bytes_over_budget"] == 0
    clock.now += 61
    store.put_run("d", rows(), POSITIONS)
    assert held(store) == ["c", "d"]  # b's lease expired: evicted like any other run


def test_overwriting_a_leased_run_counts_what_the_put_leaves_leased():
    store = store_for(2)
    store.put_run("a", rows(), POSITIONS)
    store.put_run("b", rows(), POSITIONS)
    store.lease("a", 60, "engine-0")  # follows the id: the new contents take a's place
    store.lease("b", 60, "engine-0")
    store.put_run("a", rows(1), POSITIONS, overwrite=True)
    assert held(store) == ["b", "a"]
    v = store.manifests(["a"])[0].ref
    store.lease(v, 60, "sweep")  # pinned: an overwrite keeps this version too
    with pytest.raises(TooLargeError, match="leased runs hold"):
        store.put_run("a", rows(2), POSITIONS, overwrite=True)
    assert store.get_rows("a", [(0, "post_block", 0)]).equal(rows(1)[(0, "post_block")][:1])


def test_drop_run_ignores_leases():
    store = store_for(2)
    store.put_run("r", rows(), POSITIONS)
    store.lease("r", 60, "engine-0")
    assert store.drop_run("r") == RUN_BYTES
    with pytest.raises(RunNotFoundError, match="dropped by its owner"):
        store.get_rows("r", [(0, "post_block", 0)])
    with pytest.raises(RunNotFoundError):
        store.drop_run("r")
    s = store.stats()
    assert (s["drops"], s["runs"], s["bytes"], s["leased_runs"]) == (1, 0, 0, 0)


def test_invalidate_all_drops_every_run_leased_or_not():
    store = store_for(3)
    for name in "abc":
        store.put_run(name, rows(), POSITIONS)
    store.lease("a", 60, "engine-0")
    assert store.invalidate_all("weights updated to step 7") == 3
    assert held(store) == []
    with pytest.raises(RunNotFoundError, match="invalidated \\(weights updated to step 7\\)"):
        store.get_rows("a", [(0, "post_block", 0)])
    store.put_run("a", rows(), POSITIONS)  # the id is free again
    s = store.stats()
    assert (s["invalidations"], s["invalidated_runs"], s["runs"]) == (1, 3, 1)


# -- metadata and metrics ----------------------------------------------------------------------


def test_manifests_carry_metadata_only():
    clock = Clock()
    store = store_for(3, clock)
    store.put_run(
        "a", rows(dtype=torch.bfloat16), [7, 2, 9, 4], model="m@1", token_ids=list(range(10))
    )
    store.put_run("b", rows(), POSITIONS)
    store.lease("a", 20, "engine-1")
    (m,) = store.manifests(["a"])
    assert isinstance(m, Manifest)
    assert m.run_id == "a" and m.model == "m@1" and m.dtype == "bfloat16" and m.hidden_size == H
    assert m.keys == ((0, "post_block"), (3, "pre_attn"))
    assert m.layers == (0, 3) and m.sites == ("post_block", "pre_attn")
    assert m.positions == (7, 2, 9, 4) and m.token_ids == tuple(range(10))
    assert m.bytes == RUN_BYTES // 2  # bfloat16
    assert m.holders == ("engine-1",) and m.leased_until == clock.now + 20
    assert m.created_at > 1.6e9  # wall-clock seconds
    assert not any(isinstance(v, torch.Tensor) for v in vars(m).values())
    assert [x.run_id for x in store.manifests()] == ["b", "a"]  # least recently used first
    assert store.manifests([]) == []
    with pytest.raises(RunNotFoundError):
        store.manifests(["a", "nope"])


def test_stats_and_prometheus_counters_agree():
    registry = CollectorRegistry()
    clock = Clock()
    store = PatchStore(2 * RUN_BYTES, clock=clock, registry=registry)
    for name in "abc":
        store.put_run(name, rows(), POSITIONS)  # evicts a
    store.get_rows("c", [(0, "post_block", 0), (3, "pre_attn", 1)])
    with pytest.raises(RunNotFoundError):
        store.get_rows("a", [])
    store.lease("b", 5, "h")
    store.lease("c", 5, "h")
    with pytest.raises(TooLargeError):
        store.put_run("d", rows(), POSITIONS)  # both leased: refused

    def metric(name: str) -> float | None:
        return registry.get_sample_value(f"coxswain_patch_store_{name}")

    assert store.stats()["leased_bytes"] == 2 * RUN_BYTES == metric("leased_bytes")
    store.drop_run("c")
    store.invalidate_all()
    s = store.stats()

    assert s["puts"] == 3 and metric("puts_total") == 3
    assert (s["gets"], s["hits"], s["misses"], s["rows_served"]) == (2, 1, 1, 2)
    assert metric("hits_total") == 1 and metric("misses_total") == 1
    assert s["evictions"] == 1 and metric("evictions_total") == 1
    assert metric("evicted_bytes_total") == RUN_BYTES
    assert s["puts_refused"] == 1 and metric("puts_refused_total") == 1
    assert s["drops"] == 1 and metric("drops_total") == 1
    assert s["invalidations"] == 1 and metric("invalidations_total") == 1
    assert metric("invalidated_runs_total") == 1
    assert s["budget_bytes"] == 2 * RUN_BYTES and metric("budget_bytes") == 2 * RUN_BYTES
    assert s["bytes"] == 0 and metric("bytes") == 0 and metric("runs") == 0
    assert metric("bytes_over_budget") == 0 and metric("leased_runs") == 0
    assert s["leased_bytes"] == 0 and metric("leased_bytes") == 0
    # Each store has its own registry: a second store registers the same names without clashing.
    other = PatchStore(RUN_BYTES)
    other.put_run("x", rows(), POSITIONS)
    assert other.registry.get_sample_value("coxswain_patch_store_bytes") == RUN_BYTES
    assert registry.get_sample_value("coxswain_patch_store_bytes") == 0


def test_concurrent_puts_gets_and_leases_keep_the_books_straight():
    store = store_for(6)
    errors: list[BaseException] = []

    evicted_before_lease = [0] * 4

    def worker(w: int) -> None:
        try:
            for i in range(30):
                run = f"w{w}-{i}"
                store.put_run(run, rows(i), POSITIONS)
                try:
                    store.lease(run, 60, f"w{w}")
                except RunNotFoundError:  # six other puts landed between ours and the lease
                    evicted_before_lease[w] += 1
                    continue
                got = store.get_rows(run, [(3, "pre_attn", 2)])
                assert torch.equal(got[0], rows(i)[(3, "pre_attn")][2])
                store.release(run, f"w{w}")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = store.stats()
    assert s["puts"] == 120 and s["hits"] == 120 - sum(evicted_before_lease)
    assert s["bytes"] == s["runs"] * RUN_BYTES <= 6 * RUN_BYTES
    assert s["evictions"] == 120 - s["runs"]
