"""Continuous batching with chunked prefill (Sarathi-Serve / vLLM v1 style).

Each step has a budget of `max_num_batched_tokens`. Running sequences that decode go first
(one token each), then prompts already part-way through prefill, then waiting prompts: each
takes min(what it still needs, what is left of the budget), so a long prompt is split over
steps and never stalls the streams around it. When KV blocks run out the most recently
admitted running sequence is preempted and later recomputed from scratch (its tokens are
kept, its KV is dropped).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jetserve.engine.block_manager import BlockManager
from jetserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """Sequences of one step and how many of their uncomputed tokens each computes now."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self):
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        # KV slots reserved past a sequence that samples this step: its MTP drafts are chained
        # (and their draft-layer KV written) before the next step allocates for them.
        self.num_lookahead_slots = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        # Decodes before partial prefills; each group keeps admission order.
        for seq in sorted(self.running, key=self._is_prefilling):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted by an earlier one in this loop
                continue
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            if not self._make_room(seq, n, batch):
                continue
            batch.add(seq, n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.blocks.match_prefix(seq)
            n = self._chunk(seq, budget)
            if n == 0 or not self.blocks.can_allocate(seq, self._slots(seq, n)):
                self.blocks.free(seq)  # a waiting sequence holds no blocks, cached ones neither
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, self._slots(seq, n))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return batch

    def _is_prefilling(self, seq: Sequence) -> bool:
        return seq.num_uncomputed_tokens > 1 + len(seq.spec_token_ids)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes this step: all it needs, or a chunk; 0 if it must wait. Drafts
        that do not fit the budget are dropped (they are only guesses), or a decode with drafts
        could wait forever under a budget smaller than 1 + k."""
        if seq.spec_token_ids and not self._is_prefilling(seq):
            del seq.spec_token_ids[max(0, budget - seq.num_uncomputed_tokens):]
        need = seq.num_uncomputed_tokens + len(seq.spec_token_ids)
        if need <= budget:
            return need
        return budget if self.chunked and self._is_prefilling(seq) else 0

    def _slots(self, seq: Sequence, n: int) -> int:
        """KV slots `seq` needs for `n` tokens: plus the lookahead when this step samples it."""
        return n + self.num_lookahead_slots if seq.completes(n) else n

    def _make_room(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Allocate blocks for `seq`, preempting later-admitted sequences; False if `seq` itself
        had to be preempted."""
        slots = self._slots(seq, n)
        while not self.blocks.can_allocate(seq, slots):
            victim = next((s for s in reversed(self.running) if s not in batch.seqs), None)
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq, slots)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire `seq` (finished or aborted) and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def set_max_num_seqs(self, n: int) -> None:
        """Lower or raise the concurrency cap; sequences above a lowered cap finish normally."""
        if n < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {n}")
        self.max_num_seqs = n
