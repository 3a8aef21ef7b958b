"""Continuous batching with chunked prefill (Sarathi-Serve / vLLM v1 style); the owner of
every request's state.

Each step has a budget of `max_num_batched_tokens`. Running sequences that decode go first
(one token each, plus their drafts), then prompts already part-way through prefill, then
waiting prompts: each takes min(what it still needs, what is left of the budget), so a long
prompt is split over steps and never stalls the streams around it. With a step latency target
(`max_step_latency_ms`) the budget is only a cap: each chunk is the largest that keeps the step's
predicted time under the target (step_cost.py), fitted to the times of the steps it scheduled
(read in `update`, or in `step_done` under async scheduling); decodes are never held back by it.
When KV blocks run out the most recently admitted running sequence is preempted and later
recomputed from scratch (its tokens are kept, its KV is dropped).

As in nano-vllm (`postprocess`) and vLLM v1 (`update_from_output`), the scheduler is the only
writer of a sequence's state: `schedule()` picks the step, `update()` (or `launched()` and
`receive()` with async scheduling) records what the step did, `finish()` retires a sequence.
The engine decides when a request stops; the runner only reads.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from jetserve.engine.block_manager import BlockManager
from jetserve.engine.config import DEFAULT_CHUNK_BUDGET, EngineConfig
from jetserve.engine.sequence import Sequence, SequenceStatus
from jetserve.engine.step_cost import MIN_CHUNK, StepCost


@dataclass
class ScheduledBatch:
    """Sequences of one step and how many of their uncomputed tokens each computes now."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    # With a latency target: what the step cost model learns from this step (None: nothing, a
    # decode step) and when the step was scheduled.
    cost_features: tuple[float, float, float] | None = None
    scheduled_at: float | None = None
    # Set by the runner: the step ran eagerly because its CUDA graph is not captured yet (a served
    # engine captures mixed-step graphs in its idle moments). Such a step's time is not what the
    # graphed steps to come will cost, so the step cost model does not learn from it.
    graph_pending: bool = False

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def __len__(self):
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int):
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.chunked = config.enable_chunked_prefill
        # Speculative steps replay CUDA graphs, which exist for uniform steps only (a CPU's run eagerly).
        self.uniform_drafts = config.cuda_graphs is not None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        self.step_cost = None
        # While a served engine's mixed-step graphs for steps past the token budget are still being
        # captured (ModelRunner.chunk_cap; the core keeps it current): the most tokens a step with a
        # timed chunk may bring. A server loaded from its first second then chunks as the budget
        # would, on graphs, and takes the target's schedule once its graphs exist.
        self.chunk_cap: int | None = None
        self.in_flight: deque[ScheduledBatch] = deque(maxlen=4)  # launched, tokens unread (step_done), with a target
        if config.max_step_latency_ms:
            graphed = config.cuda_graphs.token_sizes if config.cuda_graphs else ()
            self.step_cost = StepCost(config.max_step_latency_ms, config.step_token_sizes, graphed,
                                      config.model_config, DEFAULT_CHUNK_BUDGET)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- choosing a step ------------------------------------------------------------------

    def schedule(self, num_lookahead_slots: int = 0) -> ScheduledBatch:
        """The next step. `num_lookahead_slots`: KV slots reserved past each sequence this step
        samples, for the MTP drafts chained after it (their draft-layer KV is written before the
        next step allocates for them)."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # Decodes before partial prefills; each group keeps admission order.
        for seq in sorted(self.running, key=self._is_prefilling):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted by an earlier one in this loop
                continue
            n = self._chunk(seq, budget, batch)
            if n == 0:
                continue
            if not self._make_room(seq, n, num_lookahead_slots, batch):
                continue
            batch.add(seq, n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            seq.num_computed_tokens = self.blocks.match_prefix(seq)
            n = self._chunk(seq, budget, batch)
            slots = self._slots(seq, n, num_lookahead_slots)
            if n == 0 or not self.blocks.can_allocate(seq, slots):
                self._release(seq)  # a waiting sequence holds no blocks, cached ones neither
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, slots)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        if self.uniform_drafts and batch:
            self._uniform_drafts(batch)
        if self.step_cost and batch:
            batch.cost_features, batch.scheduled_at = self._features(batch), time.perf_counter()
        return batch

    @staticmethod
    def _uniform_drafts(batch: ScheduledBatch) -> None:
        """Every sequence of a step verifies as many drafts: the fewest any of them has (none
        beside a prefill chunk or a sequence that has no drafts yet), the rest dropped. Why: a
        graphed engine has a program for each uniform step, and any other step runs eagerly,
        launch by launch and outside the async pipeline, at the cost of many plain steps; a
        dropped draft is only a guess, so the tokens stay the same and the loss is one step's
        expected gain. A step of such sequences without drafts then proposes for all of them."""
        counts = [len(seq.spec_token_ids) if n == 1 + len(seq.spec_token_ids) and seq.num_uncomputed_tokens == 1
                  else 0 for seq, n in zip(batch.seqs, batch.num_tokens)]
        fewest = min(counts)
        for i, (seq, count) in enumerate(zip(batch.seqs, counts)):
            if count > fewest:
                del seq.spec_token_ids[fewest:]
                batch.num_tokens[i] -= count - fewest

    def decoding_only(self) -> bool:
        """Every running sequence decodes one token without drafts, and no waiting one could join:
        the next step can be launched before the last one's tokens are read (async scheduling)."""
        return (bool(self.running) and not (self.waiting and len(self.running) < self.max_num_seqs)
                and all(seq.num_uncomputed_tokens == 1 and not seq.spec_token_ids for seq in self.running))

    def reserve_chained(self, seqs: list[Sequence], reach: int) -> bool:
        """Whether a speculative step may follow the unread one of `seqs` on the device alone
        (async scheduling): they are all the running sequences, in order, none waits to join,
        each stays `reach` tokens clear of max_tokens and max_model_len, and each gets the KV
        blocks for `reach` more tokens here."""
        if self.running != seqs or (self.waiting and len(self.running) < self.max_num_seqs):
            return False
        for seq in seqs:
            max_tokens = seq.params.max_tokens
            if (seq.num_tokens + reach > self.max_model_len
                    or (max_tokens is not None and seq.num_output_tokens + reach >= max_tokens)
                    or not self.blocks.can_allocate(seq, reach)):
                return False
            self.blocks.allocate(seq, reach)
        return True

    def _is_prefilling(self, seq: Sequence) -> bool:
        return seq.num_uncomputed_tokens > 1 + len(seq.spec_token_ids)

    def _chunk(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        """Tokens `seq` computes this step: all it needs, or a chunk; 0 if it must wait. Drafts
        that do not fit the budget are dropped (they are only guesses), or a decode with drafts
        could wait forever under a budget smaller than 1 + k."""
        if seq.spec_token_ids and not self._is_prefilling(seq):
            del seq.spec_token_ids[max(0, budget - seq.num_uncomputed_tokens):]
        need = seq.num_uncomputed_tokens + len(seq.spec_token_ids)
        if self.step_cost and self._is_prefilling(seq):
            return self._timed_chunk(seq, need, budget, batch)
        if need <= budget:
            return need
        return budget if self.chunked and self._is_prefilling(seq) else 0

    def _timed_chunk(self, seq: Sequence, need: int, budget: int, batch: ScheduledBatch) -> int:
        """The largest chunk the step's predicted time allows; when none fits and the step has no
        other prefill chunk, MIN_CHUNK anyway, so prompts progress under any target."""
        q_lens, ctx_lens = self._shape(batch)
        limit = budget
        if self.chunk_cap is not None:
            limit = max(0, min(budget, self.chunk_cap - sum(q_lens)))
        n = self.step_cost.largest_chunk(q_lens, ctx_lens, seq.num_computed_tokens, need, limit)
        if n == 0 and not any(map(self._is_prefilling, batch.seqs)):
            n = min(need, budget, MIN_CHUNK)
        return n

    @staticmethod
    def _shape(batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        """New tokens and context (theirs included) of each sequence of a step being scheduled."""
        return batch.num_tokens, [seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_tokens)]

    def _features(self, batch: ScheduledBatch):
        """What the step cost model learns from this step's time: steps with prefill chunks only
        (a decode step is not what it sizes)."""
        if not any(map(self._is_prefilling, batch.seqs)):
            return None
        return self.step_cost.features(*self._shape(batch))

    def step_done(self, synced: bool) -> None:
        """Async scheduling: the engine read the tokens of the oldest launched step (`synced`;
        else it sampled none and its end is unknown): its time, for the step cost model."""
        if self.step_cost and self.in_flight:
            batch = self.in_flight.popleft()
            self.step_cost.done(self._observed(batch), batch.scheduled_at, synced)

    @staticmethod
    def _observed(batch: ScheduledBatch):
        """What the step cost model learns from `batch`'s time: nothing from a step that ran
        without the graph its kind will have."""
        return None if batch.graph_pending else batch.cost_features

    @staticmethod
    def _slots(seq: Sequence, n: int, lookahead: int) -> int:
        """KV slots `seq` needs for `n` tokens: plus the lookahead when this step samples it."""
        return n + lookahead if seq.sampled_after(n) else n

    def _make_room(self, seq: Sequence, n: int, lookahead: int, batch: ScheduledBatch) -> bool:
        """Allocate blocks for `seq`, preempting later-admitted sequences; False if `seq` itself
        had to be preempted."""
        slots = self._slots(seq, n, lookahead)
        while not self.blocks.can_allocate(seq, slots):
            victim = next((s for s in reversed(self.running) if s not in batch.seqs), None)
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq, slots)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        """Drop a sequence's KV: its blocks, its computed count and its drafts."""
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids.clear()

    # -- recording what a step did --------------------------------------------------------

    def update(self, batch: ScheduledBatch, sampled: list[list[int] | None], drafts: list[list[int]]) -> None:
        """After a step: each sequence's computed count advances by what it computed, less its
        rejected drafts (their KV is stale and gets rewritten: that is the rollback); a sampled
        one gains its tokens (accepted drafts + one) and keeps its next drafts."""
        if self.step_cost:  # the step's tokens were read, if it sampled any
            self.step_cost.done(self._observed(batch), batch.scheduled_at, any(new is not None for new in sampled))
        for seq, n, new, next_drafts in zip(batch.seqs, batch.num_tokens, sampled, drafts):
            if new is None:  # a prefill chunk short of the prompt's end
                seq.num_computed_tokens += n
            else:
                rejected = len(seq.spec_token_ids) - (len(new) - 1)
                seq.num_computed_tokens += n - rejected
                seq.token_ids.extend(new)
                seq.spec_token_ids = next_drafts
            self.blocks.cache_computed_blocks(seq)  # before a finish frees the blocks

    def launched(self, batch: ScheduledBatch, sampled: list[Sequence]) -> None:
        """Async scheduling: a step is on the device. Its tokens count as computed now; each
        sampled sequence has one token pending, which `receive` delivers a step later."""
        if self.step_cost:
            self.in_flight.append(batch)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            self.blocks.cache_computed_blocks(seq)
        for seq in sampled:
            seq.num_pending += 1

    def receive(self, seq: Sequence, token: int) -> bool:
        """Async scheduling: a pending token reaches the host; False if `seq` ended meanwhile
        (the token was wasted work, dropped here)."""
        seq.num_pending -= 1
        if seq.status is SequenceStatus.FINISHED:
            return False
        seq.token_ids.append(token)
        return True

    def finish(self, seq: Sequence, reason: str, num_output_tokens: int | None = None) -> None:
        """Retire `seq` (finished or aborted) and return its blocks. `num_output_tokens` cuts
        tokens that a stop inside an accepted run of drafts made moot."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        if num_output_tokens is not None:
            del seq.token_ids[seq.num_prompt_tokens + num_output_tokens:]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def set_max_num_seqs(self, n: int) -> None:
        """Lower or raise the concurrency cap; sequences above a lowered cap finish normally."""
        if n < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {n}")
        self.max_num_seqs = n
