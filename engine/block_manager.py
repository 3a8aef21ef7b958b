"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts and a prefix cache.

Blocks are reference counted so that one block can serve several sequences, and go back to the
free list only when their last user lets go. With prefix caching, a full block whose KV has been
computed is remembered by its tokens and everything before them; a new request whose prompt
starts the same way takes those blocks instead of computing them again (a kiosk's system prompt,
a robot's tool preamble). A freed block keeps its contents until it is handed out again, oldest
freed first, so recently used prefixes stay cached as long as memory allows.

The scheduler owns the block manager; a sequence's `block_table` and `block_keys` are this
class's state kept on the sequence, and nothing else writes them.
"""

from __future__ import annotations

from collections import OrderedDict

from jetserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one KV block of at least one token, got "
                             f"num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.prefix_caching = enable_prefix_caching
        self._cached: dict[tuple, int] = {}  # (digest of the blocks before, block tokens) → block
        self._key_of: dict[int, tuple] = {}  # block → its key, while it holds those tokens
        self.prefix_queries = 0  # prompt tokens looked up / found in the cache
        self.prefix_hits = 0

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
            block, _ = self.free_blocks.popitem(last=False)
            key = self._key_of.pop(block, None)  # its old contents are gone now
            if key is not None:
                del self._cached[key]
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def share(self, block: int) -> int:
        """Take another reference to a block (prefix reuse); a cached free block comes back to life."""
        if self.ref_counts[block] == 0:
            if block not in self._key_of:
                raise RuntimeError(f"block {block} is not allocated")
            del self.free_blocks[block]
        self.ref_counts[block] += 1
        return block

    def free(self, seq: Sequence) -> None:
        """Let go of every block of `seq` (the caller forgets its computed tokens)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table.clear()
        seq.block_keys.clear()

    # -- prefix caching -------------------------------------------------------------------

    def _key(self, seq: Sequence, index: int) -> tuple:
        """Block `index` of `seq` by its tokens and, through a digest of the blocks before it, all
        the tokens before them (a flat key: hashing it never walks the whole prefix)."""
        tokens = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
        return (seq.block_keys[index - 1] if index else None, tokens)

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence that has nothing computed the cached blocks of its longest known
        prefix; returns how many of its tokens they hold. At least one token is left to compute:
        the step that computes it samples. A request for prompt_logprobs computes its whole
        prompt (as vLLM's): cached blocks would leave rows without logits."""
        if not self.prefix_caching or seq.block_table or seq.params.prompt_logprobs is not None:
            return 0
        self.prefix_queries += seq.num_tokens
        for index in range((seq.num_tokens - 1) // self.block_size):
            key = self._key(seq, index)
            block = self._cached.get(key)
            if block is None:
                break
            seq.block_table.append(self.share(block))
            seq.block_keys.append(hash(key))
        hits = len(seq.block_table) * self.block_size
        self.prefix_hits += hits
        return hits

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Remember the sequence's full blocks whose KV is computed and whose tokens are known."""
        if not self.prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        for index in range(len(seq.block_keys), full):
            key = self._key(seq, index)
            seq.block_keys.append(hash(key))
            block = seq.block_table[index]
            if block not in self._key_of and key not in self._cached:
                self._cached[key] = block
                self._key_of[block] = key
