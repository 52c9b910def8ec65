"""Load a local Hugging Face checkpoint directory (safetensors) into a model stage."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.errors import CheckpointError
from services.engine.model.llama import LlamaFamilyForCausalLM

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Tensors some exporters include that carry nothing the forward pass needs.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, checking that every shard the index names exists."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{root}: shard file(s) named in model.safetensors.index.json are missing: "
                f"{', '.join(missing)}"
            )
        return [root / n for n in names]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(root.glob("*.safetensors"))
    if found:
        return found
    hint = (
        " (PyTorch .bin weights are not supported; convert to safetensors)"
        if any(root.glob("*.bin"))
        else ""
    )
    raise CheckpointError(f"{root}: no model.safetensors or model.safetensors.index.json{hint}")


def iter_checkpoint_tensors(
    model_dir: str | Path, wanted: Callable[[str], bool] = lambda name: True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint whose name is `wanted`; the others are never read (a
    pipeline stage skips the other stages' layers)."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if wanted(name):
                        yield name, f.get_tensor(name)
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None


def _target(model: LlamaFamilyForCausalLM, hf_name: str) -> list[tuple[str, object]]:
    """Map one HF tensor name to (our parameter name, shard id) pairs this stage owns."""
    if _IGNORED.search(hf_name):
        return []
    if hf_name == "model.embed_tokens.weight":
        out: list[tuple[str, object]] = []
        if model.embed_tokens is not None:
            out.append(("embed_tokens.weight", None))
        # A tied head on a stage without the embedding still needs these weights.
        if (
            model.cfg.tie_word_embeddings
            and model.lm_head is not None
            and model.embed_tokens is None
        ):
            out.append(("lm_head.weight", None))
        return out
    if hf_name == "lm_head.weight":
        if model.lm_head is None or model.cfg.tie_word_embeddings:
            return []
        return [("lm_head.weight", None)]
    if hf_name == "model.norm.weight":
        return [("norm.weight", None)] if model.norm is not None else []
    m = _LAYER.match(hf_name)
    if m is None:
        return [("?" + hf_name, None)]
    layer, rest = int(m.group(1)), m.group(2)
    if layer not in model.layer_range:
        return []
    module_path, _, leaf = rest.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module in model.PACKED_MODULES:
        fused, shard = model.PACKED_MODULES[module]
        return [(f"layers.{layer}.{parent}.{fused}.{leaf}", shard)]
    return [(f"layers.{layer}.{rest}", None)]


def _hf_name(model: LlamaFamilyForCausalLM, name: str, shard: object) -> str:
    """The Hugging Face tensor name that fills (our parameter, shard)."""
    if shard is not None:
        module_path, fused, leaf = name.rsplit(".", 2)
        hf_module = next(
            m for m, (f, s) in model.PACKED_MODULES.items() if f == fused and s == shard
        )
        name = f"{module_path}.{hf_module}.{leaf}"
    return name if name.startswith("lm_head") else f"model.{name}"


def load_weights(model: LlamaFamilyForCausalLM, model_dir: str | Path) -> None:
    """Copy every tensor this stage owns from the checkpoint; fail on anything missing."""
    # A tied head shares the embedding's Parameter, so it is listed (and loaded) once.
    params = dict(model.named_parameters())
    expected: set[tuple[str, object]] = set()
    for name, param in params.items():
        parts = getattr(param, "num_parts", None)  # fused params load one HF tensor per part
        for shard in range(parts) if parts else [None]:
            expected.add((name, shard))

    loaded: set[tuple[str, object]] = set()
    unknown: list[str] = []
    for hf_name, tensor in iter_checkpoint_tensors(model_dir, lambda n: bool(_target(model, n))):
        for name, shard in _target(model, hf_name):
            if name not in params:
                unknown.append(hf_name)
                continue
            param = params[name]
            try:
                param.weight_loader(param, tensor, shard)
            except CheckpointError as e:
                raise CheckpointError(f"{hf_name}: {e}") from None
            loaded.add((name, shard))
    if unknown:
        log.warning("ignoring %d unexpected checkpoint tensors, e.g. %s", len(unknown), unknown[:3])
    missing = sorted(_hf_name(model, n, s) for n, s in expected - loaded)
    if missing:
        raise CheckpointError(
            f"{model_dir}: checkpoint is missing {len(missing)} tensor(s) the model needs, "
            f"e.g. {', '.join(missing[:5])}"
        )
