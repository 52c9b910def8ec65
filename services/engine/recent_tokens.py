"""The sampled tokens of the last steps, on the device, for the placeholders of the next.

With overlapped steps a sequence's newest token may still be on the device when the step
that feeds it back is launched: the scheduler hands it over as PLACEHOLDER, and the first
pipeline stage (the only one that embeds tokens) fills it in on the device from the step
that sampled it. `RecentTokens` keeps those steps' token tensors, and for each one which
sequence sits in which row.

- One process, or tensor parallelism: every rank samples the tokens itself (`add`).
- Pipeline stages: the last stage sends each step's tokens to the first on the device.
  With one part a step (`lookback` 1) the next step feeds back every token the step
  sampled, so the first stage takes them as soon as its own part of the step is queued.
  With M microbatches (`lookback` M) a step's tokens are fed back M steps later, and the
  steps between carry other parts: the first stage takes a step's tokens only when
  launching the step M later (`expect`, then `receive_through`), so its stream does not
  wait for the last stage between parts, and through a group of its own, so that wait
  is not ordered behind the stage hand-offs either way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class RecentTokens:
    """The last `lookback` steps' sampled tokens, newest last (see the module docstring)."""

    def __init__(self, lookback: int = 1):
        self.lookback = lookback
        self._steps: deque[tuple[torch.Tensor, dict[int, int]]] = deque()
        # First pipeline stage: steps whose tokens the last stage sends, not yet received,
        # as (launch number, how many, each sequence's row).
        self._expected: deque[tuple[int, int, dict[int, int]]] = deque()
        self._source: torch.Tensor | None = None  # what `rows_for`'s rows index
        self._sends: deque[Any] = deque()  # last stage: sends still under way (their works)

    def add(self, token_ids: torch.Tensor, rows: dict[int, int]) -> None:
        """A step's sampled tokens (device) and each sequence's row in them."""
        self._steps.append((token_ids, rows))
        while len(self._steps) > self.lookback:
            self._steps.popleft()

    def sent(self, work: Any) -> None:
        """Last pipeline stage: a send to the first stage left under way (None: done). The
        first stage takes each within `lookback` launches, so older ones are waited on."""
        if work is not None:
            self._sends.append(work)
        while len(self._sends) > self.lookback + 1:
            self._sends.popleft().wait()

    def expect(self, launch: int, count: int, rows: dict[int, int]) -> None:
        """First pipeline stage: launch `launch` samples `count` tokens on the last stage."""
        self._expected.append((launch, count, rows))

    def receive_through(self, launch: int, recv: Callable[[int], torch.Tensor]) -> None:
        """Take the tokens of every expected launch up to `launch`, in order (`recv(n)`)."""
        while self._expected and self._expected[0][0] <= launch:
            _, count, rows = self._expected.popleft()
            self.add(recv(count), rows)

    def rows_for(self, seq_ids: list[int], out: np.ndarray) -> None:
        """`out[i]` = the row of sequence `seq_ids[i]`'s newest token in `source()`."""
        steps = self._steps
        if len(steps) == 1:
            rows = steps[0][1]
            out[:] = [rows[s] for s in seq_ids]
            self._source = steps[0][0]
            return
        offsets = np.cumsum([0] + [len(ids) for ids, _ in steps])
        for i, s in enumerate(seq_ids):
            for k in range(len(steps) - 1, -1, -1):  # the newest step that sampled it
                j = steps[k][1].get(s)
                if j is not None:
                    out[i] = offsets[k] + j
                    break
            else:
                raise KeyError(f"sequence {s} has a placeholder no recent step sampled")
        self._source = torch.cat([ids for ids, _ in steps])

    def fill(self, input_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """`input_ids[i]` = the token at row `rows[i]` of the last `rows_for`'s tokens,
        where `rows[i]` >= 0 (on the device, in the stream)."""
        assert self._source is not None, "a placeholder token with no step before it"
        prev = self._source[rows.clamp(min=0)]
        input_ids.copy_(torch.where(rows >= 0, prev, input_ids))
