"""The `coxswain` command line, run as a user runs it: a subprocess per command."""

from __future__ import annotations

import json
import subprocess
import sys


def _coxswain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_make_tiny_then_generate(tmp_path):
    out = tmp_path / "tiny-qwen2"
    r = _coxswain("model", "make-tiny", "--arch", "qwen2", "--out", str(out), "--layers", "3")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3

    r = _coxswain(
        "generate",
        "--model",
        str(out),
        "--device",
        "cpu",
        "--json",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--logprobs",
        "2",
        "Once upon a time",
        "The harbour",
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Once upon a time", "The harbour"]
    for x in lines:
        (c,) = x["outputs"]
        assert len(c["token_ids"]) == 6 and c["finish_reason"] == "length"
        assert len(c["logprobs"]) == 6


def test_generate_reports_bad_checkpoint_and_bad_values(tmp_path):
    r = _coxswain("generate", "--model", str(tmp_path / "missing"), "hello")
    assert r.returncode == 2
    assert "does not exist" in r.stderr or "no config.json" in r.stderr
    out = tmp_path / "tiny"
    assert _coxswain("model", "make-tiny", "--out", str(out)).returncode == 0
    r = _coxswain("generate", "--model", str(out), "--device", "cpu", "--top-p", "0", "hi")
    assert r.returncode == 2 and "top_p" in r.stderr


def test_demo_runs_on_the_embedded_default(tmp_path):
    r = _coxswain("demo", "--model-dir", str(tmp_path / "demo"), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "prefix cache hits" in r.stdout
    hits = r.stdout.split("prefix cache hits ")[1].split("/")[0]
    assert int(hits) > 0
