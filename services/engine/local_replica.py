"""A parallel replica in local processes, for tests and single-host scripts (clusters run
their ranks as Ray actors: `services/engine/actors.py`)."""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from services.common.net import free_port
from services.engine.distributed import init_replica, run_worker
from services.engine.heap import freeze_startup_heap
from services.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)


def launch_local(
    model: str,
    tp_size: int,
    pp_size: int,
    driver_fn: Callable[[LLMEngine], Any],
    *,
    engine_config: Any = None,
    device_type: str = "cpu",
    timeout_s: float = 600.0,
) -> Any:
    """Run a `tp_size × pp_size` replica in local processes and return `driver_fn(engine)`
    evaluated on its driver rank. `driver_fn` must be picklable (a module-level function);
    the other ranks step in lock-step until it returns. For tests and single-host scripts:
    clusters use the Ray actors in `services/engine/actors.py`. A replica still running
    5 s before `timeout_s` prints every rank's stacks to its stderr (where it hangs)."""
    mp = torch.multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = mp.Queue()
    procs = [
        mp.Process(
            target=_local_rank,
            args=(rank, tp_size, pp_size, init_method, device_type, model, engine_config),
            kwargs={
                "driver_fn": driver_fn if rank == 0 else None,
                "results": results,
                "dump_after_s": max(1.0, timeout_s - 5),
            },
            daemon=True,
        )
        for rank in range(tp_size * pp_size)
    ]
    for p in procs:
        p.start()
    try:
        status, value = _first_result(results, procs, timeout_s)
    finally:
        _reap(procs, grace_s=10.0)
    if status != "ok":
        raise RuntimeError(f"the replica's driver failed:\n{value}")
    return pickle.loads(value)


def _first_result(results: Any, procs: list, timeout_s: float) -> tuple[str, Any]:
    """The driver's (status, value), or an error as soon as a rank dies without one (its
    peers would wait in a collective for it until `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode]
            if dead:
                return "error", f"rank(s) exited before the driver finished: {dead} (rank, code)"
            if time.monotonic() >= deadline:
                return "error", f"the replica's driver did not finish within {timeout_s:g} s"


def _reap(procs: list, grace_s: float) -> None:
    """Let the ranks exit on their own for `grace_s` in all, then stop the rest: the
    driver has ended (its result or error is in hand, or it ran out of time), so a rank
    still running holds nothing we need. (On
    four H200s the three NCCL workers of a tiny TP=4 replica each outlived a 30 s join
    after the driver returned, 90 s a launch.) A rank stopped here first prints its
    stacks to its stderr (SIGUSR1, `_local_rank`), which says where it was stuck."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [(rank, p) for rank, p in enumerate(procs) if p.is_alive()]
    for rank, p in stuck:
        log.warning("rank %d still running %g s after the driver ended: stopping it", rank,
                    grace_s)  # fmt: skip
        os.kill(p.pid, signal.SIGUSR1)
    if stuck:
        time.sleep(1.0)  # the stacks out before the stop
    for _, p in stuck:
        p.terminate()
        p.join(timeout=5)
        if p.is_alive():
            p.kill()


def _local_rank(
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    device_type: str,
    model: str,
    engine_config: Any,
    *,
    driver_fn: Callable[[LLMEngine], Any] | None,
    results: Any,
    dump_after_s: float,
) -> None:
    torch.set_num_threads(1)  # ranks share the host's cores
    # A hung replica (a collective one rank never reaches) says where each rank waits: the
    # stacks come out before the parent gives up on it (`COXSWAIN_HANG_DUMP_S` sooner).
    faulthandler.dump_traceback_later(float(os.environ.get("COXSWAIN_HANG_DUMP_S", dump_after_s)))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `_reap`'s, before it stops us
    fused = getattr(engine_config, "fused_all_reduce_norm", None)
    microbatches = getattr(engine_config, "pipeline_microbatches", 1)
    ctx, sync = init_replica(rank, tp_size, pp_size, init_method, device_type, fused, microbatches)
    engine = None
    try:
        engine = LLMEngine(model, engine_config, ctx=ctx, sync=sync)
        freeze_startup_heap()  # a rank's process serves this engine for its life
        if driver_fn is None:
            run_worker(engine)
            return
        try:
            # Plain pickle bytes, not tensors: torch's queue would share a tensor's memory
            # through a file descriptor this process serves, and it may have exited before
            # the parent unpickles (FileNotFoundError on the parent's side).
            results.put(("ok", pickle.dumps(driver_fn(engine))))
        except BaseException:
            results.put(("error", traceback.format_exc()))
        finally:
            sync.stop()
    finally:
        faulthandler.cancel_dump_traceback_later()
        _leave_process_group(device_type, engine)


def _leave_process_group(device_type: str, engine: LLMEngine | None) -> None:
    """Tear this rank's process groups down on the way out. NCCL does not shut down a
    communicator while a CUDA graph that captured its collectives lives
    (pytorch/pytorch#115388: on four H200s every rank of a TP=4 replica sat in
    `destroy_process_group` until `_reap` stopped it), so the engine's graphs go first."""
    try:
        if device_type == "cuda":
            torch.cuda.synchronize()  # this rank's last sends have left it
        if engine is not None:
            engine.runner.release_graphs()
    except RuntimeError:  # a device error: the rank's own result says what happened
        log.exception("rank teardown: releasing the CUDA graphs failed")
    finally:
        dist.destroy_process_group()
