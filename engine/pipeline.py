"""Async scheduling's pipeline: what lies between two of the engine core's steps.

Under `--async-scheduling` the core launches step N+1 before it reads step N's tokens, so the
host's bookkeeping for N overlaps the device's work on N+1 (the runner takes N+1's inputs from
N's tokens on the device). Between two calls of `EngineCore.step` this is the whole state of
that overlap, in two public fields:

- `in_flight`: the launched step whose tokens the host has not read yet (a `Launch`, or a
  `SpeculativeLaunch` with drafting on); None while steps run one at a time.
- `next_drafts`: the drafts decided for the next launched step (`DraftPolicy.next`), kept
  until a step is launched: a step() that only reads the one in flight launches nothing, and a
  decision taken twice would count the same probe twice.

Without async scheduling `in_flight` stays None and `next_drafts` only carries a decision from
one step to the same step's launch.
"""

from __future__ import annotations

from dataclasses import dataclass

from jetserve.engine.draft_policy import DraftPolicy
from jetserve.engine.runner import Launch, SpeculativeLaunch


@dataclass
class Pipeline:
    in_flight: Launch | SpeculativeLaunch | None = None
    next_drafts: int | None = None

    def drafts(self, policy: DraftPolicy | None, batch: int) -> int:
        """The drafts the next launched step (of about `batch` sequences) proposes: decided once,
        kept until `launched`."""
        if policy is None:
            return 0
        if self.next_drafts is None:
            self.next_drafts = policy.next(batch)
        return self.next_drafts

    def launched(self) -> None:
        """A step was launched with `next_drafts`: the step after it decides afresh."""
        self.next_drafts = None

    def take(self) -> Launch | SpeculativeLaunch | None:
        """The step in flight, which the caller now reads; none is left in flight."""
        launch, self.in_flight = self.in_flight, None
        return launch
