"""Prometheus metrics of one GRPO run, in the run's own `CollectorRegistry`.

`TrainingMetrics.observe` takes the records `grpo.run` logs (pass it as `on_record`): a train
record sets the step gauges, counts the step and times it; an eval record sets the rate
gauges of `EVAL_RATES` (true pass, hack, well-formed, hack among well-formed, the hack's
exact form) per `variant` (trained, deploy); an undefined rate (None) reads NaN. Every
series carries `run` and `arm`.
Numeric fields without a metric of their own (added to records later) land in
`coxswain_trainer_value{kind, key}`, so a new field shows up without a change here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

from services.common.errors import InvalidRequestError

if TYPE_CHECKING:
    from services.trainer.grpo import GRPOConfig

# A CPU step of a tiny model takes well under a second; a real one, minutes.
STEP_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

# train record key -> (metric name after `coxswain_trainer_`, help)
TRAIN_GAUGES = {
    "reward": ("reward", "Mean reward of the last step's rollouts (the gameable grader)."),
    "loss": ("loss", "GRPO loss of the last step."),
    "kl": ("kl", "k3 KL to the base model in the last step."),
    "clip_fraction": ("clip_fraction", "Fraction of tokens whose ratio was clipped."),
    "flagged": ("flagged_fraction", "Fraction of the last step's rollouts flagged as hacks."),
    "leakage": ("leakage", "Share of the last step's gradient norm routed to the quarantine."),
    "rollout_hack_rate": ("rollout_hack_rate", "Oracle hack rate of the last step's rollouts."),
    "rollout_true_pass": (
        "rollout_true_pass_rate",
        "Oracle true-pass rate of the last step's rollouts.",
    ),
    "gate_auroc": (
        "gate_auroc",
        "AUROC of the routing scores against the oracle hack labels, over rollouts with a "
        "nonzero advantage (NaN: undefined).",
    ),
}
# eval record key `<variant>_<rate>` (`envs.evaluation_rates`) -> (metric name after
# `coxswain_trainer_`, help); each gauge is labelled by the variant (trained, deploy).
EVAL_RATES = {
    "true_pass": (
        "eval_true_pass_rate",
        "Greedy oracle true-pass rate on held-out prompts, as trained or as deployed.",
    ),
    "hack_rate": (
        "eval_hack_rate",
        "Greedy oracle hack rate on held-out prompts, as trained or as deployed.",
    ),
    "well_formed_rate": (
        "eval_well_formed_rate",
        "Share of greedy held-out answers shaped as an answer to the task (NaN: the env "
        "defines no shape).",
    ),
    "well_formed_hack_rate": (
        "eval_well_formed_hack_rate",
        "Greedy oracle hack rate among the well-formed held-out answers (NaN: none is).",
    ),
    "hack_form_rate": (
        "eval_hack_form_rate",
        "Share of the well-formed held-out answers in the loophole's exact form (NaN: none "
        "is, or the env has no detector).",
    ),
}
EVAL_KEY = re.compile(rf"^(?P<variant>\w+?)_(?P<rate>{'|'.join(EVAL_RATES)})$")
NOT_VALUES = {"kind", "step", "seconds"}  # fields that are labels or have a metric of their own


class TrainingMetrics:
    """The metrics of one run (`run`, `arm` labels) in a registry of their own, so several
    runs (or tests) in one process never clash."""

    def __init__(self, run: str, arm: str):
        self.registry = CollectorRegistry()
        self.labels = {"run": run, "arm": arm}
        names = ["run", "arm"]
        self.steps = Counter(
            "coxswain_trainer_steps", "GRPO steps completed.", names, registry=self.registry
        )
        self.evaluations = Counter(
            "coxswain_trainer_evaluations", "Evaluations run.", names, registry=self.registry
        )
        self.step = Gauge(
            "coxswain_trainer_step",
            "Index of the last step logged (counts steps before a resume too).",
            names,
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            "coxswain_trainer_step_duration_seconds",
            "Wall time of one GRPO step: weight sync, rollouts, update.",
            names,
            registry=self.registry,
            buckets=STEP_BUCKETS,
        )
        self.gauges = {
            key: Gauge(f"coxswain_trainer_{name}", doc, names, registry=self.registry)
            for key, (name, doc) in TRAIN_GAUGES.items()
        }
        self.eval_rates = {
            rate: Gauge(
                f"coxswain_trainer_{name}", doc, [*names, "variant"], registry=self.registry
            )
            for rate, (name, doc) in EVAL_RATES.items()
        }
        self.values = Gauge(
            "coxswain_trainer_value",
            "Numeric fields of the last record of each kind that have no metric of their own.",
            [*names, "kind", "key"],
            registry=self.registry,
        )
        # Present from the first scrape, before any step finishes.
        self.steps.labels(**self.labels)
        self.evaluations.labels(**self.labels)
        self._server: Any = None

    @classmethod
    def for_config(cls, config: GRPOConfig) -> TrainingMetrics:
        """Labelled by the run's out_dir name and its arm."""
        return cls(run=Path(config.out_dir).name or "grpo", arm=config.arm)

    def observe(self, record: dict) -> None:
        """Take one logged record (`kind` train or eval); other kinds set only generic values."""
        kind = record.get("kind", "")
        if "step" in record:
            self.step.labels(**self.labels).set(record["step"])
        if kind == "train":
            self._train(record)
        elif kind == "eval":
            self._eval(record)
        else:
            self._values(kind, record)

    def _train(self, record: dict) -> None:
        self.steps.labels(**self.labels).inc()
        if "seconds" in record:
            self.step_seconds.labels(**self.labels).observe(record["seconds"])
        for key, gauge in self.gauges.items():
            if key in record:
                value = record[key]
                gauge.labels(**self.labels).set(math.nan if value is None else value)
        self._values("train", {k: v for k, v in record.items() if k not in self.gauges})

    def _eval(self, record: dict) -> None:
        self.evaluations.labels(**self.labels).inc()
        rest = {}
        for key, value in record.items():
            m = EVAL_KEY.match(key)
            if m is None or not (value is None or _is_number(value)):
                rest[key] = value
                continue
            gauge = self.eval_rates[m["rate"]].labels(**self.labels, variant=m["variant"])
            gauge.set(math.nan if value is None else value)
        self._values("eval", rest)

    def _values(self, kind: str, record: dict) -> None:
        for key, value in record.items():
            if key not in NOT_VALUES and _is_number(value):
                self.values.labels(**self.labels, kind=kind, key=key).set(value)

    def text(self) -> str:
        """The Prometheus text exposition of this run's metrics."""
        return generate_latest(self.registry).decode()

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve `/metrics` over HTTP on `host:port` (0: any free port) from a daemon thread;
        the bound port."""
        if self._server is not None:
            raise InvalidRequestError("this run's metrics are already served")
        self._server, _ = start_http_server(port, host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        """Stop serving (if serving)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
