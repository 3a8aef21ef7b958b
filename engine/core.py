"""The engine core: the step loop with nothing else in it (vLLM V1's EngineCore / EngineCoreProc).

request → scheduler → runner → sampler → scheduler update → `CoreOutput`s. Requests come in as
checked token ids; out go token deltas with the token-level finish reasons (EOS, stop token ids,
max_tokens, max_model_len) and logprobs in compact columns (`LogprobsLists`). Text
(detokenization, stop strings, logprobs' tokens, the n completions of one request) is the front
end's (`output_processor.py`), so it never costs a step; a stop string it finds comes back as an
abort. Async scheduling's state between steps is `self.pipeline` (`pipeline.py`).

`EngineCore` applies the messages below between steps; offline `LLMEngine` steps it in its own
thread (`SyncClient`), `AsyncLLM` through a thread (`InprocClient`) or, in its own process,
`run_engine_core`: a busy loop that drains requests, aborts and control calls from one ZMQ
socket, steps, and pushes the step's deltas with a stats snapshot to another (msgpack, msgspec).
"""

from __future__ import annotations

import bisect
import gc
import logging
import math
import os
import pickle
import random
import shutil
import signal
import sys
import time
from array import array
from dataclasses import dataclass

import msgspec

from jetserve.engine import lifeline
from jetserve.engine.config import EngineConfig
from jetserve.engine.draft_policy import DraftPolicy
from jetserve.engine.draft_vocab import DraftVocabulary
from jetserve.engine.plan import refuse_if_it_cannot_fit
from jetserve.engine.outputs import LogprobsLists
from jetserve.engine.pipeline import Pipeline
from jetserve.engine.prompts import check_prompt
from jetserve.engine.protocol import ITERATION_TOKENS_BUCKETS, EngineStats, ModelInfo
from jetserve.engine.runner import Launch, ModelRunner, SpeculativeLaunch, log_import_time
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.scheduler import ScheduledBatch, Scheduler
from jetserve.engine.sequence import Sequence, SequenceStatus
from jetserve.engine.spec_decode import SpecCounters
from jetserve.engine.tokenizer import Tokenizer

log = logging.getLogger("jetserve.engine.core")  # its name when run as __main__ too

# An idle core still reports this often: a front end that hears nothing for longer knows it is wedged.
IDLE_TICK = 0.5
# A busy served core captures a graph it left for later (ModelRunner.capture_deferred) at most this
# often: each capture stalls every stream for about one long step, so one a second costs them a few
# percent of their time, and a core under load from its first second has every graph within a minute
# instead of running those steps eagerly until it is idle.
BUSY_CAPTURE_EVERY_S = 1.0


# -- front end → core -------------------------------------------------------------------------

class AddRequest(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: array  # int32 (prompts.token_array): one binary field on the wire, one buffer on each side
    params: SamplingParams
    arrival_time: float


class Abort(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_ids: list[str]


class Call(msgspec.Struct, tag=True, array_like=True, gc=False):
    """A live control (`set_max_num_seqs`, `set_num_speculative_tokens`), answered by a Reply
    once it is in effect."""

    call_id: int
    method: str
    args: list


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


CoreRequest = AddRequest | Abort | Call | Shutdown
CONTROLS = ("set_max_num_seqs", "set_num_speculative_tokens")


# -- core → front end -------------------------------------------------------------------------

class CoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's new tokens after a step, cut at the token that finished it; `error` set:
    the core refused the request."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    first_scheduled_time: float | None = None  # when the core first gave it compute (queue time's end)
    logprobs: LogprobsLists | None = None  # of token_ids, for a request that asked
    prompt_logprobs: LogprobsLists | None = None  # of the prompt's tokens after the first, once


class Outputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: list[CoreOutput]
    stats: EngineStats


class Reply(msgspec.Struct, tag=True, array_like=True, gc=False):
    call_id: int
    error: str | None
    stats: EngineStats  # taken after the call: whoever reads stats next sees it applied


class Status(msgspec.Struct, tag=True, array_like=True, gc=False):
    text: str  # loading progress, for systemd's STATUS=


class Ready(msgspec.Struct, tag=True, array_like=True, gc=False):
    model_info: ModelInfo
    stats: EngineStats


class Failed(msgspec.Struct, tag=True, array_like=True, gc=False):
    message: str


CoreMessage = Outputs | Reply | Status | Ready | Failed


def encode_hook(obj):
    """msgspec's hook for what it does not know: a token id array goes as its bytes (msgpack bin)."""
    if isinstance(obj, array):
        return memoryview(obj).cast("B")
    raise NotImplementedError(f"cannot send {type(obj).__name__} to the engine core")


def decode_hook(kind, obj):
    if kind is array and isinstance(obj, bytes):
        ids = array("i")
        ids.frombytes(obj)
        return ids
    raise NotImplementedError(f"cannot read {kind.__name__} from {type(obj).__name__}")


@dataclass
class Request:
    """What the core keeps beside the scheduler's sequence of a request."""

    seq: Sequence
    first_scheduled_time: float | None = None
    prompt_logprobs: LogprobsLists | None = None  # gathered over the prompt's chunks, sent with the first token
    prompt_logprobs_sent: bool = False


def reads_host(params: SamplingParams) -> bool:
    """Whether a sequence's steps need its tokens or logits on the host (penalties, bad_words and
    min_tokens read its history; logprobs are computed there): async scheduling, which never
    waits for a step's tokens, runs steps one at a time while such a sequence is unfinished."""
    return params.needs_history or params.logprobs is not None or params.prompt_logprobs is not None


class EngineCore:
    """The step loop: requests of checked token ids in, `CoreOutput`s out, straight from the
    scheduler's update (token ids, finish reasons from EOS, stop token ids and length, logprobs
    in columns). It knows no text and no parent requests: a request for n completions is n
    requests here. `add`, `abort` and `call` apply the messages above between steps."""

    def __init__(self, config: EngineConfig, on_status=None, defer_capture: bool = False):
        if config.backend != "torch":
            raise ValueError(f"backend {config.backend!r}: this engine is the torch backend (see open_engine)")
        refuse_if_it_cannot_fit(config)  # here, in the process that will hold the model (and the GPU)
        self.config = config
        # The core's tokenizer only gives EOS ids and bad words' ids: text is the front end's.
        self.tokenizer = Tokenizer.from_pretrained(config.model) if config.has_tokenizer else None
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) if self.tokenizer else frozenset()
        # A served core leaves what only speeds up prefill steps for its idle moments (ModelRunner.capture_deferred).
        self.runner = ModelRunner(config, progress=on_status, defer_capture=defer_capture)
        self.scheduler = Scheduler(config, self.runner.num_blocks)
        self.scheduler.chunk_cap = self.runner.chunk_cap
        spec = config.speculative
        self.draft_policy = (DraftPolicy(spec.num_speculative_tokens, spec.adaptive, self.runner.decode_costs,
                                         spec.acceptance_window) if spec else None)
        self.spec_counters = SpecCounters()
        # Which ids the draft heads project onto, ranked from what this engine emits.
        self.draft_vocab = (DraftVocabulary(config.model_config.vocab_size, spec.draft_vocab_size)
                            if self.runner.model.draft_ids is not None else None)
        self._draft_view, self._draft_view_at = ([], [], [], []), -math.inf  # see stats()
        self.pipeline = Pipeline()
        self.requests: dict[str, Request] = {}  # by request id (a completion's, see child_request_id)
        self.num_requests_finished = 0
        self.num_reading_host = 0  # unfinished sequences whose steps read tokens or logits on the host
        self._seeds = random.Random(config.seed)  # noise keys of requests without a seed
        # Tokens computed per step, as counts per ITERATION_TOKENS_BUCKETS bucket (+Inf last) and a sum.
        self.iteration_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request: AddRequest) -> None:
        """Queue a request; a ValueError names what is wrong with it."""
        params = request.params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        params.update_from_tokenizer(self.tokenizer)
        params.check_vocab(self.config.model_config.vocab_size)
        _, ids = check_prompt({"prompt_token_ids": request.prompt_token_ids}, self.tokenizer,
                              self.config.model_config.vocab_size, self.config.max_model_len)
        # The sampling noise is keyed by (seed, position) (sampler.py): a request's own seed, or
        # one drawn here, so unseeded runs of the same workload repeat under the engine's seed.
        seed = self._seeds.getrandbits(63) if params.seed is None else params.seed % 2**63
        seq = Sequence(request.request_id, ids, params, request.arrival_time, seed)
        self.requests[seq.request_id] = Request(seq)
        self.scheduler.add(seq)
        self.num_reading_host += reads_host(params)

    def add(self, request: AddRequest) -> CoreOutput | None:
        """`add_request`, a refusal as the request's output (what the loops send back)."""
        try:
            self.add_request(request)
        except ValueError as exc:
            return CoreOutput(request.request_id, [], "abort", error=str(exc))
        return None

    def abort(self, request: Abort) -> list[CoreOutput]:
        """Stop requests wherever they are and free their blocks (the front end's abort, or a
        stop string it found); each unfinished one's last output ends with "abort"."""
        return [self._finish(self.requests[rid], "abort", []) for rid in request.request_ids if rid in self.requests]

    def has_work(self) -> bool:
        return bool(self.requests)

    def call(self, request: Call) -> Reply:
        error = None
        try:
            if request.method not in CONTROLS:
                raise ValueError(f"unknown control {request.method!r}")
            getattr(self, request.method)(*request.args)
        except ValueError as exc:
            error = str(exc)
        return Reply(request.call_id, error, self.stats())

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """One step: request → scheduler → runner (forward, sampling, drafting) → scheduler
        update → outputs. One path for every mode, over `self.pipeline`:

        - one step at a time (async scheduling off, or a sequence that reads the host is
          unfinished): read a step still in flight, or else schedule, run and read a step;
        - plain decoding overlapped: launch step N+1, then read step N (a sequence that N
          finishes costs one wasted token in N+1, which the scheduler drops);
        - drafting overlapped: consecutive speculative steps of the same sequences chain on the
          device (N+1 launched before N's tokens are read, its inputs taken from N's result
          there, `_chain`); any other step (prefill chunks, a batch that changes, a limit within
          reach) first catches up, then runs as one at a time."""
        pipe = self.pipeline
        pipe.tick(self.draft_policy.costs if self.draft_policy is not None else None)
        if self.draft_vocab is not None and self.draft_vocab.due():
            ids = self.draft_vocab.rank()
            if ids is not None:
                self.runner.rank_draft_vocabulary(ids)
        overlap = self.config.async_scheduling and not self.num_reading_host
        if pipe.in_flight is not None and not overlap:  # a sequence reads the host's tokens: catch up
            return self._receive(pipe.take())
        num_drafts = pipe.drafts(self.draft_policy, len(self.scheduler.running))
        previous = pipe.in_flight
        if overlap and (self.draft_policy is None or (
                not num_drafts and not isinstance(previous, SpeculativeLaunch) and self.scheduler.decoding_only())):
            pipe.launched()
            batch = self._schedule(0)
            launch = self.runner.launch(batch) if batch else None
            if launch is not None:
                self.scheduler.launched(batch, launch.seqs)
            pipe.in_flight = launch
            if previous is None:
                return []
            if launch is not None:
                pipe.steady = (0, len(previous.seqs))
            return self._receive(previous)
        if previous is not None:
            pipe.in_flight = self._chain(previous, num_drafts) if isinstance(previous, SpeculativeLaunch) else None
            if pipe.in_flight is not None:
                pipe.steady = (previous.num_drafts, len(previous.batch.seqs))
            return self._receive(previous)
        pipe.launched()
        batch = self._schedule(num_drafts)
        if not batch:
            return []
        if overlap and not self.runner.plain_step(batch, num_drafts) and \
                self.runner.speculative_shape(batch, num_drafts) is not None:
            pipe.in_flight = self.runner.launch_speculative(batch, num_drafts)
            return []
        return self._execute(batch, num_drafts)

    def _schedule(self, num_drafts: int) -> ScheduledBatch:
        """The scheduler's next batch, with room for `num_drafts` drafts, and its stats: when each
        request first got compute (the end of its queue time, vLLM's metrics) and the tokens of
        the step (vLLM's iteration_tokens_total)."""
        batch = self.scheduler.schedule(num_lookahead_slots=num_drafts)
        if batch:
            self._mark_scheduled(batch)
        return batch

    def _execute(self, batch: ScheduledBatch, num_drafts: int) -> list[CoreOutput]:
        """Run a scheduled step and wait for its tokens. Where drafting cannot pay at all (the
        policy's `hopeless`), prompts skip the MTP pass too."""
        hopeless = self.draft_policy is not None and self.draft_policy.hopeless
        sampled, drafts, logprobs, prompt_logprobs = self.runner.execute(batch, num_drafts, hopeless)
        for seq, lists in zip(batch.seqs, prompt_logprobs):
            if lists is not None:
                self._gather_prompt_logprobs(self.requests[seq.request_id], lists)
        return self._complete(batch, sampled, drafts, logprobs)

    def _complete(self, batch: ScheduledBatch, sampled: list[list[int] | None], drafts: list[list[int]],
                  logprobs: list | None = None) -> list[CoreOutput]:
        """Record what a step did (acceptance, for the counters and the draft policy; the
        scheduler's update), then each sampled sequence's output."""
        for seq, new in zip(batch.seqs, sampled):
            if new is not None and seq.spec_token_ids:
                self.spec_counters.record(len(seq.spec_token_ids), len(new) - 1)
                self.draft_policy.record(len(seq.spec_token_ids), len(new) - 1)
        self.scheduler.update(batch, sampled, drafts)
        return [self._process(self.requests[seq.request_id], new, lp)
                for seq, new, lp in zip(batch.seqs, sampled, logprobs or [None] * len(batch)) if new is not None]

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
            self.pipeline.launched()
            self._mark_scheduled(batch)
        return launch

    def capture_deferred(self) -> list[CoreOutput]:
        """One piece of the work a served core left for after its start (the runner's
        `capture_deferred`), and the outputs of the step in flight, if any: it is read first, as
        a capture needs the device to itself. Its time is no step's (the pipeline's timing skips it)."""
        outputs = self._receive(self.pipeline.take()) if self.pipeline.in_flight is not None else []
        self.runner.capture_deferred()
        self.scheduler.chunk_cap = self.runner.chunk_cap
        self.pipeline.steady = None
        return outputs

    def _receive(self, launch: Launch | SpeculativeLaunch) -> list[CoreOutput]:
        """Async scheduling: the outputs of a launched step, once its tokens are on the host."""
        self.pipeline.wait(launch)
        if isinstance(launch, SpeculativeLaunch):
            emitted, drafts = self.runner.speculative_result(launch)
            live = [i for i, seq in enumerate(launch.batch.seqs) if seq.status is not SequenceStatus.FINISHED]
            batch = ScheduledBatch([launch.batch.seqs[i] for i in live], [launch.q] * len(live))
            return self._complete(batch, [emitted[i] for i in live], [drafts[i] for i in live])
        tokens = launch.tokens()
        self.scheduler.step_done(synced=bool(launch.seqs))
        outputs = []
        for seq, token in tokens:
            if self.scheduler.receive(seq, token):
                outputs.append(self._process(self.requests[seq.request_id], [token]))
        return outputs

    def _gather_prompt_logprobs(self, request: Request, lists: LogprobsLists) -> None:
        """Add a chunk's prompt logprobs (those of the tokens after its rows' positions, computed
        from num_computed_tokens on); a prompt recomputed after a preemption adds nothing twice."""
        have = request.prompt_logprobs
        if have is None:
            request.prompt_logprobs = lists
        else:
            have.extend(lists[max(0, len(have) - request.seq.num_computed_tokens):])

    def _mark_scheduled(self, batch: ScheduledBatch) -> None:
        n = sum(batch.num_tokens)
        self.iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, n)] += 1
        self.iteration_tokens_sum += n
        now = time.monotonic()
        for seq in batch.seqs:
            request = self.requests[seq.request_id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now

    def _process(self, request: Request, new: list[int], logprobs: LogprobsLists | None = None) -> CoreOutput:
        """The tokens a sequence gained, up to the first that ends the request (EOS, a stop token,
        max_tokens, max_model_len): a stop inside an accepted run of drafts ends the output
        exactly where it ends without drafting. Stop strings are the front end's, which aborts
        the request here when it finds one."""
        seq, params = request.seq, request.seq.params
        if self.draft_vocab is not None:
            self.draft_vocab.observe(new)
        base = seq.num_output_tokens - len(new)  # output tokens before this step's
        reason, stop_reason, kept = None, None, 0
        for token in new:
            kept += 1
            if not params.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
            elif token in params.stop_token_ids:
                reason, stop_reason = "stop", token
            elif base + kept == params.max_tokens or seq.num_prompt_tokens + base + kept >= self.config.max_model_len:
                reason = "length"
            if reason:
                break
        logprobs = logprobs[:kept] if logprobs is not None else None
        if reason:
            return self._finish(request, reason, new[:kept], logprobs, stop_reason, base + kept)
        return self._output(request, new, logprobs)

    def _finish(self, request: Request, reason: str, new: list[int], logprobs: LogprobsLists | None = None,
                stop_reason: int | None = None, num_output_tokens: int | None = None) -> CoreOutput:
        seq = request.seq
        self.scheduler.finish(seq, reason, num_output_tokens)
        del self.requests[seq.request_id]
        self.num_reading_host -= reads_host(seq.params)
        self.num_requests_finished += 1
        return self._output(request, new, logprobs, reason, stop_reason)

    def _output(self, request: Request, new: list[int], logprobs: LogprobsLists | None,
                finish_reason: str | None = None, stop_reason: int | None = None) -> CoreOutput:
        """A request's output; the prompt's logprobs go with its first token (or its end)."""
        prompt_logprobs = None
        if request.seq.params.prompt_logprobs is not None and not request.prompt_logprobs_sent and (
                new or finish_reason):
            request.prompt_logprobs_sent = True
            prompt_logprobs = request.prompt_logprobs or LogprobsLists([], [], [])
        return CoreOutput(request.seq.request_id, new, finish_reason, stop_reason,
                          first_scheduled_time=request.first_scheduled_time,
                          logprobs=logprobs if new else None, prompt_logprobs=prompt_logprobs)

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
        if self.draft_policy is None:
            if k:
                raise ValueError("num_speculative_tokens: this engine was started without speculative_config")
            return
        if k > limit:
            raise ValueError(f"num_speculative_tokens must be at most {limit}, the draft length the engine "
                             f"was started with (its CUDA graphs and KV lookahead are sized for it), got {k}")
        self.draft_policy.set_max(k)
        self.pipeline.next_drafts = None
        self._draft_view_at = -math.inf  # the next stats() shows the new cap

    def stats(self) -> EngineStats:
        blocks = self.scheduler.blocks
        used, total = blocks.num_used, blocks.num_blocks
        spec = self.spec_counters
        now = time.monotonic()
        if self.draft_policy is not None and now - self._draft_view_at >= 1.0:  # stats() comes every step
            rows = self.draft_policy.by_bucket()
            self._draft_view = ([b for b, _, _ in rows], [k for _, k, _ in rows], [c for _, _, c in rows],
                                [round(a, 4) for a in self.draft_policy.alphas])
            self._draft_view_at = now
        buckets, lengths, costs, alphas = self._draft_view
        spec_config = self.config.speculative
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
            num_speculative_tokens=self.draft_policy.k if self.draft_policy else 0,
            draft_buckets=buckets, draft_lengths=lengths, draft_step_costs_s=costs, acceptance_estimates=alphas,
            draft_vocab_size=spec_config.draft_vocab_size if spec_config else 0,
            draft_vocab_coverage=(self.draft_vocab.coverage if self.draft_vocab else 1.0) if spec_config else 0.0,
            iteration_tokens=list(self.iteration_tokens), iteration_tokens_sum=self.iteration_tokens_sum)

    @property
    def model_info(self) -> ModelInfo:
        cfg = self.config
        return ModelInfo(
            model=cfg.model, served_model_name=cfg.served_model_name, architecture=cfg.model_config.architecture,
            dtype=cfg.dtype, device=cfg.device,
            max_model_len=cfg.max_model_len, vocab_size=cfg.model_config.vocab_size,
            num_mtp_layers=cfg.model_config.num_mtp_layers,
            num_speculative_tokens=self.draft_policy.k if self.draft_policy else 0,
            cuda_graphs=cfg.device.startswith("cuda") and bool(self.runner.graphs and self.runner.graphs.graphs),
            backend="torch",
            max_num_seqs_limit=cfg.max_num_seqs, num_speculative_tokens_limit=cfg.num_speculative_tokens)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """The core process: load, say Ready (or Failed), then the busy loop until Shutdown or until
    the front end's process is gone."""
    import zmq

    # SIGINT (a Ctrl-C to the process group) and SIGTERM are the front end's to handle: it drains
    # and then sends Shutdown. A dead front end is noticed through the parent pid.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.device == "cpu":  # leave a core to the front end, or the two processes fight over every one
        import torch
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    parent = os.getppid()
    context = zmq.Context(io_threads=1)
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(input_address)
    outbox.connect(output_address)
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(CoreRequest, dec_hook=decode_hook).decode

    def send(message) -> None:
        outbox.send(encode(message), copy=False)

    try:
        core = EngineCore(config, on_status=lambda text: send(Status(text)), defer_capture=True)
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, which decides
        send(Failed(f"{type(exc).__name__}: {exc}"))
        outbox.close(linger=5000)
        raise SystemExit(1) from None
    # The model, graphs and buffers live as long as the process: out of the collector's scans, a
    # collection in the busy loop costs the requests' objects, not the whole heap (as vLLM's core).
    gc.collect()
    gc.freeze()
    send(Ready(core.model_info, core.stats()))
    next_busy_capture = 0.0
    try:
        while True:
            if not core.has_work() and not inbox.poll(0 if core.runner.deferred else IDLE_TICK * 1000):
                if os.getppid() != parent:
                    return
                send(Outputs(core.capture_deferred() if core.runner.deferred else [], core.stats()))  # the heartbeat
                continue
            outputs: list[CoreOutput] = []
            while True:
                try:
                    request = decode(inbox.recv(zmq.NOBLOCK, copy=False).buffer)
                except zmq.Again:
                    break
                if isinstance(request, AddRequest):
                    refused = core.add(request)
                    if refused is not None:
                        outputs.append(refused)
                elif isinstance(request, Abort):
                    outputs.extend(core.abort(request))
                elif isinstance(request, Call):
                    send(core.call(request))
                else:
                    return
            if core.has_work():
                outputs.extend(core.step())
                if core.runner.deferred and time.monotonic() >= next_busy_capture:
                    outputs.extend(core.capture_deferred())
                    next_busy_capture = time.monotonic() + BUSY_CAPTURE_EVERY_S
            send(Outputs(outputs, core.stats()))
    finally:
        context.destroy(linger=0)


def main(argv: list[str]) -> None:
    """`python -m jetserve.engine.core INPUT OUTPUT LIFELINE_FD SERVER_PID`, the EngineConfig pickled
    on stdin (what `MPClient` starts through `lifeline.spawn`)."""
    input_address, output_address, lifeline_fd, server_pid = argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s[core]: %(message)s")
    _live_with_server(int(lifeline_fd), int(server_pid), input_address)
    # Started early (core_process.py): the driver's initialisation, too, waits for no configuration.
    import torch

    if torch.cuda.is_available():
        torch.cuda.init()
    log_import_time()
    began = time.perf_counter()
    payload = sys.stdin.buffer.read()
    if not payload:  # the front end gave up before it had a configuration (a bad flag, a taken port)
        return
    log.info("start-up: configuration in %.1f s (the front end's own start, beside ours)", time.perf_counter() - began)
    run_engine_core(pickle.loads(payload), input_address, output_address)


def _live_with_server(lifeline_fd: int, server_pid: int, input_address: str) -> None:
    """Before the load: a server that dies, even mid-load, takes this process (and the model's
    memory) with it; its IPC directory, which it can no longer remove, goes with us."""
    ipc_dir = os.path.dirname(input_address.removeprefix("ipc://"))
    lifeline.hold(lifeline_fd, server_pid, on_gone=lambda: shutil.rmtree(ipc_dir, ignore_errors=True))


if __name__ == "__main__":
    main(sys.argv[1:])
    # Triton's extension reports what it still holds at interpreter exit (a screen of "nanobind:
    # leaked" lines in the server's log); everything the core owns is closed by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
