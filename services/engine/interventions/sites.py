"""Hook sites: where in a decoder layer an intervention reads or writes the residual stream.

| Coxswain     | TransformerLens            | Hugging Face                             |
|--------------|----------------------------|------------------------------------------|
| `pre_attn`   | `blocks.L.hook_resid_pre`  | `hidden_states[L]`: input of layer L     |
| `post_attn`  | `blocks.L.hook_resid_mid`  | input + self-attention output of layer L |
| `post_block` | `blocks.L.hook_resid_post` | `hidden_states[L + 1]`: output of layer L |

(HF's last `hidden_states` entry is after the final norm; our last `post_block` is before.)
"""

from __future__ import annotations

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


def parse_site(name: object) -> str:
    """The canonical name of a site (ours or a TransformerLens alias), else InvalidRequestError."""
    if isinstance(name, str):
        if name in SITES:
            return name
        if name in SITE_ALIASES:
            return SITE_ALIASES[name]
    raise InvalidRequestError(
        f"unknown site {name!r}: use one of {', '.join(SITES)} "
        f"(or TransformerLens {', '.join(sorted(SITE_ALIASES))})"
    )


def site_key(layer: int, site: str) -> str:
    """The name a (layer, site) goes by in captures and read-outs: `"<layer>.<site>"`."""
    return f"{layer}.{site}"
