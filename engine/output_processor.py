"""The front end's half of a request (vLLM V1's OutputProcessor): text, stop strings, n > 1.

One implementation for every front end: offline `LLMEngine` and the service's `AsyncLLM` both
turn the engine core's outputs into `RequestOutput`s here. The core hands back token ids and the
token-level finish reasons (EOS, stop token ids, max_tokens, max_model_len). Here, outside the
step loop, each token is detokenized and checked for stop strings one at a time: a stop string
inside an accepted run of drafts ends the output at the token that completes it, exactly where
it would end without drafting, and `process_outputs` names the request for the caller to abort
in the core (vLLM V1's `reqs_to_abort`). Logprobs arrive as compact columns and get their
tokens' text here. A request for n completions is a parent of n requests in the core (vLLM V1's
parallel sampling, `ParentRequest`), with ids `child_request_id` gives: each its own stop
strings and logprobs, its deltas tagged with its index, the parent finished with its last.
Completions after the first may be held back until the first has its first token: by then the
prompt's full blocks are in the prefix cache, so the others read its KV instead of computing the
prompt again (sent together, all would compute it in the same step). `RequestOutputCollector`
is one stream's mailbox: deltas that arrive while its reader is busy merge into one message
instead of queueing one per token.
"""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass, field

from jetserve.engine.core import AddRequest, CoreOutput
from jetserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jetserve.engine.prompts import queued_bytes
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.tokenizer import Detokenizer, StopStrings, Tokenizer


@dataclass
class _ParentRequest:
    """The caller's request: what its n completions share."""

    request_id: str
    prompt: str | None
    prompt_token_ids: array  # the one copy in the front end: its completions' AddRequests and outputs share it
    arrival_time: float
    queued_bytes: int  # what its prompt holds while it is in the engine (prompts.queued_bytes)
    running: set[str] = field(default_factory=set)  # its completions' ids in the core, until each finishes
    held: list[AddRequest] = field(default_factory=list)  # completions not yet sent (see `release`)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    prompt_logprobs_sent: bool = False


@dataclass
class _Completion:
    """One completion, one request in the core."""

    parent: _ParentRequest
    index: int
    detokenizer: Detokenizer | None
    stops: StopStrings


@dataclass
class ProcessedOutputs:
    """What one batch of core outputs gave: the deltas, by the caller's request id (an error
    where the core refused a request), and what the caller does next in the core."""

    deltas: list[tuple[str, RequestOutput | ValueError]] = field(default_factory=list)
    to_abort: list[str] = field(default_factory=list)  # ended here (a stop string, a sibling refused)
    to_add: list[AddRequest] = field(default_factory=list)  # completions held back until now


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The id in the core of completion `index`: the caller's own when n is 1, vLLM's form otherwise."""
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    """Core deltas → RequestOutput deltas with text. Not thread-safe: one caller at a time."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentRequest] = {}
        self.requests: dict[str, _Completion] = {}  # by id in the core
        self.queued_bytes = 0  # of the parents' prompts, as `max_queued_bytes` counts them

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: array, params: SamplingParams,
            arrival_time: float, hold_back: bool = False) -> list[AddRequest]:
        """Follow a request; returns its completions as the core takes them. With `hold_back`,
        only the first: `release` gives the others once it has its first token."""
        children = [AddRequest(child_request_id(request_id, i, params.n), prompt_token_ids,
                               params.child(i) if params.n > 1 else params, arrival_time) for i in range(params.n)]
        if request_id in self.parents or any(child.request_id in self.requests for child in children):
            raise ValueError(f"request_id {request_id!r} is already streaming")
        parent = self.parents[request_id] = _ParentRequest(
            request_id, prompt, prompt_token_ids, arrival_time, queued_bytes(len(prompt_token_ids), params.n))
        self.queued_bytes += parent.queued_bytes
        for index, core_id in enumerate(child.request_id for child in children):
            detok = (Detokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                     if self.tokenizer else None)
            stops = StopStrings(params.stop if detok else (), params.include_stop_str_in_output)
            self.requests[core_id] = _Completion(parent, index, detok, stops)
            parent.running.add(core_id)
        if hold_back:
            parent.held = children[1:]
            return children[:1]
        return children

    def release(self, request_id: str) -> list[AddRequest]:
        """The completions held back, once the first has its first token (its prompt's KV is
        computed and cached by then); nothing before that, or twice."""
        parent = self.parents.get(request_id)
        if parent is None or parent.first_token_time is None:
            return []
        held, parent.held = parent.held, []
        return held

    def parent_of(self, core_id: str) -> str | None:
        request = self.requests.get(core_id)
        return None if request is None else request.parent.request_id

    def drop(self, request_id: str) -> list[str]:
        """Stop following a request; returns its completions still running in the core."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        self.queued_bytes -= parent.queued_bytes
        for core_id in parent.running:
            del self.requests[core_id]
        return sorted(parent.running)

    def abort(self, request_id: str, now: float) -> tuple[RequestOutput | None, list[str]]:
        """The last delta of an aborted request (each unfinished completion ends with "abort"),
        and its completions to abort in the core."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None, []
        running = sorted(parent.running)
        last = None
        for core_id in running:
            delta, _ = self.process(CoreOutput(core_id, [], "abort"), now)
            if last is None:
                last = delta
            else:
                last.merge(delta)
        return last, running

    def process_outputs(self, outputs: list[CoreOutput], now: float) -> ProcessedOutputs:
        """The core's outputs of a step as deltas, in order; outputs of requests no longer
        followed here (aborted meanwhile) are dropped."""
        result = ProcessedOutputs()
        for o in outputs:
            request_id = self.parent_of(o.request_id)
            if request_id is None:
                continue
            if o.error is not None:
                result.to_abort += [r for r in self.drop(request_id) if r != o.request_id]
                result.deltas.append((request_id, ValueError(o.error)))
                continue
            delta, stopped_here = self.process(o, now)
            if stopped_here:
                result.to_abort.append(o.request_id)
            result.to_add += self.release(request_id)
            result.deltas.append((request_id, delta))
        return result

    def process(self, o: CoreOutput, now: float) -> tuple[RequestOutput | None, bool]:
        """The delta for the core's output (None for a request no longer followed here), and
        whether a stop string ended it here while the core still runs it (so: abort it there)."""
        request = self.requests.get(o.request_id)
        if request is None:
            return None, False
        parent, token_ids, finish_reason, stop_reason = request.parent, o.token_ids, o.finish_reason, o.stop_reason
        if token_ids and parent.first_token_time is None:
            parent.first_token_time = now
        if parent.first_scheduled_time is None:
            parent.first_scheduled_time = o.first_scheduled_time
        text, kept = "", len(token_ids)
        if request.detokenizer:
            for i, token in enumerate(token_ids):
                text += request.stops.push(request.detokenizer.push([token]))
                if request.stops.stopped:
                    kept, finish_reason, stop_reason = i + 1, "stop", request.stops.matched
                    break
        stopped_here = request.stops.stopped
        finished = finish_reason is not None
        if finished:
            text += request.stops.flush()
            del self.requests[o.request_id]
            parent.running.discard(o.request_id)
            if not parent.running:
                del self.parents[parent.request_id]
                self.queued_bytes -= parent.queued_bytes
        logprobs = None if o.logprobs is None else o.logprobs[:kept].to_dicts(self.tokenizer)
        prompt_logprobs = None
        if o.prompt_logprobs is not None and not parent.prompt_logprobs_sent:
            parent.prompt_logprobs_sent = True
            prompt_logprobs = [None, *o.prompt_logprobs.to_dicts(self.tokenizer)]
        output = RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            outputs=[CompletionOutput(request.index, text, list(token_ids[:kept]), finish_reason,
                                      stop_reason if finished else None, logprobs)],
            finished=not parent.running,
            metrics=RequestMetrics(parent.arrival_time, parent.first_token_time, now if not parent.running else None,
                                   parent.first_scheduled_time),
            prompt_logprobs=prompt_logprobs)
        return output, stopped_here


class RequestOutputCollector:
    """One stream's pending delta: `put` (on the stream's event loop) merges into what the reader
    has not taken yet, so a slow reader gets one larger message, never a growing queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._pending, RequestOutput) and isinstance(item, RequestOutput):
            self._pending.merge(item)
        elif not isinstance(self._pending, BaseException):  # an error is final
            self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item
