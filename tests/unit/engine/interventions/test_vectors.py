from __future__ import annotations

import threading

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from services.common.errors import InvalidRequestError, NotFoundError, http_status
from services.common.wire import pack_tensor
from services.engine.interventions.vectors import (
    VectorRegistry,
    load_gguf_control_vector,
    load_safetensors_vectors,
    vector_for_layer,
)

H = 8


def write_repeng_gguf(path, directions: dict[int, np.ndarray], model_hint="llama"):
    """A control vector file exactly as repeng's `ControlVector.export_gguf` writes one."""
    arch = "controlvector"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string(f"{arch}.model_hint", model_hint)
    writer.add_uint32(f"{arch}.layer_count", len(directions))
    for layer, direction in directions.items():
        writer.add_tensor(f"direction.{layer}", direction)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- registry ----------------------------------------------------------------------------


def test_register_get_list_unregister():
    reg = VectorRegistry(hidden_size=H)
    v = torch.randn(H)
    reg.register("honesty", v)
    reg.register("calm", {3: torch.randn(H), "1": [0.5] * H}, source="notebook")
    assert "honesty" in reg and len(reg) == 2
    assert torch.equal(reg.get("honesty").vector, v)
    assert reg.list() == [
        {"name": "calm", "hidden_size": H, "layers": [1, 3], "source": "notebook"},
        {"name": "honesty", "hidden_size": H, "layers": None, "source": "api"},
    ]
    reg.unregister("honesty")
    assert "honesty" not in reg and len(reg) == 1
    with pytest.raises(NotFoundError, match="no vector named 'honesty'") as e:
        reg.unregister("honesty")
    assert http_status(e.value) == 404


def test_registered_vector_is_a_float32_copy():
    v = torch.ones(H, dtype=torch.float64)
    entry = VectorRegistry().register("v", v)
    v.zero_()
    assert entry.vector.dtype == torch.float32 and entry.vector.tolist() == [1.0] * H


@pytest.mark.parametrize(
    "value",
    [[0.25] * H, pack_tensor(torch.full((H,), 0.25, dtype=torch.bfloat16))],
    ids=["list", "packed"],
)
def test_register_from_wire_values(value):
    entry = VectorRegistry().register("v", value)
    assert entry.vector.tolist() == [0.25] * H


def test_two_dim_value_is_per_layer_by_row():
    rows = torch.randn(3, H)
    entry = VectorRegistry().register("v", rows.tolist())
    assert entry.layers == [0, 1, 2]
    assert torch.equal(vector_for_layer(entry, 2), rows[2])
    one_row = VectorRegistry().register("one", [[1.0] * H])
    assert one_row.layers is None and one_row.vector.tolist() == [1.0] * H


def test_overwrite():
    reg = VectorRegistry()
    reg.register("v", [1.0] * H)
    with pytest.raises(InvalidRequestError, match=r"already registered.*overwrite"):
        reg.register("v", [2.0] * H)
    assert reg.get("v").vector[0] == 1.0
    reg.register("v", [2.0] * H, overwrite=True)
    assert reg.get("v").vector[0] == 2.0


def test_unknown_name_lists_registered_ones():
    reg = VectorRegistry()
    with pytest.raises(InvalidRequestError, match=r"unknown vector name 'x'; registered: \(none\)"):
        reg.get("x")
    reg.register("b", [1.0])
    reg.register("a", [1.0])
    with pytest.raises(InvalidRequestError, match="unknown vector name 'x'; registered: a, b"):
        reg.get("x")


def test_wrong_hidden_size_is_rejected():
    reg = VectorRegistry(hidden_size=H)
    with pytest.raises(InvalidRequestError, match=f"hidden size 7; the model's hidden size is {H}"):
        reg.register("v", [1.0] * 7)
    with pytest.raises(InvalidRequestError, match="hidden size 7"):
        reg.register("v", {0: [1.0] * 7})
    assert "v" not in reg


def test_layers_past_the_model_are_rejected():
    reg = VectorRegistry(hidden_size=H, num_layers=4)
    with pytest.raises(InvalidRequestError, match=r"layer\(s\) 4, 9; the model has layers 0-3"):
        reg.register("v", {1: [1.0] * H, 4: [1.0] * H, 9: [1.0] * H})


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("", [1.0], "invalid vector name"),
        ("has space", [1.0], "invalid vector name"),
        ("x" * 129, [1.0], "invalid vector name"),
        (3, [1.0], "invalid vector name"),
        ("v", [1.0, float("nan")], "vector 'v' contains NaN or Inf"),
        ("v", {2: [1.0, float("inf")]}, "vector 'v' layer 2 contains NaN or Inf"),
        ("v", {0: [1.0] * 3, 1: [1.0] * 4}, "sizes differ"),
        ("v", {}, "no layers"),
        ("v", {"first": [1.0]}, "layer indices"),
        ("v", {-1: [1.0]}, ">= 0"),
        ("v", {0: [[1.0], [2.0]]}, r"must be one vector \[H\]"),
        ("v", {0: [1.0], "0": [1.0]}, "layer 0 is given twice"),
        ("v", [[1.0, 2.0], [3.0]], "ragged"),
    ],
)
def test_register_rejects(name, value, match):
    reg = VectorRegistry()
    with pytest.raises(InvalidRequestError, match=match):
        reg.register(name, value)
    assert len(reg) == 0


def test_valid_names():
    reg = VectorRegistry()
    for name in ("a", "repeng/happy:v2", "x" * 128, "A-b_c.d"):
        reg.register(name, [1.0])
    assert len(reg) == 4


def test_vector_for_layer():
    reg = VectorRegistry()
    single = reg.register("s", [1.0] * H)
    assert vector_for_layer(single, 17).tolist() == [1.0] * H
    per = reg.register("p", {5: [2.0] * H, 7: [3.0] * H})
    assert vector_for_layer(per, 7).tolist() == [3.0] * H
    with pytest.raises(InvalidRequestError, match=r"'p' has no direction for layer 6; .* 5, 7"):
        vector_for_layer(per, 6)


def test_concurrent_registration():
    reg = VectorRegistry()

    def work(i):
        for j in range(50):
            reg.register(f"v{i}.{j}", [float(j)])
            reg.get(f"v{i}.{j}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg) == 400 and len(reg.list()) == 400


# -- GGUF control vectors ------------------------------------------------------------------


def test_gguf_import_maps_direction_l_to_layer_l(tmp_path):
    rng = np.random.default_rng(0)
    dirs = {layer: rng.standard_normal(H).astype(np.float32) for layer in (1, 2, 5, 11)}
    path = write_repeng_gguf(tmp_path / "happy.gguf", dirs)

    loaded = load_gguf_control_vector(path)
    assert list(loaded) == [1, 2, 5, 11]
    for layer, d in dirs.items():
        assert torch.equal(loaded[layer], torch.from_numpy(d))

    reg = VectorRegistry(hidden_size=H, num_layers=12)
    entry = reg.import_file("happy", path)
    assert entry.source == str(path) and entry.layers == [1, 2, 5, 11]
    # direction.5 steers the output of decoder layer 5: our post_block of layer 5.
    assert torch.equal(vector_for_layer(entry, 5), torch.from_numpy(dirs[5]))
    with pytest.raises(InvalidRequestError, match="no direction for layer 0"):
        vector_for_layer(entry, 0)


def test_gguf_import_rejects_bad_files(tmp_path):
    def write(name, tensors):
        p = tmp_path / name
        w = gguf.GGUFWriter(str(p), "controlvector")
        for k, v in tensors.items():
            w.add_tensor(k, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return p

    with pytest.raises(InvalidRequestError, match=r"no direction\.<layer> tensors"):
        load_gguf_control_vector(write("empty.gguf", {}))
    with pytest.raises(InvalidRequestError, match=r"unexpected tensor 'token_embd\.weight'"):
        load_gguf_control_vector(write("model.gguf", {"token_embd.weight": np.ones(H, "f4")}))
    with pytest.raises(InvalidRequestError, match="must be 1-D"):
        load_gguf_control_vector(write("2d.gguf", {"direction.1": np.ones((2, H), "f4")}))
    with pytest.raises(InvalidRequestError, match="sizes differ"):
        load_gguf_control_vector(
            write("sizes.gguf", {"direction.1": np.ones(H, "f4"), "direction.2": np.ones(4, "f4")})
        )
    with pytest.raises(InvalidRequestError, match="type I32"):
        load_gguf_control_vector(write("int.gguf", {"direction.1": np.ones(H, "i4")}))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(InvalidRequestError, match="not a readable GGUF file"):
        load_gguf_control_vector(junk)


# -- safetensors ---------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["direction.", "layers.", ""])
def test_safetensors_per_layer_keys(tmp_path, prefix):
    dirs = {3: torch.randn(H), 10: torch.randn(H)}
    path = tmp_path / "v.safetensors"
    save_file({f"{prefix}{layer}": d for layer, d in dirs.items()}, str(path))
    loaded = load_safetensors_vectors(path)
    assert list(loaded) == [3, 10]
    assert all(torch.equal(loaded[layer], dirs[layer]) for layer in dirs)


def test_safetensors_single_vector_any_key(tmp_path):
    v = torch.randn(H, dtype=torch.bfloat16)
    path = tmp_path / "v.safetensors"
    save_file({"refusal_direction": v}, str(path))
    loaded = load_safetensors_vectors(path)
    assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, v.float())
    entry = VectorRegistry().import_file("refusal", path)
    assert entry.layers is None and torch.equal(entry.vector, v.float())


def test_safetensors_layer_matrix_is_per_layer_by_row(tmp_path):
    m = torch.randn(4, H)
    path = tmp_path / "v.safetensors"
    save_file({"directions": m}, str(path))
    loaded = load_safetensors_vectors(path)
    assert list(loaded) == [0, 1, 2, 3] and torch.equal(loaded[2], m[2])
    entry = VectorRegistry().import_file("m", path)
    assert torch.equal(vector_for_layer(entry, 3), m[3])


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"a": torch.randn(H), "b": torch.randn(H)}, "unrecognised keys: a, b"),
        ({"direction.1": torch.randn(H), "bias": torch.randn(H)}, "unrecognised keys: bias"),
        ({"x": torch.randn(2, 3, H)}, r"must be \[H\] or \[num_layers, H\]"),
        ({"direction.1": torch.randn(2, H)}, "must be 1-D"),
        ({"1": torch.randn(H), "2": torch.randn(4)}, "sizes differ"),
        ({"1": torch.randn(H), "layers.1": torch.randn(H)}, "layer 1 appears twice"),
        ({"x": torch.arange(H)}, "must hold floats"),
    ],
)
def test_safetensors_rejects(tmp_path, tensors, match):
    path = tmp_path / "v.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(InvalidRequestError, match=match):
        load_safetensors_vectors(path)


def test_import_file_checks_path_and_suffix(tmp_path):
    reg = VectorRegistry()
    with pytest.raises(InvalidRequestError, match="does not exist"):
        reg.import_file("v", tmp_path / "missing.gguf")
    other = tmp_path / "v.pt"
    other.write_bytes(b"")
    with pytest.raises(InvalidRequestError, match=r"expected a \.gguf or \.safetensors"):
        reg.import_file("v", other)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 3)
    with pytest.raises(InvalidRequestError, match="not a readable safetensors file"):
        reg.import_file("v", junk)
    assert len(reg) == 0
