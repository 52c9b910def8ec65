"""Named steering/probe vectors: an explicit registry, and import from GGUF or safetensors files.

An entry is one direction `[H]` used at every layer, or one direction per layer `{L: [H]}`,
where `L` is our 0-based decoder layer index (see `sites.py`). Vectors are stored as float32
on the CPU; the engine moves them to its device when it builds steering tables.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.errors import InvalidRequestError, NotFoundError
from services.common.wire import decode_vector
from services.engine.interventions.spec import check_identifier

# Per-layer tensor names in a safetensors file: `direction.<L>`, `layers.<L>` or `<L>`.
_LAYER_KEY = re.compile(r"(?:direction\.|layers\.)?(\d+)")
_GGUF_FLOAT_TYPES = ("F32", "F16")  # llama.cpp itself accepts only F32


@dataclass(frozen=True)
class NamedVector:
    """A registered vector: `vector` for one direction at every layer, or `per_layer`.

    Exactly one of the two is set. Treat the tensors as read-only.
    """

    name: str
    vector: torch.Tensor | None  # [H]
    per_layer: dict[int, torch.Tensor] | None  # layer -> [H], sorted by layer
    source: str  # "api", or the file it was imported from

    def __post_init__(self) -> None:
        if (self.vector is None) == (self.per_layer is None):
            raise ValueError("NamedVector needs exactly one of vector and per_layer")

    @property
    def hidden_size(self) -> int:
        if self.vector is not None:
            return self.vector.shape[0]
        assert self.per_layer is not None
        return next(iter(self.per_layer.values())).shape[0]

    @property
    def layers(self) -> list[int] | None:
        """The layers a per-layer entry covers; None for a single vector (every layer)."""
        return None if self.per_layer is None else list(self.per_layer)

    def describe(self) -> dict[str, Any]:
        """Metadata only (no data): name, hidden_size, layers, source."""
        return {
            "name": self.name,
            "hidden_size": self.hidden_size,
            "layers": self.layers,
            "source": self.source,
        }


def check_vector_name(name: object) -> str:
    """`name` if it can name a vector (the identifier rule every request's ids follow,
    `spec.check_identifier`), else InvalidRequestError saying why. The registry and the
    cluster's admin API (before anything is recorded) both call it, so they refuse exactly
    the names a request naming a vector is refused for."""
    return check_identifier(name, "vector name")


def vector_for_layer(entry: NamedVector, layer: int) -> torch.Tensor:
    """The `[H]` direction `entry` applies at `layer`; an error if a per-layer entry lacks it."""
    if entry.per_layer is None:
        return entry.vector  # type: ignore[return-value]
    if layer not in entry.per_layer:
        raise InvalidRequestError(
            f"vector '{entry.name}' has no direction for layer {layer}; "
            f"it has layers {', '.join(map(str, entry.per_layer))}"
        )
    return entry.per_layer[layer]


class VectorRegistry:
    """Thread-safe name → `NamedVector` map, checked against the model's shape when given.

    `hidden_size` / `num_layers`, when set, make `register` reject vectors of another width
    and per-layer entries naming layers the model does not have.
    """

    def __init__(self, hidden_size: int | None = None, num_layers: int | None = None) -> None:
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self._entries: dict[str, NamedVector] = {}
        self._lock = threading.Lock()
        # A parallel replica's driver mirrors every change to its other ranks: called with
        # ("put", entry) or ("drop", name) while the change is made, under `mirror_lock`.
        self.mirror: Callable[[tuple[str, Any]], None] | None = None
        self.mirror_lock: AbstractContextManager = nullcontext()

    def register(
        self, name: str, value: Any, *, overwrite: bool = False, source: str = "api"
    ) -> NamedVector:
        """Add (or with `overwrite`, replace) `name`.

        `value`: a tensor, float list or packed object — `[H]` (or `[1, H]`) is one direction
        for every layer, `[n, H]` is per-layer with row `i` for layer `i` — or a mapping
        `{layer: [H] value}` (JSON's string keys such as `"12"` are accepted).
        """
        check_vector_name(name)
        entry = self._build_entry(name, value, source)
        with self.mirror_lock, self._lock:
            if name in self._entries and not overwrite:
                raise InvalidRequestError(
                    f"vector '{name}' is already registered; pass overwrite=True to replace it"
                )
            self._entries[name] = entry
            if self.mirror is not None:
                self.mirror(("put", entry))
        return entry

    def replay(self, change: tuple[str, Any]) -> None:
        """Apply a change another registry mirrored (a parallel replica's driver)."""
        op, arg = change
        with self._lock:
            if op == "put":
                self._entries[arg.name] = arg
            else:
                self._entries.pop(arg, None)

    def import_file(self, name: str, path: str | Path, *, overwrite: bool = False) -> NamedVector:
        """Register `name` from a `.gguf` control vector or a `.safetensors` file of vectors."""
        path = Path(path)
        loaders = {".gguf": load_gguf_control_vector, ".safetensors": load_safetensors_vectors}
        loader = loaders.get(path.suffix.lower())
        if loader is None:
            raise InvalidRequestError(
                f"cannot import vectors from {path}: expected a .gguf or .safetensors file"
            )
        return self.register(name, loader(path), overwrite=overwrite, source=str(path))

    def unregister(self, name: str) -> NamedVector:
        """Remove `name` and return its entry; NotFoundError (404) if it is not registered."""
        with self.mirror_lock, self._lock:
            entry = self._entries.pop(name, None)
            if entry is not None and self.mirror is not None:
                self.mirror(("drop", name))
        if entry is None:
            raise NotFoundError(f"no vector named '{name}' is registered")
        return entry

    def get(self, name: str) -> NamedVector:
        """The entry for `name`; InvalidRequestError naming the registered ones if unknown."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                known = ", ".join(sorted(self._entries)) or "(none)"
                raise InvalidRequestError(f"unknown vector name '{name}'; registered: {known}")
        return entry

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def list(self) -> list[dict[str, Any]]:
        """Metadata of every entry, sorted by name (no vector data)."""
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: e.name)
        return [e.describe() for e in entries]

    def _build_entry(self, name: str, value: Any, source: str) -> NamedVector:
        what = f"vector '{name}'"
        if isinstance(value, Mapping) and not {"dtype", "shape", "data"} & set(value):
            per_layer = _per_layer_from_mapping(value, what)
            entry = NamedVector(name=name, vector=None, per_layer=per_layer, source=source)
        else:
            t = decode_vector(value, name=what)  # [H] or [num_layers, H]
            if t.dim() == 2 and t.shape[0] == 1:  # one row: one vector, as inline in a spec
                t = t[0]
            rows = dict(enumerate(t)) if t.dim() == 2 else None
            vector = t if rows is None else None
            entry = NamedVector(name=name, vector=vector, per_layer=rows, source=source)
        if entry.per_layer is not None:
            _check_equal_widths(entry.per_layer, what)
        if self.hidden_size is not None and entry.hidden_size != self.hidden_size:
            raise InvalidRequestError(
                f"{what} has hidden size {entry.hidden_size}; "
                f"the model's hidden size is {self.hidden_size}"
            )
        if entry.layers is not None and self.num_layers is not None:
            outside = [layer for layer in entry.layers if layer >= self.num_layers]
            if outside:
                raise InvalidRequestError(
                    f"{what} names layer(s) {', '.join(map(str, outside))}; "
                    f"the model has layers 0-{self.num_layers - 1}"
                )
        return entry


def _per_layer_from_mapping(value: Mapping, what: str) -> dict[int, torch.Tensor]:
    """`{layer: [H]}` from a mapping with int (or decimal-string) keys, sorted by layer."""
    if not value:
        raise InvalidRequestError(f"{what} has no layers")
    out: dict[int, torch.Tensor] = {}
    for key, v in value.items():
        if isinstance(key, int) and not isinstance(key, bool):
            layer = key
        elif isinstance(key, str) and key.isdecimal():
            layer = int(key)
        else:
            raise InvalidRequestError(
                f"{what}: per-layer keys must be non-negative layer indices, got {key!r}"
            )
        if layer < 0:
            raise InvalidRequestError(f"{what}: layer index must be >= 0, got {layer}")
        if layer in out:
            raise InvalidRequestError(f"{what}: layer {layer} is given twice")
        t = decode_vector(v, name=f"{what} layer {layer}")
        if t.dim() != 1:
            raise InvalidRequestError(
                f"{what} layer {layer} must be one vector [H], got shape {list(t.shape)}"
            )
        out[layer] = t
    return dict(sorted(out.items()))


def load_gguf_control_vector(path: str | Path) -> dict[int, torch.Tensor]:
    """`{layer: [H]}` from a llama.cpp / repeng control vector (GGUF tensors `direction.<L>`).

    `direction.<L>` is added to the output of 0-based decoder layer `L` — our `post_block` of
    layer `L`, HF `hidden_states[L + 1]` — so `L` maps to our layer `L` unchanged. Evidence:
    repeng (`extract.py`) reads `hidden_states[L + 1]` for its key `L` and (`control.py`) adds
    it to the output of `model.layers[L]`; llama.cpp (`common_control_vector_load_one`,
    `llama_adapter_cvec::apply`, `build_cvec(cur, il)` after each block's residual add) adds
    `direction.<il>` to `l_out` of block `il`. llama.cpp rejects `direction.0` (it never
    steers block 0's output); we accept it as our layer 0. Metadata is not read (llama.cpp
    ignores it too). Tensors must be 1-D F32 (or F16) of equal length.
    """
    import gguf  # optional dependency: only needed to import GGUF files

    path = _existing_file(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct errors, ... on corrupt files
        raise InvalidRequestError(f"{path} is not a readable GGUF file: {e}") from None
    out: dict[int, torch.Tensor] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"direction\.(\d+)", t.name)
        if m is None:
            raise InvalidRequestError(
                f"{path}: unexpected tensor '{t.name}'; a control vector holds only "
                f"direction.<layer> tensors"
            )
        layer = int(m.group(1))
        if layer in out:
            raise InvalidRequestError(f"{path}: layer {layer} appears twice")
        if t.tensor_type.name not in _GGUF_FLOAT_TYPES:
            raise InvalidRequestError(
                f"{path}: {t.name} has type {t.tensor_type.name}; expected F32 (or F16)"
            )
        if int(np.prod(t.shape[1:])) != 1:  # ggml dims, innermost first; trailing 1s don't count
            raise InvalidRequestError(
                f"{path}: {t.name} must be 1-D, got ggml shape {[int(d) for d in t.shape]}"
            )
        out[layer] = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
    if not out:
        raise InvalidRequestError(f"{path} holds no direction.<layer> tensors")
    _check_equal_widths(out, path)
    return dict(sorted(out.items()))


def load_safetensors_vectors(path: str | Path) -> torch.Tensor | dict[int, torch.Tensor]:
    """Vectors from a safetensors file, as float32, by these layouts (checked in this order):

    1. every key is `direction.<L>`, `layers.<L>` or `<L>`, each a 1-D `[H]` → `{L: [H]}`;
    2. exactly one tensor (any name) of shape `[H]` → that single vector;
    3. exactly one tensor (any name) of shape `[num_layers, H]` → `{row: [H]}`.

    Anything else is an error.
    """
    from safetensors import SafetensorError, safe_open

    path = _existing_file(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except (SafetensorError, OSError) as e:
        raise InvalidRequestError(f"{path} is not a readable safetensors file: {e}") from None
    if not tensors:
        raise InvalidRequestError(f"{path} holds no tensors")
    for k, t in tensors.items():
        if not t.is_floating_point():
            raise InvalidRequestError(f"{path}: tensor '{k}' must hold floats, got {t.dtype}")
    matches = {k: _LAYER_KEY.fullmatch(k) for k in tensors}
    if all(matches.values()):
        out: dict[int, torch.Tensor] = {}
        for k, t in tensors.items():
            layer = int(matches[k].group(1))  # type: ignore[union-attr]
            if layer in out:
                raise InvalidRequestError(f"{path}: layer {layer} appears twice (key '{k}')")
            if t.dim() != 1:
                raise InvalidRequestError(
                    f"{path}: per-layer tensor '{k}' must be 1-D [H], got shape {list(t.shape)}"
                )
            out[layer] = t.float()
        _check_equal_widths(out, path)
        return dict(sorted(out.items()))
    if len(tensors) == 1:
        ((key, t),) = tensors.items()
        if t.dim() == 1:
            return t.float()
        if t.dim() == 2:
            return dict(enumerate(t.float()))
        raise InvalidRequestError(
            f"{path}: tensor '{key}' must be [H] or [num_layers, H], got shape {list(t.shape)}"
        )
    unmatched = sorted(k for k, m in matches.items() if m is None)
    raise InvalidRequestError(
        f"{path}: expected keys direction.<L>, layers.<L> or <L>, or exactly one tensor; "
        f"unrecognised keys: {', '.join(unmatched[:8])}{' ...' if len(unmatched) > 8 else ''}"
    )


def _existing_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"vector file {path} does not exist")
    return path


def _check_equal_widths(per_layer: dict[int, torch.Tensor], what: object) -> None:
    widths = {layer: t.shape[0] for layer, t in per_layer.items()}
    if len(set(widths.values())) > 1:
        raise InvalidRequestError(f"{what}: direction sizes differ across layers: {widths}")
