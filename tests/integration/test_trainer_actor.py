"""A GRPO run as a Ray actor on a local cluster: it trains in the background, reports its
status, logs metrics.jsonl and serves Prometheus metrics; a run that fails says why."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.errors import InvalidRequestError
from services.trainer.actor import start_trainer

ray = pytest.importorskip("ray")


def _config(model, out_dir, **kw) -> dict:
    return {
        "model": str(model),
        "env": "addition",
        "arm": "route",
        "steps": 2,
        "prompts_per_step": 2,
        "group_size": 2,
        "eval_prompts": 2,
        "hack_pairs": 2,
        "out_dir": str(out_dir),
        **kw,
    }


def _scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_trainer_actor_runs_and_serves_metrics(ray_cluster, tiny_checkpoint, tmp_path):
    out = tmp_path / "actor-run"
    actor = start_trainer(_config(tiny_checkpoint("llama"), out))
    status = ray.get(actor.wait.remote(60))
    assert status["state"] == "done", status
    assert status["error"] is None
    assert (status["step"], status["steps"]) == (2, 2)
    assert status["last"]["kind"] == "train" and status["last"]["step"] == 2
    records = ray.get(actor.records.remote())
    assert [(r["kind"], r["step"]) for r in records] == [
        ("eval", 0), ("train", 1), ("train", 2), ("eval", 2)
    ]  # fmt: skip
    assert ray.get(actor.records.remote(3)) == records[3:]
    assert (out / "metrics.jsonl").is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == len(records)

    port = ray.get(actor.metrics_port.remote())
    assert ray.get(actor.metrics_url.remote()) == f"http://127.0.0.1:{port}/metrics"
    families = _scrape(port)
    labels = {"run": "actor-run", "arm": "route"}
    (steps,) = [s for s in families["coxswain_trainer_steps"] if s.name.endswith("_total")]
    assert steps.labels == labels and steps.value == 2
    (reward,) = families["coxswain_trainer_reward"]
    assert reward.value == pytest.approx(status["last"]["reward"])
    hack = {s.labels["variant"]: s.value for s in families["coxswain_trainer_eval_hack_rate"]}
    last_eval = records[-1]
    assert hack == {v: last_eval[f"{v}_hack_rate"] for v in ("trained", "deploy")}
    ray.kill(actor)


def test_failed_run_reports_its_error(ray_cluster, tmp_path):
    missing = tmp_path / "no-such-model"
    actor = start_trainer(_config(missing, tmp_path / "failing"), metrics_port=None)
    status = ray.get(actor.wait.remote(30))
    assert status["state"] == "failed"
    assert status["error"] and str(missing) in status["error"]
    assert ray.get(actor.metrics_port.remote()) is None
    ray.kill(actor)


def test_bad_config_and_taken_name_fail_in_the_caller(ray_cluster, tiny_checkpoint, tmp_path):
    model = tiny_checkpoint("llama")
    with pytest.raises(InvalidRequestError, match="steps"):
        start_trainer(_config(model, tmp_path / "bad", steps=0))
    with pytest.raises(InvalidRequestError, match="rollout_wokers"):
        start_trainer(_config(model, tmp_path / "typo", rollout_wokers=2))
    first = start_trainer(_config(model, tmp_path / "twice"), autostart=False)
    assert ray.get(first.status.remote())["state"] == "idle"
    with pytest.raises(InvalidRequestError, match="already taken"):
        start_trainer(_config(model, tmp_path / "twice"))
    ray.kill(first)
