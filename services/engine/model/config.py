"""Parse a Hugging Face `config.json` into the one record the model code reads."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import CheckpointError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `scaling` is None or HF's `rope_scaling` dict (llama3 only)."""

    theta: float
    scaling: dict[str, Any] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Everything about a decoder-only Llama-family model that changes its forward pass."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints use
    # top-level `rope_theta` and `rope_scaling`. Accept both.
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw["rope_scaling"]) if raw.get("rope_scaling") else {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return RopeConfig(theta=theta)
    if rope_type != "llama3":
        raise CheckpointError(
            f"rope scaling type {rope_type!r} is not supported (supported: default, llama3)"
        )
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        if key not in scaling:
            raise CheckpointError(f"llama3 rope_scaling is missing {key!r}")
    return RopeConfig(theta=theta, scaling=dict(scaling, rope_type="llama3"))


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from config.json's dict, rejecting what we cannot run faithfully."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported (supported: silu)")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        vocab = int(raw["vocab_size"])
        intermediate = int(raw["intermediate_size"])
    except KeyError as e:
        raise CheckpointError(f"config.json is missing {e.args[0]!r}") from None
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"num_attention_heads={heads} is not a multiple of kv heads={kv_heads}"
        )
    head_dim = int(raw.get("head_dim") or hidden // heads)

    is_qwen2 = arch == "Qwen2ForCausalLM"
    sliding: int | None = raw.get("sliding_window")
    if arch.startswith("Qwen") and not raw.get("use_sliding_window", False):
        sliding = None  # Qwen configs carry a window they do not use unless asked to
    if sliding is not None and is_qwen2 and raw.get("max_window_layers", layers) < layers:
        raise CheckpointError(
            "Qwen2 per-layer sliding windows (max_window_layers) are not supported"
        )

    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
        o_bias=(not is_qwen2) and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=int(sliding) if sliding else None,
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and parse `<model_dir>/config.json`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {model_dir} (is this a Hugging Face checkpoint?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    return parse_model_config(raw)


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids `<model_dir>/generation_config.json` adds (none without it)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    return _eos_ids(json.loads(path.read_text()).get("eos_token_id"))


def llama3_inv_freq(inv_freq: Any, scaling: dict[str, Any]) -> Any:
    """Apply Llama 3.1 frequency scaling to `inv_freq` [head_dim/2], as transformers does."""
    import torch

    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
