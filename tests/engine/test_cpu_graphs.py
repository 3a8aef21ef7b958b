"""The compiled CPU decode step (engine/cpu_graphs.py) against transformers and the eager step.

One engine compiles the tiny model's two programs (batch 1, and batches of 2 or more serving the
bucket of 4), about 20-40 s on a busy 2-core box; the suite otherwise runs CPU engines eagerly
(tests/conftest.py sets TORCH_COMPILE_DISABLE)."""

import pytest
import torch

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.config import EngineArgs
from jetserve.engine.cpu_graphs import CPUGraphs

from tests.engine.builders import hf_greedy

PROMPTS = [[5, 17, 2, 99, 31, 8, 64], [200, 3], list(range(40, 63)), [7] * 11]
LENGTHS = [12, 3, 9, 6]  # sequences finish apart: the batch shrinks from 4 to 1, padded to the bucket


@pytest.fixture(scope="module")
def compiled(tiny):
    """An engine with the compiled step, and the (key, rows) of each compiled step it runs."""
    with pytest.MonkeyPatch.context() as mp:  # torch.compile on while this module's tests run
        mp.delenv("TORCH_COMPILE_DISABLE", raising=False)
        mp.setattr(torch._dynamo.config, "disable", False)
        llm = LLM(str(tiny[0]), max_num_seqs=4, cudagraph_capture_sizes=[1, 4], block_size=8)
        replays = []
        graphs = llm.engine.runner.graphs
        run = graphs.replay
        mp.setattr(graphs, "replay", lambda key, n: replays.append((key, n)) or run(key, n))
        yield llm, replays


def test_greedy_tokens_equal_transformers(tiny, compiled):
    path, hf_model = tiny
    llm, replays = compiled
    assert isinstance(llm.engine.runner.graphs, CPUGraphs)
    assert list(llm.engine.runner.graphs.graphs) == [(None, 1, 1), (None, 1, 4)]
    assert not llm.engine.model_info.cuda_graphs  # compiled CPU steps are not CUDA graphs to a client
    replays.clear()
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled >= 2  # the two programs (the counter counts what dynamo traced)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    # every decode step ran compiled: 11 steps after the prefill, batches 4, 3 and 2 padded to 4, then 1
    assert len(replays) == max(LENGTHS) - 1 and {(key[2], n) for key, n in replays} == {(4, 4), (4, 3), (4, 2), (1, 1)}
    # contexts grew past several spans (16, 32) and the batch shrank: nothing was compiled again
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled
    assert llm.engine.scheduler.blocks.num_used == 0


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


def test_cpu_default_and_switches(tiny, monkeypatch):
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/inductor")
    config = EngineArgs(model=str(tiny[0]), device="cpu", max_num_seqs=12).resolve()
    assert config.cpu_compile.capture_sizes == (1, 2, 4, 8, 12)
    assert config.cpu_compile.cache_dir == "/somewhere/inductor"
    assert config.cuda_graphs is None
    assert EngineArgs(model=str(tiny[0]), device="cpu", enforce_eager=True).resolve().cpu_compile is None
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    assert EngineArgs(model=str(tiny[0]), device="cpu").resolve().cpu_compile is None
