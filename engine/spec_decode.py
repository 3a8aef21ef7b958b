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
   draft and the previous MTP hidden state, one token per sequence; drafts are argmax. A step
   that ends a prompt stops after step 3: the next step verifies nothing and drafts k (a
   speculative step of q = 1, graphed like the others), so the first token is not delayed.

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
from jetserve.engine.model.qwen3 import runs_triton
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


def chained_inputs(packed: torch.Tensor, context_lens: torch.Tensor, prev_q: int, q: int, block_tables: torch.Tensor,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of a speculative step that verifies what the step before it proposed, from
    that step's result on the device, before the host reads it (async scheduling): per
    sequence, the token after its accepted drafts and its q - 1 new drafts, at the positions
    after the accepted ones. packed [B, prev_q + q]: the previous step's sampled tokens,
    accepted count and drafts; context_lens [B]: the previous step's. Returns ids, positions,
    slots [B*q] and context_lens [B], int32. The graphs run the same as one kernel
    (spec_kernels.chain_inputs)."""
    accepted = packed[:, prev_q]
    ids = torch.cat([packed.gather(1, accepted[:, None]), packed[:, prev_q + 1:]], 1)
    start = context_lens.long() - prev_q + accepted + 1
    positions = start[:, None] + torch.arange(q, device=packed.device)
    blocks = block_tables.long().gather(1, positions // block_size)
    slots = blocks * block_size + positions % block_size
    return tuple(t.flatten().to(torch.int32) for t in (ids, positions, slots, start + q))

Acceptance = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor],
                      tuple[torch.Tensor, torch.Tensor, list[tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]]]]


def speculative_step(model, kv_cache: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata, q: int, num_drafts: int, sample_rows: Callable[[torch.Tensor], torch.Tensor],
                     accept: Acceptance, packed: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-4 for B sequences of q rows each (last token, q-1 drafts), proposing
    `num_drafts` each, on device tensors with fixed shapes and no host read, so it can be
    captured in a CUDA graph.

    `sample_rows(logits)` gives each row's token (step 2); `accept(ids, target, positions, x,
    residual, n, packed)` writes the sampled tokens and accepted counts into `packed` and gives
    the MTP pass's output (x, residual) at each sequence's last verified row and the inputs
    (RoPE, attention metadata) of n one-token drafting steps after it (the caller knows where
    the KV slots are). Returns [B, q + 1 + num_drafts] int64 (into `packed` when given): the q
    sampled tokens, the accepted count n, then the next drafts; the sequence gains the first n+1
    tokens.

    Launches are what a small model's step costs, so the MTP pass shares the verify's RoPE, each
    MTP layer's input is one kernel (`Qwen3ForCausalLM.draft_input`: the embedding, both norms,
    and in the chain the previous draft's argmax and final norm), and a draft head is its final
    norm fused into the projection of the draft vocabulary."""
    rope = model.rotary(positions, model.embed_tokens.weight.dtype)
    hidden = model(ids, positions, kv_cache, meta, rope)
    target = sample_rows(model.compute_logits(hidden)).view(-1, q)
    # Row j's successor is target[j] for every row up to the first rejection: the shifted ids.
    x, residual = model.mtp_layer(0, model.draft_input(0, target.flatten(), hidden), rope, kv_cache, meta)
    if packed is None:
        packed = torch.empty(target.shape[0], q + 1 + num_drafts, dtype=torch.int64, device=target.device)
    x, residual, chain = accept(ids, target, positions, x, residual, max(num_drafts - 1, 0), packed)
    for step in range(num_drafts):
        logits, total = model.draft_logits(step, x, residual)
        column = packed[:, q + 1 + step]
        if step == num_drafts - 1:
            if model.lm_head.skinny(total) and runs_triton(total):
                from jetserve.engine.model.spec_kernels import argmax_into  # needs Triton

                argmax_into(logits, column)
            else:
                column.copy_(logits.argmax(dim=-1))
            break
        step_rope, step_meta = chain[step]
        inputs = model.draft_input(step + 1, logits, total, model.mtp[step % len(model.mtp)].norm, column)
        x, residual = model.mtp_layer(step + 1, inputs, step_rope, kv_cache, step_meta)
    return packed


def device_acceptance(meta: AttentionMetadata, q: int, rotary, scratch_slot: int = 0) -> Acceptance:
    """Acceptance and drafting inputs computed on the device from a uniform step's metadata, in
    one kernel (model/spec_kernels.py): no host read, so they can live in a CUDA graph. A graph's
    padded sequences (context length 1) draft into `scratch_slot`. `rotary`: the model's
    RotaryEmbedding."""
    from jetserve.engine.model.spec_kernels import accept_and_chain  # needs Triton

    def accept(ids, target, positions, x, residual, steps, packed):
        x, residual, slots, context_lens, cos, sin = accept_and_chain(
            ids, target, positions, meta.block_tables, meta.context_lens, meta.block_size, q, steps, x, residual,
            *rotary.tables(x.dtype), packed, scratch_slot)
        return x, residual, [
            ((cos[s][:, None], sin[s][:, None]),
             AttentionMetadata(slot_mapping=slots[s], block_tables=meta.block_tables, context_lens=context_lens[s],
                               q_len=1, block_size=meta.block_size))
            for s in range(steps)]
    return accept


def host_acceptance(block_tables: list[list[int]], block_size: int, device: torch.device, rotary) -> Acceptance:
    """Acceptance in torch, drafting inputs built on the host (the general attention path, e.g.
    on a CPU, where reading the positions costs nothing)."""
    def accept(ids, target, positions, x, residual, steps, packed):
        batch, q = target.shape
        accepted = accepted_counts(ids.view(batch, q)[:, 1:], target)
        packed[:, :q], packed[:, q] = target, accepted
        last = torch.arange(batch, device=ids.device) * q + accepted
        last_positions = positions[last].long()
        ends = last_positions.tolist()
        return x[last], residual[last], [
            (rotary(last_positions + s, x.dtype),
             AttentionMetadata.build([1] * batch, [p + s + 1 for p in ends], block_tables, block_size, device))
            for s in range(1, steps + 1)]
    return accept


def next_tokens(seqs: list[Sequence], num_tokens: list[int], emitted: list[list[int] | None]) -> list[int]:
    """What the MTP pass feeds each row of a step beside its hidden state: the token after it
    (the next prompt token, the next draft, or the token this step emitted; 0 past what is known:
    rows of rejected drafts, rewritten next step)."""
    shifted = []
    for seq, n, new in zip(seqs, num_tokens, emitted):
        start = seq.num_computed_tokens
        known = seq.token_ids[start + 1:start + n + 1].tolist() + (new or [])
        shifted.extend(known[:n] + [0] * (n - len(known)))
    return shifted


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

    def propose(self, draft_forward, draft_tokens, seqs: list[Sequence], num_tokens: list[int],
                hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                emitted: list[list[int] | None], k: int) -> list[list[int]]:
        """Run the MTP pass over this step's rows, then chain drafts; returns drafts per sequence."""
        last_rows, row = [], 0
        for seq, n, new in zip(seqs, num_tokens, emitted):
            # The last verified row: its successor is the token just emitted.
            last_rows.append(row + n - 1 - len(seq.spec_token_ids) + len(new) - 1 if new else -1)
            row += n
        shifted = next_tokens(seqs, num_tokens, emitted)
        mtp_hidden = draft_forward(0, torch.tensor(shifted, device=self.device), positions, hidden, meta)
        # A step that finished a prompt drafts nothing: its first drafts come from the next step,
        # a graphed speculative step that verifies none (q = 1) and proposes k, instead of an
        # eager drafting chain here that would delay the first token by a launch-bound chain on a GPU.
        counts = [self.num_drafts(s, new, k) if new and s.num_computed_tokens >= s.num_prompt_tokens else 0
                  for s, new in zip(seqs, emitted)]
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
            tokens = draft_tokens(h).tolist()
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
    P comes from a rolling window per draft position (the last verifications that drafted that
    far: position k+1 is drafted by probes alone, and a window shared with position 1 would never
    hold enough of them to climb back to k+1); step times are moving averages of measured
    decode steps per (drafts verified, drafts proposed, batch size): a step's cost depends on
    all three.

    While drafting (k >= 1), every `probe_interval`-th step is a probe. Most probes propose one
    more or one fewer than k, in turn, so the next step verifies that many: that measures the
    acceptance of position k+1 and the times T(k, k±1) and T(k±1, k); with step time additive
    in its verify and draft parts, T_{k±1} = T(k, k±1) + T(k±1, k) - T(k, k) (or T_{k±1} as
    last measured, if that is fresher than these). Every 8th probe
    proposes nothing for three steps, the last two plain decodes: T_0 is measured directly on
    the second, launched while the first runs as in steady plain decoding (the first few steps
    decode plainly too), not inferred, so drafting switches off from any k as soon as it is not
    measured ON_GAIN faster than plain decoding. Otherwise k climbs or falls one at a time
    to where tokens per second peak.

    Off (k = 0) costs nothing: plain decode steps skip the MTP pass too (runner.plain_step).
    Every `reprobe_interval` steps a burst of min_samples + 1 steps drafts one token a step on
    fresh acceptance statistics, and its verdict turns drafting back on if that beats plain
    decoding by ON_GAIN (off, nothing else does). Positions decoded while off have no MTP KV
    entries, so a burst sees a partial MTP context and, if anything, under-rates drafting: the
    price of an off state that is free. Each burst doubles the wait for the next (up to
    MAX_BACKOFF times `reprobe_interval`).

    The step times leave out what does not fit a step: steps that start or drain the pipeline,
    catch up, wait on the host, so the model can see drafting ahead where it runs behind
    (bench/results/mtp-h200-r8). So every decode step's tokens and time also feed realized rates, of
    drafting steps and of plain ones; while drafting, a stretch of CHECK_STEPS plain steps every
    CHECK_EVERY (the first soon after drafting turns on) keeps plain decoding's current, and
    drafting whose realized rate falls below it goes off. The re-probe backoff is reset only
    once the realized rates show drafting paying.

    Drafting that cannot pay even if every draft were accepted — a step proposing k costs more
    than k + 1 plain ones, as eager drafting steps do beside a compiled plain step on a CPU — is
    switched off (or its burst ended) after TIME_SAMPLES timed steps, before its acceptance is
    known: a burst of such steps would otherwise cost a share of the steps between bursts. While
    off on that bound, prompts skip the MTP pass too (`priced_out`); priced out FAR_OUT times
    over, the next burst waits MAX_BACKOFF intervals; and a draft length made `fresh` for a new
    workload starts off on the bound from the step times it knows.
    """

    OFF_PROBE_EVERY = 8  # every 8th probe measures plain decoding
    CHECK_STEPS = 64  # drafting: a stretch of plain decoding that measures its realized rate (see _realized_gain)
    CHECK_EVERY = 2048  # ... every this many steps; the first 4 x CHECK_STEPS after drafting turns on
    REALIZED_WINDOW = {False: CHECK_STEPS, True: 4 * CHECK_STEPS}  # steps (plain, drafting) a realized rate spans
    TIME_SAMPLES = 2  # timed steps enough for T_0, and for the bound above (step times are steady, unlike acceptance)
    MAX_BACKOFF = 16
    # Drafting priced out by twice its reach (a CPU's eager drafting steps cost 10-20 plain ones)
    # re-probes after MAX_BACKOFF intervals at once: each burst there costs ~40 plain steps.
    FAR_OUT = 2.0
    STALL = 4  # a step slower than 4x the fastest of its kind counts as 4x (see record_step)
    # Drafting stays on only where it is predicted ON_GAIN faster than plain decoding: the step
    # times leave out the steps that leave and rejoin the pipeline (a probe, a chain that breaks),
    # which cost drafting about that much where the model had it narrowly ahead
    # (bench/results/mtp-h200-r8). Then it never loses more than it was predicted to gain.
    ON_GAIN = 1.05

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.k_max = self.k = config.num_speculative_tokens
        # accepted_at[j]: for the last verifications that drafted >= j tokens, whether the j-th
        # was accepted; accepted_sum[j]: how many were.
        self.accepted_at: list[deque[bool]] = []
        self.accepted_sum: list[int] = []
        self._grow(config.num_speculative_tokens + 2)
        # (drafts verified, drafts proposed, batch size) → (moving average of the step time in s, steps)
        self.step_time: dict[tuple[int, int, int], tuple[float, int]] = {}
        self.fastest: dict[tuple[int, int, int], float] = {}  # ... and the fastest step of each, for the bound below
        self.timed_at: dict[tuple[int, int, int], int] = {}  # ... and the step that last timed each
        self.batch_size = 1
        self.steps = 0
        # Proposals already decided for the next steps (a probe, a burst). The first steps decode
        # plainly, so T_0 is known by the time drafting is first judged: where drafting costs more
        # than it gives, it is switched off after min_samples steps, not after a probe cycle.
        self.plan: deque[int] = deque([0] * (self.TIME_SAMPLES + 2) if config.adaptive else [])
        self.reprobe_at = 0  # off: the step of the next burst
        self.backoff = 1  # reprobe_interval's multiple before the next burst
        # The last moves of k and what they were made on: (step, from, to, why, {k: T_k in s}, {k: E_k}).
        self.moves: deque[tuple] = deque(maxlen=64)
        # Tokens a second as realized by every decode step, timed or not: (drafting, batch size) →
        # (tokens, seconds, steps), the sums decayed over REALIZED_WINDOW steps of that kind.
        self.realized: dict[tuple[bool, int], tuple[float, float, int]] = {}
        self.check_at = 4 * self.CHECK_STEPS  # drafting: the step of the next stretch of plain decoding
        self.burst_until = 0  # off: the last step at which the burst's verdict may still come
        self.k_since = 0  # the step from which k (or a burst's) has been drafted
        self._priced_out = False  # off on the cannot-pay bound (see priced_out)

    def fresh(self) -> DraftLength:
        """A draft length that starts afresh (no acceptance statistics, no moves) knowing the step
        times measured so far: what a server that has been serving brings to a new workload. Where
        they say drafting k_max cannot pay, it starts off rather than learn that again (a CPU's
        eager drafting steps cost many plain ones: the few it took, with the MTP pass over each
        prompt, cost a short run much of its speed; bench/results/mtp-cpu-r9)."""
        new = DraftLength(self.config)
        new.k_max = new.k = self.k_max
        new.step_time, new.fastest = dict(self.step_time), dict(self.fastest)
        new.timed_at = dict.fromkeys(self.step_time, 0)
        new.k_since = -1  # the known times count as measured at k_max
        new.update()  # judged before the first step
        return new

    def start_afresh(self) -> None:
        """Become `fresh()` in place: how a live engine's draft length meets a new workload (`jetserve
        bench mtp` between temperatures), by its own method rather than swapped in from outside."""
        vars(self).update(vars(self.fresh()))

    @property
    def priced_out(self) -> bool:
        """Off because drafting's steps cost more than every draft accepted would give, no burst
        planned: no step needs the MTP pass, prefill chunks neither (a CPU's MTP pass over a
        prompt slows its first token). Off for poor acceptance, prompts still go
        through it, so that a burst judges drafts that see their context."""
        return self.k == 0 and not self.plan and self._priced_out

    def next(self) -> int:
        """k for the next step (a probe's or a burst's k at times)."""
        self.steps += 1
        if self.plan:
            return self.plan.popleft()
        if not self.config.adaptive or self.k_max == 0:
            return self.k
        if self.k == 0:
            if self.steps < self.reprobe_at:
                return 0
            self.reprobe_at = self.steps + self.config.reprobe_interval * self.backoff
            self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)  # reset once drafting pays again
            self._clear_window()  # the burst judges on its own acceptance
            # min_samples verifications and timed steps of k = 1 by its verdict (the update that
            # reads its last step): the burst's first step verifies nothing and is not timed (it
            # starts the chain). With min_samples steps both fell one short, so under async
            # scheduling no burst turned drafting on (the demo on a GPU, off after warming up on
            # prompts its heads cannot draft, stayed off).
            self.plan.extend([1] * (self.config.min_samples + 1))
            self.burst_until, self.k_since, self._priced_out = self.steps + len(self.plan), self.steps, False
            return 1
        if self.steps >= self.check_at:
            self.check_at = self.steps + self.CHECK_EVERY
            self.plan.extend([0] * (self.CHECK_STEPS - 1))
            return 0
        if self.steps % self.config.probe_interval:
            return self.k
        probe = self.steps // self.config.probe_interval
        if probe % self.OFF_PROBE_EVERY == 0:
            self.plan.extend([0, 0])  # this step verifies k and proposes 0; two plain decodes follow
            return 0
        return min(self.k + 1, self.k_max) if probe % 2 else max(self.k - 1, 0)

    def set_max(self, k: int) -> None:
        """Live control: the most tokens to draft; 0 turns drafting off (no probes either)."""
        self.k_max = self.k = k
        self.plan.clear()
        self._grow(k + 2)

    def _grow(self, size: int) -> None:
        while len(self.accepted_at) < size:
            self.accepted_at.append(deque(maxlen=self.config.acceptance_window))
            self.accepted_sum.append(0)

    def record(self, drafted: int, accepted: int) -> None:
        for j in range(1, min(drafted, len(self.accepted_at) - 1) + 1):
            window, hit = self.accepted_at[j], accepted >= j
            if len(window) == window.maxlen:
                self.accepted_sum[j] -= window[0]
            window.append(hit)
            self.accepted_sum[j] += hit

    def record_progress(self, verified: int, proposed: int, batch_size: int, tokens: int, seconds: float) -> None:
        """Any decode step's tokens and time (from the previous step's tokens to its own, or its
        whole run where none overlapped it): the realized rates. Unlike the step times, these
        count the steps that start or drain the pipeline, catch up, or wait on the host."""
        key = (bool(verified or proposed), batch_size)
        tokens_sum, seconds_sum, n = self.realized.get(key, (0.0, 0.0, 0))
        keep = 1 - 1 / self.REALIZED_WINDOW[key[0]]
        self.realized[key] = (tokens_sum * keep + tokens, seconds_sum * keep + seconds, n + 1)

    def _realized_gain(self) -> float | None:
        """Drafting's realized tokens a second over plain decoding's at the current batch size,
        once each has half its window of steps; None before."""
        rates = []
        for drafting in (True, False):
            tokens, seconds, n = self.realized.get((drafting, self.batch_size), (0.0, 0.0, 0))
            if n < self.REALIZED_WINDOW[drafting] // 2 or seconds <= 0:
                return None
            rates.append(tokens / seconds)
        return rates[0] / rates[1]

    def record_step(self, verified: int, proposed: int, batch_size: int, seconds: float) -> None:
        """The time of a decode step (every sequence verifying `verified` drafts, proposing `proposed`).
        No step counts for more than STALL times the fastest of its kind: one stall (a kernel
        compiled on first use takes 1000 steps' time) would hold the average up for hundreds of
        steps, and drafting off for as long."""
        key = verified, proposed, batch_size
        fastest = self.fastest[key] = min(seconds, self.fastest.get(key, seconds))
        average, n = self.step_time.get(key, (seconds, 0))
        average, seconds = min(average, self.STALL * fastest), min(seconds, self.STALL * fastest)
        weight = max(1 / (n + 1), 0.1)  # a plain mean at first, then a moving average
        self.step_time[key] = (average + weight * (seconds - average), n + 1)
        self.timed_at[key] = self.steps
        self.batch_size = batch_size

    def _clear_window(self) -> None:
        for window in self.accepted_at:
            window.clear()
        self.accepted_sum = [0] * len(self.accepted_sum)

    def tokens_per_step(self, k: int) -> float | None:
        """E_k from the window; None while a position up to k has too few verifications."""
        expected = 1.0
        for j in range(1, k + 1):
            if len(self.accepted_at[j]) < self.config.min_samples:
                return None
            expected += self.accepted_sum[j] / len(self.accepted_at[j])
        return expected

    def _time(self, verified: int, proposed: int, needed: int | None = None) -> float | None:
        average, n = self.step_time.get((verified, proposed, self.batch_size), (0.0, 0))
        if needed is None:
            needed = self.TIME_SAMPLES if verified == proposed == 0 else self.config.min_samples
        return average if n >= min(needed, self.config.min_samples) else None

    def _over_reach(self, k: int) -> float:
        """The fastest of TIME_SAMPLES steps drafting k over k + 1 plain steps, the most it can
        emit: above 1, drafting k cannot pay whatever is accepted (the fastest: one stall, a
        kernel compiled on first use say, must not switch drafting off). 0 while not known, or
        known only from before k was last entered."""
        plain = self._time(0, 0)
        if plain is None or self._time(k, k, self.TIME_SAMPLES) is None or self._timed_at(k, k) <= self.k_since:
            return 0.0
        return self.fastest[k, k, self.batch_size] / ((k + 1) * plain)

    def step_seconds(self, k: int) -> float | None:
        """T_k at the current batch size: measured, or from the probes around the current k where
        those are fresher. A k left long ago keeps its last measurement, which may date from a
        stall (graphs warming up, a busy host): read forever, one slow spell at k = 2 kept the
        draft length at 1 where 3 paid most."""
        keys = ((self.k, k), (k, self.k), (self.k, self.k))
        parts = [self._time(*key) for key in keys]
        direct = self._time(k, k)
        if direct is not None and (None in parts or k == self.k or self._timed_at(k, k) >= min(
                self._timed_at(*key) for key in keys)):
            return direct
        return None if None in parts else parts[0] + parts[1] - parts[2]

    def _timed_at(self, verified: int, proposed: int) -> int:
        return self.timed_at.get((verified, proposed, self.batch_size), -1)

    def tokens_per_second(self, k: int) -> float | None:
        expected, seconds = self.tokens_per_step(k), self.step_seconds(k)
        return None if expected is None or seconds is None or seconds <= 0 else expected / seconds

    def _gain_needed(self, current: int, k: int) -> float:
        """How much faster k must be predicted than the current k to move there: drafting must
        beat plain decoding by ON_GAIN to be (or stay) on; between two draft lengths 2% (window
        estimates are noisy, and each move costs the transition's steps)."""
        if current == 0:
            return self.ON_GAIN
        return 1 / self.ON_GAIN if k == 0 else 1.02

    def update(self) -> None:
        """Re-choose k (once a step, after its verifications and time were recorded): move to a
        neighbour, or to off, when it is measured to give more tokens a second; off, only a
        burst's verdict may turn drafting on. Drafting whose realized rate falls below plain
        decoding's goes off whatever the step model says (see _realized_gain)."""
        if not self.config.adaptive or self.k_max == 0 or (self.k == 0 and self.steps > self.burst_until):
            return
        before = self.k
        trying = self.k or (self.plan[0] if self.plan else 0)  # off, a burst's k is in the plan
        why = "measured"
        gain = self._realized_gain() if self.k and not self.plan else None
        over = self._over_reach(trying) if trying else 0.0
        if over > 1:
            self.k, why, self._priced_out = 0, f"k={trying} cannot pay", True
            self.plan.clear()
            if over > self.FAR_OUT:  # not a slow spell: the next burst waits the longest
                self.backoff = self.MAX_BACKOFF
                self.reprobe_at = self.steps + self.config.reprobe_interval * self.backoff
        elif gain is not None and gain < 1:
            self.k, why = 0, f"realized {gain:.2f}x plain"
        elif (here := self.tokens_per_second(self.k)) is not None:
            for k in sorted({0, self.k - 1, self.k + 1}):
                if 0 <= k <= self.k_max and k != self.k and (rate := self.tokens_per_second(k)) is not None \
                        and rate > self._gain_needed(self.k, k) * here:
                    self.k, here = k, rate
        if gain is not None and gain >= self.ON_GAIN:
            self.backoff = 1  # drafting is seen to pay: the next time off, re-probe soon
        if self.k != before:
            self.k_since = self.steps
        if self.k != before or why != "measured":
            ks = range(self.k_max + 1)
            self.moves.append((self.steps, before, self.k, why, {k: self.step_seconds(k) for k in ks},
                               {k: self.tokens_per_step(k) for k in ks}))
        if before and not self.k:
            self.reprobe_at = self.steps + self.config.reprobe_interval * self.backoff
        elif self.k and not before:
            self.check_at = self.steps + 4 * self.CHECK_STEPS  # the realized rates judge it soon


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
