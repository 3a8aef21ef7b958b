"""jetserve's LLM engine: Qwen3 (+MTP) on a paged KV cache, with vLLM's API.

Exports load lazily, so `jetserve.engine.cli` (and `jetserve --help`) import no torch.
"""

import importlib

_EXPORTS = {
    "AsyncLLM": "async_llm", "CompletionOutput": "outputs", "EngineArgs": "config", "EngineClient": "protocol",
    "EngineConfig": "config", "EngineStats": "protocol", "LLM": "llm", "LLMEngine": "llm_engine",
    "ModelInfo": "protocol", "RequestOutput": "outputs", "SamplingParams": "sampling_params",
    "open_engine": "async_llm",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
