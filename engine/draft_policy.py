"""How many tokens to draft next step: the k that emits the most tokens a second.

The rules, all of them:

1. Acceptance per draft position: alpha_i, the chance that draft i is accepted once drafts
   1..i-1 were. A decayed estimate: each verification that reached position i (drafted it, all
   before it accepted) is one trial of it, a hit if accepted; earlier trials and hits of that
   position are discounted by 1 - 1/acceptance_window each time. It starts at PRIOR = 1 (every
   draft accepted), worth one trial, so a new workload drafts from its first step wherever the
   table says drafting can pay, and its first estimates come from drafts made with the MTP pass's
   whole context (see "Off costs nothing" below: a policy that started pessimistic, off, would
   learn only from probes, which under-rate acceptance, and could stay off where drafting pays).
2. Tokens a sequence gains from a step that verifies k drafts: E_k = 1 + sum_{j<=k} prod_{i<=j} alpha_i.
3. Step time T(k, b): the step-cost table (step_cost.DecodeCosts) at the batch bucket of b
   sequences, the longer of the device's time (measured when the engine captured or compiled its
   steps) and the host's (observed on the steps that overlapped the device); T(0, b) is a plain
   decode. Where the host is the longer, a draft costs little more than it does.
4. Each step drafts k = argmax E_k / T(k, b) over 0..k_max (the smaller k on a tie): off (0)
   where no k beats plain decoding.
5. The argmax learns only about the positions it drafts, so every N-th step drafts one more
   (off: one), N such that these probes cost at most PROBE_SHARE of the time even when none of
   their drafts is accepted: a probe turns two steps of T(k) into about T(k+1) (it proposes
   k+1, the next step verifies them), so N = 2 (T(k+1) - T(k)) / (PROBE_SHARE T(k)), at least
   MIN_PROBE_EVERY (a probe out of plain decoding leaves the async pipeline, which the table
   does not price) and at most MAX_PROBE_EVERY.
6. Where drafting cannot pay even with every draft accepted (E_k = k + 1) at any batch bucket
   on the device's times, it stays off with no probes, and prompts skip the MTP pass too
   (`hopeless`).
7. Fixed k (`adaptive` false): every step drafts k_max. k_max is num_speculative_tokens; the
   live control lowers it (set_max), 0 turns drafting off.

Off costs nothing: a plain decode skips the MTP pass, so the MTP KV cache lacks the positions
decoded while off, and a probe's drafts see part of their context: while off, acceptance is
under-rated if anything.
"""

from __future__ import annotations

import math

from jetserve.engine.step_cost import DecodeCosts

PRIOR = 1.0  # alpha of a position never verified (rule 1)
PROBE_SHARE = 0.01
MIN_PROBE_EVERY, MAX_PROBE_EVERY = 64, 4096


class DraftPolicy:
    def __init__(self, k_max: int, adaptive: bool = True, costs: DecodeCosts | None = None,
                 acceptance_window: int = 64):
        self.adaptive, self.costs, self.window = adaptive, costs, acceptance_window
        self.set_max(k_max)

    def set_max(self, k_max: int) -> None:
        """The most drafts a step (0: off); acceptance is forgotten (see reset)."""
        self.k_max = self.k = k_max
        self.reset()

    def reset(self) -> None:
        """Forget acceptance and the choices made, keep the costs: a new workload."""
        self.hits = [PRIOR] * self.k_max
        self.trials = [1.0] * self.k_max
        self.chosen = [0] * (self.k_max + 1)  # steps that drafted each k (probes included)
        self.steps = 0

    def record(self, drafted: int, accepted: int) -> None:
        """One sequence's verification: `accepted` of its `drafted` drafts were."""
        keep = 1 - 1 / self.window
        for i in range(min(drafted, accepted + 1, self.k_max)):
            self.hits[i] = self.hits[i] * keep + (i < accepted)
            self.trials[i] = self.trials[i] * keep + 1

    @property
    def alphas(self) -> list[float]:
        return [h / t for h, t in zip(self.hits, self.trials)]

    def expected_tokens(self, k: int) -> float:
        """E_k (rule 2)."""
        expected = reach = 1.0
        for alpha in self.alphas[:k]:
            reach *= alpha
            expected += reach
        return expected

    def best(self, batch: int) -> int:
        """The argmax of rule 4."""
        rates = [self.expected_tokens(k) / self.costs.seconds(k, batch) for k in range(self.k_max + 1)]
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    def probe_every(self, k: int, batch: int) -> int:
        """N of rule 5, for a probe of k + 1 beside k."""
        here, there = self.costs.seconds(k, batch), self.costs.seconds(k + 1, batch)
        if not math.isfinite(there):
            return MAX_PROBE_EVERY
        n = math.ceil(2 * (there - here) / (PROBE_SHARE * here))
        return min(max(n, MIN_PROBE_EVERY), MAX_PROBE_EVERY)

    @property
    def hopeless(self) -> bool:
        """Rule 6: no k pays at any bucket even if every draft is accepted."""
        if not self.adaptive or self.costs is None:
            return self.k_max == 0
        return not self.costs.could_pay(self.k_max)

    def by_bucket(self) -> list[tuple[int, int, list[float]]]:
        """For each batch bucket of the table: the k a step of that many would draft now, and
        its T(k) for k = 0..k_max as priced (device or host, the longer; 0.0 where the device's
        was not measured): why drafting is on or off."""
        if self.costs is None:
            return []
        return [(b, (0 if self.hopeless else self.best(b)) if self.adaptive and self.k_max else self.k_max,
                 [t if math.isfinite(t) else 0.0 for t in (self.costs.seconds(k, b) for k in range(self.k_max + 1))])
                for b in self.costs.buckets]

    def next(self, batch: int) -> int:
        """The drafts the next step proposes, for a step of about `batch` decoding sequences."""
        self.steps += 1
        k = self.k_max
        if self.adaptive and self.costs is not None and self.k_max:
            if self.hopeless:
                self.k = k = 0
            else:
                self.k = k = self.best(batch)
                if k < self.k_max and self.steps % self.probe_every(k, batch) == 0:
                    k += 1
        self.chosen[k] += 1
        return k
