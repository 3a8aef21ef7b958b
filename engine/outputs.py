"""What the engine hands back, with vLLM's names (RequestOutput, CompletionOutput)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec


@dataclass
class Logprob:
    """vLLM's: a token's log-probability under the model, its rank (1: the most likely) and text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of a run of positions in compact columns (vLLM V1's LogprobsLists), the form the
    engine core sends: per position, column 0 is the token there (sampled, or the prompt's) and
    columns 1.. the most likely tokens in order (their ranks are their columns)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # of the column-0 token

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, positions: slice) -> LogprobsLists:
        return LogprobsLists(self.token_ids[positions], self.logprobs[positions], self.ranks[positions])

    def top(self, num: int) -> LogprobsLists:
        """The same positions with only the `num` most likely tokens beside the token itself."""
        return LogprobsLists([ids[:num + 1] for ids in self.token_ids], [v[:num + 1] for v in self.logprobs],
                             list(self.ranks))

    def extend(self, other: LogprobsLists) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks

    def to_dicts(self, tokenizer) -> list[dict[int, Logprob]]:
        """vLLM's user-facing form: per position {token id: Logprob}, the top N and the token itself,
        each token's text decoded alone (its id as text on a model without a tokenizer)."""
        def decode(token: int) -> str:
            return tokenizer.decode([token]) if tokenizer is not None else str(token)

        out = []
        for ids, values, rank in zip(self.token_ids, self.logprobs, self.ranks):
            entry = {t: Logprob(v, r, decode(t)) for r, (t, v) in enumerate(zip(ids[1:], values[1:]), 1)}
            entry[ids[0]] = Logprob(values[0], rank, decode(ids[0]))
            out.append(entry)
        return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while streaming; "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # With SamplingParams.logprobs = N: per token, {token id: Logprob} for the top N and the sampled one
    # (the engine core's raw deltas carry them as LogprobsLists, which the front end decodes).
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
    prompt_token_ids: Sequence[int]  # the request's own int32 array (prompts.token_array), shared by its deltas
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # With SamplingParams.prompt_logprobs = N: per prompt token, as `logprobs` (None for the first),
    # in the request's first delta.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

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
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
