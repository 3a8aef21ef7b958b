"""The synchronous engine: requests in, one scheduled step at a time, output deltas out.

request → scheduler → runner → sampler → (detokenizer, stop checks) → RequestOutput delta.
`LLM` drives it in a loop; `AsyncLLM` drives it from a thread and streams the deltas.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from jetserve.engine.block_manager import BlockManager
from jetserve.engine.model.checkpoint import read_json
from jetserve.engine.config import EngineArgs, ModelConfig
from jetserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jetserve.engine.prompts import check_prompt
from jetserve.engine.runner import Launch, ModelRunner
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.scheduler import Scheduler
from jetserve.engine.sequence import Sequence
from jetserve.engine.spec_decode import DraftLength, SpecCounters, SpeculativeConfig
from jetserve.engine.tokenizer import Detokenizer, StopStrings, Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_CHUNK_BUDGET = 512


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found (their KV reused, not computed)
    # Speculative decoding (MTP); zeros when drafting is off.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    num_speculative_tokens: int = 0


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    detokenizer: Detokenizer | None
    stops: StopStrings


def _positive(name: str, value, allow_none=False):
    if value is None and allow_none:
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class LLMEngine:
    def __init__(self, args: EngineArgs, on_status=None):
        if not args.model:
            raise ValueError("model must name a checkpoint directory")
        self.args = args
        self.model_config = ModelConfig.from_dict(read_json(Path(args.model) / "config.json"))
        self.max_model_len = self._check_args(args)
        self.max_num_batched_tokens = args.max_num_batched_tokens or (
            DEFAULT_CHUNK_BUDGET if args.enable_chunked_prefill else self.max_model_len)
        if not args.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_model_len="
                             f"{self.max_model_len}: without chunked prefill a whole prompt must fit in one step")
        spec = args.speculative_config
        if spec and args.async_scheduling:
            raise ValueError("async_scheduling does not combine with speculative_config yet: "
                             "drafts depend on the tokens the host has not seen")
        self.spec_config = SpeculativeConfig.from_dict(spec, self.model_config.num_mtp_layers) if spec else None
        self.draft_length = DraftLength(self.spec_config) if spec else None
        self.spec_counters = SpecCounters()
        has_tokenizer = (Path(args.model) / "tokenizer.json").exists()
        self.tokenizer = Tokenizer.from_pretrained(args.model) if has_tokenizer else None
        self.runner = ModelRunner(args, self.model_config, self.max_model_len, progress=on_status)
        lookahead = self.spec_config.num_speculative_tokens if spec else 0
        if self.runner.num_blocks * args.block_size < self.max_model_len + lookahead:
            raise ValueError(f"num_kv_blocks={self.runner.num_blocks} of {args.block_size} tokens cannot hold one "
                             f"sequence of max_model_len={self.max_model_len}"
                             + (f" plus {lookahead} draft slots" if lookahead else ""))
        self.blocks = BlockManager(self.runner.num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, args.max_num_seqs, self.max_num_batched_tokens,
                                   args.enable_chunked_prefill)
        self.requests: dict[str, _Request] = {}
        self.num_requests_finished = 0
        self._in_flight: Launch | None = None  # async scheduling: the step whose tokens are still out

    def _check_args(self, args: EngineArgs) -> int:
        for name in ("max_num_seqs", "block_size", "max_waiting"):
            _positive(name, getattr(args, name))
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks"):
            _positive(name, getattr(args, name), allow_none=True)
        if args.backend != "torch":
            raise ValueError(f"backend {args.backend!r}: this engine is the torch backend (see open_engine)")
        if not 0 < args.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}")
        limit = self.model_config.max_position_embeddings
        if args.max_model_len and args.max_model_len > limit:
            raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        return args.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)

    # -- requests -------------------------------------------------------------------------

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        return check_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        text, ids = self.tokenize_prompt(prompt)
        seq = Sequence(request_id, ids, params, arrival_time)
        detok = Detokenizer(self.tokenizer, ids, params.skip_special_tokens) if self.tokenizer else None
        self.requests[request_id] = _Request(seq, text, detok, StopStrings(params.stop))
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; returns its last delta."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, "abort", "", [], time.monotonic())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.args.async_scheduling:
            return self._step_async()
        num_drafts = self.draft_length.next() if self.draft_length else 0
        self.scheduler.num_lookahead_slots = num_drafts
        batch = self.scheduler.schedule()
        if not batch:
            return []
        tokens, drafts = self.runner.execute(batch, num_drafts)
        now = time.monotonic()
        outputs = []
        for seq, n, new, new_drafts in zip(batch.seqs, batch.num_tokens, tokens, drafts):
            if new is None:
                seq.num_computed_tokens += n
                self.blocks.cache_computed_blocks(seq)
                continue
            drafted, accepted = len(seq.spec_token_ids), len(new) - 1
            seq.num_computed_tokens += n - (drafted - accepted)  # rejected drafts' KV is rolled back
            if drafted:
                self.spec_counters.record(drafted, accepted)
                self.draft_length.record(drafted, accepted)
            seq.spec_token_ids = new_drafts
            self.blocks.cache_computed_blocks(seq)  # before a finish frees the blocks
            outputs.append(self._append(self.requests[seq.request_id], new, now))
        if self.draft_length:
            self.draft_length.update()
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """Launch step N+1, then read step N's tokens: the host's bookkeeping for N overlaps the
        device's work on N+1, whose inputs the runner takes from N's tokens on the device. A
        sequence that N finishes costs one wasted token in N+1, which is dropped here next time."""
        batch = self.scheduler.schedule()
        launch = self.runner.launch(batch) if batch else None
        if launch is not None:
            for seq, n in zip(batch.seqs, batch.num_tokens):
                seq.num_computed_tokens += n
                self.blocks.cache_computed_blocks(seq)
            for seq in launch.seqs:
                seq.num_pending += 1
        previous, self._in_flight = self._in_flight, launch
        if previous is None:
            return []
        outputs, now = [], time.monotonic()
        for seq, token in previous.tokens():
            seq.num_pending -= 1
            request = self.requests.get(seq.request_id)
            if request is not None and request.seq is seq:  # not finished or aborted meanwhile
                outputs.append(self._append(request, [token], now))
        return outputs

    def _append(self, request: _Request, tokens: list[int], now: float) -> RequestOutput:
        """Add sampled tokens to a request, stopping at the first that ends it."""
        seq, params = request.seq, request.seq.params
        if seq.first_token_time is None:
            seq.first_token_time = now
        new, reason, stop_reason = [], None, None
        for token in tokens:
            seq.token_ids.append(token)
            new.append(token)
            if not params.ignore_eos and self.tokenizer and token in self.tokenizer.eos_token_ids:
                reason = "stop"
            elif token in params.stop_token_ids:
                reason, stop_reason = "stop", token
            elif seq.num_output_tokens == params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                break
        text = request.stops.push(request.detokenizer.push(new)) if request.detokenizer else ""
        if request.stops.stopped:
            reason, stop_reason = "stop", request.stops.matched
        if reason:
            return self._finish(request, reason, text, new, now, stop_reason)
        return self._output(request, text, new, now)

    def _finish(self, request: _Request, reason: str, text: str, new: list[int], now: float,
                stop_reason=None) -> RequestOutput:
        text += request.stops.flush()
        self.scheduler.finish(request.seq, reason)
        del self.requests[request.seq.request_id]
        self.num_requests_finished += 1
        return self._output(request, text, new, now, stop_reason, finished_time=now)

    def _output(self, request: _Request, text: str, new: list[int], now: float, stop_reason=None,
                finished_time: float | None = None) -> RequestOutput:
        seq = request.seq
        finished = finished_time is not None
        return RequestOutput(
            request_id=seq.request_id, prompt=request.prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=[CompletionOutput(0, text, new, seq.finish_reason if finished else None, stop_reason)],
            finished=finished,
            metrics=RequestMetrics(seq.arrival_time, seq.first_token_time, finished_time))

    # -- live controls and stats ----------------------------------------------------------

    def set_max_num_seqs(self, n: int) -> None:
        _positive("max_num_seqs", n)
        self.scheduler.set_max_num_seqs(n)

    def set_num_speculative_tokens(self, k: int) -> None:
        """Live control of the draft length cap; 0 turns drafting off, adaptive k moves below the cap."""
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        if self.draft_length is None:
            if k:
                raise ValueError("num_speculative_tokens: this engine was started without speculative_config")
            return
        self.draft_length.set_max(k)

    def stats(self) -> EngineStats:
        used, total = self.blocks.num_used, self.blocks.num_blocks
        spec = self.spec_counters
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            max_num_seqs=self.scheduler.max_num_seqs, kv_blocks_total=total, kv_blocks_used=used,
            kv_usage=used / total, num_preemptions=self.scheduler.num_preemptions,
            num_requests_finished=self.num_requests_finished,
            prefix_cache_queries=self.blocks.prefix_queries, prefix_cache_hits=self.blocks.prefix_hits,
            num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens,
            accepted_per_position=list(spec.accepted_per_position),
            acceptance_rate=spec.acceptance_rate, mean_accepted_length=spec.mean_accepted_length,
            num_speculative_tokens=self.draft_length.k if self.draft_length else 0)

    @property
    def model_info(self) -> dict:
        cfg = self.model_config
        return {
            "model": str(self.args.model), "architecture": cfg.architecture,
            "dtype": str(self.runner.dtype).replace("torch.", ""), "device": str(self.runner.device),
            "max_model_len": self.max_model_len, "vocab_size": cfg.vocab_size,
            "num_mtp_layers": cfg.num_mtp_layers,
            "num_speculative_tokens": self.draft_length.k if self.draft_length else 0,
            "cuda_graphs": bool(self.runner.graphs and self.runner.graphs.graphs), "backend": "torch",
        }
