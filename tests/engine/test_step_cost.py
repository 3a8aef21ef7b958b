"""Prefill chunks sized by predicted step time (`max_step_latency_ms`): the cost model fits step
times, the scheduler's chunks shrink as the context grows and stay under the target, prompts
always progress, the target off schedules as the token budget did, and greedy tokens stay
transformers' whatever the chunks."""

import argparse
import random

import numpy as np
import pytest
from transformers import Qwen3Config

from jetserve.engine import LLM, EngineArgs, SamplingParams
from jetserve.engine.config import (DEFAULT_CHUNK_BUDGET, DEFAULT_TARGET_BUDGET, FINE_TOKEN_STEP, ModelConfig,
                                    token_sizes)
from jetserve.engine.cuda_graphs import MixedStepGraphs
from jetserve.engine.model.attention import PREFILL_BLOCK_M, prefill_plan
from jetserve.engine.scheduler import Scheduler
from jetserve.engine.sequence import Sequence, SequenceStatus
from jetserve.engine.step_cost import MIN_CHUNK, StepCost, tile_keys
from tests.engine.builders import TINY, hf_greedy

QWEN3_06B = ModelConfig(151936, 1024, 3072, 28, 16, 8, 128, 1e-6, 1e6, 40960, True, 0, "bfloat16", "Qwen3ForCausalLM")
# A fit of the H200's chunked-prefill steps (0.6B, 8 streams beside an 8k prompt; bench/results/prefill-h200): ms, ms a token,
# ms a tile-key.
H200 = np.array([2.05, 1.376e-3, 1.132e-4])
SIZES = token_sizes(2048, FINE_TOKEN_STEP)
STREAMS = 8


def truth(features):
    return float(H200 @ np.array(features))


def test_tile_keys_count_the_flash_kernels_work():
    """The keys the flash kernel's tiles walk, as prefill_plan lays them out (odd lengths; a decode: none)."""
    for q, ctx in [(1, 300), (128, 128), (129, 1000), (504, 7500), (2040, 2040), (77, 77)]:
        items, _ = prefill_plan([q], [ctx], split_items=1)
        assert tile_keys(q, ctx) == sum(end - first for first, end in zip(items[2], items[3]))
    assert FINE_TOKEN_STEP == PREFILL_BLOCK_M == MIN_CHUNK


@pytest.mark.parametrize("noise, outliers", [(0.0, 0.0), (0.03, 0.1)])
def test_the_model_fits_synthetic_step_times(noise, outliers):
    """Steps of every chunk size and depth timed by a known law, with noise and a tenth of them
    slowed 2-10x (a compile, a collector pause): the fit predicts the law within a few percent."""
    cost = StepCost(7.0, SIZES, SIZES, QWEN3_06B, DEFAULT_CHUNK_BUDGET)
    rng = random.Random(1)
    for _ in range(300):
        n, ctx = rng.choice([128, 256, 504, 1016, 1528, 2040]), rng.randrange(0, 8000)
        features = cost.features([1] * STREAMS + [n], [300] * STREAMS + [ctx + n])
        ms = truth(features) * rng.gauss(1, noise)
        cost.observe(features, ms * (rng.uniform(2, 10) if rng.random() < outliers else 1))
    errors = [cost.predict(f) / truth(f) - 1 for ctx in range(0, 8000, 500) for n in (128, 504, 1016, 2040)
              for f in [cost.features([1] * STREAMS + [n], [300] * STREAMS + [ctx + n])]]
    assert np.median(np.abs(errors)) < (0.005 if noise == 0 else 0.02) and np.max(np.abs(errors)) < 0.05
    if noise == 0:
        np.testing.assert_allclose(cost.coef, H200, rtol=0.02)


def test_before_any_data_a_first_chunk_is_at_most_todays_budget():
    cost = StepCost(7.0, SIZES, SIZES, QWEN3_06B, DEFAULT_CHUNK_BUDGET)
    assert DEFAULT_CHUNK_BUDGET - FINE_TOKEN_STEP <= cost.largest_chunk([], [], 0, 8192, 2048) <= DEFAULT_CHUNK_BUDGET
    assert cost.largest_chunk([], [], 0, 100, 2048) == 100  # a short prompt whole


def test_the_clock_times_overlapped_steps_from_the_previous_end():
    """Sync: a step runs from its scheduling to its read; async: a step queued behind another
    starts when that one's tokens were read; after a step that sampled nothing (no read), the
    next step's start is unknown and it is not observed; nor is a step the scheduler did not
    schedule (a chained speculative step), which still marks its read."""
    cost = StepCost(10.0, SIZES, (), QWEN3_06B, DEFAULT_CHUNK_BUDGET)
    seen = []
    cost.observe = lambda features, ms: seen.append((features, round(ms, 6)))
    cost.done("sync", 1.000, True, at=1.004)
    assert seen == [("sync", 4.0)]
    cost.done("a", 2.000, True, at=2.005)
    cost.done("b", 2.001, True, at=2.012)  # scheduled while a ran
    assert seen[1:] == [("a", 5.0), ("b", 7.0)]
    cost.done("quiet", 3.000, False, at=3.002)  # sampled nothing: its end is unknown
    cost.done("after", 3.001, True, at=3.010)
    cost.done(None, 3.011, True, at=3.012)  # a decode step: timed, not observed
    cost.done("chained", None, True, at=3.013)
    cost.done("next", 3.011, True, at=3.020)
    assert seen[3:] == [("next", 7.0)]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny shape with room for an 8k prompt: only its config.json (the scheduler loads no weights)."""
    path = tmp_path_factory.mktemp("long")
    Qwen3Config(**{**TINY, "max_position_embeddings": 16384}, architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    return str(path)


def scheduler(path, **kwargs):
    config = EngineArgs(model=path, max_model_len=8704, max_num_seqs=STREAMS + 1, **kwargs).resolve()
    return Scheduler(config, num_blocks=(STREAMS + 1) * 8704 // 16 + 1)


def prompt_chunks(sched, prompt_len=8192):
    """8 streams in steady state, then a prompt: its chunk each step, and each step's features."""
    greedy = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    streams = [Sequence(f"s{i}", [1] * 300, greedy) for i in range(STREAMS)]
    for seq in streams:
        sched.add(seq)
    long = Sequence("long", [2] * prompt_len, greedy)
    chunks, steps = [], []
    for _ in range(10**4):
        if long.status is SequenceStatus.WAITING and all(seq.num_output_tokens for seq in streams):
            sched.add(long)
        batch = sched.schedule()
        if long in batch.seqs:
            chunks.append(batch.num_tokens[batch.seqs.index(long)])
            steps.append(sched._shape(batch))
        sampled = [[0] if seq.sampled_after(n) else None for seq, n in zip(batch.seqs, batch.num_tokens)]
        sched.update(batch, sampled, [[] for _ in batch.seqs])
        if long.num_output_tokens:
            return chunks, steps
    raise AssertionError("the prompt never finished")


def test_chunks_shrink_as_the_context_grows_and_stay_under_the_target(long_model):
    sched = scheduler(long_model, max_step_latency_ms=7.0)
    cost = sched.step_cost
    cost.coef = H200.copy()
    cost.observe = lambda features, ms: None  # the law stays put: the schedule follows from it alone
    chunks, steps = prompt_chunks(sched)
    assert sum(chunks) == 8192
    assert all(a >= b for a, b in zip(chunks[:-2], chunks[1:-1])), chunks  # the last one is what is left
    assert chunks[0] >= 1500 and chunks[-2] <= 800, chunks
    assert len(chunks) <= 12  # a 512-token budget takes 17 steps
    for q_lens, ctx_lens in steps:
        assert cost.predict(cost.features(q_lens, ctx_lens)) <= 7.0
    assert all(sum(q_lens) in SIZES for q_lens, _ in steps[:-1])  # whole buckets: no padding computed for nothing


def test_a_step_run_before_its_graph_exists_does_not_teach_the_model(long_model):
    """A served engine captures mixed-step graphs in its idle moments; until then such steps run
    eagerly, several times slower. Learned from, they would make every chunk look over the target
    (the minimum chunk every step); so the scheduler passes them over, and learns from the rest."""
    sched = scheduler(long_model, max_step_latency_ms=7.0)
    observed = []
    sched.step_cost.observe = lambda features, ms: observed.append(features)
    greedy = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    sched.add(Sequence("stream", [1] * 100, greedy))
    sched.add(Sequence("long", [2] * 8192, greedy))

    def step(pending):
        batch = sched.schedule()
        batch.graph_pending = pending
        sched.update(batch, [[0] if seq.sampled_after(n) else None for seq, n in zip(batch.seqs, batch.num_tokens)],
                     [[] for _ in batch.seqs])
        return batch

    while not step(False).cost_features:  # the stream's prompt, then its decode beside the long prompt's chunks
        pass
    counts = []
    for pending in (True, True, False, False, True, False):
        assert step(pending).cost_features is not None  # each step carries a chunk of the long prompt
        counts.append(len(observed))
    base = counts[0]
    assert counts == [base, base, base + 1, base + 2, base + 2, base + 3], counts


@pytest.mark.parametrize("cap", [DEFAULT_CHUNK_BUDGET, None])
def test_chunks_stay_within_the_graphs_a_served_engine_has(long_model, cap):
    """A served engine captures its mixed-step graphs after start-up, the token budget's first;
    until those past it exist (`chunk_cap`), a timed chunk brings its step to at most the budget,
    so a server loaded early chunks as the budget would, on graphs, not eagerly."""
    sched = scheduler(long_model, max_step_latency_ms=7.0)
    sched.step_cost.coef = H200.copy()
    sched.step_cost.observe = lambda features, ms: None
    sched.chunk_cap = cap
    chunks, steps = prompt_chunks(sched)
    assert sum(chunks) == 8192
    largest = max(sum(q_lens) for q_lens, _ in steps)
    assert largest == DEFAULT_CHUNK_BUDGET if cap else largest > 1024, chunks


def test_deferred_graphs_come_the_budgets_first_largest_first():
    """The capture order of a served engine's mixed-step graphs (no GPU needed to build the list)."""
    sizes = token_sizes(2048, FINE_TOKEN_STEP)
    order = MixedStepGraphs.capture_order(sizes, DEFAULT_CHUNK_BUDGET)
    assert sorted(order) == sorted(sizes)
    budgets = [s for s in sizes if s <= DEFAULT_CHUNK_BUDGET]
    assert order[:len(budgets)] == sorted(budgets, reverse=True)
    assert order[len(budgets):] == sorted(set(sizes) - set(budgets), reverse=True)


def test_a_prompt_progresses_under_any_target(long_model):
    """A target no step can meet: each step still takes MIN_CHUNK of the prompt, and only of one
    prompt; decodes go on every step."""
    sched = scheduler(long_model, max_step_latency_ms=1e-3)
    chunks, steps = prompt_chunks(sched, prompt_len=1000)
    assert chunks == [MIN_CHUNK] * 7 + [1000 - 7 * MIN_CHUNK]
    assert all(len(q_lens) == STREAMS + 1 for q_lens, _ in steps)


def test_target_off_schedules_by_the_budget(long_model):
    """Off (0, and the default on a CPU): the budget's schedule, decodes first, the prompt filling the rest."""
    assert scheduler(long_model).step_cost is None
    sched = scheduler(long_model, max_step_latency_ms=0, max_num_batched_tokens=DEFAULT_CHUNK_BUDGET)
    assert sched.step_cost is None
    chunks, _ = prompt_chunks(sched)
    rest = DEFAULT_CHUNK_BUDGET - STREAMS
    assert chunks == [rest] * (8192 // rest) + [8192 % rest]


def test_config(long_model):
    """One setting, resolved once: the flag (and so the TOML key), its bounds, off by default here."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    config = EngineArgs.from_cli_args(parser.parse_args([long_model, "--max-step-latency-ms", "5"])).resolve()
    assert config.max_step_latency_ms == 5.0 and config.max_num_batched_tokens == DEFAULT_TARGET_BUDGET
    assert config.step_token_sizes == [16, 32, 64, *range(128, 2049, 128)]
    assert EngineArgs(model=long_model).resolve().max_step_latency_ms is None  # CPU
    assert EngineArgs(model=long_model).resolve(device="cuda").max_step_latency_ms is None  # not a GPU seen here
    for value in (-1, 1001, float("nan"), True, "7"):
        with pytest.raises(ValueError, match="max_step_latency_ms"):
            EngineArgs(model=long_model, max_step_latency_ms=value).resolve()
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        EngineArgs(model=long_model, max_step_latency_ms=5, enable_chunked_prefill=False).resolve()


def staggered(engine, prompts, max_tokens=8):
    """The first prompt alone for a step (its time, far over a 1 µs target, teaches the model
    that no chunk fits), then the others: one chunk a step, beside the decodes. Their tokens."""
    tokens = {str(i): [] for i in range(len(prompts))}
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy)
        if i == 0:
            for out in engine.step():
                tokens[out.request_id] += out.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_tokens_are_transformers_whatever_the_chunks(tiny, async_scheduling):
    """Streams decoding beside prompts cut by the target (one chunk of at most MIN_CHUNK a step
    here) get transformers' greedy tokens, as with the target off; and every step with a chunk
    that samples reaches the model with its time, whether the engine waits for each step or
    reads a step's tokens after launching the next."""
    path, model = tiny
    rng = random.Random(0)
    prompts = [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in (5, 9, 200, 150)]
    expected = [hf_greedy(model, p, 8) for p in prompts]
    for target in (1e-3, 0):
        engine = LLM(str(path), max_step_latency_ms=target, max_num_batched_tokens=256, max_num_seqs=4,
                     async_scheduling=async_scheduling).engine
        assert staggered(engine, prompts) == expected
        cost = engine.scheduler.step_cost
        if cost:  # 5 alone; then 9, 200 (128 + 72), 150 (128 + 22) a chunk a step, each beside decodes
            n = cost.num_observed  # async: the second step is scheduled before the first is timed
            assert (n >= 3 if async_scheduling else n == 6) and all(0 < ms < 60e3 for ms in cost.y[:n])
            assert async_scheduling or list(cost.x[:n, 1]) == [5, 10, 130, 74, 131, 25]  # tokens of each step
