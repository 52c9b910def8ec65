"""A GRPO run as a Ray actor: the actor trains in a background thread and answers `status()`,
`records()` and Prometheus scrapes while it does, so a driver (the CLI's `--ray`, a notebook)
can follow a run it does not host.

Ray is imported only when an actor is started. A run that fails in its thread is `failed`
with the exception's message in `status()`; it never just stops.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Literal

from services.cluster.state import NAMESPACE
from services.common.errors import InvalidRequestError
from services.trainer.grpo import GRPOConfig, run, validate_config
from services.trainer.metrics import TrainingMetrics

log = logging.getLogger(__name__)

State = Literal["idle", "running", "done", "failed"]
_ANY_HOST = ("0.0.0.0", "::", "")


class TrainerActor:
    """Owns one GRPO run of `config` (a `GRPOConfig` as a dict) and its `TrainingMetrics`,
    served on `metrics_host:metrics_port` (0: any free port; None: not served). `start()`
    begins training in a thread; `resume` as in `grpo.run`."""

    def __init__(
        self,
        config: dict,
        *,
        resume: bool = True,
        metrics_port: int | None = 0,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        self.config = validate_config(config)
        self.resume = resume
        self.metrics = TrainingMetrics.for_config(self.config)
        self._host = metrics_host
        self._port: int | None = None
        if metrics_port is not None:
            self._port = self.metrics.serve(metrics_port, metrics_host)
        self._records: list[dict] = []
        self._lock = threading.Lock()  # the records list: appended by the run, read by calls
        self._thread: threading.Thread | None = None
        self._finished = threading.Event()
        self._error: str | None = None

    def start(self) -> dict[str, Any]:
        """Begin training (once; later calls change nothing); the status."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._train, name="grpo-run", daemon=True)
            self._thread.start()
        return self.status()

    def _train(self) -> None:
        try:
            run(self.config, resume=self.resume, on_record=self._record)
        except Exception as e:
            log.exception("GRPO run %s failed", self.config.out_dir)
            self._error = f"{type(e).__name__}: {e}"
        finally:
            self._finished.set()

    def _record(self, record: dict) -> None:
        with self._lock:
            self._records.append(record)
        self.metrics.observe(record)

    def state(self) -> State:
        if self._thread is None:
            return "idle"
        if not self._finished.is_set():
            return "running"
        return "failed" if self._error is not None else "done"

    def status(self) -> dict[str, Any]:
        """`state` (idle, running, done, failed), the last `step` logged, the run's `steps`,
        the `last` train record (None before the first) and the failure's `error`."""
        with self._lock:
            step = max((r["step"] for r in self._records), default=0)
            last = next((r for r in reversed(self._records) if r["kind"] == "train"), None)
        return {
            "state": self.state(),
            "step": step,
            "steps": self.config.steps,
            "last": last,
            "error": self._error,
        }

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the run ends or `timeout` seconds pass; the status."""
        self._finished.wait(timeout)
        return self.status()

    def records(self, start: int = 0) -> list[dict]:
        """The records logged so far, from index `start` (to poll only new ones)."""
        with self._lock:
            return self._records[start:]

    def metrics_port(self) -> int | None:
        """The port `/metrics` is served on (None: not served)."""
        return self._port

    def metrics_url(self) -> str | None:
        """Where to scrape this run (the node's IP when bound to every interface)."""
        if self._port is None:
            return None
        host = self._host
        if host in _ANY_HOST:
            import ray

            host = ray.util.get_node_ip_address()
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self._port}/metrics"

    def metrics_text(self) -> str:
        """The metrics exposition, for drivers that cannot reach the actor's port."""
        return self.metrics.text()


def start_trainer(
    config: dict | GRPOConfig,
    *,
    name: str | None = None,
    resume: bool = True,
    metrics_port: int | None = 0,
    metrics_host: str = "127.0.0.1",
    num_cpus: float = 1,
    num_gpus: float | None = None,
    autostart: bool = True,
    **options: Any,
) -> Any:
    """Start a `TrainerActor` named `name` (default `grpo-<out_dir name>`) in the "coxswain"
    namespace of the connected Ray cluster, training at once unless `autostart=False`; its
    handle. The config is validated here first, so a bad one fails in the caller. `num_gpus`
    defaults to 1 for a CUDA `device`; other `options` (lifetime, resources, ...) go to
    `ray.remote(...).options`."""
    import ray

    cfg = validate_config(config)
    name = name or f"grpo-{Path(cfg.out_dir).name or 'run'}"
    if num_gpus is None:
        num_gpus = 1 if cfg.device.startswith("cuda") else 0
    try:
        actor: Any = (
            ray.remote(TrainerActor)
            .options(
                name=name,
                namespace=NAMESPACE,
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                max_concurrency=4,  # status() answers while a wait() blocks
                **options,
            )
            .remote(
                cfg.model_dump(),
                resume=resume,
                metrics_port=metrics_port,
                metrics_host=metrics_host,
            )
        )
    except ValueError as e:  # the name is taken
        raise InvalidRequestError(f"cannot start trainer {name!r}: {e}") from None
    if autostart:
        actor.start.remote()
    return actor
