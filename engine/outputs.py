"""What the engine hands back, with vLLM's names (RequestOutput, CompletionOutput)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's: a token's log-probability under the model, its rank (1: the most likely) and text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while streaming; "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # With SamplingParams.logprobs = N: per token, {token id: Logprob} for the top N and the sampled one.
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic()
    first_token_time: float | None = None
    finished_time: float | None = None
    first_scheduled_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))

    def merge(self, delta: RequestOutput) -> None:
        """Fold a streamed delta into this (cumulative) output, completion by completion (n > 1)."""
        for new in delta.outputs:
            mine = next((o for o in self.outputs if o.index == new.index), None)
            if mine is None:
                self.outputs.append(dataclasses.replace(new, token_ids=list(new.token_ids),
                                                         logprobs=None if new.logprobs is None else list(new.logprobs)))
                self.outputs.sort(key=lambda o: o.index)
                continue
            mine.text += new.text
            mine.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + new.logprobs
            mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
        self.finished, self.metrics = delta.finished, delta.metrics
