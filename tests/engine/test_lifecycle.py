"""Requests that end early or get squeezed: abort, preemption, bad input, streaming text."""

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from jetserve.engine import LLM, AsyncLLM, EngineArgs, SamplingParams
from jetserve.engine.model.checkpoint import CheckpointError
from jetserve.engine.errors import PromptTooLongError, QueueFullError
from jetserve.engine.llm_engine import LLMEngine
from jetserve.engine.offline.mtp_checkpoint import merge
from tests.engine.builders import CORPUS, build_qwen3, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def engine(path, **kwargs):
    return LLMEngine(EngineArgs(model=str(path), **kwargs).resolve())


def run_until(eng, predicate, limit=500):
    for _ in range(limit):
        if predicate():
            return
        eng.step()
    raise AssertionError("condition never reached")


def test_abort_mid_prefill_and_mid_decode_frees_every_block(tiny):
    path, _ = tiny
    eng = engine(path, max_num_batched_tokens=4, block_size=4)
    eng.add_request("decode", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    eng.add_request("prefill", {"prompt_token_ids": list(range(30))}, GREEDY)
    seqs = {r: eng.requests[r].seq for r in ("prefill", "decode")}
    run_until(eng, lambda: seqs["decode"].num_output_tokens >= 2)
    assert 0 < seqs["prefill"].num_computed_tokens < 30, "the long prompt is part-way through prefill"
    assert eng.scheduler.blocks.num_used > 0
    final = eng.abort("prefill")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    eng.abort("decode")
    assert eng.scheduler.blocks.num_used == 0 and not eng.has_unfinished_requests()
    assert eng.abort("decode") is None  # a second abort is harmless


def test_a_refused_request_leaves_the_running_ones_alone(tiny):
    """A second request under a running one's id, or one the core refuses (a token id past the
    vocabulary in stop_token_ids, checked there), is refused whole: n = 2 leaves no completion
    behind, and the running request finishes as if alone."""
    path, _ = tiny
    eng = engine(path)
    eng.add_request("a", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    with pytest.raises(ValueError, match="already"):
        eng.add_request("a", {"prompt_token_ids": [4, 5]}, GREEDY)
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.add_request("b", {"prompt_token_ids": [4, 5]}, SamplingParams(n=2, stop_token_ids=[10**6]))
    assert list(eng.requests) == ["a"] and list(eng.output_processor.parents) == ["a"]
    tokens = []
    while eng.has_unfinished_requests():
        tokens += [t for out in eng.step() for t in out.outputs[0].token_ids]
    assert len(tokens) == GREEDY.max_tokens and eng.scheduler.blocks.num_used == 0


def test_preemption_under_a_tiny_kv_pool_is_exact(tiny):
    """8 blocks of 4 tokens cannot hold 4 growing sequences: some are preempted and recomputed."""
    path, model = tiny
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5], [8, 9, 7, 9, 3, 2, 3, 8], [4, 6]]
    llm = LLM(str(path), num_kv_blocks=8, block_size=4, max_model_len=32, max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.blocks.num_used == 0
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 12) for p in prompts]


@pytest.mark.parametrize("field, kwargs", [
    ("temperature", dict(temperature=-0.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-3)),
    ("min_p", dict(min_p=2.0)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-4)),
    ("stop", dict(stop=[""])),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_and_engine_args_are_clear_errors(tiny):
    path, _ = tiny
    llm = LLM(str(path), max_model_len=16)
    with pytest.raises(PromptTooLongError, match="max_model_len=16"):
        llm.generate({"prompt_token_ids": list(range(16))}, GREEDY)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", GREEDY)
    with pytest.raises(ValueError, match="not a token id"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, GREEDY)
    assert llm.engine.scheduler.blocks.num_used == 0 and not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(path), max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(path), max_model_len=10**6)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(str(path), gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(path), dtype="float8")
    with pytest.raises(ValueError, match=r"cudagraph_capture_sizes must be an integer in \[1, 2147483647\], got 0"):
        LLM(str(path), cudagraph_capture_sizes=[4, 0])
    with pytest.raises(ValueError, match=r"max_num_seqs must be an integer in \[1, 2147483647\], got 1180591620717411303424"):
        LLM(str(path), max_num_seqs=2**70)  # once a memory plan "fitting max_num_seqs=0" instead
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        LLM(str(path), max_cudagraph_capture_size=-1)
    with pytest.raises(ValueError, match="without chunked prefill"):
        LLM(str(path), enable_chunked_prefill=False, max_num_batched_tokens=8)


def test_checkpoint_errors_name_the_problem(tiny, tmp_path):
    path, _ = tiny
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")

    def checkpoint(name, config=config, tensors=tensors):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        if tensors is not None:
            save_file(tensors, d / "model.safetensors")
        return str(d)

    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        LLM(checkpoint("missing", tensors=missing))
    bad = dict(tensors, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 64)})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[8, 64\], expected \[48, 64\]"):
        LLM(checkpoint("misshaped", tensors=bad))
    with pytest.raises(CheckpointError, match="unknown architecture 'LlamaForCausalLM'"):
        LLM(checkpoint("llama", config=dict(config, architectures=["LlamaForCausalLM"])))
    unreadable = checkpoint("unreadable", tensors=None)
    (tmp_path / "unreadable" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        LLM(unreadable)
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        LLM(checkpoint("empty", tensors=None))


def _mtp_tensors(hidden, inter, heads, kv_heads, head_dim, seed=1):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.05  # noqa: E731
    p = "mtp.layers.0."
    return {
        "mtp.fc.weight": r(hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": 1 + r(hidden),
        "mtp.pre_fc_norm_hidden.weight": 1 + r(hidden), "mtp.norm.weight": 1 + r(hidden),
        p + "input_layernorm.weight": 1 + r(hidden), p + "post_attention_layernorm.weight": 1 + r(hidden),
        p + "self_attn.q_proj.weight": r(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": r(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": r(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
        p + "self_attn.q_norm.weight": 1 + r(head_dim), p + "self_attn.k_norm.weight": 1 + r(head_dim),
        p + "mlp.gate_proj.weight": r(inter, hidden), p + "mlp.up_proj.weight": r(inter, hidden),
        p + "mlp.down_proj.weight": r(hidden, inter),
    }


def test_mtp_split_off_and_merged_back_loads_identically(tmp_path):
    full = tmp_path / "full"
    build_qwen3(full)
    config = json.loads((full / "config.json").read_text())
    mtp = _mtp_tensors(64, 96, 4, 2, 24)
    save_file({**load_file(full / "model.safetensors"), **mtp}, full / "model.safetensors")
    (full / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=1)))

    base, heads = tmp_path / "base", tmp_path / "heads"
    base.mkdir()
    heads.mkdir()
    tensors = load_file(full / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, base / "model.safetensors")
    (base / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in tensors.items() if k.startswith("mtp.")}, heads / "model.safetensors")
    merge(base, heads, tmp_path / "merged", max_shard_size="100KB")

    want = LLM(str(full)).engine.runner.model.state_dict()
    got = LLM(str(tmp_path / "merged")).engine.runner.model.state_dict()
    assert len(got["mtp.0.fc.weight"]) == 64 and want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_deepseek_named_mtp_heads_load_like_qwen3_next_ones(tmp_path):
    """`model.layers.{N}.{eh_proj,enorm,hnorm,shared_head.norm}` + block = the same MTP layer."""
    qwen, deepseek = tmp_path / "qwen", tmp_path / "deepseek"
    build_qwen3(qwen)
    config = json.loads((qwen / "config.json").read_text())
    base = load_file(qwen / "model.safetensors")
    mtp = _mtp_tensors(64, 96, 4, 2, 24)
    save_file({**base, **mtp}, qwen / "model.safetensors")
    (qwen / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=1)))
    head = {"mtp.fc.weight": "eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
            "mtp.pre_fc_norm_hidden.weight": "hnorm.weight", "mtp.norm.weight": "shared_head.norm.weight"}
    layer = f"model.layers.{config['num_hidden_layers']}."
    renamed = {layer + (head.get(k) or k.removeprefix("mtp.layers.0.")): v for k, v in mtp.items()}
    deepseek.mkdir()
    save_file({**base, **renamed}, deepseek / "model.safetensors")
    (deepseek / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))

    want = LLM(str(qwen)).engine.runner.model.state_dict()
    got = LLM(str(deepseek)).engine.runner.model.state_dict()
    assert want.keys() == got.keys() and "mtp.0.block.mlp.gate_up_proj.weight" in got
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_streamed_cjk_and_emoji_text_never_has_replacement_chars(tiny):
    path, _ = tiny

    async def stream(engine, prompt, params):
        pieces, ids = [], []
        async for out in engine.generate(prompt, params):
            pieces.append(out.outputs[0].text)
            ids += out.outputs[0].token_ids
        return pieces, ids, out

    async def main():
        engine = AsyncLLM(EngineArgs(model=str(path), max_num_seqs=8).resolve())
        engine.start()
        try:
            params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True) for s in range(6)]
            return engine, await asyncio.gather(*(stream(engine, CORPUS[1 + s % 3], p) for s, p in enumerate(params)))
        finally:
            engine.shutdown()

    engine, results = asyncio.run(main())
    split_chars = 0
    for pieces, ids, final in results:
        text = "".join(pieces)
        assert "\ufffd" not in text
        assert final.finished and final.outputs[0].finish_reason == "length" and len(ids) == 40
        split_chars += sum("\ufffd" in engine.tokenizer.decode([t]) for t in ids)
    # Byte tokens that are only part of a character must really occur, or the test proves nothing.
    assert split_chars > 20
    assert engine.stats().kv_blocks_used == 0


def test_stop_strings_end_the_stream_before_the_stop_text(tiny):
    path, _ = tiny
    llm = LLM(str(path))
    params = dict(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    free = llm.generate(CORPUS[0], SamplingParams(**params), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    stopped = llm.generate(CORPUS[0], SamplingParams(**params, stop=stop), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[:text.index(stop)]
    assert llm.engine.scheduler.blocks.num_used == 0


def test_async_queue_bound_and_cancel(tiny):
    """One running, two waiting fill a queue of two: the next is refused; cancelling frees everything."""
    path, _ = tiny
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        engine = AsyncLLM(EngineArgs(model=str(path), max_num_seqs=1, max_waiting=2).resolve())
        engine.start()
        received = []

        async def consume(i):
            async for out in engine.generate({"prompt_token_ids": [i + 1] * 5}, long):
                received.append(out)

        try:
            tasks = [asyncio.create_task(consume(i)) for i in range(3)]
            for _ in range(100):
                await asyncio.sleep(0.02)
                if received and engine.stats().num_waiting == 2:
                    break
            busy = engine.stats()
            with pytest.raises(QueueFullError, match="waiting queue is full"):
                await engine.generate({"prompt_token_ids": [9]}, long).__anext__()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(100):
                await asyncio.sleep(0.02)
                if engine.stats().kv_blocks_used == 0 and engine.stats().num_waiting == 0:
                    break
            return busy, engine.stats()
        finally:
            engine.shutdown()

    busy, idle = asyncio.run(main())
    assert (busy.num_running, busy.num_waiting) == (1, 2) and busy.kv_blocks_used > 0
    assert (idle.num_running, idle.num_waiting, idle.kv_blocks_used) == (0, 0, 0)


def test_a_request_the_core_cannot_take_gives_its_place_back(tiny):
    """A request that fails on its way into the engine core (here a seed set past 64 bits after
    SamplingParams checked it, which cannot cross to the core's process) gives back its place in
    the queue: more such failures than the queue holds still leave room for the next request. And
    n beyond everything the queue holds is refused as a bad value, naming n, not as a full queue
    that a client would retry for ever."""
    path, _ = tiny

    async def main():
        engine = AsyncLLM(EngineArgs(model=str(path), max_num_seqs=1, max_waiting=1).resolve())
        engine.start()
        try:
            unsendable = SamplingParams(temperature=0, max_tokens=2)
            unsendable.seed = 2**70
            for _ in range(3):  # past the two places the queue has
                with pytest.raises(OverflowError):
                    await engine.generate({"prompt_token_ids": [5] * 4}, unsendable).__anext__()
            with pytest.raises(ValueError, match=r"^n=3 completions cannot be admitted: .* at most 2"):
                await engine.generate({"prompt_token_ids": [5] * 4}, SamplingParams(n=3, max_tokens=2)).__anext__()
            return [out async for out in engine.generate({"prompt_token_ids": [5] * 4},
                                                          SamplingParams(n=2, temperature=0, max_tokens=2))]
        finally:
            engine.shutdown()

    outputs = asyncio.run(main())
    assert outputs[-1].finished and {c.index for out in outputs for c in out.outputs} == {0, 1}  # deltas


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    path, _ = tiny
    llm = LLM(str(path), max_num_seqs=8)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, seed=1234, max_tokens=16,
                            ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate([{"prompt_token_ids": [1, 2, 3]}] + [{"prompt_token_ids": [i, 7]} for i in range(5)],
                         [params] + [SamplingParams(temperature=1.0, max_tokens=9)] * 5, use_tqdm=False)
    assert crowd[0].outputs[0].token_ids == alone
    other = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(
        temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, seed=99, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert other[0].outputs[0].token_ids != alone
