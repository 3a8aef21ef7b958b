"""Prefix caching: a prompt that starts like an earlier one reuses its KV, and changes no token."""

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.block_manager import BlockManager
from jetserve.engine.sequence import Sequence
from tests.engine.builders import hf_greedy

SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]  # 19 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_a_shared_system_prompt_is_computed_once_and_tokens_stay_exact(tiny):
    path, model = tiny
    llm = LLM(str(path), block_size=4)
    prompts = [SYSTEM + [100 + i, 101 + i] for i in range(3)]
    outputs = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 6) for p in prompts]
    stats = llm.engine.stats()
    # The first request computes everything; each later one finds SYSTEM's 4 full blocks (16 tokens).
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (3 * 21, 2 * 16)
    assert stats.kv_blocks_used == 0, "cached blocks are free blocks until reused"


def test_prefix_caching_off_reuses_nothing(tiny):
    path, _ = tiny
    llm = LLM(str(path), block_size=4, enable_prefix_caching=False)
    for _ in range(2):
        llm.generate({"prompt_token_ids": SYSTEM + [7]}, GREEDY, use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits == 0


def test_cached_blocks_are_evicted_oldest_first_when_memory_is_needed():
    blocks = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    first = Sequence("a", [1, 2, 3, 4, 5], SamplingParams())
    blocks.allocate(first, 5)
    first.num_computed_tokens = 5
    blocks.cache_computed_blocks(first)  # [1, 2] and [3, 4] are full; [5] is not
    blocks.free(first)
    assert blocks.num_free == 4
    again = Sequence("b", [1, 2, 3, 4, 9], SamplingParams())
    again.num_computed_tokens = blocks.match_prefix(again)  # the scheduler records what it returns
    assert again.num_computed_tokens == 4 and blocks.num_used == 2
    blocks.free(again)
    other = Sequence("c", [7] * 8, SamplingParams())
    blocks.allocate(other, 8)  # needs every block: the cached ones are handed out too
    blocks.free(other)
    late = Sequence("d", [1, 2, 3, 4, 9], SamplingParams())
    late.num_computed_tokens = blocks.match_prefix(late)
    assert late.num_computed_tokens == 0, "evicted contents are not found again"
