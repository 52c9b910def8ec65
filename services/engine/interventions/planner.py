"""One step's interventions as tensors: what each site of the forward pass does.

The planner (in `manager.py`) turns the scheduler's output into per-token index tensors;
the model calls `StepInterventions.apply(layer, site, h)` at every site, which — in the
order the design fixes — captures the pristine residual, evaluates read-out probes on
it, patches the rows a patch lands on, then runs the fused steer/monitor/gate op where
anything is installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.engine.interventions.resolve import ProbeRead, SiteKey
from services.engine.interventions.tables import SteeringTables
from services.engine.kernels.patch import patch
from services.engine.kernels.steer import steer


@dataclass
class SteerTokens:
    """Each token's inputs to the fused steer op, planned on the host. The runner writes them
    into the step batch (`StepBatch` fields `steer_*`), uploaded with everything else, and
    binds the device views to the step's `StepInterventions`."""

    rows: np.ndarray  # [T] int32: each token's steering row
    latched: np.ndarray  # [T] int32: latched gate bits of each token's request
    decode: np.ndarray  # [T] float32: 1 on decode tokens
    gain: np.ndarray  # [T] float32: dynamic-tier gain (0 on prefill tokens)


@dataclass
class StepInterventions:
    tables: SteeringTables
    kernel_sites: set[SiteKey]
    steer_tokens: SteerTokens | None  # None when no site runs the steer op this step
    capture_index: dict[SiteKey, torch.Tensor] = field(default_factory=dict)  # rows to copy
    # per (layer, site): (request id, positions) of the copied rows, in row order
    capture_meta: dict[SiteKey, list[tuple[str, list[int]]]] = field(default_factory=dict)
    readout_index: dict[SiteKey, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # rows [n], probes [n, H]
    readout_meta: dict[SiteKey, list[tuple[int, ProbeRead]]] = field(default_factory=dict)
    # rows [P], targets [P, H], alpha [P] of the patches that land in this step
    patch_index: dict[SiteKey, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )
    view_sites: set[SiteKey] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.captured: dict[SiteKey, torch.Tensor] = {}
        self.scores: dict[SiteKey, torch.Tensor] = {}
        self.view: dict[SiteKey, torch.Tensor] = {}

    def touches(self, layer: int, site: str) -> bool:
        """Whether anything happens at (layer, site) this step (else the model may fuse
        across it)."""
        key = (layer, site)
        return key in self.kernel_sites or self._reads_or_patches(key)

    def _reads_or_patches(self, key: SiteKey) -> bool:
        """Whether something at `key` reads the residual (capture, read-out, a consumer's
        view) or replaces rows of it (a patch)."""
        return (
            key in self.capture_index
            or key in self.readout_index
            or key in self.patch_index
            or key in self.view_sites
        )

    def bind(
        self, rows: torch.Tensor, latched: torch.Tensor, decode: torch.Tensor, gain: torch.Tensor
    ) -> None:
        """The device views of `steer_tokens` in the uploaded step batch (each [T])."""
        self.rows, self.latched, self.decode, self.dyn_gain = rows, latched, decode, gain
        self.fired = torch.zeros_like(latched)  # [T] int32: gate bits that fired

    def apply(
        self, layer: int, site: str, h: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """capture → read-outs and monitor → patch → steer at one site; [T, H].

        Probes (read-outs, the monitor, gates) read the pristine `h`; steering adds onto the
        patched residual. `add`: the residual add before the site, still to do (the residual
        is `h + add`); the steer op does it itself when it is all that runs here.
        """
        key = (layer, site)
        if add is not None and (key not in self.kernel_sites or self._reads_or_patches(key)):
            h, add = h + add, None
        idx = self.capture_index.get(key)
        if idx is not None:
            self.captured[key] = h.index_select(0, idx)
        if key in self.view_sites:
            self.view[key] = h  # the op below is out of place, so `h` stays pristine
        read = self.readout_index.get(key)
        if read is not None:
            rows, probes = read
            self.scores[key] = (h.index_select(0, rows).float() * probes).sum(-1)
        patched = None
        if key in self.patch_index:
            patched = patch(h, *self.patch_index[key])
        if key in self.kernel_sites:
            return steer(
                h,
                self.rows,
                self.decode,
                dyn_gain=self.dyn_gain,
                latched=self.latched,
                fired=self.fired,
                base=patched,
                add=add,
                **self.tables.site_args(layer, site),
            )
        return h if patched is None else patched
