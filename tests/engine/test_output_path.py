"""One output path: offline `LLM` and the service's `AsyncLLM` (its engine core in its own
process) give the same completions for the same seeded requests, because both are the same
engine core behind a client and the same `OutputProcessor`: text, token ids, logprobs and their
text, prompt logprobs, where stop strings, stop token ids, EOS and max_tokens end a request, and
each of n completions."""

import asyncio
import copy

import pytest

from jetserve.engine import LLM, AsyncLLM, EngineArgs, SamplingParams
from tests.engine.builders import CORPUS

REQUESTS = [
    (CORPUS[0], SamplingParams(temperature=1.0, seed=1, max_tokens=24, stop=["u", "的"])),
    (CORPUS[1], SamplingParams(temperature=1.0, seed=2, max_tokens=24, stop=["天", "o"],
                               include_stop_str_in_output=True, logprobs=2)),
    (CORPUS[2], SamplingParams(temperature=0.8, seed=3, max_tokens=16, stop_token_ids=list(range(100, 164)))),
    (CORPUS[0], SamplingParams(temperature=0, max_tokens=9, logprobs=3, prompt_logprobs=2)),
    # n > 1 on a prompt of several blocks: the service holds the later completions back until
    # the first has cached the prompt's KV; offline sends all three at once.
    (CORPUS[0] * 2, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, stop=["d", "8"], logprobs=1)),
    (CORPUS[1], SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=10, prompt_logprobs=1)),
    ({"prompt_token_ids": [5, 17, 2, 99]}, SamplingParams(temperature=0, max_tokens=30)),
]


def logprobs_of(entries):
    """Per position {token: (rank, text)} exactly, and the log-probabilities apart (a batch of
    another shape may move them in the last bits on a CPU)."""
    if entries is None:
        return None, None
    return ([None if e is None else {t: (p.rank, p.decoded_token) for t, p in e.items()} for e in entries],
            [None if e is None else {t: p.logprob for t, p in e.items()} for e in entries])


def summary(output):
    completions = []
    for o in sorted(output.outputs, key=lambda o: o.index):
        tokens, values = logprobs_of(o.logprobs)
        completions.append(((o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason, tokens), values))
    prompt_tokens, prompt_values = logprobs_of(output.prompt_logprobs)
    return ((list(output.prompt_token_ids), output.finished, [c for c, _ in completions], prompt_tokens),
            ([v for _, v in completions], prompt_values))


def close(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    return a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_offline_and_service_give_the_same_outputs(tiny, async_scheduling):
    path, _ = tiny
    flags = dict(model=str(path), max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
                 async_scheduling=async_scheduling)
    llm = LLM(**flags)
    offline = llm.generate([p for p, _ in REQUESTS], [s for _, s in REQUESTS], use_tqdm=False)
    assert not llm.engine.core.requests and llm.engine.stats().kv_blocks_used == 0
    # A stop string ends a request in the front end, which aborts it in the core at once.
    alone = llm.generate(*REQUESTS[0], use_tqdm=False)[0].outputs[0]
    assert alone.stop_reason == "u" and not llm.engine.core.requests and llm.engine.stats().kv_blocks_used == 0

    async def serve():
        engine = AsyncLLM(EngineArgs(**flags).resolve())
        assert engine.config.engine_core_process
        engine.start()
        try:
            async def one(prompt, params):
                merged = None
                async for delta in engine.generate(prompt, params):
                    if merged is None:
                        merged = copy.deepcopy(delta)
                    else:
                        merged.merge(delta)
                return merged
            results = await asyncio.gather(*(one(p, s) for p, s in REQUESTS))
            for _ in range(400):  # the core's stats come with every step and every idle tick (0.5 s)
                if engine.stats().kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.05)
            return results, engine.stats()
        finally:
            engine.shutdown()

    served, stats = asyncio.run(serve())
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    for want, got in zip(offline, served):
        (want_exact, want_values), (got_exact, got_values) = summary(want), summary(got)
        assert got_exact == want_exact
        assert close(got_values, want_values)
    # The requests cover what they are meant to: each way to stop, logprobs, n > 1.
    completions = [c for o in offline for c in o.outputs]
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    assert {type(c.stop_reason) for c in completions} == {str, int, type(None)}
    assert offline[0].outputs[0].stop_reason == "u" and offline[1].outputs[0].text.endswith(("天", "o"))
    assert {c.stop_reason for c in offline[4].outputs} >= {"d", "8"}
    assert [len(o.outputs) for o in offline[4:6]] == [3, 2] and len({tuple(c.token_ids) for c in offline[4].outputs}) == 3
    assert offline[3].outputs[0].logprobs and offline[3].prompt_logprobs and offline[5].prompt_logprobs
