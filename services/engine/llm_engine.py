"""The synchronous engine: add requests, call `step()` until they finish.

One step = schedule → run the model on the flat batch → sample → update state, detokenize,
check stop conditions → emit outputs for every request that changed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from services.common.errors import (
    ActionQueueFullError,
    DuplicateRequestError,
    InvalidRequestError,
    NotFoundError,
    PatchPassUnavailableError,
    PromptTooLongError,
    RequestNotFoundError,
)
from services.engine.adapters import AdapterBank
from services.engine.config import EngineConfig
from services.engine.device import make_attention_backend, resolve_device_dtype
from services.engine.distributed import StepSync
from services.engine.interventions.actions import Action, GlobalSteeringUpdate
from services.engine.interventions.consumers import SyncConsumer
from services.engine.interventions.host_rows import CaptureArena
from services.engine.interventions.manager import InterventionManager
from services.engine.interventions.planner import Readback
from services.engine.interventions.vectors import VectorRegistry
from services.engine.kv.block_manager import BlockManager, num_kv_blocks
from services.engine.model.config import generation_eos_ids, load_model_config
from services.engine.model.patch_pass import PassJob, PassResult, run_patch_pass
from services.engine.model.tokenizer import Tokenizer
from services.engine.model_runner import ModelRunner
from services.engine.output_processor import OutputProcessor
from services.engine.outputs import RequestDelta
from services.engine.parallel import SINGLE_PROCESS, ParallelContext
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.sequence import PLACEHOLDER, RequestGroup, SeqStatus

log = logging.getLogger(__name__)

Prompt = str | list[int]


class LLMEngine:
    """A single engine replica over one local Hugging Face checkpoint directory."""

    def __init__(
        self,
        model: str | Path,
        config: EngineConfig | None = None,
        ctx: ParallelContext = SINGLE_PROCESS,
        patch_store: Any = None,
        sync: StepSync | None = None,
    ):
        """`patch_store` (a `PatchStore` or `PatchStoreClient`) resolves `{"run": ...}` patch
        sources and receives `capture={"sink": "patch_store", "run": ...}` captures.

        `ctx` and `sync` (from `distributed.init_replica`) make this one rank of a tensor- and
        pipeline-parallel replica; callers use rank 0's engine only."""
        if (ctx.world_size > 1) != (sync is not None):
            raise ValueError("a parallel ctx needs a StepSync (distributed.init_replica)")
        self.sync = sync
        config = config or EngineConfig()
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        self.config = cfg = config.resolved_for(self.device.type)  # batch limits by device
        self.model_dir = Path(model)
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise InvalidRequestError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={self.model_config.max_position_embeddings}"
            )
        # Overlapped steps in flight: one, or each pipeline microbatch's (`step`).
        self.microbatches = cfg.pipeline_microbatches if ctx.pp_size > 1 else 1
        if self.microbatches < cfg.pipeline_microbatches:
            log.warning("pipeline_microbatches applies to pipeline stages: not used")
        skinny = cfg.skinny_gemm and self.device.type == "cuda"
        if cfg.skinny_gemm and not skinny:
            log.warning("skinny_gemm applies to CUDA devices: not used on %s", self.device)
        gemv = cfg.gemv if self.device.type == "cuda" else False
        if cfg.gemv and not gemv:
            log.warning("gemv applies to CUDA devices: not used on %s", self.device)
        in_gemv = {}  # what runs inside the GEMV kernel's launches: None means where it can
        mc = self.model_config
        for name in ("gemv_activation", "gemv_fold_norms"):
            asked, why_not = getattr(cfg, name), None
            if self.device.type != "cuda":
                why_not = f"applies to CUDA devices, not {self.device}"
            elif cfg.gemv is False:
                if asked:
                    raise InvalidRequestError(f"{name} runs inside the GEMV kernel: needs gemv on")
                why_not = "gemv is off"
            elif ctx.tp_size > 1:
                why_not = "was measured at tensor-parallel size 1 only"
            elif name == "gemv_fold_norms" and (mc.o_bias or mc.mlp_bias):
                why_not = "adds the residual where an o_proj or down_proj bias would go"
            if asked and why_not:
                log.warning("%s %s: not used", name, why_not)
            in_gemv[name] = asked is not False and why_not is None
        self.runner = ModelRunner(
            self.model_dir,
            self.model_config,
            self.device,
            self.dtype,
            cfg.block_size,
            ctx,
            backend=make_attention_backend(
                cfg.attention_backend,
                self.device,
                self.model_config.head_dim,
                fused_decode=cfg.fused_decode_attention,
            ),
            seed=cfg.seed,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            adapters=AdapterBank(
                cfg.adapter_capacity, cfg.adapter_rank, cfg.adapter_targets, cfg.adapter_lora_rank
            )
            if cfg.adapter_capacity > 0
            else None,
            steps_in_flight=self.microbatches,
            skinny_gemm=skinny,
            gemv=gemv,
            **in_gemv,
        )
        self.adapters = self.runner.adapters
        num_blocks = num_kv_blocks(
            cfg, self.runner.kv_bytes_per_block(), self.device, self.max_model_len
        )
        if sync is not None:  # stages hold different layer counts: all must agree on blocks
            num_blocks = sync.min_over_ranks(num_blocks)
        if num_blocks * cfg.block_size < self.max_model_len:
            log.warning(
                "KV cache holds %d tokens: max_model_len lowered from %d",
                num_blocks * cfg.block_size,
                self.max_model_len,
            )
            self.max_model_len = num_blocks * cfg.block_size
        self.runner.max_model_len = self.max_model_len
        self.runner.allocate_kv_cache(num_blocks)
        capture_rows = self._capture_rows()
        self.interventions = InterventionManager(
            self.model_config.num_layers,
            self.model_config.hidden_size,
            self.device,
            self.dtype,
            per_request_rows=cfg.steering_request_rows,
            dynamic_rows=cfg.steering_dynamic_rows,
            probe_columns=cfg.readout_probes_per_site,
            action_queue_size=cfg.action_queue_size,
            capture_rows=capture_rows,
            capture_arena_bytes=self._capture_arena_bytes(),
        )
        self.runner.readback = Readback(
            self.runner.max_num_batched_tokens,
            cfg.max_num_seqs,
            self.model_config.num_layers,
            cfg.readout_probes_per_site,
            self.device,
            capture_rows=capture_rows,
            hidden=self.model_config.hidden_size,
            dtype=self.dtype,
            host_rows=3 * capture_rows if cfg.capture_host_rows is None else cfg.capture_host_rows,
            ring=self.microbatches + 1,
        )
        if not cfg.enforce_eager and self.runner.can_use_graphs():
            steer_sites = frozenset(
                (layer, site)
                for layer in range(self.model_config.num_layers)
                for site in cfg.graph_steering_sites
            )
            self.runner.capture_decode_graphs(self.interventions.tables, steer_sites)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.interventions.patch_sources = patch_store
        self.interventions.model_name = str(self.model_dir)
        if sync is not None:
            sync.attach(self)
        self.scheduler = Scheduler(
            self.block_manager,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.enable_chunked_prefill,
            admit_hook=self.interventions.try_admit,
        )
        eos = set(self.model_config.eos_token_ids) | set(generation_eos_ids(self.model_dir))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, RequestGroup] = {}
        # Finished requests whose captured rows are still on their way to the host: their
        # final delta waits for them, the engine does not (`deliver_captured`). They stay in
        # `requests` until delivered, with their steering rows and KV blocks released.
        self._awaiting_captures: dict[str, RequestGroup] = {}
        # Steps launched and not yet accepted, when steps overlap: (schedule, PendingStep,
        # plan), oldest first; at most `microbatches` after a launch's acceptance.
        self._in_flight: collections.deque[tuple[Any, Any, Any]] = collections.deque()
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_patch_passes = 0
        self.num_patch_pass_tokens = 0  # rows patch passes computed, each member's once
        self.outputs = OutputProcessor(
            self.tokenizer, self.scheduler, self.interventions, self.max_model_len
        )

    def _capture_rows(self) -> int:
        """Rows of the fixed capture buffer: `graph_capture_rows` (default max_num_seqs) on
        a replica of one pipeline stage, whose model holds every layer the buffer's slots
        name (each TP rank computes the whole residual stream, so each fills its own)."""
        if self.runner.ctx.pp_size > 1:
            return 0
        rows = self.config.graph_capture_rows
        return self.config.max_num_seqs if rows is None else rows

    def _capture_arena_bytes(self) -> int:
        """`capture_arena_bytes`, or by default an eighth of the host's memory, at most
        16 GiB (a chunk is page-locked only when requests need it)."""
        arena = self.config.capture_arena_bytes
        if arena is not None:
            if 0 < arena < CaptureArena.CHUNK_BYTES:  # it could hold nothing: say so
                raise InvalidRequestError(
                    f"capture_arena_bytes must be 0 (off) or at least {CaptureArena.CHUNK_BYTES}"
                    f" (one chunk), got {arena}"
                )
            return arena
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(total // 8, 16 << 30)

    # -- requests -----------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a string or a token-id list."""
        if isinstance(prompt, str):
            if not prompt:  # it would encode to BOS alone: a request with nothing to say
                raise InvalidRequestError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple) or not (
            set(map(type, prompt)) <= {int}  # the common case, checked at C speed
            or all(isinstance(t, int) for t in prompt)
        ):
            raise InvalidRequestError("a prompt must be a string or a list of token ids")
        return None, list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Reject what this engine cannot serve, naming the problem (raises InvalidRequestError)."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty (it encodes to zero tokens)")
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:  # at C speed; the names if not
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            raise InvalidRequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                f"{self.max_model_len} (the prompt plus at least one generated token must fit)"
            )
        cfg = self.config
        if not cfg.enable_chunked_prefill and len(prompt_ids) > cfg.max_num_batched_tokens:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens, more than max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens}, and chunked prefill is off"
            )
        for name in ("logprob_token_ids", "stop_token_ids"):
            bad = [t for t in getattr(params, name) if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{name} out of range [0, {vocab}): {bad[:5]}")

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises InvalidRequestError (and changes nothing) on bad input."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, arrival_time))

    def prepare_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        text: str | None = None,
    ) -> RequestGroup:
        """The part of admitting a request that changes no engine state: tokenize, validate,
        resolve its steering, captures, read-outs and patch sources (reading the vector
        registry and the patch store). Safe on another thread while the engine steps, so a
        server resolves requests off the engine's thread (`AsyncLLM.admit`); `add_prepared`
        queues the result. Raises InvalidRequestError on bad input. `text`: what a token-id
        `prompt` was encoded from, for the outputs."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use")
        encoded_text, ids = self.encode(prompt)
        self.validate(ids, params)
        group = RequestGroup(
            request_id=request_id,
            prompt=text if text is not None else encoded_text,
            prompt_token_ids=ids,
            params=params,
            arrival_time=arrival_time or time.time(),
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
        )
        self.interventions.resolve(group)  # steering/capture/readouts/patches, or raises
        return group

    def add_prepared(self, group: RequestGroup) -> None:
        """Queue a request `prepare_request` resolved (on the engine's thread, between
        steps): what depends on engine state a step or an action may have changed since
        (the global steering its cache signatures fold in, the adapter bank) is done here."""
        if group.request_id in self.requests:
            raise DuplicateRequestError(f"request id {group.request_id!r} is already in use")
        self.interventions.refresh_sigs(group)
        if group.params.adapter is not None:
            self._bind_adapter(group)
        if self.sync is not None:
            self.sync.record_request(group)
        self._admit(group)

    def _admit(self, group: RequestGroup) -> None:
        params = group.params
        if params.seed is not None:
            for seq in group.seqs:
                seq.generator = torch.Generator(device=self.device)
                seq.generator.manual_seed(params.seed + 1_000_003 * seq.index)
        self.requests[group.request_id] = group
        self.interventions.add(group)
        self.scheduler.add(group)

    def abort(self, request_id: str) -> RequestDelta:
        """Stop a request now and free its blocks; returns its final delta."""
        if request_id in self._awaiting_captures:  # finished and released: its final delta
            return self._deliver_awaiting(request_id)
        group = self.requests.pop(request_id, None)
        if group is None:
            raise RequestNotFoundError(f"no unfinished request with id {request_id!r}")
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        final = self.outputs.delta(group)
        self.interventions.release(group)
        if self.sync is not None:
            self.sync.record("abort", request_id)
        return final

    def _bind_adapter(self, group: RequestGroup) -> None:
        params = group.params
        if self.adapters is None:
            raise InvalidRequestError(
                "this engine serves no adapters (EngineConfig.adapter_capacity is 0)"
            )
        row, version = self.adapters.row(params.adapter, params.adapter_variant)  # type: ignore[arg-type]
        group.adapter_row = row
        group.cache_salt = (("adapter", params.adapter, params.adapter_variant),)
        # KV computed under these adapter weights is reusable only under the same version:
        # positions carry it in their signature from the step they are scheduled in on.
        group.adapter_sig = b"adapter-version" + version.to_bytes(8, "little")

    def load_adapter(self, name: str, state: dict) -> int:
        """Install or replace adapter `name` from its δ vectors (`{module: {"kept": δS,
        "quarantine": δS_q}}`, plus `"lora_a"`/`"lora_b"` for a LoRA quarantine; see
        `AdapterBank.load`); returns its new version. Requests already running under it
        use the new weights from the next step, and their later KV blocks are keyed by the
        new version, so no block computed under old weights serves a later request."""
        if self.adapters is None:
            raise InvalidRequestError(
                "this engine serves no adapters (EngineConfig.adapter_capacity is 0)"
            )
        entry = self.adapters.load(name, state)
        for group in self.requests.values():
            if group.params.adapter == name:
                self._bind_adapter(group)
        if self.sync is not None:
            self.sync.record("adapter", (name, state))
        return entry.version

    def unload_adapter(self, name: str) -> None:
        """Remove adapter `name` (NotFoundError if absent; InvalidRequestError while a request
        still runs under it)."""
        if self.adapters is None:
            raise NotFoundError(f"no adapter named {name!r} is loaded")
        users = [
            g.request_id
            for g in self.requests.values()
            if g.params.adapter == name and g.request_id not in self._awaiting_captures
        ]
        if users:
            raise InvalidRequestError(f"adapter {name!r} is in use by requests {users[:3]}")
        self.adapters.unload(name)
        if self.sync is not None:
            self.sync.record("unload_adapter", name)

    def replay(self, kind: str, payload: Any) -> None:
        """Apply a change the driver rank of this replica made (see `distributed.py`)."""
        if kind == "add":
            group = pickle.loads(payload)
            iv = group.interventions
            if iv is not None and iv.patches is not None:  # unpickled onto the driver's GPU
                iv.patches = self.interventions._on_device(iv.patches)
            self._admit(group)
        elif kind == "abort":
            self.abort(payload)
        elif kind == "vector":
            self.interventions.registry.replay(payload)
        elif kind == "adapter":
            self.load_adapter(*payload)
        elif kind == "unload_adapter":
            self.unload_adapter(payload)
        else:
            raise ValueError(f"unknown replica change {kind!r}")

    @property
    def num_generated_tokens(self) -> int:
        return self.outputs.num_generated_tokens

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)  # those awaiting their captures among them

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one engine step; return a delta for every request it advanced (what the step
        added: `OutputAccumulator` turns deltas into totals).

        When nothing intervenes, steps overlap as in vLLM's async scheduling: the step
        launched here runs on the device while the host accepts the tokens of the step the
        previous call launched (sampled tokens a step still computes are placeholders the
        next step reads on the device). A call that finds nothing to schedule drains the
        step in flight.
        """
        if self.sync is None:
            self.interventions.apply_actions()  # issued during the previous step: apply now
        else:
            with self.sync.lock:
                actions, job = self.sync.exchange(self)
                self.interventions.apply_actions(actions)
            if job is not None:  # a worker rank: the driver runs a patch pass, not a step
                # A refusal is the driver's to report; every rank makes it at the same point.
                with contextlib.suppress(InvalidRequestError):
                    self._patch_pass(job)
                return []
        overlap = self._can_overlap()
        outputs: list[RequestDelta] = self.deliver_captured() if self._awaiting_captures else []
        if not overlap:
            outputs += self._drain()
        sched = self.scheduler.schedule(self.microbatches if overlap else 1, self.num_steps)
        if sched.is_empty:
            outputs += self._drain()
            # Nothing else left to run (every unfinished request awaits its captures): wait
            # for them. Else (the step in flight held the rest) the next call schedules.
            idle = len(self.requests) == len(self._awaiting_captures)
            return outputs + self.deliver_captured(wait=idle)
        plan = self.interventions.plan_step(sched)
        pending = self.runner.launch(sched.requests(), plan)
        self.num_steps += 1
        if overlap:  # the next plan needs nothing this step reads back (see _can_overlap)
            self.scheduler.advance(sched)
            self._hold_places(sched)
            self._in_flight.append((sched, pending, plan))
            if len(self._in_flight) > self.microbatches:  # a step, or M parts, in flight
                outputs += self._finish(*self._in_flight.popleft())
            return outputs
        result = pending.result()
        if self.sync is not None:
            result = self.sync.finish_step(self, sched, result, plan)
        report = self.interventions.observe(sched, plan) if plan is not None else None
        self.scheduler.advance(sched)
        return outputs + self._accept(sched, result, report)

    def _can_overlap(self) -> bool:
        """Overlap needs the next step's plan to need nothing the step before reads back:
        steering, monitors, gates, read-outs, captures and adapters may run, but not patches
        still ahead of a request or consumers. Placeholders are filled on the device: every
        TP rank samples the same tokens itself, and the last pipeline stage sends its to the
        first. Every rank of a replica decides alike: the inputs are replicated state."""
        return self.config.async_scheduling and self.interventions.reads_nothing_back()

    def _drain(self) -> list[RequestDelta]:
        """Accept the tokens of the steps in flight, if any."""
        outputs: list[RequestDelta] = []
        while self._in_flight:
            outputs += self._finish(*self._in_flight.popleft())
        return outputs

    def _finish(self, sched: Any, pending: Any, plan: Any) -> list[RequestDelta]:
        """Accept an overlapped step: its tokens, and what its interventions read back."""
        result = pending.result()
        if self.sync is not None:
            result = self.sync.finish_step(self, sched, result, plan)
        report = self.interventions.observe(sched, plan) if plan is not None else None
        return self._accept(sched, result, report)

    def _hold_places(self, sched: Any) -> None:
        """Give each sampling sequence of a launched step a placeholder for its new token, so
        the next step can be scheduled now; mark those the token will end by length."""
        for s in sched.scheduled:
            if not s.samples:
                continue
            seq = s.seq
            seq.token_ids.append(PLACEHOLDER)
            seq.num_pending += 1
            seq.pending_step = self.num_steps - 1  # the step just launched
            max_tokens = seq.group.params.max_tokens
            if seq.num_tokens >= self.max_model_len or (
                max_tokens is not None and seq.num_generated + seq.num_pending >= max_tokens
            ):
                seq.final_pending = True

    def _accept(self, sched: Any, result: Any, report: Any) -> list[RequestDelta]:
        """Take a finished step's tokens into its sequences; deltas of the requests it
        advanced."""
        self.scheduler.publish(sched)
        touched: dict[str, RequestGroup] = {}
        prompt_logprobs, sampled = result.prompt_logprobs, result.sampled
        for i, s in enumerate(sched.scheduled):
            seq = s.seq
            if seq.status is SeqStatus.FINISHED:  # aborted, or stopped while in flight
                continue
            group = seq.group
            if prompt_logprobs[i] is not None:
                _, dicts = prompt_logprobs[i]
                group.prompt_logprobs.extend(dicts)
            if s.start < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(
                    s.num_tokens, seq.num_prompt_tokens - s.start
                )
            token = sampled[i]
            if token is None:
                continue
            touched[group.request_id] = group
            if seq.index == 0 and seq.num_generated == 0 and group.params.n > 1:
                self.scheduler.fork_samples(seq)
            if report is not None and report.aborts[i] is not None:
                # A probe fired on the residual this token would be sampled from: stop
                # before emitting it.
                self.scheduler.finish(seq, "probe", report.aborts[i])
                continue
            readouts = report.readouts[i] if report is not None else None
            self.outputs.append_token(seq, token, result.logprobs[i], readouts)
        outputs = []
        for rid, group in touched.items():
            if not group.is_finished:
                outputs.append(self.outputs.delta(group))
                continue
            if self.interventions.captures_ready(group):
                outputs.append(self.outputs.delta(group))
                self.requests.pop(rid, None)
                self.interventions.release(group)
            else:  # its steering rows go now, as on every rank; its delta later
                self.interventions.release(group, keep_captures=True)
                self._awaiting_captures[rid] = group
        return outputs

    def deliver_captured(self, wait: bool = False) -> list[RequestDelta]:
        """The final deltas of finished requests whose captured rows have come home (all of
        them with `wait`). Per-token capture brings a request's last rows back a step or
        two after its last token (copy, drain, assembly on their own threads); the engine
        runs the next steps meanwhile instead of waiting for them."""
        return [
            self._deliver_awaiting(rid)
            for rid, group in list(self._awaiting_captures.items())
            if wait or self.interventions.captures_ready(group)
        ]

    def _deliver_awaiting(self, request_id: str) -> RequestDelta:
        """The final delta of a finished request that awaited its captures (waiting for
        any still on their way), which is then forgotten."""
        group = self._awaiting_captures.pop(request_id)
        self.requests.pop(request_id, None)
        final = self.outputs.delta(group)
        self.interventions.drop_captures(group)
        return final

    # -- patch passes ---------------------------------------------------------------------

    def patch_pass_unavailable(self) -> str | None:
        """Why `run_patch_pass` cannot run on this engine now, in words (None: it can)."""
        if self.interventions.steers_prefill_globally():
            return "global prefill steering is installed, and a pass applies no steering"
        return None

    def run_patch_pass(self, job: PassJob) -> PassResult:
        """Run one layered patching pass (`model/patch_pass.py`) between steps: the corrupt
        prompt, the clean one and every cell of `job` in one forward. Pending actions apply
        first, as at the top of a step (on a tensor-parallel replica the driver sends them
        with the job, and every rank runs the pass's forward with it); InvalidRequestError
        if a pass cannot run here."""
        H = self.model_config.hidden_size
        if job.source_rows is not None and job.source_rows.shape[-1] != H:
            raise InvalidRequestError(
                f"patch rows have width {job.source_rows.shape[-1]}, the model's hidden size is {H}"
            )
        if self.sync is None:  # a one-process replica applies its own queue
            self.interventions.apply_actions()
        else:
            with self.sync.lock:
                actions, _ = self.sync.exchange(self, job)
                self.interventions.apply_actions(actions)
        return self._patch_pass(job)

    def _patch_pass(self, job: PassJob) -> PassResult:
        """The pass itself, after the checks every rank makes alike."""
        why = self.patch_pass_unavailable()
        if why is not None:
            raise PatchPassUnavailableError(f"a patch pass cannot run on this engine: {why}")
        if job.source_rows is not None:
            job = replace(job, source_rows=job.source_rows.to(self.device))
        result = run_patch_pass(self.runner.model, job)
        if self.sync is not None and self.runner.ctx.pp_size > 1:  # the last stage's
            result = self.sync.share_pass_result(result)
        self.num_patch_passes += 1
        self.num_patch_pass_tokens += job.num_tokens
        return result

    # -- steering control -----------------------------------------------------------------

    def set_global_steering(self, steering: Any) -> None:
        """Steer every request (prefill and/or decode tiers, by each vector's `phase`),
        replacing any previous global steering, from the next step on. Bad input raises
        InvalidRequestError now; a full action queue raises ActionQueueFullError."""
        self.interventions.check_global(steering)
        if not self.interventions.submit(GlobalSteeringUpdate(steering), "api"):
            raise ActionQueueFullError("the action queue is full: global steering not queued")

    def clear_global_steering(self) -> None:
        """Remove engine-wide steering from the next step on."""
        self.set_global_steering(None)

    def submit_action(self, action: Action, source: str = "api") -> bool:
        """Queue a controller action for the top of the next step (False: queue full)."""
        return self.interventions.submit(action, source)

    def add_consumer(self, consumer: SyncConsumer) -> None:
        """Register a sync consumer: `on_step(view)` runs after every step."""
        self.interventions.add_consumer(consumer)

    @property
    def vectors(self) -> VectorRegistry:
        """The engine's named vector registry (register / list / unregister / import_file)."""
        return self.interventions.registry

    def steering_snapshot(self) -> dict:
        """Action-queue counters, pool use, active tiers and monitors, consumer timing."""
        return self.interventions.snapshot()

    def stats(self) -> dict:
        """Counters for dashboards and tests: cache hits, preemptions, pool use."""
        bm = self.block_manager
        readback = self.runner.readback
        host_rows = readback.host_rows if readback else None
        drain = readback.drain if readback else None
        sink = self.interventions.sink
        arena = getattr(sink, "arena", None)
        return {
            "num_steps": self.num_steps,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            "num_cached_blocks": len(bm.cached),
            "num_evictions": bm.num_evictions,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "num_generated_tokens": self.num_generated_tokens,
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "num_graph_steps": self.runner.num_graph_steps,
            "num_steered_graph_steps": self.runner.num_steered_graph_steps,
            "num_capture_graph_steps": self.runner.num_capture_graph_steps,
            "num_adapted_graph_steps": self.runner.num_adapted_graph_steps,
            "num_eager_steps": self.runner.num_eager_steps,
            # Linears whose one-row inputs run kernels/gemv.py (EngineConfig.gemv)
            "num_gemv_linears": len(self.runner.gemv_linears),
            "num_patch_passes": self.num_patch_passes,
            "num_patch_pass_tokens": self.num_patch_pass_tokens,
            # capture blocks larger than the pinned reserve (capture_host_rows), and steps
            # that waited for the drain to give rows back
            "num_capture_host_misses": host_rows.num_misses if host_rows else 0,
            "num_capture_host_waits": host_rows.num_waits if host_rows else 0,
            "capture_host_wait_s": host_rows.wait_s if host_rows else 0.0,
            # the drain thread: blocks taken out of pinned memory, its seconds waiting for
            # their copies and moving them, and from submission to the rows' return
            "capture_drain_blocks": drain.num_blocks if drain else 0,
            "capture_drain_copy_wait_s": drain.copy_wait_s if drain else 0.0,
            "capture_drain_move_s": drain.move_s if drain else 0.0,
            "capture_drain_lag_s": drain.lag_s if drain else 0.0,
            # the capture arena: page-locked host bytes it holds, block rows the device wrote
            # into requests' buffers there, and buffers it had no room for (those requests,
            # or their later rows, came home by the drain)
            "capture_arena_bytes": arena.num_bytes if arena else 0,
            "capture_rows_placed": getattr(sink, "num_placed", 0),
            "capture_arena_refused": arena.num_refused if arena else 0,
            "config": asdict(self.config),
        }
