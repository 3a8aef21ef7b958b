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

Three more fields clock the host's share of an overlapped decode step for the step-cost table
(`DecodeCosts.observe_host`): from one step() to the next (`began`), less the time spent waiting
for the device (`waited`), when that step() read a decode step and launched the next one
(`steady`: the steady state, where the device's and the host's work overlap).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from jetserve.engine.draft_policy import DraftPolicy
from jetserve.engine.runner import Launch, SpeculativeLaunch
from jetserve.engine.step_cost import DecodeCosts


@dataclass
class Pipeline:
    in_flight: Launch | SpeculativeLaunch | None = None
    next_drafts: int | None = None
    began: float = 0.0  # when the current step() began
    waited: float = 0.0  # of it, seconds spent waiting for the device
    steady: tuple[int, int] | None = None  # (k, sequences) of the decode step it read while it launched the next

    def tick(self, costs: DecodeCosts | None) -> None:
        """A step() begins: the previous one's host time goes to `costs`, if it was steady."""
        now = time.perf_counter()
        if self.steady is not None and costs is not None:
            costs.observe_host(*self.steady, now - self.began - self.waited)
        self.began, self.waited, self.steady = now, 0.0, None

    def wait(self, launch: Launch | SpeculativeLaunch) -> None:
        """Wait for a launched step's result, the time kept apart from the host's."""
        began = time.perf_counter()
        launch.wait()
        self.waited += time.perf_counter() - began

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
