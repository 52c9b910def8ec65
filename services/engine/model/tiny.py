"""Tiny random Hugging Face checkpoints for tests.

`make_tiny_checkpoint` writes a directory that `transformers` (and our engine) load like any
real checkpoint: classic-format `config.json`, safetensors weights (optionally sharded), a
byte-level BPE `tokenizer.json` trained on an in-repo corpus, and the usual side files. It
needs only torch, safetensors and tokenizers, and the same arguments give the same bytes.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

SUPPORTED_TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
# Trained first, so they take ids 0..4 in this order.
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Pre-tokenizer split patterns of the real families. transformers 5 rebuilds qwen2 tokenizers
# with its own Qwen2Tokenizer (NFC + QWEN2 pattern) whatever tokenizer.json says, so ours must
# match it exactly for the HF tokenizer and tokenizer.json to agree.
_SPLIT_PATTERNS = {
    "llama3": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}

_CORPUS_PATH = pathlib.Path(__file__).parent / "corpus" / "tiny_corpus.txt"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BYTE_ALPHABET_SIZE = 256
_MIN_VOCAB = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)

# What differs between the supported architectures; everything else is shared.
_ARCH_TRAITS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "tied": False,
        "qkv_bias": False,
        "qk_norm": False,
        "adds_bos": True,
        "tokenizer_family": "llama3",
        "head_dim_factor": 1,
        "rope_theta": 500000.0,
        "extra": {"mlp_bias": False, "pretraining_tp": 1},
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "tied": False,
        "qkv_bias": False,
        "qk_norm": False,
        "adds_bos": True,
        "tokenizer_family": "llama3",
        "head_dim_factor": 2,
        "rope_theta": 10000.0,
        "extra": {"sliding_window": None},
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "tied": True,
        "qkv_bias": True,
        "qk_norm": False,
        "adds_bos": False,
        "tokenizer_family": "qwen2",
        "head_dim_factor": 1,
        "rope_theta": 1000000.0,
        "extra": {"use_sliding_window": False, "sliding_window": None},
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "tied": True,
        "qkv_bias": False,
        "qk_norm": True,
        "adds_bos": False,
        "tokenizer_family": "qwen2",
        "head_dim_factor": 2,
        "rope_theta": 1000000.0,
        "extra": {"use_sliding_window": False, "sliding_window": None},
    },
}


def make_tiny_checkpoint(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    intermediate: int | None = None,
    head_dim: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    shards: int = 1,
    layers_per_shard: int | None = None,
    workers: int = 1,
) -> pathlib.Path:
    """Write a tiny random `arch` checkpoint with tokenizer into `out_dir` and return its path.

    Weights come from `torch.Generator().manual_seed(seed)`, scaled so greedy decoding has
    clear winners (no near-ties between the top two logits).

    `layers_per_shard` writes a checkpoint of any size straight into shards of that many
    layers, each from its own generator, by `workers` processes, never holding more than
    `workers` shards in memory (a 70B shape, say); `shards` is then ignored.
    """
    if arch not in _ARCH_TRAITS:
        raise ValueError(
            f"unknown tiny arch {arch!r}; supported: {', '.join(SUPPORTED_TINY_ARCHS)}"
        )
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; supported: {', '.join(_DTYPES)}")
    traits = _ARCH_TRAITS[arch]
    for name, value in (
        ("layers", layers),
        ("hidden", hidden),
        ("heads", heads),
        ("kv_heads", kv_heads),
        ("max_position_embeddings", max_position_embeddings),
        ("shards", shards),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if heads % kv_heads != 0:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    if vocab < _MIN_VOCAB:
        raise ValueError(
            f"vocab must be >= {_MIN_VOCAB} (256 byte tokens + {len(SPECIAL_TOKENS)} specials), "
            f"got {vocab}"
        )
    if head_dim is None:
        if (traits["head_dim_factor"] * hidden) % heads != 0:
            raise ValueError(
                f"hidden ({hidden}) * {traits['head_dim_factor']} must be divisible by heads "
                f"({heads}) for the default {arch} head_dim; pass head_dim explicitly"
            )
        head_dim = traits["head_dim_factor"] * hidden // heads
    if head_dim < 2 or head_dim % 2 != 0:
        raise ValueError(f"head_dim must be a positive even number (rotary), got {head_dim}")
    if intermediate is None:
        intermediate = 2 * hidden
    if intermediate < 1:
        raise ValueError(f"intermediate must be >= 1, got {intermediate}")

    tokenizer = Tokenizer.from_str(_trained_tokenizer_json(vocab, traits["tokenizer_family"]))
    special_ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    bos_id = special_ids[BOS] if traits["adds_bos"] else None
    eos_id = special_ids[EOS]

    config = _config(
        arch,
        traits,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        intermediate=intermediate,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        dtype=dtype,
        bos_id=bos_id,
        eos_id=eos_id,
    )
    shape = dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        intermediate=intermediate,
        head_dim=head_dim,
    )
    out = pathlib.Path(out_dir)
    if layers_per_shard is not None:
        if layers_per_shard < 1 or workers < 1:
            raise ValueError("layers_per_shard and workers must be >= 1")
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "config.json", config)
        _write_layer_shards(out, traits, shape, seed, _DTYPES[dtype], layers_per_shard, workers)
    else:
        weights = _random_weights(traits, seed=seed, **shape)
        weights = {name: t.to(_DTYPES[dtype]).contiguous() for name, t in weights.items()}
        if shards > len(weights):
            raise ValueError(f"shards ({shards}) exceeds the number of tensors ({len(weights)})")
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "config.json", config)
        _write_weights(out, weights, shards)
    _write_tokenizer_files(out, tokenizer, traits["adds_bos"], special_ids, max_position_embeddings)
    return out


def _config(
    arch: str,
    traits: dict[str, Any],
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    intermediate: int,
    head_dim: int,
    max_position_embeddings: int,
    dtype: str,
    bos_id: int | None,
    eos_id: int,
) -> dict[str, Any]:
    """The classic HF config.json dict (top-level `rope_theta` / `rope_scaling`)."""
    rope_scaling = None
    if arch == "llama":
        # original_max_position_embeddings far below max_position_embeddings, so the llama3
        # scaling really rewrites the low frequencies of a 512-position model.
        rope_scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    config: dict[str, Any] = {
        "architectures": traits["architectures"],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_theta": traits["rope_theta"],
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": traits["tied"],
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "dtype": dtype,
        "attention_bias": traits["qkv_bias"],
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch in ("qwen2", "qwen3"):
        config["max_window_layers"] = layers
    config.update(traits["extra"])
    return config


def _random_weights(traits: dict[str, Any], *, seed: int, **shape: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors, drawn in a fixed order from one seeded generator (see
    `_random_tensors`)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(_random_tensors(traits, gen, range(shape["layers"]), True, True, **shape))


def _random_tensors(
    traits: dict[str, Any],
    gen: torch.Generator,
    layer_ids: range,
    first: bool,
    last: bool,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    intermediate: int,
    head_dim: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 tensors of `layer_ids` (with the embedding when `first`, the final
    norm and head when `last`), drawn in a fixed order from `gen`.

    Scales are chosen so greedy decoding has clear winners that depend on the context:
    embeddings and lm_head ~ N(0, 1), so logits have std ~ sqrt(hidden) whether tied or not;
    projections into a block ~ N(0, 1/fan_in); projections back into the residual stream
    (o_proj, down_proj) ~ N(0, hidden/fan_in), so the blocks' outputs outweigh the token's own
    embedding (otherwise a tied model's top logit is e.e and it just repeats its input);
    biases ~ N(0, 0.1); norm weights 1 + 0.1 * N(0, 1), so a forgotten norm changes the output.
    """
    del layers  # the whole model's depth: `layer_ids` says which layers to draw

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        return normal(out_features, in_features, std=gain * in_features**-0.5)

    def norm(size: int) -> torch.Tensor:
        return 1.0 + normal(size, std=0.1)

    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    if first:
        yield "model.embed_tokens.weight", normal(vocab, hidden, std=1.0)
    for i in layer_ids:
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", norm(hidden)
        yield f"{p}.self_attn.q_proj.weight", linear(q_out, hidden)
        yield f"{p}.self_attn.k_proj.weight", linear(kv_out, hidden)
        yield f"{p}.self_attn.v_proj.weight", linear(kv_out, hidden)
        if traits["qkv_bias"]:
            yield f"{p}.self_attn.q_proj.bias", normal(q_out, std=0.1)
            yield f"{p}.self_attn.k_proj.bias", normal(kv_out, std=0.1)
            yield f"{p}.self_attn.v_proj.bias", normal(kv_out, std=0.1)
        if traits["qk_norm"]:
            yield f"{p}.self_attn.q_norm.weight", norm(head_dim)
            yield f"{p}.self_attn.k_norm.weight", norm(head_dim)
        yield f"{p}.self_attn.o_proj.weight", linear(hidden, q_out, gain=hidden**0.5)
        yield f"{p}.post_attention_layernorm.weight", norm(hidden)
        yield f"{p}.mlp.gate_proj.weight", linear(intermediate, hidden)
        yield f"{p}.mlp.up_proj.weight", linear(intermediate, hidden)
        yield f"{p}.mlp.down_proj.weight", linear(hidden, intermediate, gain=hidden**0.5)
    if last:
        yield "model.norm.weight", norm(hidden)
        if not traits["tied"]:
            yield "lm_head.weight", normal(vocab, hidden, std=1.0)


def _write_layer_shards(
    out: pathlib.Path,
    traits: dict[str, Any],
    shape: dict[str, int],
    seed: int,
    dtype: torch.dtype,
    layers_per_shard: int,
    workers: int,
) -> None:
    """Shards of `layers_per_shard` layers each (the embedding in the first, the final norm
    and head in the last), each drawn from its own generator (`seed`, shard) and written as
    it is drawn, by `workers` processes at once: a model of any size, in the memory of
    `workers` shards, at the speed of the host's cores."""
    layers = shape["layers"]
    count = -(-layers // layers_per_shard)
    jobs = [(out, traits, shape, seed, dtype, k, count, layers_per_shard) for k in range(count)]
    if workers > 1:
        ctx = torch.multiprocessing.get_context("spawn")
        with ctx.Pool(min(workers, count)) as pool:
            shards = pool.starmap(_write_one_shard, jobs)
    else:
        shards = [_write_one_shard(*job) for job in jobs]
    weight_map = {name: f for names, _ in shards for name, f in names.items()}
    total = sum(nbytes for _, nbytes in shards)  # of the tensors, as in any HF index
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


def _write_one_shard(
    out: pathlib.Path,
    traits: dict[str, Any],
    shape: dict[str, int],
    seed: int,
    dtype: torch.dtype,
    k: int,
    count: int,
    layers_per_shard: int,
) -> tuple[dict[str, str], int]:
    """Draw and write shard `k` of `count`: its tensors' file names, and their bytes."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + k)
    ids = range(k * layers_per_shard, min((k + 1) * layers_per_shard, shape["layers"]))
    tensors = {
        name: t.to(dtype).contiguous()
        for name, t in _random_tensors(traits, gen, ids, k == 0, k == count - 1, **shape)
    }
    filename = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
    save_file(tensors, out / filename, metadata={"format": "pt"})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return dict.fromkeys(tensors, filename), nbytes


def _write_weights(out: pathlib.Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    """`model.safetensors`, or `shards` files plus `model.safetensors.index.json`."""
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(weights, out / "model.safetensors", metadata=metadata)
        return
    names = list(weights)
    sizes = {name: weights[name].numel() * weights[name].element_size() for name in names}
    total = sum(sizes.values())
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for i, name in enumerate(names):
        left_after = len(names) - i
        shards_to_fill = shards - len(groups)
        # Close a shard once it holds its share of bytes, or when every later tensor is
        # needed to keep the remaining shards non-empty.
        if (
            groups[-1]
            and shards_to_fill > 0
            and (group_bytes * shards >= total or left_after == shards_to_fill)
        ):
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += sizes[name]
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups, start=1):
        filename = f"model-{k:05d}-of-{shards:05d}.safetensors"
        save_file({name: weights[name] for name in group}, out / filename, metadata=metadata)
        weight_map.update(dict.fromkeys(group, filename))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


@functools.lru_cache(maxsize=16)
def _trained_tokenizer_json(vocab: int, family: str) -> str:
    """A byte-level BPE with `vocab` entries trained on the tiny corpus, as JSON (no BOS added).

    `family` picks the normalizer and pre-tokenizer of the real llama3 or qwen2 tokenizers.
    Cached per process, as training is the slow part of building a checkpoint.
    """
    tokenizer = Tokenizer(models.BPE())
    if family == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[family]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = _CORPUS_PATH.read_text(encoding="utf-8")
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer.to_str()


def _write_tokenizer_files(
    out: pathlib.Path,
    tokenizer: Tokenizer,
    adds_bos: bool,
    special_ids: dict[str, int],
    model_max_length: int,
) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json."""
    if adds_bos:
        # Llama-3 style: keep byte-level offsets handling, then prepend BOS.
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{BOS}:0 $A:0",
                    pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                    special_tokens=[(BOS, special_ids[BOS])],
                ),
            ]
        )
    tokenizer.save(str(out / "tokenizer.json"))

    bos_token = BOS if adds_bos else None
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": EOS,
        "pad_token": PAD,
        # Explicit null: byte-level BPE has no unknown token, and Qwen2Tokenizer would
        # otherwise add "<|endoftext|>" past the end of the vocabulary.
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": adds_bos,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(special_ids[tok]): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for tok in SPECIAL_TOKENS
        },
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)

    special_tokens_map: dict[str, Any] = {"eos_token": EOS, "pad_token": PAD}
    if adds_bos:
        special_tokens_map["bos_token"] = BOS
    special_tokens_map["additional_special_tokens"] = [IM_START, IM_END]
    _write_json(out / "special_tokens_map.json", special_tokens_map)

    generation_config = {
        "bos_token_id": special_ids[BOS] if adds_bos else None,
        "eos_token_id": [special_ids[EOS], special_ids[IM_END]],
        "pad_token_id": special_ids[PAD],
    }
    _write_json(out / "generation_config.json", generation_config)


def _write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
