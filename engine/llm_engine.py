"""The synchronous engine: requests in, one scheduled step at a time, output deltas out.

request → scheduler → runner → sampler → (detokenizer, stop checks) → RequestOutput delta.
`LLM` drives it in a loop. Under `AsyncLLM` it is the engine core (`core.py`), built with
`detokenize=False`: its deltas are token ids (logprobs in compact columns, `LogprobsLists`) with
the token-level finish reasons, and the text (detokenizer, stop strings, logprobs' tokens) is the
front end's (`output_processor.py`).
"""

from __future__ import annotations

import bisect
import logging
import random
import time
from dataclasses import dataclass

from jetserve.engine.config import EngineConfig
from jetserve.engine.outputs import CompletionOutput, LogprobsLists, RequestMetrics, RequestOutput
from jetserve.engine.prompts import check_prompt
from jetserve.engine.protocol import ITERATION_TOKENS_BUCKETS, EngineStats, ModelInfo
from jetserve.engine.runner import Launch, ModelRunner, SpeculativeLaunch
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.scheduler import ScheduledBatch, Scheduler
from jetserve.engine.sequence import Sequence, SequenceStatus
from jetserve.engine.spec_decode import DraftLength, SpecCounters
from jetserve.engine.tokenizer import Detokenizer, StopStrings, Tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Request:
    """What the engine keeps beside the scheduler's sequence: text and timing."""

    seq: Sequence
    prompt: str | None
    detokenizer: Detokenizer | None
    stops: StopStrings
    parent: str  # the request id the caller gave; several sequences share it when n > 1
    index: int  # which of the n completions this is
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    logprobs: LogprobsLists | None = None  # of the tokens of the delta being built
    prompt_logprobs: LogprobsLists | None = None  # gathered over the prompt's chunks, sent with the first token
    prompt_logprobs_sent: bool = False


def reads_host(params: SamplingParams) -> bool:
    """Whether a sequence's steps need its tokens or logits on the host (penalties, bad_words and
    min_tokens read its history; logprobs are computed there): async scheduling, which never
    waits for a step's tokens, runs steps one at a time while such a sequence is unfinished."""
    return params.needs_history or params.logprobs is not None or params.prompt_logprobs is not None


class LLMEngine:
    def __init__(self, config: EngineConfig, on_status=None, detokenize: bool = True):
        if config.backend != "torch":
            raise ValueError(f"backend {config.backend!r}: this engine is the torch backend (see open_engine)")
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.model) if config.has_tokenizer else None
        self.detokenize = detokenize and self.tokenizer is not None
        self.decode_logprobs = detokenize  # the engine core sends them raw: the front end decodes
        self.runner = ModelRunner(config, progress=on_status)
        self.scheduler = Scheduler(config, self.runner.num_blocks)
        self.draft_length = DraftLength(config.speculative) if config.speculative else None
        self.spec_counters = SpecCounters()
        self.requests: dict[str, _Request] = {}  # by sequence id
        self.families: dict[str, list[str]] = {}  # request id → its unfinished sequences' ids
        self.num_requests_finished = 0
        self._in_flight: Launch | SpeculativeLaunch | None = None  # async scheduling: the step whose tokens are out
        self._received_at = 0.0  # perf_counter when the last launched step's tokens arrived
        self._next_drafts: int | None = None  # drafts decided for the next launched step
        self.num_reading_host = 0  # unfinished sequences whose steps read tokens or logits on the host
        self._seeds = random.Random(config.seed)  # noise keys of requests without a seed
        # Tokens computed per step, as counts per ITERATION_TOKENS_BUCKETS bucket (+Inf last) and a sum.
        self.iteration_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0

    # -- requests -------------------------------------------------------------------------

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt (string or {"prompt_token_ids": [...]}) as checked token ids. A caller that
        tokenized already passes {"prompt": text, "prompt_token_ids": ids}: ids are only checked."""
        return check_prompt(prompt, self.tokenizer, self.config.model_config.vocab_size, self.config.max_model_len)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.families:
            raise ValueError(f"request_id {request_id!r} is already running")
        params.update_from_tokenizer(self.tokenizer)
        params.check_vocab(self.config.model_config.vocab_size)
        text, ids = self.tokenize_prompt(prompt)
        # n > 1: n sequences of one prompt (vLLM's parent request), seeds apart so they differ.
        keys = [request_id] if params.n == 1 else [f"{request_id}[{i}]" for i in range(params.n)]
        if any(key in self.requests for key in keys):
            raise ValueError(f"request_id {request_id!r} is already running")
        self.families[request_id] = list(keys)
        for index, key in enumerate(keys):
            child = params if params.n == 1 else params.child(index)
            # The sampling noise is keyed by (seed, position) (sampler.py): a request's own seed, or
            # one drawn here, so unseeded runs of the same workload repeat under the engine's seed.
            seed = self._seeds.getrandbits(63) if child.seed is None else child.seed % 2**63
            seq = Sequence(key, ids, child, arrival_time, seed)
            detok = Detokenizer(self.tokenizer, ids, params.skip_special_tokens) if self.detokenize else None
            stops = StopStrings(params.stop if detok else (), params.include_stop_str_in_output)
            self.requests[key] = _Request(seq, text, detok, stops, request_id, index)
            self.scheduler.add(seq)
            self.num_reading_host += reads_host(child)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all n of its sequences) wherever it is and free its blocks; returns
        its last delta."""
        output = None
        for key in list(self.families.get(request_id, ())):
            output = self._finish(self.requests[key], "abort", "", [], time.monotonic())
        return output

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: request → scheduler → runner (forward, sampling, drafting) → scheduler
        update → detokenizer and stop checks → output deltas."""
        if self.config.async_scheduling and not self.num_reading_host:
            return self._step_drafting_async() if self.draft_length else self._step_async()
        if self._in_flight is not None:  # a sequence reads the host's tokens: catch up, then step in turn
            previous, self._in_flight = self._in_flight, None
            return self._receive(previous)
        num_drafts = self._draft_length_next()
        self._next_drafts = None
        batch = self.scheduler.schedule(num_lookahead_slots=num_drafts)
        if not batch:
            return []
        self._mark_scheduled(batch)
        return self._execute(batch, num_drafts, timed=True)

    def _execute(self, batch: ScheduledBatch, num_drafts: int, timed: bool) -> list[RequestOutput]:
        """Run a scheduled step and wait for its tokens. `timed`: a decode step's time tells the
        draft length what k costs (steps run one at a time; under async scheduling a step that
        catches up is not timed: see _record_step_time)."""
        verified = self.runner.speculative_shape(batch, num_drafts) if self.draft_length else None
        start = time.perf_counter()
        priced_out = self.draft_length is not None and self.draft_length.priced_out
        sampled, drafts, logprobs, prompt_logprobs = self.runner.execute(batch, num_drafts, priced_out)
        for seq, lists in zip(batch.seqs, prompt_logprobs):
            if lists is not None:
                self._gather_prompt_logprobs(self.requests[seq.request_id], lists)
        if verified is not None:
            seconds = time.perf_counter() - start
            if timed:
                self.draft_length.record_step(verified, num_drafts, len(batch), seconds)
            self.draft_length.record_progress(verified, num_drafts, len(batch),
                                              sum(len(new) for new in sampled if new is not None), seconds)
        return self._complete(batch, sampled, drafts, logprobs)

    def _complete(self, batch: ScheduledBatch, sampled: list[list[int] | None], drafts: list[list[int]],
                  logprobs: list | None = None) -> list[RequestOutput]:
        """Record what a step did (acceptance, the scheduler's update, the draft length), then
        each sampled sequence's delta."""
        for seq, new in zip(batch.seqs, sampled):
            if new is not None and seq.spec_token_ids:
                self.spec_counters.record(len(seq.spec_token_ids), len(new) - 1)
                self.draft_length.record(len(seq.spec_token_ids), len(new) - 1)
        self.scheduler.update(batch, sampled, drafts)
        if self.draft_length:
            self.draft_length.update()
        now = time.monotonic()
        return [self._process(self.requests[seq.request_id], new, now, lp)
                for seq, new, lp in zip(batch.seqs, sampled, logprobs or [None] * len(batch)) if new is not None]

    def _draft_length_next(self) -> int:
        """Drafts the next launched step proposes: decided once (DraftLength.next), kept until a
        step is launched (a step() that only catches up launches none)."""
        if self.draft_length is None:
            return 0
        if self._next_drafts is None:
            self._next_drafts = self.draft_length.next()
        return self._next_drafts

    def _step_async(self) -> list[RequestOutput]:
        """Launch step N+1, then read step N's tokens: the host's bookkeeping for N overlaps the
        device's work on N+1, whose inputs the runner takes from N's tokens on the device. A
        sequence that N finishes costs one wasted token in N+1, which the scheduler drops."""
        batch = self.scheduler.schedule()
        if batch:
            self._mark_scheduled(batch)
        launch = self.runner.launch(batch) if batch else None
        if launch is not None:
            self.scheduler.launched(batch, launch.seqs)
            launch.pipelined = self._in_flight is not None
        previous, self._in_flight = self._in_flight, launch
        return self._receive(previous) if previous is not None else []

    def _step_drafting_async(self) -> list[RequestOutput]:
        """Async scheduling with drafting. Consecutive speculative steps of the same sequences
        chain on the device: step N+1 is launched before step N's tokens are read, its inputs
        taken from N's result there (`_chain`); plain decode steps, drafting off, overlap as
        without drafting. Any other step (prefill chunks, a batch that changes, a limit within
        reach) first catches up, then runs as in sync mode."""
        num_drafts = self._draft_length_next()
        previous = self._in_flight
        if not num_drafts and not isinstance(previous, SpeculativeLaunch) and self.scheduler.decoding_only():
            self._next_drafts = None
            return self._step_async()
        if previous is not None:
            self._in_flight = self._chain(previous, num_drafts) if isinstance(previous, SpeculativeLaunch) else None
            return self._receive(previous)
        self._next_drafts = None
        batch = self.scheduler.schedule(num_lookahead_slots=num_drafts)
        if not batch:
            return []
        self._mark_scheduled(batch)
        if self.runner.plain_step(batch, num_drafts) or self.runner.speculative_shape(batch, num_drafts) is None:
            return self._execute(batch, num_drafts, timed=False)
        self._in_flight = self.runner.launch_speculative(batch, num_drafts)
        return []

    def _chain(self, previous: SpeculativeLaunch, num_drafts: int) -> SpeculativeLaunch | None:
        """Launch the step after `previous` before its tokens are read: the same sequences, in
        the same order, verify the drafts it proposed and propose `num_drafts`. None where that
        step is not known without them: `previous` proposed nothing, a sequence finished or
        another waits to join, max_tokens or max_model_len is within reach, KV runs short."""
        q = previous.num_drafts + 1
        seqs = previous.batch.seqs
        # Tokens past the host's view the two steps may cover: previous's accepted run, this
        # step's rows, and the KV of the drafting chain after them.
        if not previous.num_drafts or not self.scheduler.reserve_chained(seqs, previous.q + q + num_drafts):
            return None
        batch = ScheduledBatch(list(seqs), [q] * len(seqs))
        launch = self.runner.launch_speculative(batch, num_drafts, after=previous)
        if launch is not None:
            launch.pipelined = True
            self._next_drafts = None
            self._mark_scheduled(batch)
        return launch

    def _receive(self, launch: Launch | SpeculativeLaunch) -> list[RequestOutput]:
        """Async scheduling: the deltas of a launched step, once its tokens are on the host."""
        if isinstance(launch, SpeculativeLaunch):
            emitted, drafts = self.runner.speculative_result(launch)
            live = [i for i, seq in enumerate(launch.batch.seqs) if seq.status is not SequenceStatus.FINISHED]
            self._record_step_time(launch, launch.q - 1, launch.num_drafts, len(launch.batch),
                                   sum(len(emitted[i]) for i in live))
            batch = ScheduledBatch([launch.batch.seqs[i] for i in live], [launch.q] * len(live))
            return self._complete(batch, [emitted[i] for i in live], [drafts[i] for i in live])
        tokens = launch.tokens()
        self.scheduler.step_done(synced=bool(launch.seqs))
        outputs, now = [], time.monotonic()
        for seq, token in tokens:
            if self.scheduler.receive(seq, token):
                outputs.append(self._process(self.requests[seq.request_id], [token], now))
        if self.draft_length and launch.seqs:  # a plain decode with drafting off: T_0 for the draft length
            self._record_step_time(launch, 0, 0, len(launch.seqs), len(outputs))
            self.draft_length.update()
        return outputs

    def _record_step_time(self, launch: Launch | SpeculativeLaunch, verified: int, proposed: int, batch: int,
                          tokens: int) -> None:
        """A launched step's time for the draft length: from the previous step's tokens to its own
        (the pipeline's period: what a token costs when steps overlap). Timed only for a step
        launched while another was in flight: the first step after a wait (a prefill, a chain that
        broke, the plain step of a probe) pays the pipeline's whole latency, which steady decoding
        at that k does not; counted, it made plain decoding look 1.5x slower than it runs. Every
        step counts in the realized rates (DraftLength.record_progress), where that latency is
        part of what drafting costs."""
        now = time.perf_counter()
        seconds = now - max(launch.launched_at, self._received_at)
        if launch.pipelined:
            self.draft_length.record_step(verified, proposed, batch, seconds)
        self.draft_length.record_progress(verified, proposed, batch, tokens, seconds)
        self._received_at = now

    def _gather_prompt_logprobs(self, request: _Request, lists: LogprobsLists) -> None:
        """Add a chunk's prompt logprobs (those of the tokens after its rows' positions, computed
        from num_computed_tokens on); a prompt recomputed after a preemption adds nothing twice."""
        have = request.prompt_logprobs
        if have is None:
            request.prompt_logprobs = lists
        else:
            have.extend(lists[max(0, len(have) - request.seq.num_computed_tokens):])

    def _mark_scheduled(self, batch) -> None:
        """When each request first got compute (the end of its queue time, vLLM's metrics), and
        the tokens of the step (vLLM's iteration_tokens_total)."""
        n = sum(batch.num_tokens)
        self.iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, n)] += 1
        self.iteration_tokens_sum += n
        now = time.monotonic()
        for seq in batch.seqs:
            request = self.requests[seq.request_id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now

    def _process(self, request: _Request, new: list[int], now: float,
                 logprobs: list[dict] | None = None) -> RequestOutput:
        """Detokenize the tokens a sequence gained, one at a time, and stop at the first that
        ends the request (EOS, a stop token, max_tokens, max_model_len, or the completion of a
        stop string): a stop inside an accepted run of drafts ends the output exactly where it
        ends without drafting."""
        seq, params = request.seq, request.seq.params
        if request.first_token_time is None:
            request.first_token_time = now
        base = seq.num_output_tokens - len(new)  # output tokens before this step's
        text, reason, stop_reason, kept = "", None, None, 0
        for token in new:
            kept += 1
            if request.detokenizer:
                text += request.stops.push(request.detokenizer.push([token]))
            if request.stops.stopped:
                reason, stop_reason = "stop", request.stops.matched
            elif not params.ignore_eos and self.tokenizer and token in self.tokenizer.eos_token_ids:
                reason = "stop"
            elif token in params.stop_token_ids:
                reason, stop_reason = "stop", token
            elif base + kept == params.max_tokens or seq.num_prompt_tokens + base + kept >= self.config.max_model_len:
                reason = "length"
            if reason:
                break
        request.logprobs = logprobs[:kept] if logprobs is not None else None
        if reason:
            return self._finish(request, reason, text, new[:kept], now, stop_reason, base + kept)
        return self._output(request, text, new, now)

    def _finish(self, request: _Request, reason: str, text: str, new: list[int], now: float,
                stop_reason=None, num_output_tokens: int | None = None) -> RequestOutput:
        text += request.stops.flush()
        seq = request.seq
        self.scheduler.finish(seq, reason, num_output_tokens)
        del self.requests[seq.request_id]
        self.num_reading_host -= reads_host(seq.params)
        family = self.families[request.parent]
        family.remove(seq.request_id)
        if not family:
            del self.families[request.parent]
            self.num_requests_finished += 1
        return self._output(request, text, new, now, stop_reason, finished_time=now)

    def _output(self, request: _Request, text: str, new: list[int], now: float, stop_reason=None,
                finished_time: float | None = None) -> RequestOutput:
        """A delta of one sequence, under the request's id; the request is finished with its last sequence."""
        seq = request.seq
        done = finished_time is not None
        logprobs = request.logprobs if new else None
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and not request.prompt_logprobs_sent and (new or done):
            request.prompt_logprobs_sent = True
            prompt_logprobs = request.prompt_logprobs or LogprobsLists([], [], [])
        if self.decode_logprobs:  # the user's form; the engine core's deltas keep the compact one
            logprobs = None if logprobs is None else logprobs.to_dicts(self.tokenizer)
            prompt_logprobs = None if prompt_logprobs is None else [None, *prompt_logprobs.to_dicts(self.tokenizer)]
        return RequestOutput(
            request_id=request.parent, prompt=request.prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=[CompletionOutput(request.index, text, new, seq.finish_reason if done else None, stop_reason,
                                      logprobs)],
            finished=done and request.parent not in self.families,
            metrics=RequestMetrics(seq.arrival_time, request.first_token_time, finished_time,
                                   request.first_scheduled_time),
            prompt_logprobs=prompt_logprobs)

    # -- live controls and stats ----------------------------------------------------------

    def set_max_num_seqs(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.config.max_num_seqs:
            raise ValueError(f"max_num_seqs must be an integer in [1, {self.config.max_num_seqs}] "
                             f"(the engine was started with {self.config.max_num_seqs}), got {n!r}")
        self.scheduler.set_max_num_seqs(n)

    def set_num_speculative_tokens(self, k: int) -> None:
        """Live control of the draft length cap; 0 turns drafting off, adaptive k moves below the cap.
        The cap cannot pass the k the engine started with: graphs and KV lookahead are sized for it."""
        limit = self.config.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        if self.draft_length is None:
            if k:
                raise ValueError("num_speculative_tokens: this engine was started without speculative_config")
            return
        if k > limit:
            raise ValueError(f"num_speculative_tokens must be at most {limit}, the draft length the engine "
                             f"was started with (its CUDA graphs and KV lookahead are sized for it), got {k}")
        self.draft_length.set_max(k)
        self._next_drafts = None

    def stats(self) -> EngineStats:
        blocks = self.scheduler.blocks
        used, total = blocks.num_used, blocks.num_blocks
        spec = self.spec_counters
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            max_num_seqs=self.scheduler.max_num_seqs, kv_blocks_total=total, kv_blocks_used=used,
            kv_usage=used / total, num_preemptions=self.scheduler.num_preemptions,
            num_requests_finished=self.num_requests_finished,
            prefix_cache_queries=blocks.prefix_queries, prefix_cache_hits=blocks.prefix_hits,
            num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens,
            accepted_per_position=list(spec.accepted_per_position),
            acceptance_rate=spec.acceptance_rate, mean_accepted_length=spec.mean_accepted_length,
            num_speculative_tokens=self.draft_length.k if self.draft_length else 0,
            iteration_tokens=list(self.iteration_tokens), iteration_tokens_sum=self.iteration_tokens_sum)

    @property
    def model_info(self) -> ModelInfo:
        cfg = self.config
        return ModelInfo(
            model=cfg.model, served_model_name=cfg.served_model_name, architecture=cfg.model_config.architecture,
            dtype=cfg.dtype, device=cfg.device,
            max_model_len=cfg.max_model_len, vocab_size=cfg.model_config.vocab_size,
            num_mtp_layers=cfg.model_config.num_mtp_layers,
            num_speculative_tokens=self.draft_length.k if self.draft_length else 0,
            cuda_graphs=cfg.device.startswith("cuda") and bool(self.runner.graphs and self.runner.graphs.graphs),
            backend="torch",
            max_num_seqs_limit=cfg.max_num_seqs, num_speculative_tokens_limit=cfg.num_speculative_tokens)
