"""Turn a request's intervention spec into tensors for this model, or a clear error.

Resolution happens once, when a request is added: layer ranges, hidden size, vector
names and values are checked here, so a step never meets a spec it cannot apply.
Resolved vectors are float32 on the CPU; the tables move them to the device.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from services.common.errors import InvalidRequestError
from services.common.wire import decode_vector
from services.engine.interventions.sites import SITES, site_key
from services.engine.interventions.spec import (
    CaptureSpec,
    PatchEntry,
    ProbeCondition,
    Readout,
    SteeringSpec,
)
from services.engine.interventions.vectors import VectorRegistry, vector_for_layer
from services.engine.kernels.capture import capture_slot

SiteKey = tuple[int, str]  # (layer, site)

MAX_GATES = 31  # gates of one request are told apart by a bit of an int32 mask


@dataclass(frozen=True)
class GateRow:
    """One gate of a request at one (layer, site); see `spec.Gate`."""

    probe: torch.Tensor  # [H]
    vector: torch.Tensor  # [H]: added, or the unit direction attenuated
    threshold: float
    sharpness: float
    scale: float
    attenuate: bool
    latch: bool
    bit: int


@dataclass(frozen=True)
class RowContent:
    """What one table row holds across every (layer, site): summed vectors and gates."""

    vectors: dict[SiteKey, torch.Tensor] = field(default_factory=dict)  # [H], scale applied
    gates: dict[SiteKey, GateRow] = field(default_factory=dict)
    digest: bytes = b""  # b"" exactly when the row is empty

    @property
    def is_empty(self) -> bool:
        return not self.vectors and not self.gates

    @functools.cached_property
    def latching_bits(self) -> int:
        """The bits of this row's `rest_of_request` gates."""
        return sum(1 << g.bit for g in self.gates.values() if g.latch)

    def sites(self) -> set[SiteKey]:
        return set(self.vectors) | set(self.gates)


@dataclass(frozen=True)
class ProbeRead:
    """A probe evaluated on the pristine residual of each sampled token: a read-out, or an
    `abort_when` condition when `threshold` is set."""

    name: str
    layer: int
    site: str
    probe: torch.Tensor  # [H]
    threshold: float | None = None
    sharpness: float = 1.0

    def fires(self, score: float) -> bool:
        return self.threshold is not None and self.sharpness * (score - self.threshold) > 0


@dataclass(frozen=True)
class ResolvedSteering:
    prefill: RowContent
    decode: RowContent
    abort_when: list[ProbeRead]


@dataclass(frozen=True)
class ResolvedCapture:
    sites: list[SiteKey]
    positions: str | frozenset[int]
    run: str | None = None  # also write to the patch-source store under this run id
    dtype: torch.dtype = torch.float32  # of the rows returned

    @functools.cached_property
    def keys(self) -> list[str]:
        """Its sites as `"<layer>.<site>"` keys, in `sites` order."""
        return [site_key(L, s) for L, s in self.sites]

    @functools.cached_property
    def slots(self) -> frozenset[int]:
        """Its sites' slots in a capture block (`kernels.capture.capture_slot`)."""
        return frozenset(capture_slot(L, s) for L, s in self.sites)

    def wants(self, position: int, num_prompt_tokens: int) -> bool:
        p = self.positions
        if p == "last_prompt":
            return position == num_prompt_tokens - 1
        if p == "all_prompt":
            return position < num_prompt_tokens
        if p == "all_generated":
            return position >= num_prompt_tokens
        if p == "all":
            return True
        assert isinstance(p, frozenset)
        return position in p

    def max_positions(self, num_prompt_tokens: int, max_tokens: int | None) -> int | None:
        """The most positions it can capture (None: not known, `max_tokens` unset): what
        its capture buffer is sized for. A position computed again after a preemption
        writes its row again, and only one that went from the block path to an eager copy
        and back takes a new row (the buffer then grows)."""
        p = self.positions
        if isinstance(p, frozenset):
            return len(p)
        if p == "last_prompt":
            return 1
        if p == "all_prompt":
            return num_prompt_tokens
        if max_tokens is None:
            return None
        return max_tokens + (num_prompt_tokens if p == "all" else 0)

    def wants_from(self, position: int, num_prompt_tokens: int) -> bool:
        """Whether some position at or after `position` is still to be captured."""
        p = self.positions
        if p == "last_prompt":
            return position <= num_prompt_tokens - 1
        if p == "all_prompt":
            return position < num_prompt_tokens
        if p in ("all_generated", "all"):
            return True
        assert isinstance(p, frozenset)
        return bool(p) and max(p) >= position

    def needs_full_prompt(self, num_prompt_tokens: int) -> bool:
        """Whether prompt positions before the last are wanted (so no prefix-cache reuse)."""
        if self.positions in ("all_prompt", "all"):
            return True
        if isinstance(self.positions, frozenset):
            return any(p < num_prompt_tokens - 1 for p in self.positions)
        return False


@dataclass(frozen=True)
class ResolvedPatches:
    """A request's patches: per (layer, site), `(position, target [H], alpha)` entries."""

    by_site: dict[SiteKey, list[tuple[int, torch.Tensor, float]]]
    first_position: int  # the request re-forwards from here; blocks from here carry `digest`
    digest: bytes

    @functools.cached_property
    def last_position(self) -> int:
        """The last position a patch lands on: computed past it, nothing is left to patch."""
        return max(pos for entries in self.by_site.values() for pos, _, _ in entries)


class PatchSources(Protocol):
    """What resolves `{"run": ..., "position": ...}` sources: a patch-source store or client."""

    def get_rows(self, run_id: str, keys: list[tuple[int, str, int]]) -> torch.Tensor: ...


def _run_position(entry: PatchEntry) -> int:
    assert entry.source.position is not None  # PatchSource requires it with `run`
    return entry.source.position


def _inline_vector(value: Any, what: str) -> torch.Tensor:
    """A float32 CPU tensor from a spec's inline vector value. A flat list here holds floats
    already (the spec's model validated it as `list[float]`, finite), so it goes straight
    into a float32 array (about 20 µs for 1,024 values, a fifth of `decode_vector`'s general
    path, which checks every element's type first); anything else takes that path."""
    if type(value) is list and value and type(value[0]) is float:
        with np.errstate(over="ignore"):  # past float32's range: inf, refused below
            array = np.fromiter(value, dtype=np.float32, count=len(value))
        if not np.isfinite(array).all():
            raise InvalidRequestError(f"{what}: vector contains NaN or Inf")
        return torch.from_numpy(array)
    try:
        return decode_vector(value)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{what}: {exc}") from None


def _check_steer_term(term: torch.Tensor, layer: int, site: str) -> None:
    """Refuse a scaled (or summed) steering vector that overflowed. A resolved vector is
    float32 on the CPU, so numpy checks it: a tenth of torch's cost for one vector."""
    if not np.isfinite(term.numpy()).all():
        raise InvalidRequestError(f"steering: scale × vector overflows at layer {layer} {site}")


def digest(*parts: Any) -> bytes:
    """A 16-byte digest of tensors, numbers and strings (order-sensitive). A tensor counts by
    the digest of its float32 values, taken once however often it recurs (one vector given
    for every layer is one tensor behind every layer's key)."""
    chunks: list[bytes] = []
    seen: dict[int, bytes] = {}
    for part in parts:
        if isinstance(part, torch.Tensor):
            d = seen.get(id(part))
            if d is None:
                values = part if part.dtype == torch.float32 else part.float()
                values = values.detach().contiguous().numpy()  # no copy for a resolved vector
                d = seen[id(part)] = hashlib.blake2b(values, digest_size=16).digest()
            chunks.append(d)
        else:
            chunks.append(repr(part).encode())
    return hashlib.blake2b(b"\x00".join(chunks) + b"\x00", digest_size=16).digest()


@functools.lru_cache(maxsize=1024)
def _keys_repr(keys: tuple[SiteKey, ...]) -> str:
    """A row's sorted (layer, site) keys as its digest takes them, made once for each set of
    keys (a request steering 28 layers spent a tenth of its admission on their repr)."""
    return repr(list(keys))


def row_content(vectors: dict[SiteKey, torch.Tensor], gates: dict[SiteKey, GateRow]) -> RowContent:
    if not vectors and not gates:
        return RowContent()
    keys = tuple(sorted(vectors))
    parts: list[Any] = ["v", _keys_repr(keys), *(vectors[key] for key in keys)]
    for key in sorted(gates):
        g = gates[key]
        parts += ["g", key, g.probe, g.vector, g.threshold, g.sharpness, g.scale]
        parts += [g.attenuate, g.latch, g.bit]
    return RowContent(vectors, gates, digest(*parts))


class Resolver:
    """Checks specs against one model's shape and one engine's vector registry."""

    def __init__(self, num_layers: int, hidden_size: int, registry: VectorRegistry):
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.registry = registry
        # Inside `shared_specs()`: each steering spec object resolved once, id(spec) ->
        # (spec, its resolution); None outside.
        self._memo: dict[int, tuple[SteeringSpec, ResolvedSteering]] | None = None

    @contextlib.contextmanager
    def shared_specs(self) -> Iterator[None]:
        """Within the block, requests that carry the same steering spec object (one
        SamplingParams given for a whole `LLM.generate` batch) share one resolution of it:
        a spec resolves to the same rows whoever carries it, while the registry and the
        model stay as they are, which they do for the block (one thread admits the batch
        before any step runs)."""
        self._memo = {}
        try:
            yield
        finally:
            self._memo = None

    # -- vectors ------------------------------------------------------------------------

    def check_layer(self, layer: int, what: str) -> int:
        if not 0 <= layer < self.num_layers:
            raise InvalidRequestError(
                f"{what}: layer {layer} is out of range (the model has layers "
                f"0..{self.num_layers - 1})"
            )
        return layer

    def _check_hidden(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if t.shape[-1] != self.hidden_size:
            raise InvalidRequestError(
                f"{what}: vector length {t.shape[-1]} does not match the model's hidden size "
                f"{self.hidden_size}"
            )
        return t

    def layer_vectors(
        self, value: Any, layers: list[int] | None, what: str
    ) -> dict[int, torch.Tensor]:
        """`{layer: [H]}` for a vector value given for `layers` (one row each, or one for all)."""
        if layers is not None and len(set(layers)) != len(layers):
            raise InvalidRequestError(f"{what}: `layers` lists a layer twice: {layers}")
        if isinstance(value, str):
            entry = self.registry.get(value)
            if layers is None:
                if entry.per_layer is None:
                    raise InvalidRequestError(
                        f"{what}: `layers` is required with vector {value!r} (it is not per-layer)"
                    )
                layers = sorted(entry.per_layer)
            rows = {self.check_layer(L, what): vector_for_layer(entry, L) for L in layers}
            return {L: self._check_hidden(v.float(), what) for L, v in rows.items()}
        if layers is None:
            raise InvalidRequestError(f"{what}: `layers` is required with an inline vector")
        if not layers:
            raise InvalidRequestError(f"{what}: `layers` is empty")
        t = _inline_vector(value, what)
        self._check_hidden(t, what)
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() == 2 and t.shape[0] != len(layers):
            raise InvalidRequestError(
                f"{what}: {t.shape[0]} vector rows for {len(layers)} layers (give one row per "
                "listed layer, or a single row for all)"
            )
        if not 0 <= min(layers) <= max(layers) < self.num_layers:
            for L in layers:
                self.check_layer(L, what)  # raises for the first out of range
        if t.dim() == 1:
            return dict.fromkeys(layers, t)
        return dict(zip(layers, t, strict=True))

    def probe(self, value: Any, layer: int, what: str) -> torch.Tensor:
        return self.layer_vectors(value, [layer], what)[layer]

    # -- specs --------------------------------------------------------------------------

    def steering(self, spec: SteeringSpec) -> ResolvedSteering:
        memo = self._memo
        if memo is not None and (hit := memo.get(id(spec))) is not None and hit[0] is spec:
            return hit[1]
        resolved = self._steering(spec)
        if memo is not None:
            memo[id(spec)] = (spec, resolved)  # the spec held: its id stays its own
        return resolved

    def _steering(self, spec: SteeringSpec) -> ResolvedSteering:
        prefill: dict[SiteKey, torch.Tensor] = {}
        decode: dict[SiteKey, torch.Tensor] = {}
        for i, v in enumerate(spec.vectors):
            rows = self.layer_vectors(v.vector, v.layers, f"steering.vectors[{i}]")
            scaled: dict[int, torch.Tensor] = {}  # a vector shared by layers is scaled once
            for layer, vec in rows.items():
                if id(vec) not in scaled:
                    scaled[id(vec)] = term = v.scale * vec
                    _check_steer_term(term, layer, v.site)
            terms = {(layer, v.site): scaled[id(vec)] for layer, vec in rows.items()}
            tables = (
                (prefill, decode)
                if v.phase == "both"
                else ((prefill,) if v.phase == "prefill" else (decode,))
            )
            for table in tables:
                if not table:  # nothing to add to (one vector: the common case)
                    table.update(terms)
                    continue
                for key, term in terms.items():
                    if key in table:
                        table[key] = total = table[key] + term
                        _check_steer_term(total, *key)
                    else:
                        table[key] = term
        gates: dict[SiteKey, GateRow] = {}
        if len(spec.gates) > MAX_GATES:
            raise InvalidRequestError(f"steering.gates: at most {MAX_GATES} gates per request")
        for i, g in enumerate(spec.gates):
            what = f"steering.gates[{i}]"
            key = (self.check_layer(g.when.layer, what), g.when.site)
            if key in gates:
                raise InvalidRequestError(
                    f"{what}: a second gate at layer {key[0]} {key[1]} (one gate per site)"
                )
            probe = self.probe(g.when.probe, g.when.layer, f"{what}.when.probe")
            if g.apply.add is not None:
                vec = g.apply.add.scale * self.probe(g.apply.add.vector, key[0], f"{what}.add")
                scale, attenuate = 1.0, False
            else:
                att = g.apply.attenuate
                assert att is not None  # GateApply checks exactly one of add/attenuate
                scale = att if isinstance(att, float | int) else att.scale
                direction = (
                    probe
                    if isinstance(att, float | int) or att.vector is None
                    else self.probe(att.vector, key[0], f"{what}.attenuate")
                )
                norm = direction.norm()
                if norm == 0:
                    raise InvalidRequestError(f"{what}: cannot attenuate along a zero vector")
                vec, attenuate = direction / norm, True
            gates[key] = GateRow(
                probe=probe,
                vector=vec,
                threshold=g.when.threshold,
                sharpness=g.when.sharpness,
                scale=float(scale),
                attenuate=attenuate,
                latch=g.scope == "rest_of_request",
                bit=i,
            )
        aborts = [
            self.probe_read(c, f"steering.abort_when[{i}]", threshold=True)
            for i, c in enumerate(spec.abort_when)
        ]
        decode_row = row_content(decode, gates)
        # Phase "both" alone, without gates: the same sums in both tables, digested once.
        same = not gates and all(v.phase == "both" for v in spec.vectors)
        prefill_row = decode_row if same else row_content(prefill, {})
        return ResolvedSteering(prefill_row, decode_row, aborts)

    def probe_read(
        self, c: ProbeCondition | Readout, what: str, threshold: bool = False
    ) -> ProbeRead:
        layer = self.check_layer(c.layer, what)
        name = getattr(c, "name", None) or (
            c.probe if isinstance(c.probe, str) else site_key(layer, c.site)
        )
        return ProbeRead(
            name=name,
            layer=layer,
            site=c.site,
            probe=self.probe(c.probe, layer, f"{what}.probe"),
            threshold=c.threshold if threshold and isinstance(c, ProbeCondition) else None,
            sharpness=c.sharpness if isinstance(c, ProbeCondition) else 1.0,
        )

    def readouts(self, readouts: list[Readout]) -> list[ProbeRead]:
        reads = [self.probe_read(r, f"readouts[{i}]") for i, r in enumerate(readouts)]
        names = [r.name for r in reads]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise InvalidRequestError(
                f"readouts: names must be unique, {sorted(dup)} repeat (set `name`)"
            )
        return reads

    def patches(
        self, entries: list[PatchEntry], num_prompt_tokens: int, sources: PatchSources | None
    ) -> ResolvedPatches:
        """Targets for every patch entry (run rows fetched now, one call per run)."""
        seen: set[tuple[int, str, int]] = set()
        targets: dict[int, torch.Tensor] = {}
        from_runs: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            what = f"patch[{i}]"
            key = (self.check_layer(e.layer, what), e.site, e.position)
            if key in seen:
                raise InvalidRequestError(
                    f"{what}: layer {e.layer} {e.site} position {e.position} is patched twice"
                )
            seen.add(key)
            if e.position >= num_prompt_tokens:
                raise InvalidRequestError(
                    f"{what}: position {e.position} is not in the prompt "
                    f"({num_prompt_tokens} tokens); patches target prompt positions"
                )
            if e.alpha != e.alpha or abs(e.alpha) == float("inf"):
                raise InvalidRequestError(f"{what}: alpha must be finite")
            src = e.source
            if src.zeros:
                targets[i] = torch.zeros(self.hidden_size)
            elif src.vector is not None:
                targets[i] = self.probe(src.vector, e.layer, f"{what}.source.vector")
            else:
                assert src.run is not None
                from_runs.setdefault(src.run, []).append(i)
        for run, idx in from_runs.items():
            if sources is None:
                raise InvalidRequestError(
                    f"patch source run {run!r} needs a patch-source store, and this engine has "
                    "none attached"
                )
            keys = [(entries[i].layer, entries[i].site, _run_position(entries[i])) for i in idx]
            rows = sources.get_rows(run, keys)  # raises RunNotFoundError / InvalidRequestError
            for i, row in zip(idx, rows, strict=True):
                what = f"patch[{i}].source"
                targets[i] = self._check_hidden(row.float(), what)
                if not bool(torch.isfinite(targets[i]).all()):  # stores refuse these; be sure
                    e = entries[i]
                    raise InvalidRequestError(
                        f"{what}: run {run!r} holds NaN or inf at (layer {e.layer}, site "
                        f"{e.site!r}, position {_run_position(e)}); a patch from it would be NaN"
                    )
        by_site: dict[SiteKey, list[tuple[int, torch.Tensor, float]]] = {}
        parts: list[Any] = []
        for i, e in sorted(
            enumerate(entries), key=lambda ie: (ie[1].layer, ie[1].site, ie[1].position)
        ):
            by_site.setdefault((e.layer, e.site), []).append((e.position, targets[i], e.alpha))
            parts += [e.layer, e.site, e.position, e.alpha, targets[i]]
        first = min(e.position for e in entries)
        return ResolvedPatches(by_site, first, digest("patch", *parts))

    def capture(self, spec: CaptureSpec) -> ResolvedCapture:
        keys: list[SiteKey] = []
        for site, layers in spec.sites.items():
            chosen = range(self.num_layers) if layers == "all" else layers
            keys += [(self.check_layer(L, f"capture.sites.{site}"), site) for L in chosen]
        keys.sort(key=lambda k: (k[0], SITES.index(k[1])))
        positions = spec.positions
        return ResolvedCapture(
            keys,
            frozenset(positions) if isinstance(positions, list) else positions,
            spec.run,
            getattr(torch, spec.dtype),
        )
