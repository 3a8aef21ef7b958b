"""Paged KV cache bookkeeping: fixed-size blocks, a free list, and reference counts.

Blocks are reference counted so that a block can be shared (prefix reuse, forks) and is
returned to the free list only when its last user lets go.
"""

from __future__ import annotations

from collections import deque

from jetserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one KV block of at least one token, got "
                             f"num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that the next `num_new_tokens` of `seq` have a slot."""
        tokens = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free} free")
        for _ in range(needed):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def share(self, block: int) -> int:
        """Take another reference to an allocated block (prefix reuse)."""
        if self.ref_counts[block] < 1:
            raise RuntimeError(f"block {block} is not allocated")
        self.ref_counts[block] += 1
        return block

    def free(self, seq: Sequence) -> None:
        """Let go of every block of `seq`; its computed tokens are forgotten."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Index of `position`'s KV entry in the flat cache."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
