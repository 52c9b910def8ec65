"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one readable decoder.

The differences between the four are configuration: qkv bias (Qwen2), per-head q/k
RMSNorm (Qwen3), explicit head_dim, Llama-3 RoPE scaling, tied embeddings, and a sliding
window (Mistral). The residual stream is kept as a plain tensor between sub-blocks so the
intervention sites (`pre_attn`, `post_attn`, `post_block`) are real points in the code.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from services.engine.attention import AttentionBackend
from services.engine.kernels import gemv
from services.engine.kernels.norm_rope import qk_rope_cache, silu_mul
from services.engine.kernels.skinny_gemm import skinny_linear, skinny_norm_linear, takes
from services.engine.kernels.tickets import Tickets
from services.engine.model.config import ModelConfig
from services.engine.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from services.engine.parallel import ParallelContext


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ctx: ParallelContext,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        skinny: bool = False,
    ):
        super().__init__()
        if cfg.num_heads % ctx.tp_size or cfg.num_kv_heads % ctx.tp_size:
            raise ValueError(
                f"{cfg.num_heads} query / {cfg.num_kv_heads} KV heads cannot be split evenly "
                f"over tensor-parallel size {ctx.tp_size}"
            )
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads // ctx.tp_size
        self.num_kv_heads = cfg.num_kv_heads // ctx.tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.sliding_window
        self.qkv_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], cfg.qkv_bias, ctx, skinny
        )
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, cfg.o_bias, ctx, skinny)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary  # one cos/sin table shared by every layer
        self.backend = backend
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the runner

    def _heads(
        self, x: torch.Tensor, qkv: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The qkv projection of `x` (or `qkv`, projected already) as q [T, Hq, D], k and v
        [T, Hkv, D] (views)."""
        qkv = self.qkv_proj(x) if qkv is None else qkv
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def project(
        self, positions: torch.Tensor, x: torch.Tensor | None, qkv: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) of the normed residual `x` (or of
        its projection `qkv`), with the per-head norms (Qwen3) and RoPE applied: what
        attention reads and caches."""
        q, k, v = self._heads(x, qkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor | None,
        meta: Any,
        reduce: bool = True,
        qkv: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the normed residual `x`, or of its qkv projection `qkv` where the
        caller ran it (with the norm folded in: `DecoderLayer.forward_fused`); with
        `residual` (one row on the GEMV kernel), `residual` + the block's output, added in
        the o projection's launch."""
        t = (x if qkv is None else qkv).shape[0]
        assert self.kv_cache is not None, "the runner must attach a KV cache before forward"
        if self.backend.reads_kv_from_cache:
            q, k, v = self._heads(x, qkv)
            norms = (None, None, 0.0)
            if self.q_norm is not None:
                norms = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
            cos, sin = self.rotary.cos, self.rotary.sin
            if self.backend.attends_raw(meta):  # all of it in the attention kernel
                o = self.backend.attend_raw(
                    q, k, v, cos, sin, positions, self.kv_cache, meta, self.scale,
                    self.sliding_window, *norms,
                )  # fmt: skip
            else:  # norms, RoPE and the K/V cache writes in one kernel, then attention
                q = qk_rope_cache(
                    q, k, v, cos, sin, positions, *self.kv_cache, meta.slot_mapping, *norms
                )
                o = self.backend.attend(q, self.kv_cache, meta, self.scale, self.sliding_window)
        else:
            q, k, v = self.project(positions, x, qkv)
            o = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale, self.sliding_window)
        o = o.reshape(t, self.q_size)
        if residual is not None:
            return gemv.gemv_triton(o.contiguous(), self.o_proj.weight, residual=residual)
        # (reduce=False only under the fused TP kernel: wrappers such as the trainer's
        # adapted Linears take one argument)
        return self.o_proj(o) if reduce else self.o_proj(o, reduce=False)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, skinny: bool = False):
        super().__init__()
        n = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [n, n], cfg.mlp_bias, ctx, skinny
        )
        self.down_proj = RowParallelLinear(n, cfg.hidden_size, cfg.mlp_bias, ctx, skinny)
        # One row: the gate-up GEMV and the activation in one launch (`use_gemv`'s `gated`)
        self.gemv_gated = False

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        gate_up = self.gate_up_proj
        # Skinny or GEMV: the gate-up GEMM and its activation in one kernel. An adapter's
        # wrapper (no MergedColumnParallelLinear) runs its own GEMM, then the activation.
        merged = isinstance(gate_up, MergedColumnParallelLinear)
        if merged and gate_up.skinny and takes(x):
            a = skinny_linear(x, gate_up.weight, gate_up.bias, gated=True, tickets=gate_up.tickets)
        elif merged and self.gemv_gated and gemv.takes(x):
            a = gemv.gemv_triton(x, gate_up.weight, gate_up.bias, gated=True)
        else:
            a = silu_mul(gate_up(x))
        return self.down_proj(a) if reduce else self.down_proj(a, reduce=False)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ctx: ParallelContext,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        layer_idx: int,
        skinny: bool = False,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.ctx = ctx
        # Under TP with the fused kernel, the plain path leaves each sub-block's output a
        # partial sum, which the norm after it all-reduces (no biases to add after it).
        self.fuse_reduce = ctx.fused_norm is not None and not (cfg.o_bias or cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ctx, backend, rotary, skinny)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, ctx, skinny)
        # One row: the norms and residual adds run in the GEMV launches (`use_gemv`'s
        # `fold_norms`, `forward_gemv`)
        self.gemv_folds = False

    def post_block_only(self, iv: Any) -> bool:
        """Whether nothing intervenes at this layer's pre_attn and post_attn this step (so
        its input norm may be computed by the layer before)."""
        L = self.layer_idx
        return not (iv.touches(L, "pre_attn") or iv.touches(L, "post_attn"))

    def forward(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        meta: Any,
        iv: Any,
        normed: torch.Tensor | None = None,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer with `iv` (a StepInterventions) capturing, probing and steering the
        residual at each site: returns (the residual after it, `next_norm` of it or None).

        `normed`: this layer's input norm of `h`, when the layer before computed it;
        `next_norm`: the norm the caller applies next, computed here with the last site.
        """
        L = self.layer_idx
        if self.post_block_only(iv):
            # The mid-block add is fused into its norm, and the last add and the next norm
            # into the site's op.
            if normed is None:
                normed = self.input_layernorm(h)
            a = self.self_attn(positions, normed, meta)
            normed, h = self.post_attention_layernorm(a, h)
            iv.capture_at(L, "post_attn", h)  # only a block-capturing step writes here
            # blocks.L.hook_resid_post
            return iv.apply_and_norm(L, "post_block", h, add=self.mlp(normed), norm=next_norm)
        h = iv.apply(L, "pre_attn", h)  # blocks.L.hook_resid_pre
        h = h + self.self_attn(positions, self.input_layernorm(h), meta)
        h = iv.apply(L, "post_attn", h)  # blocks.L.hook_resid_mid
        h = h + self.mlp(self.post_attention_layernorm(h))
        return iv.apply_and_norm(L, "post_block", h, norm=next_norm)  # blocks.L.hook_resid_post

    def forward_fused(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with each residual add fused into the norm after it (no
        intervention sites): takes and returns (the last sub-block's output, the residual
        stream before it is added); `residual` None means x is the stream itself. With
        `fuse_reduce`, sub-block outputs (x and the first part returned included) are this
        rank's partial sums, and each all-reduce runs inside the norm after it. Where the
        skinny kernel takes the step (`folds_norms`), the add and the norm run inside the
        Linear after them instead: qkv and gate-up. Where the GEMV kernel folds them
        (`folds_into_gemv`), the layer returns the stream itself and None."""
        if self.folds_into_gemv(x):
            return self.forward_gemv(positions, x if residual is None else x + residual, meta), None
        if self.folds_norms(x):
            qkv_proj, gate_up = self.self_attn.qkv_proj, self.mlp.gate_up_proj
            g = self.input_layernorm
            qkv, residual = skinny_norm_linear(
                x, residual, g.weight, g.eps, qkv_proj.weight, qkv_proj.bias,
                tickets=qkv_proj.tickets,
            )  # fmt: skip
            a = self.self_attn(positions, None, meta, qkv=qkv)
            g = self.post_attention_layernorm
            h, residual = skinny_norm_linear(
                a, residual, g.weight, g.eps, gate_up.weight, gate_up.bias, gated=True,
                tickets=gate_up.tickets,
            )  # fmt: skip
            return self.mlp.down_proj(h), residual
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            normed, residual = self._add_norm(self.input_layernorm, x, residual)
        a = self.self_attn(positions, normed, meta, reduce=not self.fuse_reduce)
        normed, residual = self._add_norm(self.post_attention_layernorm, a, residual)
        return self.mlp(normed, reduce=not self.fuse_reduce), residual

    def forward_gemv(self, positions: torch.Tensor, h: torch.Tensor, meta: Any) -> torch.Tensor:
        """The layer at one row in four GEMV launches and attention, the residual stream `h`
        in and out: each norm runs in the Linear after it (qkv, gate-up: `norm`), each
        residual add in the Linear before it (o, down: `residual`), the activation in the
        gate-up launch where `gemv_activation` is on. No norm kernel runs."""
        attn, mlp = self.self_attn, self.mlp
        g = self.input_layernorm
        qkv = gemv.gemv_triton(h, attn.qkv_proj.weight, attn.qkv_proj.bias, norm=(g.weight, g.eps))
        h = attn(positions, None, meta, qkv=qkv, residual=h)
        g, gate_up = self.post_attention_layernorm, mlp.gate_up_proj
        a = gemv.gemv_triton(
            h, gate_up.weight, gate_up.bias, gated=mlp.gemv_gated, norm=(g.weight, g.eps)
        )
        if not mlp.gemv_gated:
            a = silu_mul(a)
        return gemv.gemv_triton(a, mlp.down_proj.weight, residual=h)

    def folds_into_gemv(self, x: torch.Tensor) -> bool:
        """Whether this step runs `forward_gemv`: `gemv_folds` is set (tensor-parallel size
        1, no bias after a residual add: `use_gemv`), the kernel takes the row, and the four
        Linears are the model's own (an adapter's wrapper runs its own GEMM)."""
        attn, mlp = self.self_attn, self.mlp
        plain = (
            type(attn.qkv_proj) is type(mlp.gate_up_proj) is MergedColumnParallelLinear
            and type(attn.o_proj) is type(mlp.down_proj) is RowParallelLinear
        )
        return self.gemv_folds and plain and gemv.takes(x)

    def folds_norms(self, x: torch.Tensor) -> bool:
        """Whether this step's norms run inside the Linears after them: the skinny kernel
        takes these rows (`EngineConfig.skinny_gemm`, a decode-size CUDA batch), qkv and
        gate-up are its own plain Linears (an adapter's wrapper runs its own GEMM), no fused
        all-reduce does the adds, and the model is not float16 (the kernel rounds x ⊙ g to
        the model's dtype before it normalises, which float16's range may not hold)."""
        qkv, gate_up = self.self_attn.qkv_proj, self.mlp.gate_up_proj
        plain = type(qkv) is type(gate_up) is MergedColumnParallelLinear
        wide = x.dtype != torch.float16
        return (
            plain and qkv.skinny and gate_up.skinny and not self.fuse_reduce and wide and takes(x)
        )

    def _add_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fuse_reduce:
            return self.ctx.all_reduce_add_norm(x, residual, norm)
        return norm(x, residual)


class LlamaFamilyForCausalLM(nn.Module):
    """A pipeline stage of a Llama-family model (the whole model when pp_size == 1).

    Parameter names follow Hugging Face's, except fused `qkv_proj` and `gate_up_proj`
    (see `PACKED_MODULES`). Layers are numbered globally: stage k holds `layers[i]` only for
    i in `ctx.layer_range(num_layers)`.
    """

    PACKED_MODULES: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: ParallelContext,
        backend: AttentionBackend,
        skinny_gemm: bool = False,
    ):
        """`skinny_gemm`: the decoder layers' Linears run `kernels/skinny_gemm.py` on
        decode-size CUDA batches (`EngineConfig.skinny_gemm`), split over K, with one set
        of tickets for the whole model (its launches run one after another)."""
        super().__init__()
        self.cfg = cfg
        self.ctx = ctx
        self.layer_range = ctx.layer_range(cfg.num_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
            if ctx.is_first_stage
            else None
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(cfg, ctx, backend, self.rotary, i, skinny_gemm)
                for i in self.layer_range
            }
        )
        if skinny_gemm:
            tickets = Tickets()
            for module in self.layers.modules():
                if getattr(module, "skinny", False):
                    module.tickets = tickets
        if ctx.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx)
            if cfg.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        else:
            self.norm = None
            self.lm_head = None

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        meta: Any,
        input_ids: torch.Tensor | None = None,  # [T], first stage
        hidden_states: torch.Tensor | None = None,  # [T, H], later stages
        interventions: Any = None,  # StepInterventions
    ) -> torch.Tensor:  # [T, H]: the residual stream (final-normed on the last stage)
        h = self.embed_tokens(input_ids) if self.embed_tokens is not None else hidden_states
        if interventions is not None:
            # Each layer also computes the norm after it where nothing intervenes in
            # between: the next layer's input norm, or after the last, the final norm.
            layers = list(self.layers.values())
            if layers:  # the first layer's pre_attn; later ones come from the op before
                interventions.capture_at(layers[0].layer_idx, "pre_attn", h)
            normed = None
            for j, layer in enumerate(layers):
                if j + 1 < len(layers):
                    after = layers[j + 1]
                    next_norm = (
                        after.input_layernorm if after.post_block_only(interventions) else None
                    )
                else:
                    next_norm = self.norm  # None on a stage before the last
                h, normed = layer(positions, h, meta, interventions, normed, next_norm)
            if normed is not None and self.norm is not None:
                return normed
            return self.norm(h) if self.norm is not None else h
        # Nothing intervenes: each residual add is fused into the next norm (same rounding).
        residual = None
        for layer in self.layers.values():
            h, residual = layer.forward_fused(positions, h, residual, meta)
        if residual is None:  # a stage with no layers, or layers that folded their adds
            return self.norm(h) if self.norm is not None else h
        partial = next(iter(self.layers.values())).fuse_reduce  # h is a partial sum
        if self.norm is None:
            return (self.ctx.all_reduce(h) if partial else h) + residual
        if partial:
            return self.ctx.all_reduce_add_norm(h, residual, self.norm)[0]
        return self.norm(h, residual)[0]

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        return self.lm_head(h)

    def use_gemv(
        self, measured: bool = False, gated: bool = False, fold_norms: bool = False
    ) -> list[str]:
        """Run one-row inputs of the Linears (the decoder's and the LM head) on
        `kernels/gemv.py` (`EngineConfig.gemv`): every one, or with `measured` those whose
        weight shape the kernel reads faster than cuBLAS on this GPU (`faster_shapes`, the
        same on every TP rank); `fold_norms`: also every decoder Linear, whose layers then
        run their norms and residual adds in those launches (`EngineConfig.gemv_fold_norms`;
        tensor-parallel size 1, no bias after an add);
        `gated`: an MLP whose gate-up Linear runs the kernel runs its activation in that
        launch (`EngineConfig.gemv_activation`). Returns the names of the Linears that now
        run the kernel."""
        everything = {name: m for name, m in self.named_modules() if hasattr(m, "gemv")}
        modules = everything
        if measured and modules:
            group = self.ctx.tp_group if self.ctx.tp_size > 1 else None
            faster = gemv.faster_shapes([m.weight for m in modules.values()], group)
            modules = {n: m for n, m in modules.items() if tuple(m.weight.shape) in faster}
        if fold_norms and (self.ctx.tp_size > 1 or self.cfg.o_bias or self.cfg.mlp_bias):
            raise ValueError("folding norms into the GEMV needs TP 1 and no o/down bias")
        if fold_norms:
            modules |= {n: m for n, m in everything.items() if n.startswith("layers.")}
            for layer in self.layers.values():
                layer.gemv_folds = True
        for m in modules.values():
            m.gemv = True
        if gated:
            for layer in self.layers.values():
                layer.mlp.gemv_gated = layer.mlp.gate_up_proj.gemv
        return list(modules)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers.values()]
