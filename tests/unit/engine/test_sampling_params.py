from __future__ import annotations

import pytest

from services.common.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_values_name_the_field(kwargs, names):
    with pytest.raises(InvalidRequestError, match=names):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ["###"] and p.top_k == 0 and p.greedy
    assert isinstance(InvalidRequestError("x"), ValueError)


def test_transformerlens_hook_names_carry_their_layer():
    params = SamplingParams(
        steering={"vectors": [{"site": "blocks.1.hook_resid_mid", "vector": "v"}]},
        capture={"sites": {"blocks.0.hook_resid_post": "all", "resid_post": [1]}},
        readouts=[{"site": "blocks.1.hook_resid_pre", "probe": "v"}],
        patch=[{"site": "blocks.0.hook_resid_post", "position": 2, "source": {"zeros": True}}],
    )
    vec = params.steering.vectors[0]
    assert (vec.site, vec.layers) == ("post_attn", [1])
    assert params.capture.sites == {"post_block": [0, 1]}
    assert (params.readouts[0].site, params.readouts[0].layer) == ("pre_attn", 1)
    assert (params.patch[0].site, params.patch[0].layer) == ("post_block", 0)
    with pytest.raises(InvalidRequestError, match="names layer 1, but layer is 0"):
        SamplingParams(readouts=[{"site": "blocks.1.hook_resid_pre", "layer": 0, "probe": "v"}])
