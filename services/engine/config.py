"""Engine-wide settings, validated once when an engine is built."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from services.common.errors import InvalidRequestError
from services.engine.interventions.sites import SITES

# (`max_num_seqs`, `max_num_batched_tokens`) of an engine that leaves them unset, by device
# type: a GPU step has room for a far larger batch than a CPU one (vLLM's GPU defaults).
BATCH_LIMITS = {"cpu": (64, 2048), "cuda": (256, 8192)}


@dataclass
class EngineConfig:
    """How an engine replica runs. Defaults suit the tiny CPU models of tests and demos;
    `max_num_seqs` and `max_num_batched_tokens` left None are sized for the device the engine
    resolves (`BATCH_LIMITS`, filled in by `resolved_for`).

    `num_kv_blocks` fixes the KV cache size; otherwise it is `kv_cache_memory_gb` on CPU
    and `gpu_memory_utilization` of the free GPU memory (after weights) on CUDA, capped to
    what `max_num_seqs` sequences of `max_model_len` tokens could ever use, times four for
    prefix-cache headroom.
    """

    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int | None = None  # None: BATCH_LIMITS of the device (resolved_for)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.85
    seed: int = 0
    # Steering tables: rows for distinct per-request configs (a config whose prefill and
    # decode vectors differ takes two), rows for controller overrides, and the depth of the
    # in-process action queue.
    steering_request_rows: int = 256
    steering_dynamic_rows: int = 32
    action_queue_size: int = 1024
    # Read-out probes (`readouts`, `abort_when`): distinct probes the bank of each (layer,
    # site) holds at once, a power of two; a request waits while a bank it reads is full.
    readout_probes_per_site: int = 8
    # Low-rank adapters in the SVD basis of target Linears (services/engine/adapters.py):
    # how many may be loaded at once (0: none, and no adapted Linear is built), their rank,
    # and the module-name patterns they adapt. `adapter_lora_rank`: the LoRA quarantine
    # rank each slot reserves columns for at start; loading a larger one re-lays the tables
    # and re-captures the decode CUDA graphs (logged).
    adapter_capacity: int = 0
    adapter_rank: int = 8
    adapter_targets: tuple[str, ...] = ("*.o_proj", "*.down_proj")
    adapter_lora_rank: int = 0
    # The GPU fast path: decode steps replay CUDA graphs captured at start for batch-size
    # buckets up to max_num_seqs (`enforce_eager` turns them off: every step runs eagerly).
    # `attention_backend`: "auto" (Triton on CUDA, SDPA on CPU), "triton" or "sdpa".
    enforce_eager: bool = False
    attention_backend: str = "auto"
    # Sites (of every layer) where intervened decode steps replay a CUDA graph too: a second
    # graph per bucket runs the fused op there (steering, monitors, gates, read-outs), with
    # every switch read from the tables and the step batch. Steps that steer or read out
    # elsewhere, patch or feed a consumer run eagerly (captures: `graph_capture_rows`).
    graph_steering_sites: tuple[str, ...] = ("post_block",)
    # Steps that capture write each capturing token's residual at every (layer, site) into
    # a fixed buffer of this many token rows (None: max_num_seqs), allocated at start (rows
    # x 3 x layers x hidden in the model dtype; on CUDA three times that, with the two
    # staging buffers of its copy out), and bring it back with one copy: decode steps
    # replay a CUDA graph and overlap like any intervened step. A step with more capturing
    # tokens, or 0 here, copies each (layer, site) eagerly.
    graph_capture_rows: int | None = None
    # Pinned host rows (each 3 x layers x hidden in the model dtype) reserved at start on
    # CUDA for those copies. A step's block (only the sites its requests asked for) lands in
    # a run of them; a drain thread moves it to pageable memory and gives the run back,
    # so the reserve is a ring reused step after step whatever the requests hold. When the
    # drain is behind, a step waits for rows (back-pressure, counted in stats); only a block
    # larger than the whole reserve page-locks memory of its own (milliseconds; counted,
    # warned once). None: 3 steps of `graph_capture_rows` (one block copying, one
    # draining, one being written).
    capture_host_rows: int | None = None
    # Host memory (bytes) that per-token capture may hold for requests' own buffers in
    # chunks the device writes each block's rows into directly (page-locked on CUDA, taken
    # 256 MiB at a time as requests need them): no thread of ours touches a row until the
    # request is delivered. A request the arena has no room for (or, from that row on, one
    # whose rows outgrow the room it has) takes the drain's way above. None: an eighth of
    # the host's memory, at most 16 GiB (per engine process: replicas sharing a host each
    # take their own); 0: every request the drain's way. Otherwise at least one chunk.
    capture_arena_bytes: int | None = None
    # Overlap host work with the device: schedule and launch step N+1 before accepting step
    # N's tokens (not while a patch is still ahead of a request or a sync consumer is
    # attached, which read what the step before brings back; see LLMEngine._can_overlap).
    async_scheduling: bool = True
    # Tensor parallelism on CUDA: each layer's all-reduces run fused with the residual add
    # and norm after them, one kernel over symmetric memory (kernels/all_reduce_norm.py).
    # None: on for two TP ranks, off for more. Measured (Llama-3-8B shape, two H200s) it
    # takes a TP=2 step at batch 1 from 3.45 to 3.26 ms (1.36x -> 1.45x one GPU), at batch
    # 32 from 4.10 to 3.87, and at batch 128 level or faster (5.86 / 5.88, 6.68 / 5.31 in
    # two runs); at TP=4 (Llama-3-70B shape) it gave nothing (each call pushes to three
    # peers and waits for three). Unavailable, it is logged and kept apart.
    fused_all_reduce_norm: bool | None = None
    # CUDA: decoder Linears of steps with at most 16 tokens (small-batch decode) run one
    # Triton kernel each instead of cuBLAS (no split-K reduction), the gated MLP's
    # activation inside the gate-up one (kernels/skinny_gemm.py): fewer launches where a
    # small model's batch-1 step is bound by them. Off by default: on one H200 it gave
    # 1.06x at batch 1 on the Qwen3-0.6B shape but 0.95x at batch 8 and 0.91x on the
    # Llama-3-8B shape, where it read weights slower than cuBLAS (benchmarks/README.md).
    # Since then it also splits K over the launch (the last program of a column block sums
    # the partials: no reduce kernel), to keep more loads in flight, and runs each layer's
    # two RMSNorms (and their residual adds) inside the qkv and gate-up launches. Measured
    # on one H200 with fused_decode_attention: 0.79x at batch 1 on the Qwen3-0.6B shape and
    # 0.44x on the Llama-3-8B shape. On the 0.6B shape its kernels take 1.8x cuBLAS's device
    # time, and its step far more than that (what the GPU waits for is still open:
    # benchmarks/README.md). It stays off.
    skinny_gemm: bool = False
    # CUDA: a Linear of one row (the batch-1 decode step's, the LM head's included) runs a
    # matrix-vector kernel (kernels/gemv.py) instead of cuBLAS's GEMM tiles. None (the
    # default): at the weight shapes where it measured faster than cuBLAS on this GPU when
    # the model loaded (summed over the TP ranks, so they agree); True: at every shape;
    # False: never. On one H200 it read most decode shapes' weights 1.1-1.2x faster than
    # cuBLAS and the Qwen3-0.6B shape's o_proj 3.6x (cuBLAS runs it as split-K), and lost
    # at two (0.90x): batch 1 on the Qwen3-0.6B shape went from 717 to 909 tok/s.
    gemv: bool | None = None
    # The two below run more of a batch-1 decode layer inside the GEMV kernel's launches.
    # Each: None (the default) on where it was measured, a CUDA model at tensor-parallel
    # size 1 with `gemv` not False; True asks for it (a warning where it cannot run, an
    # error with gemv=False); False: off. Together, on one H100 (decode.py's coxswain row
    # against coxswain-unfused, benchmarks/README.md): the Qwen3-0.6B shape's batch-1 step
    # from 1.20 to 1.12 ms (835-840 -> 889-897 tok/s), batch 32 and 128 unchanged.
    #
    # The activation: where an MLP's gate-up Linear runs on the GEMV kernel, SiLU-mul runs
    # in the same launch (kernels/gemv.py, `gated`), rounded where the unfused path rounds.
    gemv_activation: bool | None = None
    # The norms and adds: a batch-1 layer's two RMSNorms run inside the qkv and gate-up
    # launches (r · ((x ⊙ g) Wᵀ), r applied to the finished sums) and its two residual adds
    # inside the o and down projections' (kernels/gemv.py, `norm`, `residual`), so the
    # layer launches no norm kernel; those four Linears then run the GEMV kernel at one row
    # whatever `gemv`'s timing picked. Needs no o_proj or down_proj bias.
    gemv_fold_norms: bool | None = None
    # CUDA: a decode step's attention in one kernel a layer, not three: the q/k norms,
    # RoPE and the K/V cache write happen in the attention kernel's programs, and the last
    # split of each request x KV head to finish merges the splits
    # (kernels/decode_attention.py: `decode_rope_attention_triton`; kernels/tickets.py). Two
    # launches fewer a layer (56 a step on a 28-layer model). Measured on one H200: 0.99-1.00x
    # at batch 1, 1.00-1.04x at batch 8-128 (benchmarks/decode.py's coxswain-fa row). Its
    # kernel tests pass on a GPU; its engine parity tests (tests/gpu) have not run yet, so it
    # stays off until they do.
    # Where attention runs on SDPA (CPU, or a head dim that is not a power of two) asking
    # for it is an error at start, not a setting quietly ignored.
    fused_decode_attention: bool = False
    # Pipeline-parallel replicas: overlapped decode steps take turns over this many disjoint
    # parts of the running batch, so each stage computes one part while the next stage
    # computes another (1: every step carries the whole batch, stage after stage). As many
    # steps stay in flight; a part's tokens go from the last stage to the first on the
    # device, for the part's next step. A decode step reads every weight of its stage
    # whatever its batch, so this pays at a batch one GPU could not hold, not at a fixed
    # one (benchmarks/README.md). Off by default; on one stage it is logged and not used.
    pipeline_microbatches: int = 1

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "steering_request_rows",
            "steering_dynamic_rows",
            "action_queue_size",
            "pipeline_microbatches",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {value}")
        p = self.readout_probes_per_site
        if p < 1 or p & (p - 1):
            raise InvalidRequestError(f"readout_probes_per_site must be a power of two, got {p}")
        if self.adapter_lora_rank < 0:
            raise InvalidRequestError(
                f"adapter_lora_rank must be >= 0, got {self.adapter_lora_rank}"
            )
        for name in ("graph_capture_rows", "capture_host_rows", "capture_arena_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InvalidRequestError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        unknown = set(self.graph_steering_sites) - set(SITES)
        if unknown:
            raise InvalidRequestError(
                f"graph_steering_sites: unknown sites {sorted(unknown)} (sites: {SITES})"
            )
        if self.attention_backend not in ("auto", "triton", "sdpa"):
            raise InvalidRequestError(
                f"attention_backend must be auto, triton or sdpa, got {self.attention_backend!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError("gpu_memory_utilization must be in (0, 1]")

    def resolved_for(self, device_type: str) -> EngineConfig:
        """This config with what was left to the device filled in for `device_type` ("cpu",
        "cuda"; others size like "cpu"): the settings an engine on that device runs."""
        seqs, tokens = BATCH_LIMITS.get(device_type, BATCH_LIMITS["cpu"])
        return replace(
            self,
            max_num_seqs=seqs if self.max_num_seqs is None else self.max_num_seqs,
            max_num_batched_tokens=(
                tokens if self.max_num_batched_tokens is None else self.max_num_batched_tokens
            ),
        )


def _has_type(value: Any, hint: Any) -> bool:
    """Whether a setting read from YAML or JSON fits a field's annotation (a list for a
    tuple, an int for a float; a bool is no int)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        base = typing.get_origin(option) or option
        if option is type(None) and value is None:
            return True
        if base is tuple and isinstance(value, list | tuple):
            return True
        if base is float and type(value) in (int, float):
            return True
        if base in (int, str, bool) and type(value) is base:
            return True
    return False


def check_settings(
    settings: Mapping[str, Any], where: str, own: Mapping[str, str] | None = None
) -> None:
    """Refuse EngineConfig settings given as plain data (`coxswain up --engine`, a Serve
    config's `engine:`) that no engine could take, naming them as `where FIELD`: a field
    EngineConfig lacks, one of `own` (field → where else it is set), a value of the wrong
    type, or one the config rejects. Raises InvalidRequestError."""
    own = own or {}
    hints = typing.get_type_hints(EngineConfig)
    for name, value in settings.items():
        if name in own:
            raise InvalidRequestError(f"{where} {name}: set it with {own[name]}")
        if name not in hints:
            known = ", ".join(sorted(hints.keys() - own.keys()))
            raise InvalidRequestError(f"{where} {name}: EngineConfig has no such field ({known})")
        if not _has_type(value, hints[name]):
            raise InvalidRequestError(f"{where} {name}={value!r}: expected {hints[name]}")
    try:
        EngineConfig(**settings)
    except (TypeError, ValueError) as e:  # InvalidRequestError is a ValueError
        raise InvalidRequestError(f"{where}: {e}") from None
