"""Steering tables on the device, and the row pools that hand out their rows.

Per site, tables are indexed `[layer, row]`: row 0 is zero, row 1 the global prefill
vector, row 2 the global decode vector, then the per-request pool, then the
dynamic-override pool. A request holds one row index across every (layer, site), so a
step carries one row index per token and one kernel launch per site serves the whole
batch however many distinct configs it holds. Every table is allocated at its full
capacity when the engine starts and only ever written in place: a CUDA graph captured
over them reads whatever rows hold at each replay.

Read-out probes (a request's `readouts` and `abort_when` conditions) live in a bank per
(layer, site) of `probe_columns` float32 columns, shared by digest like rows; the fused op
at a site scores the tokens that read out against its bank's live columns (a prefix: the
count is one past the highest column in use).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable

import torch

from services.engine.host_memory import to_device_async
from services.engine.interventions.resolve import RowContent, SiteKey
from services.engine.interventions.sites import SITES

ZERO_ROW, GLOBAL_PREFILL_ROW, GLOBAL_DECODE_ROW = 0, 1, 2
NUM_FIXED_ROWS = 3

# gate_params columns (the kernel's layout)
G_ACTIVE, G_THRESHOLD, G_SHARPNESS, G_SCALE, G_ATTENUATE, G_BIT, G_LATCH = range(7)
# mon_params columns
M_ACTIVE, M_THRESHOLD, M_SHARPNESS, M_GATE_ROWS = range(4)


class RowPool:
    """Rows [start, start + size) of every table; identical contents share a row."""

    def __init__(self, start: int, size: int, share: bool):
        self.start, self.size, self.share = start, size, share
        self.free = list(range(start, start + size))  # a heap: the lowest row goes first
        self.refs: Counter[int] = Counter()
        self.by_digest: dict[bytes, int] = {}
        self.digest_of: dict[int, bytes] = {}

    @property
    def used(self) -> int:
        return self.size - len(self.free)

    def lookup(self, digest: bytes) -> int | None:
        return self.by_digest.get(digest) if self.share else None

    def acquire(self, digest: bytes) -> int | None:
        """A fresh row (None when the pool is full); the caller writes its content."""
        if not self.free:
            return None
        row = heapq.heappop(self.free)
        self.refs[row] = 1
        if self.share:
            self.by_digest[digest] = row
            self.digest_of[row] = digest
        return row

    def ref(self, row: int) -> None:
        self.refs[row] += 1

    def release(self, row: int) -> bool:
        """Drop one reference; True when the row became free (so its content must go)."""
        self.refs[row] -= 1
        if self.refs[row] > 0:
            return False
        del self.refs[row]
        d = self.digest_of.pop(row, None)
        if d is not None:
            del self.by_digest[d]
        heapq.heappush(self.free, row)
        return True


class SteeringTables:
    """Every steering tensor the fused site op reads, for one engine replica."""

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        device: torch.device,
        dtype: torch.dtype,
        per_request_rows: int,
        dynamic_rows: int,
        probe_columns: int = 8,
    ):
        if probe_columns < 1 or probe_columns & (probe_columns - 1):
            raise ValueError(f"probe_columns must be a power of two, got {probe_columns}")
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.device, self.dtype = device, dtype
        self.num_rows = NUM_FIXED_ROWS + per_request_rows + dynamic_rows
        self.request_pool = RowPool(NUM_FIXED_ROWS, per_request_rows, share=True)
        self.dynamic_pool = RowPool(NUM_FIXED_ROWS + per_request_rows, dynamic_rows, share=False)
        L, R, H = num_layers, self.num_rows, hidden_size
        f32 = torch.float32
        self.row_scale = torch.ones(R, device=device, dtype=f32)  # [R]
        self._host_scale: dict[int, float] = {}  # rows whose scale is not 1 (host mirror)

        def table(*shape: int, dtype: torch.dtype = dtype) -> dict[str, torch.Tensor]:
            return {s: torch.zeros(*shape, device=device, dtype=dtype) for s in SITES}

        self.vec = table(L, R, H)  # site -> [L, R, H]
        self.gate_probe = table(L, R, H)
        self.gate_vec = table(L, R, H)
        self.gate_params = table(L, R, 7, dtype=f32)
        self.dyn_vec = table(L, H)
        self.mon_probe = table(L, H)
        self.mon_params = table(L, 4, dtype=f32)
        self.probe_columns = probe_columns
        self.probe_bank = table(L, probe_columns, H, dtype=f32)  # site -> [L, C, H]
        self.probe_count = table(L, dtype=torch.int32)  # site -> [L]: live columns
        self.probe_pools: dict[SiteKey, RowPool] = {}
        # How many installed things read each (layer, site): the kernel runs where > 0.
        self.site_use: Counter[SiteKey] = Counter()
        self.dynamic: dict[SiteKey, torch.Tensor] = {}  # host copies, for snapshots
        # Since the last `flush`: rows written, rows to zero (per site, in the vector and
        # gate tables) and row scales set. The device sees them all at the flush.
        self._pending: dict[int, RowContent] = {}
        self._clear_vec: dict[str, set[int]] = {}
        self._clear_gates: dict[str, set[int]] = {}
        self._scales: dict[int, float] = {}
        self.monitors: dict[SiteKey, dict] = {}
        self._site_args: dict[SiteKey, dict[str, torch.Tensor]] = {}

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype, non_blocking=True)

    # -- rows ---------------------------------------------------------------------------

    def _staging(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor to fill and copy up (`_scatter`): pinned on CUDA."""
        return torch.zeros(*shape, dtype=dtype, pin_memory=self.device.type == "cuda")

    def _upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst.copy_(src)` (a host tensor) without waiting for the device. A copy from
        pageable memory would wait for everything queued, the step in flight included, so
        on CUDA `src` is pinned (`_staging`, or staged here): PyTorch's caching host
        allocator hands a pinned block out again only once the copies that read it have
        run, so nothing here waits for a step either."""
        if self.device.type == "cuda" and not src.is_pinned():
            src = src.pin_memory()
        dst.copy_(src, non_blocking=True)

    def write_row(self, row: int, content: RowContent) -> None:
        """Fill a row acquired from a pool. The vectors and gates reach the device with every
        other row written since, before the next step that reads the tables (`flush`); the
        row's scale is 1 from now. A free row is zero at every layer, and `flush` writes
        every layer of the row at each site `content` has (zero where it has nothing),
        which keeps it so."""
        self._pending[row] = content
        self.site_use.update(content.sites())
        self.set_row_scale(row, 1.0)

    def flush(self) -> None:
        """Bring the device up to date before a step reads the tables, in one launch or copy
        per table and site rather than a few per row: zero the rows cleared since the last
        flush, copy up the rows written since (all of them at once, then one scatter into
        their rows), then set the row scales changed since. Row by row, on CUDA, each write
        page-locked a staging block of its own while the step in flight held the last one
        (a few hundred µs a row on the engine thread), and each clear launched two fills."""
        for site, rows in self._clear_vec.items():
            self.vec[site].index_fill_(1, self._index(rows), 0)
        for site, rows in self._clear_gates.items():
            self.gate_params[site].index_fill_(1, self._index(rows), 0)
        self._clear_vec, self._clear_gates = {}, {}
        if self._pending:
            self._write_pending()
        if self._scales:
            scales, self._scales = self._scales, {}
            values = to_device_async(list(scales.values()), torch.float32, self.device)
            self.row_scale.index_copy_(0, self._index(scales), values)

    def _index(self, rows: Iterable[int]) -> torch.Tensor:
        """Row numbers as an index tensor on the device, copied up without a wait."""
        return to_device_async(list(rows), torch.long, self.device)

    def _write_pending(self) -> None:
        pending, self._pending = self._pending, {}
        L, H = self.num_layers, self.hidden_size
        vector_rows: dict[str, list[tuple[int, RowContent]]] = {}
        gate_rows: dict[str, list[tuple[int, RowContent]]] = {}
        for row, content in pending.items():
            for site in {site for _, site in content.vectors}:
                vector_rows.setdefault(site, []).append((row, content))
            for site in {site for _, site in content.gates}:
                gate_rows.setdefault(site, []).append((row, content))
        for site, entries in vector_rows.items():
            staged = self._staging(len(entries), L, H, dtype=self.dtype)
            for i, (_, content) in enumerate(entries):
                layers: dict[int, tuple[torch.Tensor, list[int]]] = {}
                for (layer, s), v in content.vectors.items():
                    if s == site:  # a vector given for many layers is one tensor: one copy
                        layers.setdefault(id(v), (v, []))[1].append(layer)
                for v, at in layers.values():
                    _fill_layers(staged[i], at, v)
            self._scatter(self.vec[site], [row for row, _ in entries], staged)
        for site, entries in gate_rows.items():
            probe = self._staging(len(entries), L, H, dtype=self.dtype)
            vec = self._staging(len(entries), L, H, dtype=self.dtype)
            params = self._staging(len(entries), L, 7, dtype=torch.float32)
            for i, (_, content) in enumerate(entries):
                for (layer, s), g in content.gates.items():
                    if s != site:
                        continue
                    probe[i, layer], vec[i, layer] = g.probe, g.vector
                    params[i, layer] = torch.tensor(
                        [1.0, g.threshold, g.sharpness, g.scale, float(g.attenuate), g.bit,
                         g.latch]
                    )  # fmt: skip
            rows = [row for row, _ in entries]
            self._scatter(self.gate_probe[site], rows, probe)
            self._scatter(self.gate_vec[site], rows, vec)
            self._scatter(self.gate_params[site], rows, params)

    def _scatter(self, table: torch.Tensor, rows: list[int], staged: torch.Tensor) -> None:
        """`table[:, rows[i]] = staged[i]` for a `[L, R, X]` table and `[n, L, X]` staged
        host rows: one copy up, one scatter."""
        if self.device.type == "cuda":  # from pinned memory: no wait for the step in flight
            staged = staged.to(self.device, non_blocking=True)
        table.index_copy_(1, self._index(rows), staged.transpose(0, 1))

    def clear_row(self, row: int, content: RowContent) -> None:
        """Zero the row, at the next flush, at every site `content` wrote (every layer); a
        row written since the last flush never reached the device, which still holds what
        the row held before (zeros, or what a clear queued before that write zeroes)."""
        if self._pending.pop(row, None) is None:
            for site in {site for _, site in content.vectors}:
                self._clear_vec.setdefault(site, set()).add(row)
            for site in {site for _, site in content.gates}:
                self._clear_gates.setdefault(site, set()).add(row)
        self.site_use.subtract(content.sites())
        self.set_row_scale(row, 1.0)

    def set_row_scale(self, row: int, scale: float) -> None:
        """The row's scale from the next flush on (`scale_of` reads it now)."""
        self._scales[row] = scale
        if scale == 1.0:
            self._host_scale.pop(row, None)
        else:
            self._host_scale[row] = scale

    def scale_of(self, row: int) -> float:
        """A row's scale, read without touching the device."""
        return self._host_scale.get(row, 1.0)

    # -- dynamic tier and monitors --------------------------------------------------------

    def set_dynamic(self, key: SiteKey, vector: torch.Tensor | None) -> None:
        layer, site = key
        if key in self.dynamic:
            self.site_use[key] -= 1
            del self.dynamic[key]
        self.dyn_vec[site][layer] = 0 if vector is None else self._dev(vector)
        if vector is not None:
            self.dynamic[key] = vector
            self.site_use[key] += 1

    def set_monitor(
        self,
        key: SiteKey,
        probe: torch.Tensor | None,
        threshold: float = 0.0,
        sharpness: float = 1.0,
        gate_rows: bool = False,
    ) -> None:
        layer, site = key
        if key in self.monitors:
            self.site_use[key] -= 1
            del self.monitors[key]
        if probe is None:
            self.mon_params[site][layer] = 0
            self.mon_probe[site][layer] = 0
            return
        self.mon_probe[site][layer] = self._dev(probe)
        params = [1.0, threshold, sharpness, float(gate_rows)]
        self.mon_params[site][layer] = torch.tensor(params, dtype=torch.float32)
        self.monitors[key] = {
            "threshold": threshold,
            "sharpness": sharpness,
            "gate_rows": gate_rows,
        }
        self.site_use[key] += 1

    # -- read-out probes ------------------------------------------------------------------

    def probe_room(self, wanted: dict[SiteKey, set[bytes]]) -> bool:
        """Whether every site's bank can take the probes (by digest) it does not hold yet."""
        for key, digests in wanted.items():
            pool = self.probe_pools.get(key)
            if pool is None:
                if len(digests) > self.probe_columns:
                    return False
                continue
            if sum(pool.lookup(d) is None for d in digests) > len(pool.free):
                return False
        return True

    def acquire_probe(self, key: SiteKey, digest: bytes, probe: torch.Tensor) -> int:
        """The bank column holding `probe` at `key` (shared by digest); `probe_room` first."""
        pool = self.probe_pools.get(key)
        if pool is None:
            pool = self.probe_pools[key] = RowPool(0, self.probe_columns, share=True)
        col = pool.lookup(digest)
        if col is not None:
            pool.ref(col)
            return col
        col = pool.acquire(digest)
        assert col is not None, "checked by probe_room"
        layer, site = key
        self._upload(self.probe_bank[site][layer, col], probe.detach().float().cpu())
        self.site_use[key] += 1
        self._set_probe_count(key)
        return col

    def release_probe(self, key: SiteKey, col: int) -> None:
        pool = self.probe_pools[key]
        if pool.release(col):
            self.site_use[key] -= 1
            self._set_probe_count(key)

    def _set_probe_count(self, key: SiteKey) -> None:
        layer, site = key
        refs = self.probe_pools[key].refs
        self.probe_count[site][layer] = max(refs) + 1 if refs else 0

    # -- what the kernel reads ------------------------------------------------------------

    def active_sites(self) -> set[SiteKey]:
        return {k for k, n in self.site_use.items() if n > 0}

    def site_args(self, layer: int, site: str) -> dict[str, torch.Tensor]:
        """The table views the fused op reads at (layer, site): made once a site (the tables
        are written in place only, so a view stays theirs), not a dozen a launch."""
        key = (layer, site)
        args = self._site_args.get(key)
        if args is None:
            args = self._site_args[key] = self._make_site_args(layer, site)
        return args

    def _make_site_args(self, layer: int, site: str) -> dict[str, torch.Tensor]:
        return {
            "vec": self.vec[site][layer],
            "row_scale": self.row_scale,
            "dyn_vec": self.dyn_vec[site][layer],
            "mon_probe": self.mon_probe[site][layer],
            "mon_params": self.mon_params[site][layer],
            "gate_probe": self.gate_probe[site][layer],
            "gate_vec": self.gate_vec[site][layer],
            "gate_params": self.gate_params[site][layer],
            "probe_bank": self.probe_bank[site][layer],
            "probe_count": self.probe_count[site][layer : layer + 1],
        }


def _fill_layers(rows: torch.Tensor, layers: list[int], v: torch.Tensor) -> None:
    """`rows[layers] = v` ([L, H] rows, a vector [H]), cast to the rows' dtype: a copy per
    run of consecutive layers (all of them, mostly), not an indexed write."""
    layers = sorted(layers)
    assert not layers or 0 <= layers[0] <= layers[-1] < rows.shape[0], layers
    start = 0
    for j in range(1, len(layers) + 1):
        if j == len(layers) or layers[j] != layers[j - 1] + 1:
            first, n = layers[start], j - start
            rows[first : first + n].copy_(v.expand(n, v.shape[-1]))
            start = j
