"""Turn the last-position logits of each sampling sequence into tokens and logprobs.

A step's sampling runs entirely on the device: `SamplingMetadata.build` decides on the host,
from the requests' `SamplingParams`, which stages the batch needs (temperature, top-k,
top-p, min-p, logprobs) and uploads the per-row values once; `sample` then only queues
device work, and `SampledBatch.to_host` makes the step's one device→host copy. The only
per-row loop is drawing noise for seeded requests from their own generator, which makes a
seeded request's tokens independent of what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.host_memory import to_device_async, to_host_async
from services.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token id: logprob} (top-k ∪ sampled ∪ requested ids), or None if not asked.
    logprobs: list[dict[int, float] | None]


class _Upload:
    """A step's small per-row arrays, staged on the host and sent to the device in one copy
    per dtype (from pinned memory on CUDA, so the copies do not block the host)."""

    DTYPES = (torch.float32, torch.int64)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host: dict[torch.dtype, list] = {dtype: [] for dtype in self.DTYPES}
        self.dev: dict[torch.dtype, torch.Tensor] = {}

    def add(self, values: list, dtype: torch.dtype) -> tuple[torch.dtype, int, int]:
        """Stage `values`; the returned handle reads them back on the device after `send`."""
        buf = self.host[dtype]
        buf.extend(values)
        return dtype, len(buf) - len(values), len(buf)

    def send(self) -> None:
        pin = self.device.type == "cuda"
        for dtype, values in self.host.items():
            if values:
                host = torch.tensor(values, dtype=dtype, pin_memory=pin)
                self.dev[dtype] = host.to(self.device, non_blocking=True)

    def get(self, handle: tuple[torch.dtype, int, int] | None) -> torch.Tensor | None:
        if handle is None:
            return None
        dtype, start, stop = handle
        return self.dev[dtype][start:stop]


@dataclass
class SamplingMetadata:
    """Host-known per-row sampling parameters of one step, built once from SamplingParams.

    Every decision about which stages run is made here, from the params, so `sample` never
    reads a device value. Device tensors are None when no row needs them. "Random rows" are
    the non-greedy rows; `temperature`, `min_p` and the noise are over them, `top_k`/`top_p`
    over the random rows that truncate.
    """

    num_rows: int
    all_greedy: bool
    random_rows: list[int]  # rows sampled at random (the rest are greedy)
    random_index: torch.Tensor | None  # [R] int64 = random_rows; None when every row is random
    temperature: torch.Tensor | None  # [R, 1]; None when every random row has temperature 1
    truncate_index: torch.Tensor | None  # [T] positions among random rows with top-k/top-p;
    # None when all random rows truncate (or none do)
    top_k: torch.Tensor | None  # [T] int64, 0 = off; None when no row uses top-k
    max_top_k: int  # largest top_k asked for (0 when none)
    top_p: torch.Tensor | None  # [T] float32, 1 = off; None when no row uses top-p
    min_p: torch.Tensor | None  # [R] float32; None when no row uses min-p
    seeded: list[tuple[int, torch.Generator]]  # (position among random rows, its generator)
    unseeded_noise: bool  # some random row draws from the default generator
    default_generator: torch.Generator | None
    logprob_rows: list[int]  # rows that asked for logprobs or logprob_token_ids
    logprob_index: torch.Tensor | None  # [L] int64 = logprob_rows; None when every row asks
    num_logprobs: list[int]  # per logprob row: how many top logprobs it asked for
    max_logprobs: int
    logprob_token_ids: list[list[int]]  # per logprob row: the ids it asked for by name
    logprob_token_index: torch.Tensor | None  # [L, M] int64, padded with 0; None when M == 0

    @property
    def needs_top_k(self) -> bool:
        return self.top_k is not None

    @property
    def needs_top_p(self) -> bool:
        return self.top_p is not None

    @property
    def needs_min_p(self) -> bool:
        return self.min_p is not None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        device: torch.device | str,
        default_generator: torch.Generator | None = None,
    ) -> SamplingMetadata:
        """`generators[i]` is row i's own generator (seeded requests) or None."""
        device = torch.device(device)
        n = len(params)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        rand = [params[i] for i in random_rows]
        trunc = [j for j, p in enumerate(rand) if p.top_k > 0 or p.top_p < 1.0]
        use_top_k = any(rand[j].top_k > 0 for j in trunc)
        use_top_p = any(rand[j].top_p < 1.0 for j in trunc)
        logprob_rows = [
            i for i, p in enumerate(params) if p.logprobs is not None or p.logprob_token_ids
        ]
        asked = [params[i].logprob_token_ids for i in logprob_rows]
        width = max(map(len, asked), default=0)

        f32, i64 = torch.float32, torch.int64
        up = _Upload(device)
        h_random = up.add(random_rows, i64) if 0 < len(random_rows) < n else None
        h_temp = None
        if any(p.temperature != 1.0 for p in rand):
            h_temp = up.add([p.temperature for p in rand], f32)
        h_trunc = up.add(trunc, i64) if 0 < len(trunc) < len(rand) else None
        h_top_k = up.add([rand[j].top_k for j in trunc], i64) if use_top_k else None
        h_top_p = up.add([rand[j].top_p for j in trunc], f32) if use_top_p else None
        h_min_p = up.add([p.min_p for p in rand], f32) if any(p.min_p > 0 for p in rand) else None
        h_lp = up.add(logprob_rows, i64) if 0 < len(logprob_rows) < n else None
        h_named = None
        if width:
            h_named = up.add([t for ids in asked for t in ids + [0] * (width - len(ids))], i64)
        up.send()

        temperature = up.get(h_temp)
        named = up.get(h_named)
        seeded = [(j, g) for j, i in enumerate(random_rows) if (g := generators[i]) is not None]
        return cls(
            num_rows=n,
            all_greedy=not random_rows,
            random_rows=random_rows,
            random_index=up.get(h_random),
            temperature=None if temperature is None else temperature[:, None],
            truncate_index=up.get(h_trunc),
            top_k=up.get(h_top_k),
            max_top_k=max((rand[j].top_k for j in trunc), default=0),
            top_p=up.get(h_top_p),
            min_p=up.get(h_min_p),
            seeded=seeded,
            unseeded_noise=len(seeded) < len(random_rows),
            default_generator=default_generator,
            logprob_rows=logprob_rows,
            logprob_index=up.get(h_lp),
            num_logprobs=[params[i].logprobs or 0 for i in logprob_rows],
            max_logprobs=max((params[i].logprobs or 0 for i in logprob_rows), default=0),
            logprob_token_ids=asked,
            logprob_token_index=None if named is None else named.view(len(asked), width),
        )


@dataclass
class SampledBatch:
    """One step's sampled tokens and requested logprobs, still on the device."""

    token_ids: torch.Tensor  # [N] int64
    logprob_rows: list[int]  # rows with logprobs (host)
    num_logprobs: list[int]  # per logprob row: how many of `top_ids` it asked for
    logprob_token_ids: list[list[int]]  # per logprob row: the ids asked for by name
    sampled_logprobs: torch.Tensor | None  # [L] float32: each logprob row's sampled token
    top_logprobs: torch.Tensor | None  # [L, K] float32, K = max top logprobs asked (0: None)
    top_ids: torch.Tensor | None  # [L, K] int64
    token_logprobs: torch.Tensor | None  # [L, M] float32: of `logprob_token_ids`, padded

    def packed(self) -> torch.Tensor:
        """Everything `to_host` needs as one flat device tensor: token ids alone (int64)
        when no row asked for logprobs, else ids, sampled, top values, top ids and
        requested logprobs as float64 (which holds token ids and float32 values exactly)."""
        if not self.logprob_rows:
            return self.token_ids
        parts = [self.token_ids, self.sampled_logprobs, self.top_logprobs, self.top_ids]
        parts.append(self.token_logprobs)
        return torch.cat([t.flatten().double() for t in parts if t is not None])

    def to_host(self, pinned: torch.Tensor | None = None) -> SamplerOutput:
        """The step's one device→host sync. With `pinned` (a pinned host buffer of
        `packed()`'s dtype and at least its size) the copy goes there non_blocking and waits
        on an event; otherwise it is one blocking copy."""
        packed = self.packed()
        if pinned is not None and packed.is_cuda:
            host = pinned[: packed.numel()]
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            values = host.tolist()
        else:
            values = packed.tolist()
        return self.unpack(values)

    def unpack(self, values: list) -> SamplerOutput:
        """Build the host output from `packed()`'s values (for a caller that copied it)."""
        n = self.token_ids.shape[0]
        tokens = [int(v) for v in values[:n]]
        out: list[dict[int, float] | None] = [None] * n
        num = len(self.logprob_rows)
        k = self.top_ids.shape[1] if self.top_ids is not None else 0
        m = self.token_logprobs.shape[1] if self.token_logprobs is not None else 0
        sampled = values[n : n + num]
        top_vals = values[n + num : n + num * (1 + k)]
        top_ids = values[n + num * (1 + k) : n + num * (1 + 2 * k)]
        named = values[n + num * (1 + 2 * k) : n + num * (1 + 2 * k + m)]
        for j, i in enumerate(self.logprob_rows):
            top = self.num_logprobs[j]
            d = {
                int(t): v
                for t, v in zip(
                    top_ids[j * k : j * k + top], top_vals[j * k : j * k + top], strict=True
                )
            }
            d[tokens[i]] = sampled[j]
            ids = self.logprob_token_ids[j]
            d.update(zip(ids, named[j * m : j * m + len(ids)], strict=True))
            out[i] = d
        return SamplerOutput(tokens, out)


def _apply_top_k_top_p(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p); k == 0 and p == 1 mean off.

    Top-k keeps every logit >= the k-th largest (ties with it included). Top-p sorts, so
    it runs only when some row asks for it; top-k alone needs just `topk(max k)`.
    """
    v = x.shape[-1]
    if meta.top_p is None:  # top-k only
        assert meta.top_k is not None
        k = min(meta.max_top_k, v)
        top = x.topk(k, dim=-1).values  # [T, k], descending
        kth = top.gather(1, (meta.top_k.clamp(1, k) - 1)[:, None])
        kth = kth.masked_fill(meta.top_k[:, None] <= 0, float("-inf"))
        return x.masked_fill(x < kth, float("-inf"))
    sorted_x, order = x.sort(dim=-1, descending=True)
    if meta.top_k is not None:
        ks = torch.where(meta.top_k > 0, meta.top_k.clamp(max=v), v)
        kth = sorted_x.gather(1, (ks - 1)[:, None])
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p (keeps >= 1 token);
    # rows with top_p == 1 are left alone, so float error in the cumsum drops nothing.
    before = probs.cumsum(dim=-1) - probs
    top_p = meta.top_p[:, None]
    sorted_x = sorted_x.masked_fill((before >= top_p) & (top_p < 1.0), float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Tokens of the random rows ([R] int64) from their logits ([R, V])."""
    x = logits if meta.temperature is None else logits / meta.temperature
    if meta.top_k is not None or meta.top_p is not None:
        if meta.truncate_index is None:
            x = _apply_top_k_top_p(x, meta)
        else:  # only the rows that truncate pay for it
            rows = meta.truncate_index
            x = x.index_copy(0, rows, _apply_top_k_top_p(x.index_select(0, rows), meta))
    probs = x.softmax(dim=-1)
    if meta.min_p is not None:
        keep = probs >= meta.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
    # Exponential-race sampling: argmax(p / E), E ~ Exp(1), draws exactly from p, with no
    # host sync (unlike torch.multinomial). Unseeded rows share one draw; a seeded row
    # overwrites its own noise from its own generator.
    noise = torch.empty_like(probs)
    if meta.unseeded_noise:
        noise.exponential_(generator=meta.default_generator)
    for j, g in meta.seeded:
        noise[j].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def sample(
    logits: torch.Tensor,  # [N, V] float32
    meta: SamplingMetadata,
) -> SampledBatch:
    """Sample one token per row and compute the asked-for logprobs, all on the device: no
    device→host sync happens here (`SampledBatch.to_host` is the one)."""
    if meta.all_greedy:
        tokens = logits.argmax(dim=-1)
    elif meta.random_index is None:  # every row is random
        tokens = _sample_random(logits, meta)
    else:
        rows = meta.random_index
        tokens = logits.argmax(dim=-1)
        tokens = tokens.index_copy(0, rows, _sample_random(logits.index_select(0, rows), meta))

    sampled_lp = top_vals = top_ids = named = None
    if meta.logprob_rows:
        rows_logits, rows_tokens = logits, tokens
        if meta.logprob_index is not None:
            rows_logits = logits.index_select(0, meta.logprob_index)
            rows_tokens = tokens.index_select(0, meta.logprob_index)
        logprobs = torch.log_softmax(rows_logits, dim=-1)  # [L, V]: the raw model distribution
        sampled_lp = logprobs.gather(1, rows_tokens[:, None]).squeeze(1)
        if meta.max_logprobs:
            top_vals, top_ids = logprobs.topk(min(meta.max_logprobs, logprobs.shape[-1]), dim=-1)
        if meta.logprob_token_index is not None:
            named = logprobs.gather(1, meta.logprob_token_index)
    return SampledBatch(
        token_ids=tokens,
        logprob_rows=meta.logprob_rows,
        num_logprobs=meta.num_logprobs,
        logprob_token_ids=meta.logprob_token_ids,
        sampled_logprobs=sampled_lp,
        top_logprobs=top_vals,
        top_ids=top_ids,
        token_logprobs=named,
    )


def sample_to_host(
    logits: torch.Tensor,  # [N, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> SamplerOutput:
    """Build the metadata, sample and copy back: one call for callers that wait anyway."""
    meta = SamplingMetadata.build(params, generators, logits.device, default_generator)
    return sample(logits, meta).to_host()


class PromptLogprobs:
    """A chunk's prompt logprobs, per prompt position the top-k plus the actual next prompt
    token's: computed on the device at launch and copied to pinned host memory behind the
    step, so that launching does not wait for the device (`.tolist()` of a device tensor
    would). `to_dicts()`, when the step's result is read, waits for that copy only."""

    def __init__(
        self,
        logits: torch.Tensor,  # [P, V]: logits at prompt positions p, predicting token p+1
        next_ids: list[int],  # [P] the actual prompt tokens at p+1
        k: int,
    ):
        self.next_ids = next_ids
        lp = torch.log_softmax(logits.float(), dim=-1)
        ids = to_device_async(next_ids, torch.int64, lp.device)
        values = lp.gather(1, ids[:, None])  # [P, 1], then the top k's
        top = None
        if k:
            vals, top = lp.topk(k, dim=-1)
            values = torch.cat([values, vals], dim=1)
        self.values = to_host_async(values)
        self.top_ids = None if top is None else to_host_async(top)
        self.copied = None
        if lp.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def to_dicts(self) -> list[dict[int, float]]:
        if self.copied is not None:
            self.copied.synchronize()
        values = self.values.tolist()
        out = [{t: row[0]} for t, row in zip(self.next_ids, values, strict=True)]
        if self.top_ids is not None:
            for d, row_ids, row in zip(out, self.top_ids.tolist(), values, strict=True):
                for t, v in zip(row_ids, row[1:], strict=True):
                    d.setdefault(t, v)
        return out
