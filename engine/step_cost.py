"""What steps cost: a prefill step's time predicted from its shape (`StepCost`), so that prefill
chunks are sized by time, not by a token count; and a decode step's time measured for each draft
length and batch bucket, the device's and the host's (`DecodeCosts`), which the draft policy
reads.

A fixed token budget is the wrong unit for the streams decoding beside a long prompt: a chunk at
context 0 is cheap, the same chunk deep in the prompt pays attention over all of it, and every
step pays a fixed floor (the streams' decode, the host), so small chunks pay that floor many
times. The scheduler instead asks this model for the largest chunk that keeps the step under a
latency target (`--max-step-latency-ms`): early chunks come out large, late ones small.

A step's time is modelled as  t = a + b * tokens + c * tile_keys:
tokens, the rows its matmuls compute (padded up to its CUDA graph's token bucket); tile_keys,
the flash prefill kernel's work: for every query tile of `PREFILL_BLOCK_M` rows, the keys it
walks (a decode beside the chunks is the paged decode kernel's, no tile: its cost, nearly the
same at every step of a prompt, falls to the other terms). The coefficients are fitted online from the times
the engine observes, by least squares over the last `WINDOW` steps with prefill chunks,
Huber-weighted (a step slowed by a compile or a collector pause counts little), and pulled
towards a prior worth a tenth of an observation, which predicts the target for a chunk of
`reference_tokens` at context 0: before any data the chunks are at most today's budget, and a
direction the data cannot tell apart (every chunk the same size) stays at the prior's.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from jetserve.engine.config import ModelConfig
from jetserve.engine.model.attention import PREFILL_BLOCK_M

MIN_CHUNK = PREFILL_BLOCK_M  # a chunk the model refuses still gets this much when the step has no other prefill
WINDOW = 128  # observed steps the fit looks back over
PRIOR_WEIGHT = 0.1  # the prior counts as this many observations of its reference step
# Residuals past this fraction of the median observed step, or twice the residuals' median absolute
# deviation if larger (~1.345 sigma, Huber's usual), weigh less: scaled by the data, not by the target,
# so a prior far off (a target no step can meet) is left behind within a few steps.
HUBER = 0.05
# How much slower the flash kernel does a FLOP than the matmuls (bench/results/prefill-profile-h200):
# only the prior's split between the two terms, which the data then corrects.
ATTENTION_SLOWDOWN = 2.5
HOST_SAMPLES = 15  # a (k, bucket)'s host time: the median of its last this many overlapped steps


def tile_keys(q: int, ctx: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """Keys the flash kernel's query tiles walk for a sequence with `q` new tokens ending a
    context of `ctx` (theirs included): each tile attends up to its last row; a decode (q == 1)
    has no tile (prefill_plan)."""
    if q <= 1:
        return 0
    tiles = -(-q // block_m)
    return tiles * (ctx - q) + block_m * tiles * (tiles - 1) // 2 + q


class StepCost:
    """The model (fit, prediction, largest chunk) and the clock that times steps for it."""

    def __init__(self, target_ms: float, sizes: list[int], graphed: list[int], model: ModelConfig,
                 reference_tokens: int):
        """sizes: the step totals a chunk may round a step to (the mixed-step graphs' buckets,
        multiples of the flash tile); graphed: the buckets a step is padded up to (empty: eager)."""
        self.target = target_ms
        self.sizes, self.graphed = sorted(sizes), sorted(graphed)
        self.prior, reference = self._prior(target_ms, model, reference_tokens)
        # The prior counts as PRIOR_WEIGHT observations of the reference step, term by term (in its units).
        self.ridge = PRIOR_WEIGHT * np.diag((reference * self.prior) ** 2)
        self.coef = self.prior.copy()  # ms, ms a token, ms a tile-key
        self.x, self.y = np.zeros((WINDOW, 3)), np.zeros(WINDOW)  # a ring of observed steps
        self.num_observed = 0
        self.last_done: float | None = 0.0  # when the last step's tokens were read; None: unknown

    @staticmethod
    def _prior(target: float, model: ModelConfig, reference_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """A quarter of the target fixed, the rest a `reference_tokens` chunk at context 0, split
        between matmuls and attention by their FLOPs (attention's slowed by ATTENTION_SLOWDOWN)."""
        m = model
        weights = m.hidden_size * (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim \
            + m.num_attention_heads * m.head_dim * m.hidden_size + 3 * m.hidden_size * m.intermediate_size
        flops_token = 2 * weights * m.num_hidden_layers
        flops_tile_key = 4 * PREFILL_BLOCK_M * m.num_attention_heads * m.head_dim * m.num_hidden_layers
        ratio = ATTENTION_SLOWDOWN * flops_tile_key / flops_token  # a tile-key's cost in tokens
        reference = np.array([1.0, reference_tokens, tile_keys(reference_tokens, reference_tokens)])
        b = 0.75 * target / (reference[1] + ratio * reference[2])
        return np.array([0.25 * target, b, ratio * b]), reference

    # -- prediction ---------------------------------------------------------------------------

    def padded(self, tokens: int) -> int:
        i = bisect.bisect_left(self.graphed, tokens)
        return self.graphed[i] if i < len(self.graphed) else tokens

    def features(self, q_lens: list[int], ctx_lens: list[int]) -> tuple[float, float, float]:
        """A step of sequences with `q_lens` new tokens ending contexts of `ctx_lens`."""
        return 1.0, float(self.padded(sum(q_lens))), float(sum(map(tile_keys, q_lens, ctx_lens)))

    def predict(self, features) -> float:
        a, b, c = self.coef
        return a * features[0] + b * features[1] + c * features[2]

    def largest_chunk(self, q_lens: list[int], ctx_lens: list[int], context: int, need: int, limit: int) -> int:
        """The most of `need` tokens (at most `limit`) that a sequence with `context` tokens
        computed can add to the step so far (`q_lens`, `ctx_lens`) within the target: all of
        them, or a chunk that brings the step to one of `sizes` (no padding wasted), at least
        MIN_CHUNK (or `limit`, if less); 0 if none fits."""
        used, keys, least = sum(q_lens), sum(map(tile_keys, q_lens, ctx_lens)), min(MIN_CHUNK, limit)
        chunks = [s - used for s in self.sizes if least <= s - used <= limit and s - used < need]
        if need <= limit:
            chunks.append(need)

        def over(n: int) -> bool:
            return self.predict((1.0, self.padded(used + n), keys + tile_keys(n, context + n))) > self.target
        fits = bisect.bisect_left(chunks, True, key=over)  # the time grows with the chunk
        return chunks[fits - 1] if fits else 0

    # -- observation --------------------------------------------------------------------------

    def done(self, features, scheduled_at: float | None, synced: bool, at: float | None = None) -> None:
        """A step ended: it was scheduled at `scheduled_at` (None: not by the scheduler, e.g. a
        speculative step chained on the device) and `synced`: its tokens were read now (else its
        end is unknown, and so is the next step's start). Its time runs from its scheduling, or
        from the previous step's read when it was queued behind it (async scheduling), to now;
        `features` None: a step that does not inform the fit (a decode step)."""
        if not synced:
            self.last_done = None
            return
        now = time.perf_counter() if at is None else at
        if features is not None and scheduled_at is not None and self.last_done is not None:
            self.observe(features, (now - max(scheduled_at, self.last_done)) * 1e3)
        self.last_done = now

    def observe(self, features, ms: float) -> None:
        """One step's time; refits."""
        i = self.num_observed % WINDOW
        self.x[i], self.y[i] = features, ms
        self.num_observed += 1
        self.coef = self.fit()

    def fit(self, iterations: int = 3) -> np.ndarray:
        """Huber-weighted least squares over the window, from the current fit, ridge towards the
        prior; solved for each term's scale against the prior's, so one ridge fits every term."""
        n = min(self.num_observed, WINDOW)
        x, y = self.x[:n] * self.prior, self.y[:n]  # ms each term contributes under the prior
        scale = self.coef / self.prior
        typical = HUBER * np.median(y)
        for _ in range(iterations):
            residual = y - x @ scale
            delta = max(typical, 2.0 * np.median(np.abs(residual - np.median(residual))), 1e-9)
            w = np.minimum(1.0, delta / np.maximum(np.abs(residual), 1e-12))
            xw = x * w[:, None]
            scale = np.linalg.solve(xw.T @ x + self.ridge, xw.T @ y + self.ridge.diagonal())
            scale = np.maximum(scale, 0.0)  # no term makes a step cheaper
        return scale * self.prior


class DecodeCosts:
    """Seconds of a decode step by (k, batch bucket): k = 0 a plain decode, k >= 1 a speculative
    step that verifies k drafts a sequence and proposes k (drafting steadily at k). A step costs
    the larger of two times, each measured apart:

    - the device's: measured once the runner has captured its CUDA graphs or compiled its CPU
      steps (`time_runs` on each graph's replay, or on the eager step where none is captured),
      over padded inputs on the scratch block: a decode step of a small model costs its weights
      and launches, not its context, so one context stands for all. Not timed online: a step's
      wall time inside the async pipeline says more about the pipeline than about the step.
    - the host's: what the engine core's own work (scheduling, launching, reading and emitting
      the tokens) takes for a step, `observe_host`, from the steps that overlapped the device
      (async scheduling: the device runs step N+1 while the host reads step N, so a step lasts
      the longer of the two). The median of the last HOST_SAMPLES of each (k, bucket), time
      spent waiting for the device left out. Where many sequences decode, a small model's
      device step is shorter than the host's bookkeeping of it, and pricing the device alone
      would rate drafting, whose extra tokens cost the host little, far below what it gains.
      A (k, bucket) the host has not been seen running costs the host what the nearest smaller
      k did (drafting adds host work, it removes none), or nothing.

    A (k, bucket) the device table lacks costs infinity: never chosen."""

    def __init__(self, seconds: dict[tuple[int, int], float]):
        self.table: dict[tuple[int, int], float] = {}
        self.host: dict[tuple[int, int], float] = {}
        self._host_samples: dict[tuple[int, int], collections.deque] = {}
        self.buckets: list[int] = []
        self._pays: dict[int, bool] = {}
        self.update(seconds)

    def update(self, seconds: dict[tuple[int, int], float]) -> None:
        """New device measurements (a CPU's plain step once its compiled program is in use)."""
        self.table.update(seconds)
        self.buckets = sorted({b for _, b in self.table})
        self._pays.clear()

    def bucket(self, batch: int) -> int | None:
        """The bucket a step of `batch` sequences is padded to (the largest bucket past it: those
        steps run eagerly, at least as slowly)."""
        return self.buckets[min(bisect.bisect_left(self.buckets, batch), len(self.buckets) - 1)] \
            if self.buckets else None

    def observe_host(self, k: int, batch: int, seconds: float) -> None:
        """The host's busy seconds of one overlapped decode step drafting k over `batch` sequences."""
        key = (k, self.bucket(batch))
        samples = self._host_samples.setdefault(key, collections.deque(maxlen=HOST_SAMPLES))
        samples.append(seconds)
        self.host[key] = statistics.median(samples)

    def device_seconds(self, k: int, batch: int) -> float:
        return self.table.get((k, self.bucket(batch)), math.inf)

    def host_seconds(self, k: int, batch: int) -> float:
        b = self.bucket(batch)
        return next((self.host[j, b] for j in range(k, -1, -1) if (j, b) in self.host), 0.0)

    def seconds(self, k: int, batch: int) -> float:
        """T(k) for `batch` sequences: the longer of the device's and the host's time."""
        return max(self.device_seconds(k, batch), self.host_seconds(k, batch))

    def could_pay(self, k_max: int) -> bool:
        """Whether some k <= k_max beats plain decoding at some bucket on the device's times if
        every draft is accepted (k + 1 tokens a step). The device's times alone: they are known
        before any step runs, and where they rule drafting out (a CPU's eager drafting steps,
        many plain ones each) the host's bookkeeping is small beside them."""
        if k_max not in self._pays:
            self._pays[k_max] = any((k + 1) * self.device_seconds(0, b) > self.device_seconds(k, b)
                                    for b in self.buckets for k in range(1, k_max + 1))
        return self._pays[k_max]

    def __str__(self) -> str:
        ks = sorted({k for k, _ in self.table})
        return "; ".join(f"batch {b}: " + " ".join(f"k={k} {self.table[k, b] * 1e3:.3g}" for k in ks
                                                    if (k, b) in self.table) for b in self.buckets) + " (ms)"


def time_runs(run: Callable[[], object], runs: int, device: torch.device) -> float:
    """The fastest of `runs` calls of `run`: a busy host or a stall only ever adds time. On a GPU
    after one untimed call, CUDA events around each (the device's time, no host sync between
    runs); on a CPU the host's clock, every call timed (an eager step needs no warming up, and
    each costs the start-up a whole step)."""
    if device.type != "cuda":
        times = []
        for _ in range(runs):
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
        return min(times)
    run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize(device)
    return min(start.elapsed_time(end) for start, end in events) / 1e3
