"""Where Coxswain keeps what it makes on disk, and which checkpoint directory a model name
means. A leaf module: the CLI, the local cluster and the Serve application all need these,
and none of them may import another for it (they would import each other in a circle)."""

from __future__ import annotations

import os
from pathlib import Path

from services.common.errors import CheckpointError


def coxswain_home() -> Path:
    """$COXSWAIN_HOME, else ~/.cache/coxswain: generated models and the local cluster's state."""
    return Path(os.environ.get("COXSWAIN_HOME") or Path.home() / ".cache" / "coxswain")


def resolve_model(model: str) -> Path:
    """A checkpoint directory; "tiny" generates the embedded tiny model once per host."""
    if model != "tiny":
        return Path(model)
    from services.engine.model.tiny import make_tiny_checkpoint

    out = coxswain_home() / "tiny-llama"
    if not (out / "config.json").is_file():
        make_tiny_checkpoint(out, "llama")
    return out


def check_model_dir(model: str | Path) -> None:
    """Raise CheckpointError naming the path and what is missing, before anything loads or
    starts: every command that takes `--model DIR` words the same mistake the same way."""
    from services.engine.model.config import load_model_config
    from services.engine.model.loader import checkpoint_files

    root = Path(model)
    checkpoint_files(root)  # the directory exists and holds safetensors weights
    load_model_config(root)  # config.json, a supported architecture
    if not (root / "tokenizer.json").is_file():
        raise CheckpointError(f"{root}: no tokenizer.json (only fast tokenizers are supported)")
