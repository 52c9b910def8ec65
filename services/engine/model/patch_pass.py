"""A patching sweep as one layered forward, where each cell starts at the site it patches.

A cell of a causal-tracing sweep patches the corrupt prompt's residual at one (layer, site,
position p) and reads the last position's logprobs. Before that site nothing differs from
the corrupt run: every earlier layer, and every position before p at every layer (the model
is causal), holds the corrupt run's values. Forwarding the whole corrupt prompt once per
cell, as hooked forwards do, recomputes all of that.

A pass forwards the corrupt prompt (and the clean one, whose rows are the patch sources)
once. Each cell *joins* that forward at its site:
- its rows p..T-1 are copied from the corrupt run's rows there, and row p is patched;
- from then on it runs as its own sequence, attending the corrupt run's keys and values
  before p and its own from p on.

A cell costs (T - p) tokens times the layers after its site, about a quarter of a whole
forward on average over a grid.

Members (the corrupt run, an optional in-pass control, the clean run, then the cells by join
point) sit back to back in one packed residual `[N, H]`. So at every point of the forward
the members that have joined are a prefix of it, and each layer runs its matmuls once, over
that prefix. Attention pads each member to the longest prompt, fills the keys and values of
the positions a member does not compute with the corrupt run's, and runs one causal SDPA
call per layer.

Pure host-side planning (`plan_passes`) is apart from the forward (`run_patch_pass`), so the
sweep can split a grid into passes that fit the engine's token budget.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.interventions.sites import SITES

# Sites in forward order within a layer: a join point is 3 * layer + this.
SITE_ORDER = {s: i for i, s in enumerate(SITES)}
# Padded attention holds [members, longest prompt] query/key/value rows: at most this many
# times a pass's token budget (a whole forward's MLP activations are larger than that).
PAD_ROWS_PER_TOKEN = 2


@dataclass(frozen=True)
class PassCell:
    """One patched cell: `source` is the clean position the row comes from (or the index of
    its row in `PassJob.source_rows` when the rows come from a stored run)."""

    layer: int
    site: str
    position: int  # the corrupt position patched
    source: int

    @property
    def join(self) -> int:
        return join_point(self.layer, self.site)


@dataclass
class PassJob:
    """One pass: the prompts, the cells, and whose logprobs come back."""

    corrupt_ids: list[int]
    cells: list[PassCell]
    token_ids: list[int]  # the tokens whose last-position logprobs each member returns
    alpha: float = 1.0
    clean_ids: list[int] | None = None  # run in the pass: the baseline, and the rows' source
    source_rows: torch.Tensor | None = None  # [K, H] patch rows (a stored run's), else clean's
    with_control: bool = False  # the corrupt prompt again beside the cells: the noise floor

    @property
    def num_tokens(self) -> int:
        """Rows the pass computes (each member's, counted once)."""
        base = len(self.corrupt_ids) * (2 if self.with_control else 1)
        base += len(self.clean_ids) if self.clean_ids is not None else 0
        return base + sum(len(self.corrupt_ids) - c.position for c in self.cells)


@dataclass
class PassResult:
    """Last-position logprobs of `PassJob.token_ids`, float32 on the host."""

    corrupt: torch.Tensor  # [K]
    cells: torch.Tensor  # [cells, K]
    clean: torch.Tensor | None = None  # [K]
    control: torch.Tensor | None = None  # [K]


def join_point(layer: int, site: str) -> int:
    """Where in the forward a patch at (layer, site) happens, as one ordered int."""
    return 3 * layer + SITE_ORDER[site]


def plan_passes(
    cells: list[PassCell], num_corrupt: int, num_clean: int, token_budget: int
) -> list[list[int]]:
    """Indices of `cells` per pass, in join order, each pass within `token_budget` rows and
    `PAD_ROWS_PER_TOKEN * token_budget` padded attention rows. Each pass re-runs the corrupt
    and clean prompts (the first also a control); every pass holds at least one cell, so a
    budget smaller than that runs one cell per pass over it."""
    longest = max(num_corrupt, num_clean)
    order = sorted(range(len(cells)), key=lambda i: cells[i].join)
    passes: list[list[int]] = []
    current: list[int] = []
    tokens = members = 0

    def start() -> None:
        nonlocal current, tokens, members
        first = not passes
        current = []
        members = 2 + (1 if num_clean else 0) if first else 1 + (1 if num_clean else 0)
        tokens = num_corrupt * (2 if first else 1) + num_clean

    start()
    for i in order:
        need = num_corrupt - cells[i].position
        over = tokens + need > token_budget
        over |= (members + 1) * longest > PAD_ROWS_PER_TOKEN * token_budget
        if current and over:
            passes.append(current)
            start()
        current.append(i)
        tokens += need
        members += 1
    if current:
        passes.append(current)
    return passes


@dataclass
class _Layout:
    """Where each member sits in the packed residual, and the index tensors the forward
    uses: the members are in join order, so those joined by any point are a prefix."""

    joins: list[int]  # [M] each member's join point (-1: embedded at the start)
    ends: list[int]  # [M] one past each member's last packed row
    positions: torch.Tensor  # [N] each row's position in its prompt
    pad_index: torch.Tensor  # [N] member * longest + position: the row in padded attention
    last_rows: torch.Tensor  # [M] each member's last row (its prompt's last position)
    longest: int

    def members_by(self, point: int) -> int:
        """How many members have joined by `point`."""
        return bisect.bisect_right(self.joins, point)

    def rows_of(self, members: int) -> int:
        return self.ends[members - 1] if members else 0


def _layout(
    n_corrupt: int, cells: list[PassCell], base: list[list[int]], device: torch.device
) -> _Layout:
    """The layout of the `base` prompts (embedded at the start) and then `cells` (in join
    order) in one packed residual."""
    spans = [(0, len(ids), -1) for ids in base]  # (first position, length, join)
    spans += [(c.position, n_corrupt, c.join) for c in cells]
    longest = max(length for _, length, _ in spans)
    positions, pad, ends, last = [], [], [], []
    for m, (first, length, _) in enumerate(spans):
        last.append(len(positions) + length - first - 1)
        positions += range(first, length)
        pad += range(m * longest + first, m * longest + length)
        ends.append(len(positions))

    def tensor(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long).to(device)

    return _Layout(
        joins=[j for *_, j in spans],
        ends=ends,
        positions=tensor(positions),
        pad_index=tensor(pad),
        last_rows=tensor(last),
        longest=longest,
    )


@torch.inference_mode()
def run_patch_pass(model, job: PassJob) -> PassResult | None:
    """Forward `job` through `model` (a `LlamaFamilyForCausalLM`) and return every member's
    last-position logprobs of `job.token_ids`.

    On a pipeline stage the pass runs stage by stage: a stage after the first receives the
    packed residual `[N, H]` from the one before (every stage plans the same layout), runs
    its layers with their joins, and hands it on; the last stage returns the result, the
    others None. TP ranks of a stage run it together (the Linears all-reduce)."""
    ctx = model.ctx
    weight = next(model.parameters())
    device, dtype = weight.device, weight.dtype
    base = [job.corrupt_ids] + ([job.corrupt_ids] if job.with_control else [])
    clean_member = None
    if job.clean_ids is not None:
        clean_member = len(base)
        base.append(job.clean_ids)
    order = sorted(range(len(job.cells)), key=lambda i: job.cells[i].join)
    cells = [job.cells[i] for i in order]
    lay = _layout(len(job.corrupt_ids), cells, base, device)
    n_base = len(base)

    # Each join point's cells: rows to fill from the corrupt run, the patched rows, sources.
    joins: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    clean_start = lay.rows_of(clean_member) if clean_member is not None else 0
    by_point: dict[int, list[int]] = {}
    for k, c in enumerate(cells):
        by_point.setdefault(c.join, []).append(k)
    for point, ks in by_point.items():
        dst, src, rows, sources = [], [], [], []
        for k in ks:
            c, start = cells[k], lay.rows_of(n_base + k)
            dst += range(start, start + len(job.corrupt_ids) - c.position)
            src += range(c.position, len(job.corrupt_ids))  # the corrupt run's rows
            rows.append(start)
            sources.append(c.source + (clean_start if job.source_rows is None else 0))
        joins[point] = tuple(  # type: ignore[assignment]
            torch.tensor(x, dtype=torch.long).to(device) for x in (dst, src, rows, sources)
        )
    alpha = torch.tensor(job.alpha, dtype=torch.float32, device=device)
    source_rows = job.source_rows.to(device) if job.source_rows is not None else None

    def join(h: torch.Tensor, point: int) -> None:
        if point not in joins:
            return
        dst, src, rows, sources = joins[point]
        h.index_copy_(0, dst, h.index_select(0, src))
        t = h.index_select(0, sources) if source_rows is None else source_rows[sources]
        if job.alpha == 1:  # a bit-exact copy, as the patch op makes it
            patched = t.to(h.dtype)
        else:  # (1 - a) * h + a * t in float32, as `kernels/patch.py`
            patched = ((1 - alpha) * h.index_select(0, rows).float() + alpha * t.float()).to(
                h.dtype
            )
        h.index_copy_(0, rows, patched)

    n_total = lay.ends[-1]
    if ctx.is_first_stage:  # rows of members that join later are filled when they join
        h = torch.empty(n_total, model.cfg.hidden_size, dtype=dtype, device=device)  # [N, H]
        ids = torch.tensor([t for ids in base for t in ids], dtype=torch.long).to(device)
        h[: ids.numel()] = model.embed_tokens(ids)
    else:
        h = ctx.recv_from_prev_stage((n_total, model.cfg.hidden_size), dtype, device)
    for layer in model.layers.values():
        L = layer.layer_idx
        join(h, join_point(L, "pre_attn"))
        members = lay.members_by(join_point(L, "pre_attn"))
        n = lay.rows_of(members)
        h[:n] += _attention(layer, h[:n], lay, members, len(job.corrupt_ids))
        join(h, join_point(L, "post_attn"))
        n = lay.rows_of(lay.members_by(join_point(L, "post_attn")))
        h[:n] += layer.mlp(layer.post_attention_layernorm(h[:n]))
        join(h, join_point(L, "post_block"))
    if not ctx.is_last_stage:
        ctx.send_to_next_stage(h)
        return None
    last = model.norm(h.index_select(0, lay.last_rows))  # [M, H]
    logprobs = torch.log_softmax(model.compute_logits(last).float(), dim=-1)
    picked = logprobs[:, torch.tensor(job.token_ids, device=device)].cpu()  # [M, K]
    result = torch.empty(len(job.cells), len(job.token_ids))
    result[torch.tensor(order, dtype=torch.long)] = picked[n_base:]
    return PassResult(
        corrupt=picked[0],
        cells=result,
        clean=picked[clean_member] if clean_member is not None else None,
        control=picked[1] if job.with_control else None,
    )


def _attention(
    layer, h: torch.Tensor, lay: _Layout, members: int, n_corrupt: int
) -> torch.Tensor:  # [n, H]
    """The attention sub-block's output for the first `members` members' rows `h [n, H]`.

    Every member is padded to the longest prompt. Keys and values of positions a member
    does not compute are the corrupt run's (member 0's rows come first): a cell joined at p
    attends the corrupt prefix, and padding past a prompt's end is never attended causally.
    """
    attn = layer.self_attn
    n, longest = h.shape[0], lay.longest
    q, k, v = attn.project(lay.positions[:n], layer.input_layernorm(h))
    pad = lay.pad_index[:n]

    def padded(x: torch.Tensor, fill: torch.Tensor | None) -> torch.Tensor:
        heads, d = x.shape[1:]
        if fill is None:
            out = x.new_zeros(members * longest, heads, d)
        else:
            base = x.new_zeros(longest, heads, d)
            base[:n_corrupt] = fill
            out = base.repeat(members, 1, 1)
        out.index_copy_(0, pad, x)
        return out.view(members, longest, heads, d).transpose(1, 2)  # [M, heads, S, D]

    qp = padded(q, None)
    kp, vp = padded(k, k[:n_corrupt]), padded(v, v[:n_corrupt])
    window = attn.sliding_window
    if window is None:
        mask, causal = None, True
    else:
        pos = torch.arange(longest, device=h.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
        causal = False
    o = F.scaled_dot_product_attention(
        qp,
        kp,
        vp,
        attn_mask=mask,
        is_causal=causal,
        scale=attn.scale,
        enable_gqa=attn.num_heads != attn.num_kv_heads,
    )  # [M, Hq, S, D]
    o = o.transpose(1, 2).reshape(members * longest, attn.num_heads, attn.head_dim)[pad]
    return attn.o_proj(o.reshape(n, attn.q_size))
