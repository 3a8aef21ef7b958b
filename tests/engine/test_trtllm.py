"""The TensorRT-LLM backend is fed from the same resolved EngineConfig; where it is absent, it says so."""

import importlib.util
import json

import pytest

from jetserve.engine import EngineArgs, SamplingParams, open_engine
from jetserve.engine.errors import EngineError
from jetserve.engine.backends.trtllm import llm_kwargs, sampling_kwargs
from tests.engine.builders import TINY


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint directory as resolve() reads it (config.json only: the mapping loads no weights)."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "architectures": ["Qwen3ForCausalLM"],
                                                      "mtp_num_hidden_layers": 1}))
    return str(tmp_path)


def _trt(model, **kwargs):
    return EngineArgs(model=model, backend="tensorrt-llm", **kwargs).resolve()


def test_engine_args_map_onto_trtllm_llm_api(checkpoint):
    config = _trt(checkpoint, dtype="bfloat16", max_num_seqs=6, max_num_batched_tokens=1024,
                  gpu_memory_utilization=0.7, cudagraph_capture_sizes=[1, 2, 4],
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    kwargs = llm_kwargs(config)
    assert kwargs["max_batch_size"] == 6 and kwargs["max_num_tokens"] == 1024
    assert kwargs["max_seq_len"] == 256 and kwargs["enable_chunked_prefill"] is True
    assert kwargs["kv_cache_config"] == ("KvCacheConfig", {"free_gpu_memory_fraction": 0.7,
                                                           "enable_block_reuse": True})
    assert kwargs["cuda_graph_config"] == ("CudaGraphConfig", {"enable_padding": True, "max_batch_size": 4,
                                                               "batch_sizes": [1, 2, 4]})
    assert kwargs["speculative_config"] == ("MTPDecodingConfig", {"max_draft_len": 3})
    eager = llm_kwargs(_trt(checkpoint, enforce_eager=True, enable_chunked_prefill=False))
    assert eager["cuda_graph_config"] is None and eager["max_num_tokens"] == 256
    with pytest.raises(ValueError, match="speculative_config.method"):
        _trt(checkpoint, speculative_config={"method": "eagle"})


def test_mtp_without_a_draft_count_takes_the_default(checkpoint):
    """{"method": "mtp"} alone is a complete speculative config (it raised KeyError here once)."""
    kwargs = llm_kwargs(_trt(checkpoint, speculative_config={"method": "mtp"}))
    assert kwargs["speculative_config"] == ("MTPDecodingConfig", {"max_draft_len": 1})


def test_sampling_params_keep_their_names():
    kwargs = sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_tokens=32, stop="\n\n",
                                            seed=7))
    assert kwargs == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "max_tokens": 32, "stop": ["\n\n"],
                      "seed": 7, "ignore_eos": False, "skip_special_tokens": True}


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed")
def test_missing_tensorrt_llm_is_a_clear_error(tiny):
    path, _ = tiny
    with pytest.raises(EngineError, match="TensorRT-LLM is not installed.*--backend torch"):
        open_engine(EngineArgs(model=str(path), backend="tensorrt-llm").resolve())
