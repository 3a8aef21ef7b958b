"""Random workloads against the scheduler's promises: whatever the budget, the step latency
target, the KV pool, async scheduling, draft length, prefix caching or aborts, every finished
request has the reference greedy tokens and no block outlives its request."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jetserve.engine import EngineArgs, SamplingParams
from jetserve.engine.llm_engine import LLMEngine
from tests.engine.builders import build_drafting_model

VOCAB, MAX_MODEL_LEN, BLOCK = 64, 64, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_drafting_model(tmp_path_factory.mktemp("props"), vocab=VOCAB)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of one prompt alone: no chunking, no drafting, a pool that never runs out."""
    engine = LLMEngine(EngineArgs(model=model, max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=False,
                                  enable_prefix_caching=False).resolve())
    cache = {}

    def greedy(prompt, max_tokens):
        if prompt not in cache:
            engine.add_request("ref", {"prompt_token_ids": list(prompt)}, SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True))
            tokens = []
            while engine.has_unfinished_requests():
                tokens += [t for out in engine.step() for t in out.outputs[0].token_ids]
            cache[prompt] = tokens
        return cache[prompt][:max_tokens]
    return greedy


token_run = st.lists(st.integers(0, VOCAB - 1), max_size=20).map(tuple)
workload = st.fixed_dictionaries({
    # Prompts share prefixes (a system prompt, say), so the prefix cache has something to find.
    "prefixes": st.lists(token_run, min_size=1, max_size=2),
    "prompts": st.lists(st.tuples(st.integers(0, 1), token_run, st.integers(1, 24)), min_size=1, max_size=6),
    "prefix_caching": st.booleans(),
    "budget": st.integers(1, 24),
    "step_latency_ms": st.sampled_from([0, 1e-3, 1000]),  # off, never met (one chunk a step), always met
    "blocks": st.integers(MAX_MODEL_LEN // BLOCK + 4, 60),
    "mode": st.sampled_from(["sync", "async", "mtp-1", "mtp-3"]),
    "aborts": st.lists(st.tuples(st.integers(0, 5), st.integers(0, 60)), max_size=3),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=workload)
def test_random_workloads_keep_tokens_and_blocks(model, reference, w):
    # Fixed k: every drafting workload drafts (the adaptive policy would keep a CPU's off).
    spec = ({"method": "mtp", "num_speculative_tokens": int(w["mode"][-1]), "adaptive": False}
            if w["mode"].startswith("mtp") else None)
    engine = LLMEngine(EngineArgs(model=model, max_model_len=MAX_MODEL_LEN, block_size=BLOCK, max_num_seqs=4,
                                  max_num_batched_tokens=w["budget"], num_kv_blocks=w["blocks"],
                                  max_step_latency_ms=w["step_latency_ms"],
                                  async_scheduling=w["mode"] == "async", speculative_config=spec,
                                  enable_prefix_caching=w["prefix_caching"]).resolve())
    prompts = [((w["prefixes"][p % len(w["prefixes"])] + own) or (0,), max_tokens)
               for p, own, max_tokens in w["prompts"]]
    for i, (prompt, max_tokens) in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": list(prompt)},
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    aborts = {(str(i), step) for i, step in w["aborts"]}
    tokens, reasons = {str(i): [] for i in range(len(prompts))}, {}
    for step in range(2000):
        if not engine.has_unfinished_requests():
            break
        for request_id in [r for r, s in aborts if s == step]:
            final = engine.abort(request_id)
            if final is not None:
                reasons[request_id] = final.outputs[0].finish_reason
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                reasons[out.request_id] = out.outputs[0].finish_reason
    assert not engine.has_unfinished_requests(), "every request ends"
    for i, (prompt, max_tokens) in enumerate(prompts):
        want = reference(prompt, max_tokens)
        if reasons[str(i)] == "abort":
            assert tokens[str(i)] == want[:len(tokens[str(i)])]
        else:
            assert (tokens[str(i)], reasons[str(i)]) == (want, "length")
    assert engine.scheduler.blocks.num_used == 0
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks and sorted(engine.scheduler.blocks.free_blocks) == list(
        range(engine.scheduler.blocks.num_blocks))
