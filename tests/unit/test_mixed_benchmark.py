"""`benchmarks/mixed.py` on the tiny model on CPU: every section runs, the arriving prompt is
prefilled in the chunks the engine is given, and its dense baseline is the same model (no
timing asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import mixed  # noqa: E402

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.model.config import load_model_config  # noqa: E402


def test_every_section_runs_and_a_mixed_step_carries_a_chunk(tmp_path):
    out = tmp_path / "mixed.json"
    argv = [
        "--shape", "tiny", "--device", "cpu", "--context", "96", "--prompt", "200", "--chunk",
        "64", "--decodes", "3", "--burst", "2", "--prefill-lengths", "80", "--steps", "4",
        "--json", str(out),
    ]  # fmt: skip
    mixed.main(argv)
    r = json.loads(out.read_text())
    (m,) = r["mixed"]
    # 64 + 3 tokens a step: alone, the prompt takes 3 steps (200 = 67 + 67 + 66); beside
    # three decodes 64 a step, so 4 (3 × 64 + 8); each then one more, which returns the
    # prompt's first token while the next step runs.
    assert len(m["prefill_alone_ms"]) == 3 + 1 and len(m["mixed_ms"]) == 4 + 1
    assert r["burst"]["burst"] == 2 and len(r["burst"]["step_ms"]) >= 2 * 200 // 67
    (p,) = r["prefill"]
    assert p["length"] == 80 and p["engine_s"] > 0 and p["dense_s"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dense_prefill_predicts_the_engines_first_token(tiny_checkpoint, arch):
    """The baseline is the same model: its greedy token after a prompt is the engine's."""
    model = tiny_checkpoint(arch)
    dense = mixed.DensePrefill(model, 64, torch.device("cpu"), torch.float32)
    prompt = list(range(5, 45))
    out = LLM(model, device="cpu", dtype="float32").generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0)
    )
    assert dense.forward(torch.tensor(prompt)).item() == out[0].outputs[0].token_ids[0]


def test_prefill_flops_count_the_layers_matmuls_and_half_the_attention(tiny_checkpoint):
    cfg = load_model_config(tiny_checkpoint())
    h, d, n = cfg.hidden_size, cfg.head_dim, 100
    per_layer = 2 * n * h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    per_layer += 2 * n * 3 * h * cfg.intermediate_size + 2 * cfg.num_heads * d * n * n
    assert mixed.prefill_flops(cfg, n) == cfg.num_layers * per_layer + 2 * h * cfg.vocab_size
