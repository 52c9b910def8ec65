"""Hook sites: where in a decoder layer an intervention reads or writes the residual stream.

| Coxswain     | TransformerLens            | Hugging Face                             |
|--------------|----------------------------|------------------------------------------|
| `pre_attn`   | `blocks.L.hook_resid_pre`  | `hidden_states[L]`: input of layer L     |
| `post_attn`  | `blocks.L.hook_resid_mid`  | input + self-attention output of layer L |
| `post_block` | `blocks.L.hook_resid_post` | `hidden_states[L + 1]`: output of layer L |

(HF's last `hidden_states` entry is after the final norm; our last `post_block` is before.)

A full TransformerLens hook name (`blocks.3.hook_resid_post`) names a layer as well as a
site; where a site is named beside its layer(s), the spec schema (`spec.py`) takes the
layer from the name (`tl_hook`), or requires it to agree with the layer given.
"""

from __future__ import annotations

import re

from services.common.errors import InvalidRequestError

SITES: tuple[str, ...] = ("pre_attn", "post_attn", "post_block")

SITE_ALIASES: dict[str, str] = {
    "hook_resid_pre": "pre_attn",
    "resid_pre": "pre_attn",
    "hook_resid_mid": "post_attn",
    "resid_mid": "post_attn",
    "hook_resid_post": "post_block",
    "resid_post": "post_block",
}


_TL_HOOK = re.compile(r"blocks\.(\d+)\.(hook_resid_(?:pre|mid|post))")


def tl_hook(name: object) -> tuple[str, int] | None:
    """(site, layer) of a full TransformerLens hook name (`blocks.3.hook_resid_post` ->
    `("post_block", 3)`), else None."""
    match = _TL_HOOK.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    return SITE_ALIASES[match.group(2)], int(match.group(1))


def parse_site(name: object) -> str:
    """The canonical name of a site (ours or a TransformerLens alias), else InvalidRequestError."""
    if isinstance(name, str):
        if name in SITES:
            return name
        if name in SITE_ALIASES:
            return SITE_ALIASES[name]
    hook = tl_hook(name)
    if hook is not None:
        raise InvalidRequestError(
            f"site {name!r} names a layer, which this field does not take: name the site "
            f"({hook[0]}) and give the layer where the layers go"
        )
    raise InvalidRequestError(
        f"unknown site {name!r}: use one of {', '.join(SITES)} "
        f"(or TransformerLens {', '.join(sorted(SITE_ALIASES))}, or blocks.<layer>.hook_resid_*"
        " beside a layer)"
    )


def site_key(layer: int, site: str) -> str:
    """The name a (layer, site) goes by in captures and read-outs: `"<layer>.<site>"`."""
    return f"{layer}.{site}"
