"""Async scheduling (step N+1 launched before step N's tokens are read) changes no result."""

import asyncio

import pytest
import torch

from jetserve.engine import LLM, AsyncLLM, EngineArgs, SamplingParams
from jetserve.engine.llm_engine import LLMEngine
from tests.engine.builders import CORPUS, build_drafting_model, build_qwen3, hf_greedy

PROMPTS = [[5, 17, 2, 99, 31, 8, 64], [200, 3], list(range(40, 63)), [7] * 11]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("async")
    model = build_qwen3(path, seed=3)
    return path, [hf_greedy(model, p, 8) for p in PROMPTS]


@pytest.mark.parametrize("budget", [1, 4, 7, 512])
def test_greedy_matches_transformers(checkpoint, budget):
    path, reference = checkpoint
    llm = LLM(str(path), max_num_seqs=8, max_num_batched_tokens=budget, block_size=4, async_scheduling=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert llm.engine.scheduler.blocks.num_used == 0


def test_preemption_is_exact(checkpoint):
    path, reference = checkpoint
    llm = LLM(str(path), num_kv_blocks=8, block_size=4, max_model_len=32, max_num_batched_tokens=16,
              async_scheduling=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert llm.engine.scheduler.blocks.num_used == 0


def test_same_text_stops_and_seeds_as_synchronous(tiny):
    """EOS, stop strings, max_tokens and seeded sampling end requests exactly where they would."""
    path, _ = tiny
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, stop=["e", "的"]) for s in range(4)] + \
             [SamplingParams(temperature=0.8, seed=9, max_tokens=5), SamplingParams(temperature=0, max_tokens=30)]
    prompts = [CORPUS[i % len(CORPUS)] for i in range(len(params))]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=async_scheduling)
        results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                        for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.scheduler.blocks.num_used == 0
    assert results[0] == results[1]
    assert {reason for _, _, reason in results[1]} >= {"stop", "length"}


def test_abort_while_a_step_is_in_flight(checkpoint):
    path, _ = checkpoint
    engine = LLMEngine(EngineArgs(model=str(path), async_scheduling=True).resolve())
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.core.pipeline.in_flight is not None and engine.scheduler.blocks.num_used > 0
    engine.abort("a")
    outputs = engine.step()
    assert all(o.request_id == "b" for o in outputs)
    engine.abort("b")
    engine.step()  # drains the step launched before the abort; its tokens are dropped
    assert engine.scheduler.blocks.num_used == 0 and not engine.has_unfinished_requests()


def test_streams_through_the_async_engine(checkpoint):
    path, reference = checkpoint

    async def main():
        engine = AsyncLLM(EngineArgs(model=str(path), async_scheduling=True).resolve())
        engine.start()
        try:
            async def one(prompt):
                tokens = []
                async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY):
                    tokens += out.outputs[0].token_ids
                return tokens
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == reference


def test_with_speculative_decoding(tmp_path):
    """Drafting under --async-scheduling: its steps run one at a time (their inputs depend on
    the accepted count), with the same tokens as without either."""
    path = build_drafting_model(tmp_path)
    prompts = [{"prompt_token_ids": [t % 64 for t in p]} for p in PROMPTS]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    plain = LLM(path, max_num_seqs=8, block_size=4).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(path, max_num_seqs=8, block_size=4, async_scheduling=True, speculative_config=spec)
    drafted = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats().num_accepted_tokens > 0 and llm.engine.scheduler.blocks.num_used == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_requests_that_read_the_host_step_in_turn(tiny, device):
    """Penalties, bad_words, min_tokens, logprobs and prompt_logprobs read a step's tokens or logits
    on the host: while one is unfinished the engine catches up with the step in flight and steps
    one at a time, with the same tokens, text and logprobs as without async scheduling; then it
    overlaps again (on a GPU: graphed steps, the default there)."""
    path, _ = tiny
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0.9, seed=5, max_tokens=12, repetition_penalty=1.4, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=6, bad_words=["e"]),
              SamplingParams(temperature=1.0, seed=2, max_tokens=12, stop=["e"])]
    prompts = [CORPUS[i % len(CORPUS)] for i in range(len(params))]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(path), device=device, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                  async_scheduling=async_scheduling)
        results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].logprobs, o.prompt_logprobs)
                        for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.scheduler.blocks.num_used == 0 and llm.engine.core.num_reading_host == 0
    assert results[0] == results[1]
    assert results[1][1][2] is not None and results[1][1][3] is not None

    engine = llm.engine
    engine.add_request("plain", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.core.pipeline.in_flight is not None
    engine.add_request("host", {"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
    caught_up = engine.step()  # the step in flight, read: "host" has not run yet
    assert [o.request_id for o in caught_up] == ["plain"] and engine.core.pipeline.in_flight is None
    while "host" in engine.requests:
        assert engine.core.pipeline.in_flight is None
        engine.step()
    engine.step()
    assert engine.core.pipeline.in_flight is not None  # overlapping again
    engine.abort("plain")


def test_through_the_engine_core_process(tiny):
    """The core in its own process, stepping asynchronously: seeded samples, stop strings, EOS and
    max_tokens end exactly where a synchronous LLM ends them, and a stream left mid-way frees
    every KV block across the process boundary."""
    path, _ = tiny
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, stop=["e", "的"]) for s in range(3)] + \
             [SamplingParams(temperature=0.8, seed=9, max_tokens=5), SamplingParams(temperature=0, max_tokens=30)]
    prompts = [CORPUS[i % len(CORPUS)] for i in range(len(params))]
    flags = dict(model=str(path), max_num_seqs=4, max_num_batched_tokens=32)
    expected = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                for o in LLM(**flags).generate(prompts, params, use_tqdm=False)]

    async def main():
        engine = AsyncLLM(EngineArgs(**flags, async_scheduling=True).resolve())
        assert engine.config.engine_core_process
        engine.start()
        try:
            async def one(prompt, sampling):
                tokens, text, reason = [], "", None
                async for out in engine.generate(prompt, sampling):
                    tokens, text, reason = tokens + out.outputs[0].token_ids, text + out.outputs[0].text, \
                        out.outputs[0].finish_reason
                return tokens, text, reason
            results = await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
            stream = engine.generate(CORPUS[0], SamplingParams(max_tokens=200, ignore_eos=True))
            async for _ in stream:  # one delta, then the reader leaves: the request is aborted
                break
            await stream.aclose()
            for _ in range(400):  # the core's stats come with every step and every idle tick (0.5 s)
                stats = engine.stats()
                if stats.kv_blocks_used == 0 and stats.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            return results, stats
        finally:
            engine.shutdown()

    results, stats = asyncio.run(main())
    assert [tuple(r) for r in results] == expected
    assert {reason for _, _, reason in expected} >= {"stop", "length"}
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
