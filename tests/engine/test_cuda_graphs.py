"""CUDA graphs and the fused CUDA path, against eager and transformers (GPU only; run through
the device tool, skipped on CPU). The CPU-side pieces (bucket sizes, step shapes) run anywhere."""

import logging

import pytest
import torch

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.config import capture_sizes, step_shapes

from tests.engine.builders import build_drafting_model, build_qwen3, hf_greedy

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = [[5, 17, 2, 99, 31, 8, 64], [200, 3], list(range(40, 63)), [7] * 11, [1, 2, 3], [9] * 30, [4, 4], [77]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHAPE = dict(head_dim=32)  # the tiny default's head_dim 24 is covered too (masked kernels): see below


def test_capture_sizes():
    assert capture_sizes(None, None, 16) == [1, 2, 4, 8, 16]
    assert capture_sizes(None, None, 20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(None, 12, 64) == [1, 2, 4, 8, 12]
    assert capture_sizes([1, 3, 99], None, 64) == [1, 3]


def test_step_shapes():
    """Plain decode, and speculative steps verifying j drafts and proposing any number (from a
    probe of k + 1, a move to k - 1 asks for k + 1 verified and k - 1 proposed)."""
    assert step_shapes(0) == [(None, 1)]
    assert step_shapes(2) == [(None, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2), (0, 3), (1, 3), (2, 3)]
    assert len(step_shapes(3)) == 1 + 4 * 4 - 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs")
    return path, build_qwen3(path, **SHAPE)


def generate(path, prompts, **kwargs):
    llm = LLM(str(path), device="cuda", max_num_seqs=8, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


def record_replays(llm):
    """Every graph replay from now on: (key, copies of its outputs: hidden, logits, greedy)."""
    graphs, calls = llm.engine.runner.graphs, []
    replay = graphs.replay

    def recorded(key, n):
        out = replay(key, n)
        calls.append((key, [None if t is None else t.clone() for t in out]))
        return out
    graphs.replay = recorded
    return calls


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_equals_eager_logits(checkpoint, dtype):
    """The same step through the graph and eagerly. Not bit-identical: capture runs on a side
    stream, where cuBLAS may pick another kernel (seen on the H200 in fp32 at batch 1), and a
    padded batch runs its GEMMs with more rows; so only rounding may differ."""
    from jetserve.engine.model.attention import AttentionMetadata

    llm, _ = generate(checkpoint[0], PROMPTS[:3], dtype=dtype)
    runner = llm.engine.runner
    for batch in (1, 3, 8):  # 3 pads to bucket 4
        ctx = [10 + 3 * b for b in range(batch)]
        tables = [[2 * b, 2 * b + 1] for b in range(batch)]  # block_size 16: two blocks each
        meta = AttentionMetadata.build([1] * batch, ctx, tables, runner.block_size, runner.device,
                                       runner.config.fused_kernels)
        ids = torch.randint(0, 300, (batch,), device="cuda")
        pos = torch.tensor([c - 1 for c in ctx], device="cuda")
        key = runner.graphs.key(None, 1, batch, 2)
        runner.graphs.stage(key, ids.tolist(), pos.tolist(), ctx, tables, [(0.0, 0.0, 0)] * batch)  # greedy draws
        graphed = runner.graphs.replay(key, batch)[0].clone()
        eager = runner.model(ids, pos, runner.kv_cache, meta)
        tol = 1e-5 if dtype == "float32" else 2e-2
        torch.testing.assert_close(graphed, eager, rtol=tol, atol=tol)


@gpu
@pytest.mark.gpu
def test_greedy_graphs_equal_eager_and_transformers(checkpoint):
    """Every batch size 1..8 (buckets 1, 2, 4, 8: padded ones included) plus one above the largest."""
    path, hf_model = checkpoint
    reference = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in PROMPTS]
    _, eager = generate(path, PROMPTS, enforce_eager=True, dtype="float32")
    assert eager == reference
    for n in range(1, 9):
        llm = LLM(str(path), device="cuda", max_num_seqs=8, dtype="float32", cudagraph_capture_sizes=[1, 2, 4])
        calls = record_replays(llm)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:n]], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference[:n], n
        assert bool(calls) == (n <= 4), n  # above the largest bucket every step runs eagerly
    assert llm.engine.model_info.cuda_graphs is True


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])  # 3 pads to bucket 4
def test_graph_logits_equal_eager(checkpoint, batch):
    """The decode graph ends in the vocab projection and the greedy argmax: its tokens are
    eager's and transformers', and its logits rows are eager `compute_logits` of its hidden rows."""
    path, hf_model = checkpoint
    prompts = PROMPTS[:batch]
    reference = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert generate(path, prompts, enforce_eager=True, dtype="float32")[1] == reference
    # Synchronous, for the exact count of decode replays (async scheduling launches one more past the end).
    llm = LLM(str(path), device="cuda", max_num_seqs=8, dtype="float32", cudagraph_capture_sizes=[1, 2, 4],
              async_scheduling=False)
    calls = record_replays(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    decodes = [out for key, out in calls if key == (None, 1, 1 if batch == 1 else 4)]
    assert len(decodes) == GREEDY.max_tokens - 1  # every step after the prefill
    model = llm.engine.runner.model
    for hidden, logits, greedy in decodes:
        assert hidden.shape[0] == logits.shape[0] == greedy.shape[0] == batch
        with torch.inference_mode():  # the engine's mode (the fused kernels have no backward)
            eager = model.compute_logits(hidden).float()
        torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
        assert torch.equal(greedy, logits.argmax(-1))


@gpu
@pytest.mark.gpu
def test_async_scheduling_with_graphs_equals_transformers(checkpoint):
    """Step N+1 takes step N's tokens on the device into the graph's staged ids: same tokens,
    also once sequences finish one by one and the rest take their tokens from other rows."""
    path, hf_model = checkpoint
    params = [SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    reference = [hf_greedy(hf_model, p, GREEDY.max_tokens)[:sp.max_tokens] for p, sp in zip(PROMPTS, params)]
    llm = LLM(str(path), device="cuda", max_num_seqs=8, dtype="float32", async_scheduling=True)
    runner, filled = llm.engine.runner, []
    fill = runner._fill_pending

    def spy(ids, pending):
        filled.append(ids is runner.graphs.ids)
        fill(ids, pending)
    runner._fill_pending = spy
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference and llm.engine.scheduler.blocks.num_used == 0
    assert any(filled)  # pending tokens went into a replayed graph's inputs


@gpu
@pytest.mark.gpu
def test_odd_head_dim_graphed(tmp_path):
    hf_model = build_qwen3(tmp_path)  # head_dim 24: the kernels' masked (non power of 2) path
    reference = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in PROMPTS[:4]]
    assert generate(tmp_path, PROMPTS[:4], dtype="float32")[1] == reference


@gpu
@pytest.mark.gpu
def test_failing_bucket_falls_back_to_eager(checkpoint, caplog, monkeypatch):
    from jetserve.engine.cuda_graphs import CUDAGraphs

    step = CUDAGraphs._step

    def broken(self, layer, q_len, bucket):
        if bucket == 4:
            raise RuntimeError("simulated capture failure")
        return step(self, layer, q_len, bucket)
    monkeypatch.setattr(CUDAGraphs, "_step", broken)
    with caplog.at_level(logging.WARNING, logger="jetserve.engine.cuda_graphs"):
        llm, tokens = generate(checkpoint[0], PROMPTS[:3], dtype="float32")
    lines = [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(lines) == 1 and "batch size 4" in lines[0] and "eagerly" in lines[0], lines
    assert sorted(b for _, _, b in llm.engine.runner.graphs.graphs) == [1, 2, 8]
    assert tokens == generate(checkpoint[0], PROMPTS[:3], dtype="float32", enforce_eager=True)[1]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("budget", [7, 64])
def test_mixed_steps_graphed_equal_transformers(checkpoint, budget):
    """Prefill chunks (mid-block, beside decodes; budget 7) and whole prompts with decodes (64)
    replay the mixed-step graphs, padded to their token bucket: transformers' greedy tokens, the
    blocks all freed, and no kernel shape met after start-up tuning."""
    path, hf_model = checkpoint
    prompts = PROMPTS + [list(range(3, 120))]
    reference = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(str(path), device="cuda", max_num_seqs=8, dtype="float32", max_num_batched_tokens=budget)
    runner, buckets = llm.engine.runner, []
    replay = runner.mixed.replay

    def recorded(bucket, n):
        buckets.append(bucket)
        return replay(bucket, n)
    runner.mixed.replay = recorded
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert set(buckets) == {7} if budget == 7 else {64} <= set(buckets) <= {16, 32, 64}, set(buckets)
    assert llm.engine.scheduler.blocks.num_used == 0 and runner.kernels.untuned == set()


@gpu
@pytest.mark.gpu
def test_a_served_core_captures_its_mixed_step_graphs_when_idle(checkpoint):
    """`jetserve serve`'s core (defer_capture) reaches SERVING with the decode graphs only; its
    prefill steps run eagerly meanwhile, each idle turn captures one mixed-step bucket, compiling
    nothing, and afterwards the prefills replay those graphs: transformers' tokens throughout,
    prompts that hit the prefix cache of the earlier requests included."""
    from jetserve.engine import EngineArgs, compile_watch
    from jetserve.engine.core import AddRequest, EngineCore
    from jetserve.engine.prompts import token_array

    path, hf_model = checkpoint
    config = EngineArgs(model=str(path), device="cuda", max_num_seqs=8, dtype="float32",
                        max_num_batched_tokens=64).resolve()
    core = EngineCore(config, defer_capture=True)
    runner = core.runner
    assert runner.deferred and not runner.mixed.graphs and runner.graphs.graphs

    def generate_all(prompts):
        for i, p in enumerate(prompts):
            core.add(AddRequest(f"r{len(core.requests)}-{i}", token_array(p), GREEDY, 0.0))
        ids = list(core.requests)
        tokens = {rid: [] for rid in ids}
        while core.has_work():
            for out in core.step():
                tokens[out.request_id] += out.token_ids
        return [tokens[rid] for rid in ids]

    prompts = PROMPTS + [list(range(3, 120))]
    reference = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    assert generate_all(prompts) == reference
    compiled, captures = compile_watch.count(), 0
    while runner.capture_deferred():
        captures += 1
    assert captures + 1 == len(runner.mixed.sizes) and set(runner.mixed.graphs) == set(runner.mixed.sizes)
    assert compile_watch.count() == compiled
    buckets, replay = [], runner.mixed.replay
    runner.mixed.replay = lambda bucket, n: buckets.append(bucket) or replay(bucket, n)
    assert generate_all(prompts) == reference  # the same prompts: prefix-cache hits on blocks written before
    assert buckets and core.scheduler.blocks.num_used == 0


@gpu
@pytest.mark.gpu
def test_enforce_eager_captures_nothing(checkpoint):
    llm, _ = generate(checkpoint[0], PROMPTS[:1], enforce_eager=True)
    assert llm.engine.runner.graphs is None and llm.engine.model_info.cuda_graphs is False


@gpu
@pytest.mark.gpu
def test_speculative_verify_and_drafts_graphed(tmp_path):
    path = build_drafting_model(tmp_path, mtp_layers=1)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    prompts = [[t % 64 for t in p] for p in PROMPTS[:4]]  # build_drafting_model's vocab is 64
    _, plain = generate(path, prompts, dtype="float32", enforce_eager=True)
    llm = LLM(path, device="cuda", max_num_seqs=8, dtype="float32", speculative_config=spec)
    calls = record_replays(llm)
    runner, chained = llm.engine.runner, []
    launch = runner.launch_speculative
    runner.launch_speculative = lambda batch, k, after=None: chained.append(after is not None) or launch(batch, k, after)
    keys = llm.engine.runner.graphs.graphs
    assert (2, 3, 4) in keys and (1, 3, 4) in keys and (0, 3, 4) in keys and (0, 1, 4) not in keys  # (proposed, verified + 1, bucket)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain  # lossless, graphed, steps chained on the device
    assert (2, 3, 4) in {key for key, _ in calls} and llm.engine.stats().num_accepted_tokens > 0
    assert llm.engine.config.async_scheduling and sum(chained) > 0, chained


@gpu
@pytest.mark.gpu
def test_drafting_prefills_replay_their_mtp_pass_graph(tmp_path):
    """A drafting engine's prefill step replays its mixed-step graph, then, once its tokens are
    sampled, the graph of its MTP pass: the MTP layer's KV cache of the prompts is what an eager
    engine writes, and the greedy tokens with drafting are the plain ones."""
    path = build_drafting_model(tmp_path, mtp_layers=1)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    prompts = [{"prompt_token_ids": [t % 64 for t in p]} for p in PROMPTS[:4]]  # build_drafting_model's vocab is 64
    common = dict(device="cuda", max_num_seqs=8, dtype="float32", speculative_config=spec, num_kv_blocks=64)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # a prefill step and nothing after it
    eager = LLM(path, enforce_eager=True, **common)
    eager.generate(prompts, first, use_tqdm=False)
    llm = LLM(path, **common)
    runner = llm.engine.runner
    assert runner.mixed.mtp_graphs and set(runner.mixed.mtp_graphs) == set(runner.mixed.graphs)
    passes = []
    replay = runner.mixed.replay_mtp_pass
    runner.mixed.replay_mtp_pass = lambda bucket, shifted: passes.append(bucket) or replay(bucket, shifted)
    llm.generate(prompts, first, use_tqdm=False)
    assert len(passes) == 1
    used = runner.num_blocks * runner.block_size  # the scratch block past them takes padded rows
    torch.testing.assert_close(runner.kv_cache[-1, :, :used], eager.engine.runner.kv_cache[-1, :, :used],
                               rtol=1e-4, atol=1e-4)
    _, plain = generate(path, [p["prompt_token_ids"] for p in prompts], dtype="float32", enforce_eager=True)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain and llm.engine.stats().num_accepted_tokens > 0


@gpu
@pytest.mark.gpu
def test_sampling_is_drawn_inside_the_graphs_as_eagerly(tmp_path):
    """Temperature and min-p draws run inside the decode and speculative graphs (no eager
    speculative step, no eager draw after a decode replay); a seeded request gets the same tokens
    there as eagerly, for k = 0..3, alone or beside greedy, top-p and logprobs requests (those
    take the eager path for their batch). fp32, so that graph and eager logits agree bit for bit."""
    from jetserve.engine import runner as runner_module

    path = build_drafting_model(tmp_path, mtp_layers=1)
    prompts = [[t % 64 for t in p] for p in PROMPTS[:4]]
    seeded = [SamplingParams(temperature=0.8, min_p=0.02 * i, max_tokens=16, ignore_eos=True, seed=7 + i)
              for i in range(2)]
    others = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.8, max_tokens=16, ignore_eos=True, seed=3, logprobs=2)]

    def run(k, params, **kwargs):
        spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False} if k else None
        llm = LLM(path, device="cuda", max_num_seqs=8, dtype="float32", speculative_config=spec, **kwargs)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts[:len(params)]], params, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in out]

    _, eager = run(0, seeded, enforce_eager=True)
    eager_samples = []
    sample = runner_module.sample
    runner_module.sample = lambda *a, **kw: eager_samples.append(1) or sample(*a, **kw)
    try:
        for k in (0, 1, 3):
            llm, graphed = run(k, seeded)
            assert graphed == eager, k
            assert len(eager_samples) <= 2, k  # the first tokens (after the prefill); every decode draw in a graph
            eager_samples.clear()
            if k:
                assert llm.engine.stats().num_accepted_tokens > 0
    finally:
        runner_module.sample = sample
    for k in (0, 3):
        _, mixed = run(k, seeded + others)
        assert mixed[:2] == eager, k
