"""TensorRT-LLM backend: the same resolved EngineConfig, run by TensorRT-LLM's LLM API where NVIDIA ships it.

TRT-LLM brings the same three optimizations (CUDA graphs, chunked prefill, MTP) in its own
kernels. This module only translates: our config into its `LLM(...)` arguments, its streamed
outputs into our RequestOutput deltas, its iteration stats into EngineStats. It offers the
AsyncLLM surface the service uses, so `jetserve serve --backend tensorrt-llm` changes nothing
else. Where it runs: TRT-LLM 1.x on data-centre GPUs; on Jetson only the v0.12.0-jetson branch
(AGX Orin, JetPack 6.1, no MTP) — elsewhere use the torch backend.
"""

from __future__ import annotations

import threading
import time
import uuid

from jetserve.engine.config import EngineConfig
from jetserve.engine.errors import EngineError
from jetserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jetserve.engine.prompts import check_prompt
from jetserve.engine.protocol import EngineStats, ModelInfo
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.tokenizer import Tokenizer

_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}


def llm_kwargs(config: EngineConfig) -> dict:
    """`tensorrt_llm.LLM` keyword arguments; config objects as (llmapi class name, kwargs)."""
    graphs = None
    if config.cuda_graphs:
        graphs = ("CudaGraphConfig", {"enable_padding": True, "max_batch_size": max(config.cuda_graphs.capture_sizes),
                                      "batch_sizes": list(config.cuda_graphs.capture_sizes)})
    spec = config.speculative
    return {
        "model": config.model,
        "dtype": config.dtype,
        "max_batch_size": config.max_num_seqs,
        "max_seq_len": config.max_model_len,
        "max_num_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "kv_cache_config": ("KvCacheConfig", {"free_gpu_memory_fraction": config.gpu_memory_utilization,
                                              "enable_block_reuse": True}),
        "cuda_graph_config": graphs,
        "speculative_config": ("MTPDecodingConfig", {"max_draft_len": spec.num_speculative_tokens}) if spec else None,
        "enable_iter_perf_stats": True,
    }


def sampling_kwargs(params: SamplingParams) -> dict:
    """`tensorrt_llm.SamplingParams` keyword arguments for ours (same names, same meaning)."""
    kwargs = {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_tokens,
              "stop": params.stop or None, "stop_token_ids": params.stop_token_ids or None,
              "ignore_eos": params.ignore_eos, "skip_special_tokens": params.skip_special_tokens}
    if params.top_k:
        kwargs["top_k"] = params.top_k
    if params.min_p:
        kwargs["min_p"] = params.min_p
    if params.seed is not None:
        kwargs["seed"] = params.seed
    return {k: v for k, v in kwargs.items() if v is not None}


class TensorRTLLMEngine:
    """The AsyncLLM surface over `tensorrt_llm.LLM.generate_async(..., streaming=True)`."""

    STATS_INTERVAL = 0.5

    def __init__(self, config: EngineConfig, on_status=None):
        try:
            import tensorrt_llm
            from tensorrt_llm import llmapi
        except ImportError as exc:
            raise EngineError(f"backend tensorrt-llm: TensorRT-LLM is not installed here ({exc.name}); "
                              "on Jetson only the v0.12.0-jetson branch exists (AGX Orin, JetPack 6.1): "
                              "use --backend torch") from None
        self.config = config
        self.model_config = config.model_config
        kwargs = llm_kwargs(config)
        built = {k: getattr(llmapi, v[0])(**v[1]) if isinstance(v, tuple) else v for k, v in kwargs.items()}
        if on_status:
            on_status("building the TensorRT-LLM executor")
        self._trt = tensorrt_llm
        self.llm = tensorrt_llm.LLM(**built)
        self.max_model_len = config.max_model_len
        self.tokenizer = Tokenizer.from_pretrained(config.model) if config.has_tokenizer else None
        self._stats = EngineStats(max_num_seqs=config.max_num_seqs)
        self._results: dict[str, object] = {}
        self._stopping = threading.Event()
        self.last_heartbeat = time.monotonic()

    @property
    def model_info(self) -> ModelInfo:
        c = self.config
        return ModelInfo(model=c.model, architecture=c.model_config.architecture, dtype=c.dtype, device="cuda",
                         max_model_len=c.max_model_len, vocab_size=c.model_config.vocab_size,
                         num_mtp_layers=c.model_config.num_mtp_layers,
                         num_speculative_tokens=c.num_speculative_tokens, cuda_graphs=c.cuda_graphs is not None,
                         backend="tensorrt-llm")

    def start(self) -> None:
        threading.Thread(target=self._poll_stats, name="jetserve-trtllm-stats", daemon=True).start()

    def shutdown(self) -> None:
        self._stopping.set()
        self.llm.shutdown()

    def stats(self) -> EngineStats:
        return self._stats

    def _poll_stats(self) -> None:
        """TRT-LLM's executor runs its own loop; its answering the stats call is our heartbeat."""
        while not self._stopping.wait(self.STATS_INTERVAL):
            for it in self.llm.get_stats(timeout=self.STATS_INTERVAL):
                kv, spec = it.get("kvCacheStats", {}), it.get("specDecodingStats", {})
                used, total = kv.get("usedNumBlocks", 0), max(kv.get("maxNumBlocks", 0), 1)
                drafted, accepted = spec.get("numDraftTokens", 0), spec.get("numAcceptedTokens", 0)
                s = self._stats
                self._stats = EngineStats(
                    num_running=it.get("numActiveRequests", 0), num_waiting=it.get("numQueuedRequests", 0),
                    max_num_seqs=s.max_num_seqs, kv_blocks_total=total, kv_blocks_used=used, kv_usage=used / total,
                    num_draft_tokens=s.num_draft_tokens + drafted, num_accepted_tokens=s.num_accepted_tokens + accepted,
                    acceptance_rate=(s.num_accepted_tokens + accepted) / max(s.num_draft_tokens + drafted, 1),
                    mean_accepted_length=spec.get("acceptanceLength", s.mean_accepted_length),
                    num_speculative_tokens=self.config.num_speculative_tokens)
            self.last_heartbeat = time.monotonic()

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None):
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        text, ids = check_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        arrival, first = time.monotonic(), None
        result = self.llm.generate_async(ids, self._trt.SamplingParams(**sampling_kwargs(params)), streaming=True)
        self._results[request_id] = result
        finished = False
        try:
            async for out in result:
                c = out.outputs[0]
                now = time.monotonic()
                first = first or now
                finished = out.finished
                yield RequestOutput(
                    request_id, text, ids,
                    [CompletionOutput(0, c.text_diff, list(c.token_ids_diff), _FINISH.get(c.finish_reason),
                                      c.stop_reason)],
                    finished, RequestMetrics(arrival, first, now if finished else None))
        finally:
            self._results.pop(request_id, None)
            if not finished:
                result.abort()

    def abort(self, request_id: str) -> None:
        result = self._results.get(request_id)
        if result is not None:
            result.abort()

    def set_max_num_seqs(self, n: int) -> None:
        raise ValueError("max_num_seqs: the TensorRT-LLM backend fixes it when the executor is built")

    def set_num_speculative_tokens(self, k: int) -> None:
        raise ValueError("num_speculative_tokens: the TensorRT-LLM backend fixes it when the executor is built")

