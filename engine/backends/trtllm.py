"""TensorRT-LLM backend: the same resolved EngineConfig, run by TensorRT-LLM's `LLM` API (PyTorch flow, ≥ 1.0).

TensorRT-LLM brings the same three optimizations (CUDA graphs, chunked prefill, MTP) in its own
kernels. This module only translates: our config into its `LLM(...)` arguments, our
SamplingParams into its own, its streamed outputs into our RequestOutput deltas and its
iteration stats into EngineStats. It offers the AsyncLLM surface the service uses, so
`jetserve serve --backend tensorrt-llm` changes nothing else.

The translation follows TensorRT-LLM's own source, not just its field names: the contracts in
tests/engine/trtllm_contracts (made by tools/trtllm_contract.py) record the fields, defaults
and validators of 1.0–1.2 and of main, and the tests hold this mapping to each of them. Where
it runs: TensorRT-LLM ≥ 1.0 on data-centre GPUs (x86_64 or SBSA). No Jetson has it: the
v0.12.0-jetson branch predates this API, and NVIDIA's LLM runtime for JetPack 7 is TensorRT
Edge-LLM (docs/engine.md, "Backends").
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from jetserve.engine.config import EngineConfig, SpeculativeConfig
from jetserve.engine.errors import EngineError
from jetserve.engine.model.checkpoint import read_json
from jetserve.engine.offline.mtp_checkpoint import inspect as inspect_mtp
from jetserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jetserve.engine.prompts import check_prompt
from jetserve.engine.protocol import EngineStats, ModelInfo
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MIN_VERSION = (1, 0)
_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class TrtllmApi:
    """Where the supported TensorRT-LLM versions differ, for this mapping: only the MTP draft length.

    1.0–1.2 draft `num_nextn_predict_layers` tokens (its validators copy it over
    `max_draft_len`, which alone is silently reset to 1); later versions draft `max_draft_len`
    and fill `num_nextn_predict_layers` from the checkpoint. The field's default tells them
    apart: a number on 1.0–1.2, None after.
    """

    mtp_draft_len_field: str

    @classmethod
    def from_num_nextn_default(cls, default) -> TrtllmApi:
        return cls("num_nextn_predict_layers" if isinstance(default, int) else "max_draft_len")

    @classmethod
    def installed(cls, llmapi) -> TrtllmApi:
        return cls.from_num_nextn_default(llmapi.MTPDecodingConfig.model_fields["num_nextn_predict_layers"].default)


def cuda_graph_kwargs(config: EngineConfig) -> dict | None:
    """`CudaGraphConfig` keyword arguments: the batch sizes, and never max_batch_size too.

    1.0–1.2 reject both unless batch_sizes equals the list they would generate from the
    maximum; main requires max_batch_size == max(batch_sizes). Sizes alone hold on both, and
    TensorRT-LLM derives the maximum from them.
    """
    if config.cuda_graphs is None:
        return None
    return {"batch_sizes": list(config.cuda_graphs.capture_sizes), "enable_padding": True}


def mtp_kwargs(spec: SpeculativeConfig, num_mtp_layers: int, api: TrtllmApi) -> dict:
    """`MTPDecodingConfig` keyword arguments for k drafts from a checkpoint with N MTP layers.

    Ours chains the layers, reusing them in turn past N. TensorRT-LLM does the same with one
    layer (EAGLE-style MTP, `use_mtp_vanilla=False`) and runs N layers once each in order
    (vanilla MTP), so k ≤ N there; it cannot reuse several layers in turn.
    """
    k = spec.num_speculative_tokens
    if num_mtp_layers < 1:
        raise ValueError("speculative_config: method 'mtp' needs MTP heads, and this checkpoint has none; "
                         "merge shipped heads with `jetserve mtp merge BASE HEADS OUT` or train them with "
                         "`jetserve mtp fit --model BASE --data FILES... --out OUT`")
    if num_mtp_layers > 1 and k > num_mtp_layers:
        raise ValueError(f"speculative_config.num_speculative_tokens={k}: TensorRT-LLM drafts with each of this "
                         f"checkpoint's {num_mtp_layers} MTP layers once, so at most {num_mtp_layers} tokens "
                         "(reusing layers in turn is for one-layer checkpoints); lower it or use --backend torch")
    return {api.mtp_draft_len_field: k, "use_mtp_vanilla": num_mtp_layers > 1}


def kv_cache_fraction(gpu_memory_utilization: float, free: int, total: int, weights: int) -> float:
    """vLLM's `gpu_memory_utilization` as TensorRT-LLM's `free_gpu_memory_fraction`.

    vLLM's is a share of the whole GPU for everything this engine and others hold; TensorRT-LLM's
    is the share of the memory still free once the weights are loaded that the KV cache takes.
    Same budget: (utilization × total − in use now − weights) / (free − weights). TensorRT-LLM
    also keeps its activations out of what it counts as free, so the cache comes out no larger.
    """
    after_load = free - weights
    budget = gpu_memory_utilization * total - (total - free) - weights
    if after_load <= 0 or budget <= 0:
        gib = 1 << 30
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} leaves no memory for the KV cache: "
                         f"the GPU has {total / gib:.1f} GiB, {(total - free) / gib:.1f} GiB are in use and the "
                         f"weights take {weights / gib:.1f} GiB")
    return min(budget / after_load, 1.0)


def llm_kwargs(config: EngineConfig, api: TrtllmApi, *, num_mtp_layers: int,
               free_gpu_memory_fraction: float) -> dict:
    """`tensorrt_llm.LLM` keyword arguments; its config objects as (llmapi class name, kwargs).

    num_mtp_layers: the MTP layers the checkpoint's weights hold (not only its config.json).
    """
    graphs, spec = cuda_graph_kwargs(config), config.speculative
    return {
        "model": config.model,
        "dtype": config.dtype,
        "skip_tokenizer_init": not config.has_tokenizer,
        "max_batch_size": config.max_num_seqs,
        "max_seq_len": config.max_model_len,
        "max_num_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "kv_cache_config": ("KvCacheConfig", {"free_gpu_memory_fraction": free_gpu_memory_fraction,
                                              "enable_block_reuse": config.enable_prefix_caching,
                                              "tokens_per_block": config.block_size}),
        "cuda_graph_config": graphs and ("CudaGraphConfig", graphs),
        "speculative_config": spec and ("MTPDecodingConfig", mtp_kwargs(spec, num_mtp_layers, api)),
        "disable_overlap_scheduler": not config.async_scheduling,
        "enable_iter_perf_stats": True,
    }


# SamplingParams fields this mapping does not carry, with the value that asks for nothing: a
# request that sets one is refused rather than served as if it had not.
_UNMAPPED = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0,
             "logprobs": None, "prompt_logprobs": None, "include_stop_str_in_output": False, "logit_bias": None,
             "allowed_token_ids": None, "bad_words": None}


def sampling_kwargs(params: SamplingParams, *, prompt_len: int, max_model_len: int,
                    end_ids: list[int] | None = None) -> dict:
    """`tensorrt_llm.SamplingParams` keyword arguments that mean what ours mean.

    - max_tokens None: up to max_model_len (TensorRT-LLM's own default is 32 tokens).
    - greedy: top_k=1 alone, greedy on every TensorRT-LLM sampler (temperature 0 is not on all).
    - seed None: a fresh seed for this request; TensorRT-LLM reads None as seed 0, the same
      for every request.
    - end_ids: the checkpoint's end tokens when it has no tokenizer, from which TensorRT-LLM
      would otherwise take them (and which it requires).
    """
    unmapped = [name for name, default in _UNMAPPED.items() if getattr(params, name) != default]
    if unmapped:
        raise ValueError(f"{', '.join(unmapped)}: not served by the TensorRT-LLM backend (use --backend torch)")
    room = max_model_len - prompt_len
    kwargs = {"max_tokens": min(params.max_tokens or room, room), "ignore_eos": params.ignore_eos,
              "skip_special_tokens": params.skip_special_tokens}
    if params.greedy:
        kwargs["top_k"] = 1
    else:
        kwargs["temperature"] = params.temperature
        kwargs["seed"] = secrets.randbits(63) if params.seed is None else params.seed
        if params.top_p < 1:
            kwargs["top_p"] = params.top_p
        if params.top_k:
            kwargs["top_k"] = params.top_k
        if params.min_p:
            kwargs["min_p"] = params.min_p
    stop_token_ids = list(params.stop_token_ids)
    if end_ids is not None:
        if params.stop:
            raise ValueError("stop: this model has no tokenizer.json, so stop strings cannot be matched; "
                             "use stop_token_ids")
        kwargs["end_id"], kwargs["detokenize"] = end_ids[0], False
        stop_token_ids += [t for t in end_ids[1:] if not params.ignore_eos and t not in stop_token_ids]
    if params.stop:
        kwargs["stop"] = list(params.stop)
    if stop_token_ids:
        kwargs["stop_token_ids"] = stop_token_ids
    return kwargs


def checkpoint_end_ids(model_dir: str | Path) -> list[int]:
    """The end-of-sequence ids of a checkpoint without a tokenizer: generation_config.json, else config.json."""
    model_dir = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        eos = read_json(path).get("eos_token_id") if path.exists() else None
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [eos]
    raise EngineError(f"backend tensorrt-llm: {model_dir} has no tokenizer.json and no eos_token_id in "
                      "generation_config.json or config.json; TensorRT-LLM needs the end token id. "
                      "Add the tokenizer or eos_token_id, or use --backend torch")


def checkpoint_weight_bytes(model_dir: str | Path, checkpoint_dtype: str, dtype: str) -> int:
    """The weights' size on the GPU: the safetensors files, rescaled when loaded in another dtype."""
    stored = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    if checkpoint_dtype not in _ITEMSIZE or dtype not in _ITEMSIZE:
        return stored
    return stored * _ITEMSIZE[dtype] // _ITEMSIZE[checkpoint_dtype]


def parse_version(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


class IterationStats:
    """Reads TensorRT-LLM's per-iteration stats for one interval at a time.

    `LLM.get_stats(timeout)` reads until its queue has been quiet for `timeout`, which under
    steady load is never; `get_stats_async` hands over one iteration at a time, so each pass
    stops at its deadline and the heartbeat keeps its interval exactly when the engine is busiest.
    """

    def __init__(self, llm, interval: float, on_stats, on_beat):
        self.llm, self.interval, self.on_stats, self.on_beat = llm, interval, on_stats, on_beat

    def run(self, stopping: threading.Event) -> None:
        asyncio.run(self._run(stopping))

    async def _run(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            deadline = time.monotonic() + self.interval
            stats = self.llm.get_stats_async(timeout=self.interval)
            try:
                while (left := deadline - time.monotonic()) > 0:
                    it = await asyncio.wait_for(anext(stats), left)
                    self.on_stats(json.loads(it) if isinstance(it, str) else it)
            except (StopAsyncIteration, asyncio.TimeoutError):
                pass
            self.on_beat()
            await asyncio.sleep(max(deadline - time.monotonic(), 0))


def apply_iteration_stats(s: EngineStats, it: dict, num_speculative_tokens: int) -> EngineStats:
    """EngineStats after one TensorRT-LLM iteration-stats dict (its camelCase keys)."""
    kv, spec = it.get("kvCacheStats", {}), it.get("specDecodingStats", {})
    used, total = kv.get("usedNumBlocks", 0), max(kv.get("maxNumBlocks", 0), 1)
    drafted = s.num_draft_tokens + spec.get("numDraftTokens", 0)
    accepted = s.num_accepted_tokens + spec.get("numAcceptedTokens", 0)
    return EngineStats(
        num_running=it.get("numActiveRequests", 0), num_waiting=it.get("numQueuedRequests", 0),
        max_num_seqs=s.max_num_seqs, kv_blocks_total=total, kv_blocks_used=used, kv_usage=used / total,
        num_draft_tokens=drafted, num_accepted_tokens=accepted, acceptance_rate=accepted / max(drafted, 1),
        mean_accepted_length=spec.get("acceptanceLength", s.mean_accepted_length),
        num_speculative_tokens=num_speculative_tokens)


class TensorRTLLMEngine:
    """The AsyncLLM surface over `tensorrt_llm.LLM.generate_async(..., streaming=True)`."""

    STATS_INTERVAL = 0.5

    def __init__(self, config: EngineConfig, on_status=None):
        try:
            import tensorrt_llm
            import torch
            from tensorrt_llm import llmapi
        except ImportError as exc:
            raise EngineError(f"backend tensorrt-llm: TensorRT-LLM is not installed here ({exc.name}); it runs on "
                              "data-centre GPUs with TensorRT-LLM >= 1.0, not on Jetson: use --backend torch") from None
        if parse_version(tensorrt_llm.__version__) < MIN_VERSION:
            raise EngineError(f"backend tensorrt-llm: TensorRT-LLM {tensorrt_llm.__version__} predates the LLM API "
                              "this backend drives (CudaGraphConfig, MTPDecodingConfig); it needs >= 1.0")
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = Tokenizer.from_pretrained(config.model) if config.has_tokenizer else None
        self.end_ids = None if config.has_tokenizer else checkpoint_end_ids(config.model)
        free, total = torch.cuda.mem_get_info()
        fraction = kv_cache_fraction(config.gpu_memory_utilization, free, total,
                                     checkpoint_weight_bytes(config.model, self.model_config.dtype, config.dtype))
        api = TrtllmApi.installed(llmapi)
        kwargs = llm_kwargs(config, api, free_gpu_memory_fraction=fraction,
                            num_mtp_layers=inspect_mtp(config.model)["found_layers"] if config.speculative else 0)
        log.info("TensorRT-LLM %s: %s (free_gpu_memory_fraction %.3f for gpu_memory_utilization %.2f)",
                 tensorrt_llm.__version__, api, fraction, config.gpu_memory_utilization)
        built = {k: getattr(llmapi, v[0])(**v[1]) if isinstance(v, tuple) else v for k, v in kwargs.items()}
        if on_status:
            on_status("building the TensorRT-LLM executor")
        self._trt = tensorrt_llm
        self.llm = tensorrt_llm.LLM(**built)
        self.max_model_len = config.max_model_len
        self._stats = EngineStats(max_num_seqs=config.max_num_seqs,
                                  num_speculative_tokens=config.num_speculative_tokens)
        self._results: dict[str, object] = {}
        self._stopping = threading.Event()
        self.last_heartbeat = time.monotonic()

    @property
    def model_info(self) -> ModelInfo:
        c = self.config
        return ModelInfo(model=c.model, served_model_name=c.served_model_name,
                         architecture=c.model_config.architecture, dtype=c.dtype, device="cuda",
                         max_model_len=c.max_model_len, vocab_size=c.model_config.vocab_size,
                         num_mtp_layers=c.model_config.num_mtp_layers,
                         num_speculative_tokens=c.num_speculative_tokens, cuda_graphs=c.cuda_graphs is not None,
                         backend="tensorrt-llm", max_num_seqs_limit=c.max_num_seqs,
                         num_speculative_tokens_limit=c.num_speculative_tokens)

    def start(self) -> None:
        loop = IterationStats(self.llm, self.STATS_INTERVAL, self._on_stats, self._on_beat)
        threading.Thread(target=loop.run, args=(self._stopping,), name="jetserve-trtllm-stats", daemon=True).start()

    def _on_stats(self, it: dict) -> None:
        self._stats = apply_iteration_stats(self._stats, it, self.config.num_speculative_tokens)

    def _on_beat(self) -> None:
        """TensorRT-LLM's executor runs its own loop; a stats pass ending on time is our heartbeat."""
        self.last_heartbeat = time.monotonic()

    def shutdown(self) -> None:
        self._stopping.set()
        self.llm.shutdown()

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None):
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        text, ids = check_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        trt_params = self._trt.SamplingParams(**sampling_kwargs(
            params, prompt_len=len(ids), max_model_len=self.max_model_len, end_ids=self.end_ids))
        arrival, first = time.monotonic(), None
        result = self.llm.generate_async(ids.tolist(), trt_params, streaming=True)
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
