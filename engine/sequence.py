"""A request's tokens and its place in the KV cache, as the scheduler and runner see it."""

from __future__ import annotations

import enum
import time
from array import array

from jetserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request. `token_ids` holds prompt + output; the KV cache holds the first
    `num_computed_tokens` of them. Whatever lies between is what the next step must compute,
    so a fresh prompt, a decode and a recompute after preemption are all the same case.
    `token_ids` is an int32 array, as the prompt came (prompts.py): a queued sequence costs 4
    bytes a token, and its slices are arrays too (`.tolist()` where a list is needed).

    The scheduler is the one writer of this state (the block manager, which it owns, keeps
    `block_table`/`block_keys`); the runner only reads it."""

    def __init__(self, request_id: str, prompt_token_ids: array, params: SamplingParams,
                 arrival_time: float | None = None, seed: int = 0):
        self.request_id = request_id
        self.token_ids = array("i", prompt_token_ids)  # its own: it grows, the request's prompt may be shared
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_keys: list[int] = []  # prefix-cache digests of the leading full, computed blocks
        self.finish_reason: str | None = None
        self.seed = seed  # keys the sampling noise of each position (sampler.py): the request's or the engine's
        self.spec_token_ids: list[int] = []  # draft tokens awaiting verification (MTP)
        self.num_pending = 0  # sampled on the device, not yet seen by the host (async scheduling)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> array:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    def sampled_after(self, n: int) -> bool:
        """Whether a step that computes `n` more of its tokens (pending drafts included) brings
        the sequence up to date, and so samples its next token; a prefill chunk short of the
        end does not."""
        return n == self.num_uncomputed_tokens + len(self.spec_token_ids)

    def __repr__(self):
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
