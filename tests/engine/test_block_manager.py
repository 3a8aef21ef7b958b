"""Block accounting: allocation covers exactly the tokens asked for; shared blocks outlive one owner."""

import pytest

from jetserve.engine.block_manager import BlockManager
from jetserve.engine.model.attention import slot_mapping
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.sequence import Sequence


def seq(n_tokens):
    return Sequence("r", list(range(n_tokens)), SamplingParams())


def test_allocation_grows_block_by_block_and_free_returns_everything():
    blocks = BlockManager(num_blocks=4, block_size=4)
    s = seq(6)
    assert blocks.blocks_needed(s, 6) == 2
    blocks.allocate(s, 6)
    assert len(s.block_table) == 2 and blocks.num_free == 2
    s.num_computed_tokens = 6
    assert blocks.blocks_needed(s, 2) == 0  # positions 6 and 7 fit in the second block
    assert blocks.blocks_needed(s, 3) == 1
    assert slot_mapping([s.block_table], [6], [1], 4) == [s.block_table[1] * 4 + 1]  # position 5
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        blocks.allocate(s, 20)
    blocks.free(s)
    assert blocks.num_free == 4 and s.block_table == []  # (the scheduler forgets its computed tokens)


def test_a_shared_block_is_freed_by_its_last_owner():
    blocks = BlockManager(num_blocks=3, block_size=4)
    a, b = seq(4), seq(4)
    blocks.allocate(a, 4)
    b.block_table.append(blocks.share(a.block_table[0]))  # b reuses a's prefix block
    blocks.free(a)
    assert blocks.num_used == 1, "b still holds the shared block"
    blocks.free(b)
    assert blocks.num_used == 0
    with pytest.raises(RuntimeError, match="not allocated"):
        blocks.share(0)
