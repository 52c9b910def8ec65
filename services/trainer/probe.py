"""One hack direction for train time and serve time: a residual-stream probe.

A run's hack pairs (`GRPOConfig.hack_pairs_from`; with personas, the base's own answers when
asked for the shortcut and for honest work) are replayed through the rollout engine with
`capture` at one (layer, site); the probe is the difference of the mean residual over the
hacking answers' tokens and over the honest ones', unit-normalised, with the midpoint's
projection as its offset (so `score > 0` leans hacking).

The probe is a plain `[H]` vector, so it goes into any engine's vector registry
(`PUT /v1/vectors/{name}`, `register_vector`) and a served model reads it out
(`readouts`) or gates on it (`abort_when`) like any other probe. The trainer registers it
in its rollout engine, writes it to `hack_probe.json` in the run directory, reports its
AUROC as a monitor on each evaluation's rollouts, and (`activation_space: residual`) lets
Arm B flag rollouts by the very same read-outs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.errors import InvalidRequestError
from services.engine import SamplingParams
from services.engine.outputs import RequestOutput
from services.trainer.envs import ContrastivePair

PROBE_FILE = "hack_probe.json"

Generate = Callable[[list[str], SamplingParams], list[RequestOutput]]


@dataclass(frozen=True)
class HackProbe:
    """A unit `[H]` direction read at (`layer`, `site`), and the score's zero point."""

    name: str
    layer: int
    site: str
    vector: torch.Tensor
    offset: float

    def readout(self) -> dict[str, Any]:
        """The `readouts` entry that reads this probe from a registry holding it by name."""
        return {"probe": self.name, "layer": self.layer, "site": self.site, "name": self.name}

    def score(self, readouts: Sequence[dict[str, float]]) -> float:
        """A completion's score: the mean read-out over its tokens, minus the offset."""
        values = [r[self.name] for r in readouts if self.name in r]
        if not values:
            raise InvalidRequestError(f"no '{self.name}' read-outs to score")
        return sum(values) / len(values) - self.offset

    def to_json(self) -> dict[str, Any]:
        """`value` is the body `PUT /v1/vectors/{name}` takes; the rest says where to read it."""
        return {
            "name": self.name,
            "layer": self.layer,
            "site": self.site,
            "offset": self.offset,
            "value": self.vector.tolist(),
        }

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / PROBE_FILE
        path.write_text(json.dumps(self.to_json()) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> HackProbe:
        d = json.loads(Path(path).read_text())
        vector = torch.tensor(d["value"], dtype=torch.float32)
        return cls(d["name"], int(d["layer"]), d["site"], vector, float(d["offset"]))


def extract_probe(
    generate: Generate,
    tokenizer: Any,
    pairs: Sequence[ContrastivePair],
    *,
    layer: int,
    site: str = "post_block",
    name: str = "hack",
) -> HackProbe:
    """The difference-in-means probe of `pairs` at (`layer`, `site`).

    Each pair's prompt is run with each answer appended (all in one batch, `max_tokens=1`),
    capturing the residual over the prompt; a row's answer is its last tokens (as many as
    the answer encodes to: exact for the character-level tokenizers of the gameable envs).
    No label is read.
    """
    if len(pairs) < 2:
        raise InvalidRequestError(f"a probe needs at least 2 pairs, got {len(pairs)}")
    key = f"{layer}.{site}"
    params = SamplingParams(
        max_tokens=1, temperature=0.0, capture={"sites": {site: [layer]}, "positions": "all_prompt"}
    )
    rows = [
        (p.prompt + a, len(tokenizer.encode(a, add_special_tokens=False)), side)
        for p in pairs
        for side, a in ((0, p.hacking.strip()), (1, p.clean.strip()))
        if a
    ]
    if {side for _, _, side in rows} != {0, 1}:
        raise InvalidRequestError("every answer of one side of the pairs is empty")
    outs = generate([text for text, _, _ in rows], params)  # both sides in one batch
    means = [o.captures[key][-n:].float().mean(0) for o, (_, n, _) in zip(outs, rows, strict=True)]  # type: ignore[index]
    hack, clean = (
        torch.stack([m for m, (_, _, side) in zip(means, rows, strict=True) if side == s]).mean(0)
        for s in (0, 1)
    )
    diff = hack - clean
    norm = diff.norm()
    if not norm > 0:
        raise InvalidRequestError("the hack probe is zero: both sides of the pairs agree")
    vector = (diff / norm).cpu()
    midpoint = (hack + clean).cpu() / 2
    return HackProbe(name, layer, site, vector, float(midpoint @ vector))
