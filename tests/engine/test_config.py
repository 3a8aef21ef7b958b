"""EngineArgs resolve once into the EngineConfig every part receives; the parts size from it."""

import dataclasses

import pytest

from jetserve.engine import LLM, EngineArgs, SamplingParams
from jetserve.engine.config import DEFAULT_CHUNK_BUDGET, MAX_GRAPH_WARMUP_STEPS, MAX_QUEUED_BYTES
from jetserve.engine.plan import memory_plan, refuse_if_it_cannot_fit
from jetserve.engine.runner import block_bytes, kv_reserve
from tests.engine.builders import build_drafting_model


@pytest.fixture(scope="module")
def model_with_heads(tmp_path_factory):
    return build_drafting_model(tmp_path_factory.mktemp("heads"))


def test_defaults_are_resolved_once(tiny):
    path, _ = tiny
    config = EngineArgs(model=str(path)).resolve()
    assert (config.device, config.dtype) == ("cpu", "float32")  # never "auto" past resolve()
    assert config.max_model_len == 256  # the model's max_position_embeddings, below the default cap
    assert config.max_num_batched_tokens == DEFAULT_CHUNK_BUDGET and config.speculative is None
    assert config.cuda_graphs is None and not config.fused_kernels  # CPU: eager, plain torch
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 2
    unchunked = EngineArgs(model=str(path), enable_chunked_prefill=False, max_model_len=200).resolve()
    assert unchunked.max_num_batched_tokens == 200  # a whole prompt in one step


def test_async_scheduling_is_on_by_default_on_a_gpu_only(tiny):
    """It hides the host's share of a step behind the GPU's; a CPU does both, so there it stays off."""
    path, _ = tiny
    assert EngineArgs(model=str(path)).resolve(device="cuda").async_scheduling
    assert not EngineArgs(model=str(path)).resolve(device="cpu").async_scheduling
    assert not EngineArgs(model=str(path), async_scheduling=False).resolve(device="cuda").async_scheduling
    assert EngineArgs(model=str(path), async_scheduling=True).resolve(device="cpu").async_scheduling


def test_kv_reserve_covers_the_largest_step_the_scheduler_runs(tiny):
    """With chunking off a step may carry max_model_len tokens: the KV plan must leave room for
    that step's activations, not for a 512-token chunk (it once reserved 512 regardless)."""
    path, _ = tiny
    measured = []

    def measure(tokens, logit_rows):
        measured.append((tokens, logit_rows))
        return tokens

    config = EngineArgs(model=str(path), enable_chunked_prefill=False, max_model_len=256, max_num_seqs=4).resolve()
    assert kv_reserve(config, measure) == 256 and measured == [(256, 4)]
    measured.clear()
    chunked = EngineArgs(model=str(path), max_num_batched_tokens=64).resolve()
    kv_reserve(chunked, measure)
    assert measured == [(64, 16)]


def test_the_queue_byte_budget_defaults_to_the_request_limits_worst_case_and_is_bounded(tiny):
    """Each of max_num_seqs + max_waiting requests a prompt of max_model_len, one array of 4 bytes
    a token in the front end and one in its sequence in the core: what the memory plan counts."""
    path, _ = tiny
    config = EngineArgs(model=str(path), max_num_seqs=4, max_waiting=12).resolve()
    assert config.max_queued_bytes == (4 + 12) * 256 * 4 * 2
    assert EngineArgs(model=str(path), max_queued_bytes=2**20).resolve().max_queued_bytes == 2**20
    huge = EngineArgs(model=str(path), max_num_seqs=2**25, max_waiting=2**25).resolve()
    assert huge.max_queued_bytes == MAX_QUEUED_BYTES  # the default never passes the bound either
    for value in (0, MAX_QUEUED_BYTES + 1, 1.5, True):
        with pytest.raises(ValueError, match="max_queued_bytes must be an integer in"):
            EngineArgs(model=str(path), max_queued_bytes=value).resolve()


def test_bad_values_name_the_field(tiny):
    path, _ = tiny
    for kwargs, field in [({"max_num_seqs": 0}, "max_num_seqs"), ({"max_model_len": 10**6}, "max_model_len"),
                          ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                          ({"speculative_config": {"method": "mtp"}}, "needs MTP heads"),
                          ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8}, "max_num_batched_tokens")]:
        with pytest.raises(ValueError, match=field):
            EngineArgs(model=str(path), **kwargs).resolve()


def test_graph_warmup_steps_are_bounded(tiny):
    path, _ = tiny
    for value in (0, MAX_GRAPH_WARMUP_STEPS):
        EngineArgs(model=str(path), cuda_graph_num_warmup_steps=value).resolve()
    for value in (-1, MAX_GRAPH_WARMUP_STEPS + 1, 1.5, True):
        with pytest.raises(ValueError, match="cuda_graph_num_warmup_steps must be an integer in"):
            EngineArgs(model=str(path), cuda_graph_num_warmup_steps=value).resolve()


def test_the_memory_plan_counts_a_given_kv_pool_and_refuses_one_too_big(tiny):
    """num_kv_blocks given is the pool the runner allocates: the plan counts it (not max_num_seqs
    sequences of max_model_len), so a pool no machine holds is refused with the plan, naming the
    setting, before anything loads (it reached torch's allocator, which named a byte count)."""
    path, _ = tiny
    config = EngineArgs(model=str(path), num_kv_blocks=5, max_num_seqs=64).resolve()
    assert memory_plan(config, "this").kv_cache == 6 * block_bytes(config)  # + the scratch block
    refuse_if_it_cannot_fit(config)
    with pytest.raises(ValueError, match="does not fit") as refused:
        refuse_if_it_cannot_fit(EngineArgs(model=str(path), num_kv_blocks=10**9).resolve())
    assert "num_kv_blocks" in str(refused.value) and "fits at most" in str(refused.value)


def test_one_sequence_with_drafts_fits_its_own_kv_plan(model_with_heads):
    """max_num_seqs=1 with k=3 (the single-stream robot case) sizes the KV for the draft slots too;
    it was refused: the pool held one sequence of max_model_len but not its lookahead."""
    llm = LLM(model_with_heads, max_num_seqs=1, max_model_len=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert llm.engine.runner.num_blocks * llm.engine.config.block_size >= 64 + 3
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=61,
                                                                         ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 61 and llm.engine.scheduler.blocks.num_used == 0


def test_a_cache_directory_another_user_may_write_is_not_used(tmp_path, monkeypatch, caplog):
    """The caches hold native code the engine loads and runs (compiled CPU programs, inductor's
    build files): a cache directory others may write, or one inside a directory others may write
    that is not sticky, is not used; the process caches in a private directory of its own, and the
    warning says which and why. Its own directory is made private and used."""
    import os
    import stat

    from jetserve.engine import config

    mine = tmp_path / "mine" / "jetserve"
    monkeypatch.setenv("JETSERVE_CACHE_DIR", str(mine))
    assert config.private_cache_root() == mine and stat.S_IMODE(mine.stat().st_mode) == 0o700
    planted = tmp_path / "shared"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)  # past the umask
    (planted / "program.pt2").write_bytes(b"someone else's code")
    loose = tmp_path / "open"
    loose.mkdir()
    loose.chmod(0o777)  # world-writable and not sticky: its entries can be swapped
    (loose / "jetserve").mkdir(mode=0o700)
    cases = [(planted, "group or others may write it (mode 777)"),
             (loose / "jetserve", "others may write the directory it is in")]
    if os.getuid() == 0:  # root can hand a directory to another user (CI runs as root)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        cases.append((theirs, "it is owned by uid 65534, not this user (0)"))
    for shared, why in cases:
        monkeypatch.setenv("JETSERVE_CACHE_DIR", str(shared))
        with caplog.at_level("WARNING", logger="jetserve.engine.config"):
            used = config.private_cache_root()
        assert used != shared and used.is_dir() and not list(used.iterdir())
        assert used.stat().st_uid == os.getuid() and not used.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        assert f"cache directory {shared} is not used: {why}" in caplog.text, caplog.text
