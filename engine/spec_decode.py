"""MTP speculative decoding: draft with the checkpoint's MTP layers, verify losslessly.

A step with speculation, per decoding sequence whose last token is x_t and drafts d_1..d_k:

1. The main model computes x_t, d_1..d_k in one forward (batched with everything else).
2. Each of the k+1 rows samples its token as if no drafts existed: the argmax for greedy
   requests, the exponential race (argmax p/E) with the counter-based noise of that position
   for sampled ones (sampler.py). The drafts are accepted while they equal those tokens, and
   the first token that differs (or the bonus after the last draft) is emitted too. For a
   one-hot draft x this *is* rejection sampling: the race picks x with probability p(x), and
   when it picks another token that token follows p with x removed and renormalized. So the
   output has the model's distribution, and because the noise of a position depends only on
   the seed and the position, a seeded request gives the same tokens for any k or none.
3. The MTP pass runs MTP layer 0 over the same rows, fed the main hidden state at position p
   and the token at p+1: the tokens now known, i.e. the prompt, accepted drafts and the new
   token. Prefill chunks go through it too, so the MTP layer's KV cache holds the whole context
   (vLLM's "shifted by one"). Rows past the last accepted token are garbage and get rewritten
   next step, like the main model's rejected entries (rollback = `num_computed_tokens`).
4. Drafting chains from the last accepted row: step j runs MTP layer j % n on the previous
   draft and the previous MTP hidden state, one token per sequence; drafts are argmax.

When every sequence of a step decodes with the same k drafts, steps 1-4 are one function of
device tensors (`speculative_step`), which the runner replays as one CUDA graph: the host
stages the inputs once and reads back the tokens, accepted counts and next drafts once.
Other steps (prefill chunks in the batch, ragged draft counts) take the general path
(`verify`, `MTPProposer`). `DraftLength` picks k from measured acceptance and step times.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from jetserve.engine.config import SpeculativeConfig
from jetserve.engine.model.attention import AttentionMetadata
from jetserve.engine.sampler import sample
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.sequence import Sequence


def accepted_counts(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B, k] drafts against the [B, k+1] tokens the model samples at their rows → [B] drafts
    accepted (the leading run that matches)."""
    return (drafts == target[:, :drafts.shape[1]]).long().cumprod(1).sum(1)


def verify(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           seeds: torch.Tensor, positions: torch.Tensor) -> list[list[int]]:
    """Accept a prefix of each sequence's one-hot drafts and add one token; lossless (step 2).

    logits: [sum(len(d) + 1), V] fp32, the rows of each sequence in order (its drafts' positions,
    then the bonus position); seeds and positions: per row, the request's seed and the position
    of the token the row samples.
    """
    rows = [p for p, d in zip(params, drafts) for _ in range(len(d) + 1)]
    target = sample(logits, rows, seeds, positions).tolist()
    out, row = [], 0
    for draft_ids in drafts:
        n = 0
        while n < len(draft_ids) and draft_ids[n] == target[row + n]:
            n += 1
        out.append(draft_ids[:n] + [target[row + n]])
        row += len(draft_ids) + 1
    return out


ChainInputs = Callable[[torch.Tensor], tuple[torch.Tensor, AttentionMetadata]]


def speculative_step(model, kv_cache: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata, q: int, num_drafts: int, sample_rows: Callable[[torch.Tensor], torch.Tensor],
                     chain_inputs: ChainInputs) -> torch.Tensor:
    """Steps 1-4 for B sequences of q rows each (last token, q-1 drafts), proposing
    `num_drafts` each, on device tensors with fixed shapes and no host read, so it can be
    captured in a CUDA graph.

    `sample_rows(logits)` gives each row's token (step 2); `chain_inputs(positions)` gives the
    positions and attention metadata of a 1-token drafting step (the caller knows where the
    KV slots are). Returns [B, q + 1 + num_drafts] int64: the q sampled tokens, the accepted
    count n, then the next drafts; the sequence gains the first n+1 tokens.
    """
    hidden = model(ids, positions, kv_cache, meta)
    target = sample_rows(model.compute_logits(hidden).float()).view(-1, q)
    batch = target.shape[0]
    accepted = accepted_counts(ids.view(batch, q)[:, 1:], target)
    # Row j's successor is target[j] for every row up to the first rejection: the shifted ids.
    mtp_hidden = model.mtp_forward(0, target.flatten(), positions, hidden, kv_cache, meta)
    last = torch.arange(batch, device=ids.device) * q + accepted  # the last verified row
    h, last_position = mtp_hidden[last], positions[last]
    drafts = []
    for step in range(num_drafts):
        if step:
            step_positions, step_meta = chain_inputs(last_position + step)
            h = model.mtp_forward(step, drafts[-1], step_positions, h, kv_cache, step_meta)
        drafts.append(model.compute_logits(h).argmax(dim=-1))
    return torch.cat([target, accepted[:, None], *(d[:, None] for d in drafts)], dim=1)


def device_chain_inputs(block_tables: torch.Tensor, block_size: int, padding: torch.Tensor | None = None,
                        scratch_slot: int = 0) -> ChainInputs:
    """Drafting steps' inputs computed on the device from the step's block tables (the fused
    kernels' uniform metadata): no host read, so they can live in a CUDA graph. `padding` marks
    a graph's padded rows, which stay at position 0 and write the scratch slot."""
    def inputs(positions: torch.Tensor) -> tuple[torch.Tensor, AttentionMetadata]:
        if padding is not None:
            positions = positions.masked_fill(padding, 0)
        blocks = block_tables.gather(1, (positions // block_size).long()[:, None])[:, 0]
        slots = (blocks * block_size + positions % block_size).to(block_tables.dtype)
        if padding is not None:
            slots = slots.masked_fill(padding, scratch_slot)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=block_tables,
                                 context_lens=(positions + 1).to(block_tables.dtype), q_len=1, block_size=block_size)
        return positions, meta
    return inputs


def host_chain_inputs(block_tables: list[list[int]], block_size: int, device: torch.device) -> ChainInputs:
    """Drafting steps' inputs built on the host (the general attention path, e.g. on a CPU,
    where reading the positions costs nothing)."""
    def inputs(positions: torch.Tensor) -> tuple[torch.Tensor, AttentionMetadata]:
        ends = [p + 1 for p in positions.tolist()]
        return positions, AttentionMetadata.build([1] * len(ends), ends, block_tables, block_size, device)
    return inputs


class MTPProposer:
    """The MTP pass and the drafting chain of one step (steps 3 and 4 above)."""

    def __init__(self, max_model_len: int, block_size: int, device: torch.device, fused: bool):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.fused = fused  # the model runs the Triton kernels: uniform steps take the paged kernel

    def num_drafts(self, seq: Sequence, emitted: list[int], k: int) -> int:
        """Drafts worth making: none past max_model_len or past the request's max_tokens."""
        left = self.max_model_len - seq.num_tokens - len(emitted)
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens - len(emitted) - 1)
        return max(0, min(k, left))

    def propose(self, draft_forward, compute_logits, seqs: list[Sequence], num_tokens: list[int],
                hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                emitted: list[list[int] | None], k: int) -> list[list[int]]:
        """Run the MTP pass over this step's rows, then chain drafts; returns drafts per sequence."""
        shifted, last_rows, row = [], [], 0
        for seq, n, new in zip(seqs, num_tokens, emitted):
            start = seq.num_computed_tokens
            known = seq.token_ids[start + 1:start + n + 1] + (new or [])
            shifted.extend(known[:n] + [0] * (n - len(known)))
            # The last verified row: its successor is the token just emitted.
            last_rows.append(row + n - 1 - len(seq.spec_token_ids) + len(new) - 1 if new else -1)
            row += n
        mtp_hidden = draft_forward(0, torch.tensor(shifted, device=self.device), positions, hidden, meta)
        counts = [self.num_drafts(s, new, k) if new else 0 for s, new in zip(seqs, emitted)]
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [i for i, c in enumerate(counts) if c > 0]
        if not active:
            return drafts
        h = mtp_hidden[[last_rows[i] for i in active]]
        # Position of the last verified token; draft j (1-based) is guessed at position last + j + 1.
        last = [seqs[i].num_tokens + len(emitted[i]) - 2 for i in active]
        for step in range(max(counts[i] for i in active)):
            if step:
                ids = torch.tensor([drafts[i][-1] for i in active], device=self.device)
                pos = [p + step for p in last]
                step_meta = AttentionMetadata.build([1] * len(active), [p + 1 for p in pos],
                                                    [seqs[i].block_table for i in active], self.block_size,
                                                    self.device, self.fused)
                h = draft_forward(step, ids, torch.tensor(pos, device=self.device), h, step_meta)
            tokens = compute_logits(h).argmax(dim=-1).tolist()
            for i, t in zip(active, tokens):
                drafts[i].append(t)
            keep = [m for m, i in enumerate(active) if counts[i] > step + 1]
            active, last, h = [active[m] for m in keep], [last[m] for m in keep], h[keep]
            if not active:
                break
        return drafts


class DraftLength:
    """How many tokens to draft next step: the k (0 = none) that gives the most tokens a second.

    A decode step that verifies k drafts and proposes k emits E_k = 1 + sum_{j<=k}
    P(accepted >= j) tokens a sequence and takes T_k seconds; k is the argmax of E_k / T_k.
    P comes from a rolling window of verifications; step times are moving averages of measured
    decode steps per (drafts verified, drafts proposed, batch size): a step's cost depends on
    all three. Only the neighbours of the current k are compared: every `probe_interval`-th
    step proposes one more or one fewer than k, in turn, so the next step verifies that many,
    which measures the acceptance of position k+1 and the times T(k, k±1) and T(k±1, k). With
    step time additive in its verify and draft parts, T_{k±1} = T(k, k±1) + T(k±1, k) - T(k, k).
    k climbs or falls one at a time to where tokens per second peak, and moves again when
    acceptance or the batch changes; so drafting does not stay on where it does not pay, on any
    device. Its price: the probes, and at k = 0 the MTP pass that keeps the MTP KV cache
    filled (one decoder layer a step), so that probes see the whole context.
    """

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.k_max = self.k = config.num_speculative_tokens
        self.window: deque[tuple[int, int]] = deque()
        size = config.num_speculative_tokens + 2
        self.drafted_ge = [0] * size  # drafted_ge[j]: verifications in the window that drafted >= j
        self.accepted_ge = [0] * size  # ... of which >= j were accepted
        # (drafts verified, drafts proposed, batch size) → (moving average of the step time in s, steps)
        self.step_time: dict[tuple[int, int, int], tuple[float, int]] = {}
        self.batch_size = 1
        self.steps = 0

    def next(self) -> int:
        """k for the next step (a probe's k every probe_interval-th step)."""
        self.steps += 1
        if not self.config.adaptive or self.steps % self.config.probe_interval:
            return self.k
        up = self.steps // self.config.probe_interval % 2
        return min(self.k + 1, self.k_max) if up else max(self.k - 1, 0)

    def set_max(self, k: int) -> None:
        """Live control: the most tokens to draft; 0 turns drafting off (no probes either)."""
        self.k_max = self.k = k
        size = max(len(self.drafted_ge), k + 2)
        self.drafted_ge += [0] * (size - len(self.drafted_ge))
        self.accepted_ge += [0] * (size - len(self.accepted_ge))

    def record(self, drafted: int, accepted: int) -> None:
        self._count(drafted, accepted, +1)
        self.window.append((drafted, accepted))
        if len(self.window) > self.config.acceptance_window:
            self._count(*self.window.popleft(), -1)

    def record_step(self, verified: int, proposed: int, batch_size: int, seconds: float) -> None:
        """The time of a decode step (every sequence verifying `verified` drafts, proposing `proposed`)."""
        average, n = self.step_time.get((verified, proposed, batch_size), (seconds, 0))
        weight = max(1 / (n + 1), 0.1)  # a plain mean at first, then a moving average
        self.step_time[verified, proposed, batch_size] = (average + weight * (seconds - average), n + 1)
        self.batch_size = batch_size

    def _count(self, drafted: int, accepted: int, sign: int) -> None:
        for j in range(1, min(drafted, len(self.drafted_ge) - 1) + 1):
            self.drafted_ge[j] += sign
            self.accepted_ge[j] += sign * (accepted >= j)

    def tokens_per_step(self, k: int) -> float | None:
        """E_k from the window; None while a position up to k has too few verifications."""
        expected = 1.0
        for j in range(1, k + 1):
            if self.drafted_ge[j] < self.config.min_samples:
                return None
            expected += self.accepted_ge[j] / self.drafted_ge[j]
        return expected

    def _time(self, verified: int, proposed: int) -> float | None:
        average, n = self.step_time.get((verified, proposed, self.batch_size), (0.0, 0))
        return average if n >= self.config.min_samples else None

    def step_seconds(self, k: int) -> float | None:
        """T_k at the current batch size: measured, or from the probes around the current k."""
        if (direct := self._time(k, k)) is not None:
            return direct
        parts = (self._time(self.k, k), self._time(k, self.k), self._time(self.k, self.k))
        return None if None in parts else parts[0] + parts[1] - parts[2]

    def tokens_per_second(self, k: int) -> float | None:
        expected, seconds = self.tokens_per_step(k), self.step_seconds(k)
        return None if expected is None or seconds is None or seconds <= 0 else expected / seconds

    def update(self) -> None:
        """Re-choose k (once a step, after its verifications and time were recorded): move to a
        neighbour when it is measured to give more tokens a second."""
        if not self.config.adaptive:
            return
        here = self.tokens_per_second(self.k)
        if here is None:
            return
        for k in (self.k - 1, self.k + 1):
            # 2% better, not just better: estimates from a window are noisy, and each move costs
            # the transition's steps.
            if 0 <= k <= self.k_max and (rate := self.tokens_per_second(k)) is not None and rate > 1.02 * here:
                self.k, here = k, rate


@dataclass
class SpecCounters:
    """Totals since start, for EngineStats (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verifications with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j+1

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted step emits on average: accepted drafts plus the one verified token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
