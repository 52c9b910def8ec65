"""Tiny checkpoints load in transformers like real ones, deterministically, with peaky outputs."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

from services.engine.model.tiny import SUPPORTED_TINY_ARCHS, make_tiny_checkpoint

TIED = {"llama": False, "mistral": False, "qwen2": True, "qwen3": True}
CLASS_NAMES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SAMPLES = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159 and a million is 1,000,000.",
    "  two  spaces\n\nnew\tlines  ",
    "héllo wörld 😀 日本語",
    "def f(x):\n    return x ** 2  # square",
    "I'm sure you're right, but they'll say DON'T.",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
]
CHATML = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def transformers():
    pytest.importorskip("transformers")
    import transformers
    from transformers.utils import logging

    logging.disable_progress_bar()
    return transformers


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in SUPPORTED_TINY_ARCHS}


def _load(transformers, path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _prompts(seed: int = 1, batch: int = 8, length: int = 32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, 512, (batch, length), generator=gen)  # [B, T], no special ids


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_transformers_loads_every_weight(transformers, checkpoints, arch):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints[arch], output_loading_info=True
    )
    assert type(model).__name__ == CLASS_NAMES[arch]
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert not info["error_msgs"]


def test_llama_config_keeps_llama3_rope_scaling(transformers, checkpoints):
    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"]["rope_type"] == "llama3"

    model = _load(transformers, checkpoints["llama"])
    hf_rope = getattr(model.config, "rope_parameters", None) or model.config.rope_scaling
    assert hf_rope["rope_type"] == "llama3"
    assert hf_rope["factor"] == 8.0
    head_dim = model.config.head_dim
    plain = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    scaled = model.model.rotary_emb.inv_freq.float()
    assert torch.allclose(scaled[:1], plain[:1])  # highest frequency untouched
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)  # lowest frequency divided by factor


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_explicit_head_dim_differs_from_hidden_over_heads(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch, hidden=64, heads=4)
    config = json.loads((path / "config.json").read_text())
    assert config["head_dim"] == 32 != config["hidden_size"] // config["num_attention_heads"]
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [128, 64]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [64, 64]
        if arch == "qwen3":
            assert f.get_slice("model.layers.1.self_attn.q_norm.weight").get_shape() == [32]
            assert f.get_slice("model.layers.1.self_attn.k_norm.weight").get_shape() == [32]

    override = make_tiny_checkpoint(tmp_path / "override", arch, head_dim=8)
    assert json.loads((override / "config.json").read_text())["head_dim"] == 8


def test_qwen2_has_qkv_bias_but_no_o_bias(checkpoints):
    keys = set(load_file(checkpoints["qwen2"] / "model.safetensors"))
    for proj in ("q", "k", "v"):
        assert f"model.layers.0.self_attn.{proj}_proj.bias" in keys
    assert "model.layers.0.self_attn.o_proj.bias" not in keys


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_hf_tokenizer_agrees_with_tokenizer_json(transformers, checkpoints, arch):
    path = checkpoints[arch]
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = raw.token_to_id("<|bos|>")
    assert len(hf_tok) == raw.get_vocab_size() == 512
    for text in SAMPLES:
        ids = hf_tok(text).input_ids
        assert ids == raw.encode(text).ids, text
        adds_bos = not TIED[arch]  # llama/mistral add BOS; qwen does not, like the real ones
        assert (ids[0] == bos) is adds_bos
        assert bos not in ids[1:]
        assert hf_tok.decode(ids, skip_special_tokens=True) == text
        assert raw.decode(raw.encode(text, add_special_tokens=False).ids) == text


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_special_token_ids_line_up_across_files(checkpoints, arch):
    path = checkpoints[arch]
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    eos, im_end = raw.token_to_id("<|eos|>"), raw.token_to_id("<|im_end|>")
    assert config["eos_token_id"] == eos
    assert generation["eos_token_id"] == [eos, im_end]
    assert generation["pad_token_id"] == raw.token_to_id("<|pad|>")
    expected_bos = None if TIED[arch] else raw.token_to_id("<|bos|>")
    assert config["bos_token_id"] == generation["bos_token_id"] == expected_bos
    # A chat special token must stay one token, not be split into bytes.
    assert raw.encode("<|im_start|>user", add_special_tokens=False).ids[0] == raw.token_to_id(
        "<|im_start|>"
    )


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_chat_template_renders_chatml(transformers, checkpoints, arch):
    hf_tok = transformers.AutoTokenizer.from_pretrained(checkpoints[arch])
    rendered = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered == CHATML
    no_prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert no_prompt == CHATML.removesuffix("<|im_start|>assistant\n")


def test_same_seed_gives_identical_bytes_and_new_seed_differs(tmp_path, checkpoints):
    again = make_tiny_checkpoint(tmp_path / "again", "llama", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (checkpoints["llama"] / name).read_bytes(), name
    other = make_tiny_checkpoint(tmp_path / "other", "llama", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sharded_checkpoint_loads_to_same_logits(transformers, tmp_path, checkpoints, arch):
    sharded = make_tiny_checkpoint(tmp_path, arch, shards=3)
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    total = 0
    for name in files:
        with safe_open(sharded / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
        for key, tensor in load_file(sharded / name).items():
            assert index["weight_map"][key] == name
            total += tensor.numel() * tensor.element_size()
    assert index["metadata"]["total_size"] == total

    ids = _prompts(batch=2, length=16)
    with torch.no_grad():
        expected = _load(transformers, checkpoints[arch])(ids).logits
        actual = _load(transformers, sharded)(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_a_checkpoint_written_straight_into_layer_shards(transformers, tmp_path):
    """`layers_per_shard` (how a 70B-shape checkpoint is written): each shard its layers,
    the embedding in the first and the head in the last, the same bytes whatever the number
    of writer processes; transformers and the engine load it to the same logits."""
    from services.engine import LLM, LLMEngine, SamplingParams
    from services.engine.config import EngineConfig

    kw = dict(layers=3, layers_per_shard=2)
    one = make_tiny_checkpoint(tmp_path / "one", "llama", **kw)
    two = make_tiny_checkpoint(tmp_path / "two", "llama", workers=2, **kw)
    index = json.loads((one / "model.safetensors.index.json").read_text())
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(set(index["weight_map"].values())) == files
    first, last = (load_file(one / f) for f in files)
    assert "model.embed_tokens.weight" in first and "model.layers.1.mlp.up_proj.weight" in first
    assert "lm_head.weight" in last and "model.layers.2.mlp.up_proj.weight" in last
    for f in files:
        a, b = load_file(one / f), load_file(two / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tensors = [t for f in files for t in load_file(one / f).values()]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors)

    ids = _prompts(batch=1, length=12)
    with torch.no_grad():
        want = _load(transformers, one)(ids).logits[0, -1]
    engine = LLMEngine(one, EngineConfig(device="cpu", num_kv_blocks=16))
    params = SamplingParams(max_tokens=1, logprobs=5)
    (out,) = LLM(engine=engine).generate([ids[0].tolist()], params)
    got = out.outputs[0].logprobs[0]
    assert len(got) >= 5
    want_lp = torch.log_softmax(want.double(), -1)
    for token, lp in got.items():
        assert lp == pytest.approx(want_lp[token].item(), abs=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint_stores_that_dtype(transformers, tmp_path, dtype):
    path = make_tiny_checkpoint(tmp_path, "qwen2", dtype=dtype)
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == dtype
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    torch_dtype = getattr(torch, dtype)
    assert {t.dtype for t in load_file(path / "model.safetensors").values()} == {torch_dtype}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert model.dtype == torch_dtype


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_tied_archs_share_embeddings_and_untied_have_lm_head(transformers, checkpoints, arch):
    path = checkpoints[arch]
    tensors = load_file(path / "model.safetensors")
    has_lm_head = "lm_head.weight" in tensors
    embed = tensors["model.embed_tokens.weight"]
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is TIED[arch]
    assert has_lm_head is not TIED[arch]
    model = _load(transformers, path)
    assert torch.equal(model.get_input_embeddings().weight, embed)
    assert torch.equal(model.lm_head.weight, embed) is TIED[arch]


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_greedy_winners_are_clear_and_depend_on_context(transformers, checkpoints, arch):
    model = _load(transformers, checkpoints[arch])
    ids = _prompts()
    changed = ids.clone()
    changed[:, :16] = _prompts(seed=2, length=16)
    with torch.no_grad():
        logits = model(ids).logits  # [B, T, V]
        logits_changed = model(changed).logits
    top2 = logits.topk(2, dim=-1)
    gap = top2.values[..., 0] - top2.values[..., 1]
    assert gap.median() > 0.5
    # A tied random model with weak blocks just echoes its input token; ours must not.
    assert (top2.indices[..., 0] == ids).float().mean() < 0.2
    # Different earlier tokens change most later predictions, so attention matters.
    later = (logits[:, 16:].argmax(-1) != logits_changed[:, 16:].argmax(-1)).float().mean()
    assert later > 0.5


def test_invalid_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        make_tiny_checkpoint(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="divisible by kv_heads"):
        make_tiny_checkpoint(tmp_path, "llama", heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        make_tiny_checkpoint(tmp_path, "llama", dtype="int8")
    with pytest.raises(ValueError, match="vocab"):
        make_tiny_checkpoint(tmp_path, "llama", vocab=100)
    with pytest.raises(ValueError, match="head_dim"):
        make_tiny_checkpoint(tmp_path, "llama", head_dim=7)
    with pytest.raises(ValueError, match="shards"):
        make_tiny_checkpoint(tmp_path, "llama", layers=1, shards=100)
