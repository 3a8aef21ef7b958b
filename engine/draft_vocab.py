"""Which token ids the draft heads project onto: the ones this engine emits most.

A draft needs only the argmax of its head, and with a big vocabulary the head's projection is
most of a drafting step's weight reads, while a few thousand ids hold most of what a workload
emits (FR-Spec). The verify step still scores every id, so the cut never changes a token; it
only caps acceptance, at the share of emitted tokens the draft vocabulary lacks, which `coverage`
reports. Which ids those are depends on the workload (code, English, Chinese each draw on
other ids), so they are ranked from the engine's own output, not fixed:

1. Until anything is emitted, the first ids: byte-level BPE numbers its tokens in merge order,
   roughly by frequency.
2. Ids rank by how often they were emitted; ties, and ids never emitted, in id order.
3. The ranking is redone after every `REFRESH` emitted tokens, and the heads' rows rewritten only
   where the set changed: a host pass over the vocabulary and one gather on the device each time,
   small beside the steps that emitted them.
4. The counts halve whenever they pass `HORIZON` tokens, so a change of workload shows within
   about that many.
"""

from __future__ import annotations

import numpy as np

REFRESH = 4096  # emitted tokens between rankings
HORIZON = 1 << 20  # tokens the counts remember before halving (rule 4)


class DraftVocabulary:
    """The ranking of one engine's draft vocabulary of `size` ids out of `vocab_size`."""

    def __init__(self, vocab_size: int, size: int):
        self.vocab_size, self.size = vocab_size, size
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.ids = np.arange(size, dtype=np.int64)  # the current set, ascending (rule 1)
        self._member = np.zeros(vocab_size, dtype=bool)
        self._member[self.ids] = True
        self._pending: list[int] = []
        self.rankings = 0  # rankings that changed the set
        self.coverage = 1.0  # share of the last REFRESH emitted tokens inside the set they met

    def observe(self, tokens: list[int]) -> None:
        """Tokens the engine emitted (any request's, drafted or not)."""
        self._pending.extend(tokens)

    def due(self) -> bool:
        return len(self._pending) >= REFRESH

    def rank(self) -> np.ndarray | None:
        """Count what was emitted since the last call and rank again (rules 2 to 4): the new set,
        ascending, where it differs from the current one, else None."""
        tokens = np.asarray(self._pending, dtype=np.int64)
        self._pending.clear()
        tokens = tokens[(tokens >= 0) & (tokens < self.vocab_size)]
        if not len(tokens):
            return None
        self.coverage = float(self._member[tokens].mean())
        self.counts += np.bincount(tokens, minlength=self.vocab_size)
        if self.counts.sum() > HORIZON:
            self.counts //= 2
        # One integer key: count first, then the lower id; the `size` largest keys are the set.
        key = self.counts * self.vocab_size + (self.vocab_size - 1 - np.arange(self.vocab_size))
        ids = np.sort(np.argpartition(key, self.vocab_size - self.size)[self.vocab_size - self.size:])
        if np.array_equal(ids, self.ids):
            return None
        self._member[:] = False
        self._member[ids] = True
        self.ids = ids
        self.rankings += 1
        return ids
