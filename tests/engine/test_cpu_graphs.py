"""The compiled CPU decode step (engine/cpu_graphs.py) against transformers and the eager step,
and its on-disk cache (engine/compile_cache.py).

One engine compiles the tiny model's two programs (batch 1, and batches of 2 or more serving the
bucket of 4) into a cache of this module's own, 30-60 s on a busy 2-core box; the second start
loads them; a corrupt entry costs one more compile of the batch-1 program. The suite otherwise runs
CPU engines eagerly (tests/conftest.py sets TORCH_COMPILE_DISABLE)."""

import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.compile_cache import MAX_ENTRIES, ProgramCache, program_key
from jetserve.engine.config import EngineArgs
from jetserve.engine.cpu_graphs import CPUGraphs, narrowed_weights, narrowest

from tests.engine.builders import TINY, add_tokenizer, build_drafting_model, build_qwen3, hf_greedy

PROMPTS = [[5, 17, 2, 99, 31, 8, 64], [200, 3], list(range(40, 63)), [7] * 11]
LENGTHS = [12, 3, 9, 6]  # sequences finish apart: the batch shrinks from 4 to 1, padded to the bucket


@pytest.fixture(scope="module")
def compile_env(tmp_path_factory):
    """torch.compile on, and a cache directory of this module's own, while its tests run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TORCH_COMPILE_DISABLE", raising=False)
        mp.setattr(torch._dynamo.config, "disable", False)
        root = tmp_path_factory.mktemp("xdg")
        mp.delenv("JETSERVE_CACHE_DIR", raising=False)
        mp.setenv("XDG_CACHE_HOME", str(root))
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
        yield root / "jetserve" / "cpu-steps"


def _engine(tiny, **kwargs):
    return _compiled(LLM(str(tiny[0]), max_num_seqs=4, block_size=8, **{"cudagraph_capture_sizes": [1, 4], **kwargs}))


def _compiled(llm):
    """The engine once the programs its start did not find in the cache are compiled and in use."""
    llm.engine.runner.graphs.wait()
    return llm


@pytest.fixture(scope="module")
def compiled(tiny, compile_env):
    """An engine that compiled its programs, and the (key, rows) of each compiled step it runs."""
    llm = _engine(tiny)
    replays = []
    graphs = llm.engine.runner.graphs
    run = graphs.replay
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs, "replay", lambda key, n: replays.append((key, n)) or run(key, n))
        yield llm, replays


def _greedy_equals_transformers(llm, hf_model, prompts=PROMPTS, lengths=LENGTHS):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, n) for p, n in zip(prompts, lengths)]


def test_greedy_tokens_equal_transformers(tiny, compiled, compile_env):
    path, hf_model = tiny
    llm, replays = compiled
    graphs = llm.engine.runner.graphs
    assert isinstance(graphs, CPUGraphs)
    assert list(graphs.graphs) == [(None, 1, 1), (None, 1, 4)]
    assert list(graphs.compile_seconds) == [1, 2] and not graphs.load_seconds  # an empty cache: both compiled
    assert sorted(p.name for p in compile_env.iterdir()) == sorted(p.name for p in graphs.entries.values())
    assert not llm.engine.model_info.cuda_graphs  # compiled CPU steps are not CUDA graphs to a client
    replays.clear()
    _greedy_equals_transformers(llm, hf_model)
    # every decode step ran compiled: 11 steps after the prefill, batches 4, 3 and 2 padded to 4, then 1
    assert len(replays) == max(LENGTHS) - 1 and {(key[2], n) for key, n in replays} == {(4, 4), (4, 3), (4, 2), (1, 1)}
    assert llm.engine.scheduler.blocks.num_used == 0


def test_weights_narrow_only_where_every_value_survives():
    exact = torch.randn(64, 32).bfloat16().float()
    assert narrowest(exact).dtype == torch.bfloat16 and torch.equal(narrowest(exact).float(), exact)
    assert narrowest(torch.full((4,), 1 + 2**-9)).dtype == torch.float16  # fp16 holds 10 mantissa bits, bf16 7
    assert narrowest(torch.tensor([2.0**100, 1.0])).dtype == torch.bfloat16  # bf16 has fp32's range, fp16 not
    for kept in (torch.randn(64, 32), torch.tensor([1.0, float("nan")]), torch.tensor([2.0**20 + 1])):
        assert narrowest(kept).dtype == torch.float32  # fp32 values, a NaN (never equal), too many bits
    assert narrowest(exact.bfloat16()).dtype == torch.bfloat16


def test_a_bf16_checkpoint_streams_bf16_weights_to_transformers_tokens(tmp_path, compile_env):
    """A bf16 checkpoint served in fp32: the batch-1 program reads its products' weights as bf16
    (the same values, half the bytes) and decodes transformers' fp32 greedy tokens."""
    model = build_qwen3(tmp_path)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    add_tokenizer(tmp_path)
    model.float()  # the checkpoint's values, in fp32: transformers' reference
    llm = _compiled(LLM(str(tmp_path), max_num_seqs=1, block_size=8, cudagraph_capture_sizes=[1]))
    ours = llm.engine.runner.model
    with narrowed_weights(ours):
        dtypes = {name: p.dtype for name, p in ours.named_parameters() if name.endswith("proj.weight")}
    assert len(dtypes) == 4 * TINY["num_hidden_layers"] and set(dtypes.values()) == {torch.bfloat16}
    assert {p.dtype for p in ours.parameters()} == {torch.float32}  # put back after the export
    assert list(llm.engine.runner.graphs.graphs) == [(None, 1, 1)]
    for prompt, n in zip(PROMPTS[:2], LENGTHS[:2]):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        assert llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids \
            == hf_greedy(model, prompt, n)


def test_sampled_tokens_equal_the_eager_step(tiny, compiled):
    """Seeded sampling reads the compiled step's fp32 logits: the same tokens as eagerly."""
    llm, replays = compiled
    eager = LLM(str(tiny[0]), max_num_seqs=4, block_size=8, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8, ignore_eos=True) for i in range(4)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    replays.clear()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert replays
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]


def test_a_second_start_loads_the_cached_programs(tiny, compiled, compile_env):
    """Another engine of the same model (another cache size, other buckets): nothing compiled."""
    first = compiled[0].engine.runner.graphs
    llm = _engine(tiny, cudagraph_capture_sizes=[1, 2, 3], num_kv_blocks=40)
    graphs = llm.engine.runner.graphs
    assert list(graphs.load_seconds) == [1, 2] and not graphs.compile_seconds
    assert graphs.entries == first.entries
    assert list(graphs.graphs) == [(None, 1, 1), (None, 1, 2), (None, 1, 3)]
    _greedy_equals_transformers(llm, tiny[1], PROMPTS[:3], LENGTHS[:3])


def test_a_program_that_disagrees_with_the_eager_step_is_refused(compiled):
    """The probe check every program passes before use (a stale or foreign entry that loads)."""
    graphs = compiled[0].engine.runner.graphs
    run = torch._inductor.aoti_load_package(str(graphs.entries[2])).loader.run
    graphs._check(run, 2)  # the true program passes
    with pytest.raises(ValueError, match="hidden states differ"):
        graphs._check(lambda inputs: [t * 1.01 if i == 0 else t for i, t in enumerate(run(inputs))], 2)
    with pytest.raises(ValueError, match="differ"):  # outputs of other shapes
        graphs._check(lambda inputs: [t[:, :-1] for t in run(inputs)], 2)


def test_a_corrupt_cache_entry_is_compiled_again(tiny, compiled, compile_env, caplog):
    entry = compiled[0].engine.runner.graphs.entries[1]
    data = bytearray(entry.read_bytes())
    data[len(data) // 3:len(data) // 3 + 4096] = os.urandom(4096)  # inside the program's code or constants
    entry.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="jetserve.engine.compile_cache"):
        llm = _engine(tiny, cudagraph_capture_sizes=[1])
    graphs = llm.engine.runner.graphs
    assert any("unusable" in r.getMessage() and entry.name in r.getMessage() for r in caplog.records)
    assert list(graphs.compile_seconds) == [1] and list(graphs.graphs) == [(None, 1, 1)]
    rebuilt = graphs.entries[1]  # the same key, a new file (named by its bytes' digest)
    assert rebuilt.name.split(".")[0] == entry.name.split(".")[0] and rebuilt != entry and not entry.exists()
    _greedy_equals_transformers(llm, tiny[1], PROMPTS[:1], LENGTHS[:1])


def test_cache_entries_are_written_whole_checked_and_pruned(tmp_path, caplog):
    cache = ProgramCache(tmp_path / "steps")

    def fails(path):
        Path(path).write_bytes(b"half a package")
        raise RuntimeError("compiler killed")

    with pytest.raises(RuntimeError):
        cache.store("k0", fails)
    assert list(cache.directory.iterdir()) == []  # neither the entry nor its temporary file
    for i in range(MAX_ENTRIES + 2):
        cache.store(f"k{i}", lambda path, i=i: Path(path).write_bytes(b"x" * i))
        os.utime(cache.path(f"k{i}"), (time.time() - 100 + i, time.time() - 100 + i))
    assert sorted(p.name.split(".")[0] for p in cache.directory.iterdir()) == sorted(
        f"k{i}" for i in range(2, MAX_ENTRIES + 2))  # the oldest two pruned
    assert cache.load("k5", lambda path: Path(path).read_bytes()) == b"x" * 5
    with caplog.at_level(logging.WARNING, logger="jetserve.engine.compile_cache"):
        assert cache.load("k6", lambda path: torch._inductor.aoti_load_package(path)) is None  # not a package
        assert "unusable" in caplog.text and cache.path("k6") is None
        cache.path("k7").write_bytes(b"y" * 7)  # same size, other bytes
        assert cache.load("k7", lambda path: pytest.fail("a damaged entry is never loaded")) is None
        assert "do not match" in caplog.text and cache.path("k7") is None
    assert cache.load("missing", lambda path: pytest.fail("no entry, nothing loaded")) is None


def test_program_keys_name_what_a_program_depends_on(monkeypatch):
    key = program_key(program=1, weights="w")
    assert key == program_key(program=1, weights="w") and key != program_key(program=1, weights="v")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)  # loops compiled for another thread count
    assert program_key(program=1, weights="w") != key


def test_a_drafting_engine_decodes_plainly_through_its_compiled_step(compile_env, tmp_path):
    """With MTP drafting on a CPU the decode step is compiled too: speculative steps run eagerly,
    but once the draft length is 0 (as `k=auto` sets it where eager drafting cannot pay) every
    decode step runs the compiled program, and the greedy tokens are those of drafting and of
    an eager engine without it."""
    path = build_drafting_model(tmp_path / "drafting", mtp_layers=1)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 2, 9, 31], [20, 3, 8])]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = _compiled(LLM(path, max_num_seqs=1, cudagraph_capture_sizes=[1],
                        speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}))
    graphs = llm.engine.runner.graphs
    assert isinstance(graphs, CPUGraphs) and list(graphs.graphs) == [(None, 1, 1)]
    replays = []
    run = graphs.replay
    graphs.replay = lambda key, n: replays.append(key) or run(key, n)
    drafted = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.stats().num_drafts > 0
    llm.engine.set_num_speculative_tokens(0)
    replays.clear()
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert replays == [(None, 1, 1)] * (2 * (params.max_tokens - 1))  # every decode step, none of the prefills
    eager = LLM(path, max_num_seqs=1, enforce_eager=True)
    assert plain == drafted == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]


def test_cpu_default_and_switches(tiny, monkeypatch):
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    monkeypatch.delenv("JETSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    config = EngineArgs(model=str(tiny[0]), device="cpu", max_num_seqs=12).resolve()
    assert config.cpu_compile.capture_sizes == (1, 2, 4, 8, 12)
    assert config.cpu_compile.cache_dir == "/somewhere/cache/jetserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    config = EngineArgs(model=str(tiny[0]), device="cpu").resolve()
    assert config.cpu_compile.cache_dir == str(Path.home() / ".cache" / "jetserve")
    monkeypatch.setenv("JETSERVE_CACHE_DIR", "/var/cache/jetserve")  # the systemd unit's CacheDirectory=
    assert EngineArgs(model=str(tiny[0]), device="cpu").resolve().cpu_compile.cache_dir == "/var/cache/jetserve"
    assert config.cuda_graphs is None
    assert EngineArgs(model=str(tiny[0]), device="cpu", enforce_eager=True).resolve().cpu_compile is None
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    assert EngineArgs(model=str(tiny[0]), device="cpu").resolve().cpu_compile is None


def test_the_default_drafting_config_decodes_at_plain_speed(compile_env, tmp_path, monkeypatch):
    """The default drafting config (adaptive, 3 drafts) against no drafting, both compiled, on the
    CPU: an eager drafting step cannot pay beside the compiled plain step, so the policy keeps
    drafting off and the engine does plain's work, which is what decoding at plain speed takes:
    no draft; every decode step the compiled program plain replays, on the same rows; and host
    work within 5% of plain's, counted as the Python and C calls each engine makes on the same
    prompts. Counted, not timed: a count holds on a loaded CI box, where a 5% timing margin did
    not (the benchmarks time it). A program cache of its own: what it counts are the programs its
    two engines compile and load, never entries the module's other engines wrote."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = build_drafting_model(tmp_path / "drafting", mtp_layers=1)
    common = dict(max_num_seqs=4, cudagraph_capture_sizes=[1, 4], enable_prefix_caching=False)
    engines = {"plain": _compiled(LLM(path, **common)),
               "default": _compiled(LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3},
                                        **common))}
    assert engines["default"].engine.draft_policy.hopeless  # by rule 6, from the table measured at start-up
    replays = {name: [] for name in engines}
    for name, llm in engines.items():
        graphs, run = llm.engine.runner.graphs, llm.engine.runner.graphs.replay
        graphs.replay = lambda key, n, run=run, seen=replays[name]: seen.append(key) or run(key, n)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    calls = dict.fromkeys(engines, 0)
    rounds = 4
    for _ in range(rounds):
        prompts = [{"prompt_token_ids": torch.randint(1, 64, (6 + i,), generator=gen).tolist()} for i in range(4)]
        outputs = {}
        for name, llm in engines.items():
            count = [0]

            def profile(frame, event, arg, count=count):
                count[0] += event in ("call", "c_call")

            sys.setprofile(profile)
            try:
                outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            finally:
                sys.setprofile(None)
            calls[name] += count[0]
        assert outputs["default"] == outputs["plain"]
    assert engines["default"].engine.stats().num_drafts == 0
    assert replays["default"] == replays["plain"] and len(replays["plain"]) == rounds * (params.max_tokens - 1)
    print(calls)
    assert calls["default"] <= 1.05 * calls["plain"], calls
