"""Builds each step's flat token batch, runs the model over the paged KV cache, samples.

The runner never sees scheduling policy or live request state: it receives the step's
`StepRequest`s (plain data) and returns tokens and logprobs. All device and dtype
decisions of the engine live here.

The hot path, as in nano-vllm's and vLLM v1's runners:
- one `StepBatch` per step, built in a single pass into persistent pinned host buffers and
  copied to persistent device buffers in one transfer;
- decode steps (one token per request) replay a CUDA graph captured at start for the
  smallest batch-size bucket that fits, padded with rows that read and write nothing;
- steps whose interventions the fused op does all of (steering, monitors, gates, read-outs,
  at the sites the graphs were captured with) replay a second, intervened graph per bucket,
  and steps that capture into the fixed capture buffer a third;
- with an adapter bank, each of those has an adapted twin that runs the batched low-rank
  op at every adapted Linear, for steps where some token uses an adapter;
- prefill and mixed steps, and steps that patch, capture eagerly or feed a consumer, run
  eagerly.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.adapters import AdapterBank
from services.engine.attention import (
    AttentionBackend,
    SdpaBackend,
    StepAttentionInputs,
    TritonBackend,
)
from services.engine.host_memory import to_device_async
from services.engine.interventions.planner import (
    STEER_PAD,
    Readback,
    SteerTokens,
    StepInterventions,
    block_capture_sites,
)
from services.engine.interventions.resolve import SiteKey
from services.engine.interventions.tables import SteeringTables
from services.engine.model.config import ModelConfig
from services.engine.model.llama import LlamaFamilyForCausalLM
from services.engine.model.loader import load_weights
from services.engine.parallel import ParallelContext
from services.engine.recent_tokens import RecentTokens
from services.engine.sampler import PromptLogprobs, SamplingMetadata, sample
from services.engine.scheduler import StepRequest
from services.engine.sequence import PLACEHOLDER
from services.engine.step_batch import (
    STEER_FIELDS,
    HostCopies,
    PendingStep,
    StepBatch,
    StepResult,
    graph_batch_sizes,
)

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor | None  # [bucket, V] float32, written by each replay (last stage)


# What a decode graph runs besides the plain model: nothing, the fused steer op at the
# steering sites, or the op at every site with the capture writes.
GRAPH_KINDS = ("plain", "steered", "capture")
GraphKey = tuple[str, bool]  # (kind, adapted: the low-rank op at every adapted Linear)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        ctx: ParallelContext,
        backend: AttentionBackend | None = None,
        seed: int = 0,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        adapters: AdapterBank | None = None,
        steps_in_flight: int = 1,
        skinny_gemm: bool = False,
        gemv: bool | None = False,
        gemv_activation: bool = False,
        gemv_fold_norms: bool = False,
    ):
        """`adapters`: the bank whose target Linears this runner's model wraps;
        `steps_in_flight`: how many launched steps the engine leaves unaccepted (one, or a
        pipeline's microbatches), so how far back a placeholder's token was sampled;
        `skinny_gemm`: `EngineConfig.skinny_gemm` (CUDA); `gemv`: `EngineConfig.gemv`
        (CUDA; None: where it measures faster); `gemv_activation`, `gemv_fold_norms`: their
        `EngineConfig` fields."""
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        if backend is None:
            backend = TritonBackend() if device.type == "cuda" else SdpaBackend()
        self.backend = backend
        self.ctx = ctx
        # The last stage sends each step's sampled tokens to the first on the device, for
        # the placeholders of the step that feeds them back (`recent_tokens.py`).
        self._recv_tokens = functools.partial(ctx.recv_from_last_stage, device=device)
        # Whether capture blocks come back to the host: not on the ranks of a parallel
        # replica that deliver no outputs (`StepSync.attach`), whose graphs still fill them.
        self.copies_captures = True
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with device:
                self.model = LlamaFamilyForCausalLM(cfg, ctx, self.backend, skinny_gemm)
        finally:
            torch.set_default_dtype(prev)
        load_weights(self.model, model_dir)
        self.model.eval()
        # The Linears whose one-row inputs run the GEMV kernel (`EngineConfig.gemv`)
        self.gemv_linears = (
            []
            if gemv is False
            else self.model.use_gemv(
                measured=gemv is None, gated=gemv_activation, fold_norms=gemv_fold_norms
            )
        )
        if self.gemv_linears:
            log.info("gemv: %d one-row Linears run kernels/gemv.py", len(self.gemv_linears))
        self.adapters = adapters
        if adapters is not None:
            adapters.attach(self.model)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.batch: StepBatch | None = None
        self.scratch_slot = 0
        self.graph_sets: dict[GraphKey, dict[int, _Graph]] = {}  # key -> bucket -> graph
        self.graph_sizes: list[int] = []
        self.graph_steer_sites: frozenset[SiteKey] = frozenset()
        self.graph_capture_sites: frozenset[SiteKey] = frozenset()
        self._graph_steering: SteeringTables | None = None  # what intervened graphs read
        self._graph_pool: Any = None  # the memory pool every graph is captured into
        self._graph_layout = 0  # the adapter bank's layout_version the graphs read
        self.readback: Readback | None = None  # set by the engine with the steering tables
        self.num_graph_steps = 0  # steps that replayed a CUDA graph
        self.num_steered_graph_steps = 0  # ... of them, a steered one
        self.num_capture_graph_steps = 0  # ... of them, one that captures
        self.num_adapted_graph_steps = 0  # ... of them (any kind), an adapted one
        self.num_eager_steps = 0
        # The last steps' sampled tokens (device), for placeholders.
        self.recent = RecentTokens(lookback=steps_in_flight)
        self.num_launches = 0
        # The pinned buffers sampled ids come back through: those not yet read, and one.
        self.copies = HostCopies(device, ring=steps_in_flight + 1)

    def kv_bytes_per_block(self) -> int:
        layers = len(self.model.attention_layers())
        a = self.model.attention_layers()[0] if layers else None
        per_token = 2 * (a.num_kv_heads * a.head_dim if a else 0) * layers
        return per_token * self.block_size * torch.tensor([], dtype=self.dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """`num_blocks` for the block manager, plus one scratch block that padding rows of a
        graph batch write to."""
        self.kv_caches = []
        for attn in self.model.attention_layers():
            shape = (num_blocks + 1, self.block_size, attn.num_kv_heads, attn.head_dim)
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.kv_cache = (k, v)
            self.kv_caches.append((k, v))
        self.scratch_slot = num_blocks * self.block_size
        max_blocks = -(-self.max_model_len // self.block_size)
        self.batch = StepBatch(
            self.max_num_batched_tokens, self.max_num_seqs, max_blocks, self.device
        )

    # -- the step batch -------------------------------------------------------------------

    def _build(
        self,
        reqs: list[StepRequest],
        pad_to: int,
        steer: SteerTokens | None = None,
        adapted: bool = False,
    ) -> tuple[int, list[int], list[int], bool]:
        """Write the step into the host buffers in one pass and upload it; returns (number of
        tokens, query start offsets, context lengths, whether placeholders need filling).
        Rows past `len(reqs)` up to `pad_to` are padding: one token each that reads nothing,
        writes the scratch slot and uses no adapter. `steer`: the steer op's per-token
        inputs, if it runs; `adapted`: some request uses an adapter."""
        sb = self.batch
        assert sb is not None, "allocate_kv_cache must run before the first step"
        sb.begin()
        np_, bs = sb.np, self.block_size
        r = len(reqs)
        q_lens = np.fromiter((q.num_tokens for q in reqs), np.int64, r)
        starts = np.fromiter((q.start for q in reqs), np.int64, r)
        qsl = np.zeros(r + 1, np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        t = int(qsl[-1])
        tables = sb.np_tables
        for i, q in enumerate(reqs):
            tables[i, : len(q.block_ids)] = q.block_ids
        ids = np_["input_ids"][:t]
        ids[:] = [tok for q in reqs for tok in q.token_ids]
        holes = ids == PLACEHOLDER
        # Only the first pipeline stage embeds tokens: it fills each placeholder from the
        # row of the recent step that sampled it.
        fills = self.ctx.is_first_stage and bool(holes.any())
        marks = np_["prev_rows"][:t]
        if fills:
            marks[:] = -1
            at = np.flatnonzero(holes)
            seq_ids = [reqs[i].seq_id for i in np.searchsorted(qsl, at, side="right") - 1]
            rows = np.empty(len(at), np.int64)
            self.recent.rows_for(seq_ids, rows)
            marks[at] = rows
        ids[holes] = 0
        req_of_token = np.repeat(np.arange(r), q_lens)
        positions = np.arange(t) - np.repeat(qsl[:-1] - starts, q_lens)
        np_["positions"][:t] = positions
        np_["slot_mapping"][:t] = tables[req_of_token, positions // bs] * bs + positions % bs
        seq_lens = starts + q_lens
        np_["seq_lens"][:r] = seq_lens
        np_["query_start_loc"][: r + 1] = qsl
        np_["logits_rows"][:r] = qsl[1:] - 1
        if adapted:
            rows = np.fromiter((q.adapter_row for q in reqs), np.int32, r)
            np_["adapter_rows"][:t] = np.repeat(rows, q_lens)
        if steer is not None:  # padding rows (below): no steering, read-out or carry
            for name in STEER_FIELDS[:-1]:
                np_["steer_" + name][:t] = getattr(steer, name)
            # The latch carry reads the row the placeholder's token was sampled in.
            carry = np_["steer_carry"][:t]
            carry[:] = np.where(steer.carry & (marks >= 0), marks, -1) if fills else -1
            for name in STEER_FIELDS:
                np_["steer_" + name][t:pad_to] = STEER_PAD[name]
        if pad_to > r:  # graph padding rows (decode: one token per row)
            np_["input_ids"][t:pad_to] = 0
            np_["positions"][t:pad_to] = 0
            np_["slot_mapping"][t:pad_to] = self.scratch_slot
            np_["adapter_rows"][t:pad_to] = 0
            np_["seq_lens"][r:pad_to] = 0
            np_["query_start_loc"][r + 1 : pad_to + 1] = np.arange(t + 1, pad_to + 1)
        sb.upload(max(r, pad_to))
        return t, qsl.tolist(), seq_lens.tolist(), fills

    # -- CUDA graphs ----------------------------------------------------------------------

    def can_use_graphs(self) -> bool:
        """CUDA and an attention backend whose decode steps can be captured. In a parallel
        replica every rank captures the same buckets in the same order, with the TP
        all-reduces and the logits' all-gather inside its graphs, and each pipeline stage's
        graph receives the stage before's residual stream and sends its own inside it."""
        return self.device.type == "cuda" and self.backend.supports_graphs

    @torch.inference_mode()
    def capture_decode_graphs(
        self, steering: SteeringTables | None = None, steer_sites: frozenset[SiteKey] = frozenset()
    ) -> None:
        """Capture one decode step (embedding → logits, float32) per batch-size bucket, and
        with `steering`, a second one per bucket that runs the fused steer op at every
        (layer, site) of `steer_sites`, reading the step batch's `steer_*` fields and the
        tables (fixed addresses: they are only written in place). With a capture buffer
        (`Readback.captures`), a third: the op also at every post_block, with the capture
        writes at every site. With an adapter bank, an adapted twin of each, reading the
        step batch's `adapter_rows`.

        Buckets are captured largest first into one memory pool, so smaller ones reuse its
        memory. Logs the time and memory they took."""
        assert self.batch is not None and self.can_use_graphs()
        steered = steering is not None and bool(steer_sites)
        assert not steered or self.readback is not None, "the readback goes with the tables"
        captures = steering is not None and self.readback.captures is not None
        self._graph_steering = steering
        self.graph_steer_sites = steer_sites if steered else frozenset()
        self.graph_capture_sites = (
            steer_sites | block_capture_sites(self.cfg.num_layers) if captures else frozenset()
        )
        kinds = [k for k, on in zip(GRAPH_KINDS, (True, steered, captures), strict=True) if on]
        adapted = (False, True) if self.adapters is not None else (False,)
        self._capture_graph_sets([(kind, a) for a in adapted for kind in kinds])

    def _capture_graph_sets(self, keys: list[GraphKey]) -> None:
        """Capture the graphs of `keys` for every bucket (replacing any of those keys)."""
        sizes = graph_batch_sizes(self.max_num_seqs)
        torch.cuda.synchronize(self.device)
        t0, free0 = time.perf_counter(), torch.cuda.mem_get_info(self.device)[0]
        sb = self.batch
        self._build([], pad_to=sizes[-1])  # every row padding: reads nothing, writes scratch
        rb = self.readback
        # A re-capture runs between steps: the latch carry the next step reads must survive.
        carry = rb.last_fired.clone() if rb is not None else None
        for key in keys:
            self.graph_sets[key] = {}
        for size in reversed(sizes):
            inputs = sb.attention_inputs(size, size, self.block_size, list(range(size + 1)), [0])
            inputs.max_query_len = 1
            meta = self.backend.prepare(inputs)
            ids, pos = sb.dev["input_ids"][:size], sb.dev["positions"][:size]
            for kind, adapted in keys:
                iv = self._graph_interventions(kind)
                if iv is not None:
                    iv.bind(rb, *sb.steer_views(size))
                rows = sb.dev["adapter_rows"][:size] if adapted else None
                graph, logits = self._capture(ids, pos, meta, iv, rows)
                self._graph_pool = graph.pool()
                self.graph_sets[kind, adapted][size] = _Graph(graph, logits)
        if carry is not None:
            rb.last_fired.copy_(carry)
        torch.cuda.synchronize(self.device)
        self.graph_sizes = sizes
        if self.adapters is not None:
            self._graph_layout = self.adapters.layout_version
        log.info(
            "captured %d decode CUDA graphs (%s; batch %d..%d%s) in %.1f s, using %.0f MiB",
            len(keys) * len(sizes),
            ", ".join(kind + " adapted" * adapted for kind, adapted in keys),
            sizes[0],
            sizes[-1],
            f"; steering at {len(self.graph_steer_sites)} sites" if self.graph_steer_sites else "",
            time.perf_counter() - t0,
            (free0 - torch.cuda.mem_get_info(self.device)[0]) / 2**20,
        )

    def _graph_interventions(self, kind: str) -> StepInterventions | None:
        """The interventions a graph of `kind` is captured with (None: plain)."""
        if kind == "plain":
            return None
        if kind == "steered":
            return StepInterventions(self._graph_steering, set(self.graph_steer_sites), None)
        return StepInterventions(
            self._graph_steering, set(self.graph_capture_sites), None, capture_block=True
        )

    def _capture(
        self, ids: torch.Tensor, pos: torch.Tensor, meta: Any, iv: Any, rows: Any
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        """One decode graph over the step batch's views; `rows`: the adapter rows (None: the
        adapted Linears run plain)."""

        ctx = self.ctx

        def run() -> torch.Tensor | None:
            if iv is not None:
                iv.reset_fired()  # the gates OR their bits in
            received = None
            if not ctx.is_first_stage:  # into a buffer of the graph's pool
                shape = (len(ids), self.cfg.hidden_size)
                received = ctx.recv_from_prev_stage(shape, self.dtype, self.device)
            with self._adapter_rows(rows):
                hidden = self.model(
                    pos,
                    meta,
                    input_ids=ids if ctx.is_first_stage else None,
                    hidden_states=received,
                    interventions=iv,
                )
            if iv is not None:  # decode: each row is its sequence's sampled row
                n = len(ids)
                self.readback.last_fired[:n].copy_(self.readback.fired[:n])
            if not ctx.is_last_stage:
                ctx.send_to_next_stage(hidden)
                return None
            return self.model.compute_logits(hidden).float()

        run()  # compiles kernels and settles allocations outside the capture
        graph = torch.cuda.CUDAGraph()
        # Under TP the NCCL watchdog thread polls the events of earlier collectives while
        # this thread captures: only this thread's calls must be capture-safe.
        mode = "thread_local" if self.ctx.world_size > 1 else "global"
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode=mode):
            logits = run()
        return graph, logits

    @contextlib.contextmanager
    def _adapter_rows(self, rows: torch.Tensor | None) -> Iterator[None]:
        """The adapted Linears read `rows` (each token's coefficient row) inside the block."""
        if rows is None or self.adapters is None:
            yield
            return
        self.adapters.step_rows = rows
        try:
            yield
        finally:
            self.adapters.step_rows = None

    def release_graphs(self) -> None:
        """Destroy every decode graph and their memory pool; later steps run eagerly. A
        communicator whose collectives a live graph captured cannot shut down (NCCL waits
        for those graphs to go: pytorch/pytorch#115388), so a parallel rank releases its
        graphs before it leaves its process groups."""
        for graphs in self.graph_sets.values():
            for g in graphs.values():
                g.graph.reset()
        self.graph_sets.clear()
        self.graph_sizes = []
        self._graph_pool = None

    def _refresh_graphs(self) -> None:
        """Re-capture every graph if the adapter bank re-laid its tables since (a LoRA of a
        rank above the reserved columns was loaded): they read the old buffers, the target
        Linears' weights among them."""
        if self._graph_layout == self.adapters.layout_version or not self.graph_sizes:
            return
        log.warning("adapter tables re-laid: re-capturing every decode CUDA graph")
        self._capture_graph_sets(list(self.graph_sets))

    def _graph_for(
        self, reqs: list[StepRequest], interventions: Any, adapted: bool
    ) -> dict[int, _Graph] | None:
        """The graphs (by bucket) one of which runs this step, or None to run eagerly."""
        if not self.graph_sizes or len(reqs) > self.graph_sizes[-1]:
            return None
        if any(q.num_tokens != 1 or q.prompt_logprobs is not None for q in reqs):
            return None
        if interventions is None:
            kind = "plain"
        elif self._steered_graph_serves(interventions):
            kind = "capture" if interventions.capture_block else "steered"
        else:
            return None
        return self.graph_sets.get((kind, adapted))

    def _steered_graph_serves(self, iv: StepInterventions) -> bool:
        """Whether the intervened graphs run everything `iv` does: the fused op only (with
        its read-outs and gates, and captures into the capture buffer), at sites they were
        captured with (eager captures, patches and consumers' views run eagerly)."""
        sites = self.graph_capture_sites if iv.capture_block else self.graph_steer_sites
        return (
            bool(sites)
            and iv.steer_tokens is not None
            and iv.kernel_sites <= sites
            and not (iv.capture_index or iv.patch_index or iv.view_sites)
        )

    # -- the step -------------------------------------------------------------------------

    def execute(self, reqs: list[StepRequest], interventions: Any = None) -> StepResult:
        """Run one step and wait for its results."""
        return self.launch(reqs, interventions).result()

    @torch.inference_mode()
    def launch(self, reqs: list[StepRequest], interventions: Any = None) -> PendingStep:
        """Queue one step on the device and start copying its sampled tokens back; the host
        is free until `PendingStep.result()`.

        A token id of PLACEHOLDER is the token the previous launched step sampled for that
        sequence; it is filled in on the device, so the next step can be launched before the
        previous one's tokens reach the host."""
        n = len(reqs)
        self.num_launches += 1
        handoff = self.ctx.pp_size > 1 and self.ctx.is_first_stage  # takes the last's tokens
        if handoff and self.recent.lookback > 1:  # the tokens of the step M launches back
            self.recent.receive_through(self.num_launches - self.recent.lookback, self._recv_tokens)
        adapted = False
        if self.adapters is not None:
            self._refresh_graphs()
            adapted = any(q.adapter_row for q in reqs)
        graphs = self._graph_for(reqs, interventions, adapted)
        bucket = None
        if graphs:
            bucket = self.graph_sizes[bisect.bisect_left(self.graph_sizes, n)]
        steer = interventions.steer_tokens if interventions is not None else None
        t, qsl, seq_lens, fills = self._build(reqs, bucket or 0, steer, adapted)
        sb = self.batch
        assert sb is not None
        if interventions is not None:
            assert self.readback is not None
            interventions.bind(self.readback, *sb.steer_views(t))
        if fills:  # input_ids[i] = a recent step's token for rows marked in prev_rows
            self.recent.fill(self.batch.dev["input_ids"][:t], self.batch.dev["prev_rows"][:t])
        hidden = None
        sample_rows = [i for i, q in enumerate(reqs) if q.samples]
        if graphs:
            self.num_graph_steps += 1
            self.num_adapted_graph_steps += adapted
            if interventions is not None and interventions.capture_block:
                self.num_capture_graph_steps += 1
            elif interventions is not None:
                self.num_steered_graph_steps += 1
            entry = graphs[bucket]
            entry.graph.replay()
            logits = None
            if entry.logits is not None:
                logits = entry.logits[:n]
                if len(sample_rows) < n:
                    logits = logits[to_device_async(sample_rows, torch.long, self.device)]
        else:
            self.num_eager_steps += 1
            if interventions is not None:
                interventions.reset_fired()
            inputs = sb.attention_inputs(t, n, self.block_size, qsl, seq_lens)
            with self._adapter_rows(sb.dev["adapter_rows"][:t] if adapted else None):
                hidden = self._forward_eager(inputs, t, interventions)
            logits = None
            if hidden is not None and sample_rows:
                index = sb.dev["logits_rows"][:n]
                if len(sample_rows) < n:
                    index = index[to_device_async(sample_rows, torch.long, self.device)]
                logits = self.model.compute_logits(hidden[index]).float()
        pending = PendingStep(n, sample_rows)
        graphed = bucket is not None
        if not self.ctx.is_last_stage:  # a pipeline stage before the last samples nothing
            if sample_rows and handoff:
                # ... but embeds the tokens it feeds back: the last stage sends them on the
                # device, so the step that feeds them back may be launched before they
                # reach any host (taken now with one part a step, else that step's launch).
                seq_rows = {reqs[i].seq_id: j for j, i in enumerate(sample_rows)}
                self.recent.expect(self.num_launches, len(sample_rows), seq_rows)
                take = functools.partial(
                    self.recent.receive_through, self.num_launches, self._recv_tokens
                )
                if self.recent.lookback == 1:
                    take()
                else:  # by `result()` at the latest: every send is received, in order
                    pending.settle = take
            if interventions is not None:
                self._read_back(pending, interventions, graphed, t, n, sample_rows)
            return pending
        if sample_rows:
            picked = [reqs[i] for i in sample_rows]
            meta = SamplingMetadata.build(
                [q.params for q in picked],
                [q.generator for q in picked],
                self.device,
                self.generator,
            )
            pending.sampled = sampled = sample(logits, meta)
            pending.host, pending.copied = self.copies.copy(sampled.packed())
            if self.ctx.is_first_stage:  # it embeds them: placeholders read them there
                self.recent.add(sampled.token_ids, {q.seq_id: j for j, q in enumerate(picked)})
            else:  # a pipeline's last stage: the first embeds them, later
                self.recent.sent(self.ctx.send_to_first_stage(sampled.token_ids))
        for i, q in enumerate(reqs):
            if q.prompt_logprobs is None or hidden is None:
                continue
            first, count, next_ids, k = q.prompt_logprobs
            row0 = qsl[i] + first - q.start
            lp_logits = self.model.compute_logits(hidden[row0 : row0 + count])
            pending.prompt_logprobs[i] = (first, PromptLogprobs(lp_logits, next_ids, k))
        if interventions is not None:
            # After the sampled ids' copy: device→host copies queue on one copy engine, and
            # a capture block's long one ahead of it would hold up that copy, and with it
            # the next step, which waits in the stream behind it.
            self._read_back(pending, interventions, graphed, t, n, sample_rows)
        return pending

    def _read_back(
        self,
        pending: PendingStep,
        iv: StepInterventions,
        graphed: bool,
        num_tokens: int,
        num_seqs: int,
        sample_rows: list[int],
    ) -> None:
        """Keep the gate bits each sampled row fired for the next step's latch carry (the
        intervened graph does it itself when every row samples), and start copying what
        the host reads of this step: fired bits, read-out scores (behind the sampled ids,
        one event covering them), the eager captures, and the capture block."""
        rb = self.readback
        assert rb is not None
        capture = iv.capture_block and self.copies_captures
        eager = bool(iv.captured) and self.copies_captures
        if not (iv.reads_fired or iv.reads_scores or capture or eager):
            return  # steering alone: nothing to read back
        if iv.reads_fired and sample_rows and not (graphed and len(sample_rows) == num_seqs):
            index = self.batch.dev["logits_rows"][:num_seqs]
            if len(sample_rows) < num_seqs:
                index = index[to_device_async(sample_rows, torch.long, self.device)]
            rb.last_fired[: len(index)].copy_(rb.fired[index])
        pending.interventions = iv
        pending.readback = rb.copy(num_tokens, num_seqs, iv.reads_fired, iv.reads_scores)
        if eager:
            pending.readback["eager_captures"] = rb.copy_eager(iv.captured)
        if self.device.type == "cuda":  # `result()` waits for these copies too
            pending.copied = torch.cuda.Event()
            pending.copied.record()
        if capture:  # on a stream of its own, with its own event
            pending.readback["captures"] = rb.copy_captures(
                len(iv.block_captures), iv.block_slots, iv.block_dtype, iv.block_placement
            )

    def _forward_eager(
        self, inputs: StepAttentionInputs, num_tokens: int, interventions: Any
    ) -> torch.Tensor | None:
        sb = self.batch
        assert sb is not None
        ctx = self.ctx
        meta = self.backend.prepare(inputs)
        received = None
        if not ctx.is_first_stage:  # the previous stage's residual stream, [T, H]
            shape = (num_tokens, self.cfg.hidden_size)
            received = ctx.recv_from_prev_stage(shape, self.dtype, self.device)
        hidden = self.model(
            sb.dev["positions"][:num_tokens],
            meta,
            input_ids=sb.dev["input_ids"][:num_tokens] if ctx.is_first_stage else None,
            hidden_states=received,
            interventions=interventions,
        )
        if not ctx.is_last_stage:  # only the last stage samples
            ctx.send_to_next_stage(hidden)
            return None
        return hidden
