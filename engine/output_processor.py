"""The front end's half of a request (vLLM V1's OutputProcessor): text, stop strings, streams.

The engine core hands back token ids and the token-level finish reasons (EOS, stop token ids,
max_tokens, max_model_len). Here, outside the step loop, each token is detokenized and checked
for stop strings one at a time: a stop string inside an accepted run of drafts ends the output
at the token that completes it, exactly where it would end without drafting, and the caller
aborts the request in the core. `RequestOutputCollector` is one stream's mailbox: deltas that
arrive while its reader is busy merge into one message instead of queueing one per token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from jetserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.tokenizer import Detokenizer, StopStrings, Tokenizer


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: Detokenizer | None
    stops: StopStrings
    arrival_time: float
    first_token_time: float | None = None
    first_scheduled_time: float | None = None


class OutputProcessor:
    """Core deltas → RequestOutput deltas with text. Not thread-safe: one caller at a time."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float) -> None:
        detok = (Detokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                 if self.tokenizer else None)
        self.requests[request_id] = _RequestState(prompt, prompt_token_ids, detok,
                                                  StopStrings(params.stop if detok else (),
                                                              params.include_stop_str_in_output), arrival_time)

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, request_id: str, token_ids: list[int], finish_reason: str | None, stop_reason,
                now: float, first_scheduled_time: float | None = None) -> tuple[RequestOutput | None, bool]:
        """The delta for the core's `token_ids` (None for a request no longer followed here), and
        whether a stop string ended it here while the core still runs it (so: abort it there)."""
        state = self.requests.get(request_id)
        if state is None:
            return None, False
        if token_ids and state.first_token_time is None:
            state.first_token_time = now
        if state.first_scheduled_time is None:
            state.first_scheduled_time = first_scheduled_time
        text, kept = "", len(token_ids)
        if state.detokenizer:
            for i, token in enumerate(token_ids):
                text += state.stops.push(state.detokenizer.push([token]))
                if state.stops.stopped:
                    kept, finish_reason, stop_reason = i + 1, "stop", state.stops.matched
                    break
        stopped_here = state.stops.stopped
        finished = finish_reason is not None
        if finished:
            text += state.stops.flush()
            del self.requests[request_id]
        output = RequestOutput(
            request_id=request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=[CompletionOutput(0, text, list(token_ids[:kept]), finish_reason, stop_reason if finished else None)],
            finished=finished,
            metrics=RequestMetrics(state.arrival_time, state.first_token_time, now if finished else None,
                                   state.first_scheduled_time))
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
