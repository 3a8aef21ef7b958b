"""Async scheduling's pipeline: what lies between two of the engine core's steps.

Under `--async-scheduling` the core launches step N+1 before it reads step N's tokens, so the
host's bookkeeping for N overlaps the device's work on N+1 (the runner takes N+1's inputs from
N's tokens on the device). Between two calls of `EngineCore.step` this is the whole state of
that overlap, in three public fields:

- `in_flight`: the launched step whose tokens the host has not read yet (a `Launch`, or a
  `SpeculativeLaunch` with drafting on); None while steps run one at a time.
- `next_drafts`: the drafts decided for the next launched step (`DraftLength.next`), kept
  until a step is launched: a step() that only reads the one in flight launches nothing, and a
  decision taken twice would count the same probe twice.
- `received_at`: when the last launched step's tokens reached the host (`time.perf_counter`),
  where the next step's period starts for the draft length.

Without async scheduling `in_flight` stays None and `next_drafts` only carries a decision from
one step to the same step's launch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jetserve.engine.runner import Launch, SpeculativeLaunch
from jetserve.engine.spec_decode import DraftLength


@dataclass
class Pipeline:
    in_flight: Launch | SpeculativeLaunch | None = None
    next_drafts: int | None = None
    received_at: float = 0.0

    def drafts(self, draft_length: DraftLength | None) -> int:
        """The drafts the next launched step proposes: decided once, kept until `launched`."""
        if draft_length is None:
            return 0
        if self.next_drafts is None:
            self.next_drafts = draft_length.next()
        return self.next_drafts

    def launched(self) -> None:
        """A step was launched with `next_drafts`: the step after it decides afresh."""
        self.next_drafts = None

    def take(self) -> Launch | SpeculativeLaunch | None:
        """The step in flight, which the caller now reads; none is left in flight."""
        launch, self.in_flight = self.in_flight, None
        return launch

    def period(self, launch: Launch | SpeculativeLaunch) -> float:
        """Seconds from the previous step's tokens (or from `launch`'s launch, if later) to now,
        when `launch`'s tokens are read: the pipeline's period, what a token costs when steps
        overlap. Now becomes `received_at`."""
        now = time.perf_counter()
        seconds = now - max(launch.launched_at, self.received_at)
        self.received_at = now
        return seconds
