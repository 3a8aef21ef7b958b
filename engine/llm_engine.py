"""The offline engine (vLLM V1's LLMEngine): requests in, one step at a time, output deltas out.

request → tokenizer → engine core (scheduler → runner → sampler → token outputs) → output
processor (detokenizer, stop strings, n > 1, logprobs' text) → RequestOutput deltas. `LLM`
drives it in a loop. It is the service's `AsyncLLM` without the streams: the same
`OutputProcessor`, and the same engine core behind a client (`SyncClient`, stepped by the
caller's thread), so both give the same outputs for the same requests, one implementation of
each part.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from jetserve.engine.config import EngineConfig
from jetserve.engine.core import EngineCore, Request
from jetserve.engine.core_client import SyncClient
from jetserve.engine.output_processor import OutputProcessor
from jetserve.engine.outputs import RequestOutput
from jetserve.engine.prompts import check_prompt
from jetserve.engine.protocol import EngineStats, ModelInfo
from jetserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jetserve.engine.runner import ModelRunner
    from jetserve.engine.scheduler import Scheduler
    from jetserve.engine.draft_policy import DraftPolicy


class LLMEngine:
    def __init__(self, config: EngineConfig, on_status=None):
        self.config = config
        self.client = SyncClient(config, on_status)
        self.core: EngineCore = self.client.core  # in this process: for tests and tools that look inside
        self.tokenizer = self.core.tokenizer  # one tokenizer for both halves
        self.output_processor = OutputProcessor(self.tokenizer)

    # The in-process core's parts, which tests and benchmarks look at.

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def draft_policy(self) -> DraftPolicy | None:
        return self.core.draft_policy

    @property
    def requests(self) -> dict[str, Request]:
        """The core's unfinished requests, by id (a completion's, see child_request_id)."""
        return self.core.requests

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
        text, ids = self.tokenize_prompt(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = self.output_processor.add(request_id, text, ids, params, arrival)
        added = []
        try:
            for child in children:
                self.client.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.output_processor.drop(request_id)
            self.client.abort(added)
            raise

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all n of its completions) wherever it is and free its blocks; returns
        its last delta (None for a request not running)."""
        last, running = self.output_processor.abort(request_id, time.monotonic())
        if running:
            self.client.abort(running)
        return last

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of the core, its outputs turned into deltas; a request that a stop string
        ended here is aborted in the core before the next step."""
        processed = self.output_processor.process_outputs(self.client.step(), time.monotonic())
        if processed.to_abort:
            self.client.abort(processed.to_abort)
        for child in processed.to_add:  # none: nothing is held back here
            self.client.add_request(child)
        deltas = []
        for _, delta in processed.deltas:
            if isinstance(delta, BaseException):  # the core refuses in add_request, before any step
                raise delta
            deltas.append(delta)
        return deltas

    # -- live controls and stats ----------------------------------------------------------

    def set_max_num_seqs(self, n: int) -> None:
        self.client.call("set_max_num_seqs", n)

    def set_num_speculative_tokens(self, k: int) -> None:
        """Live control of the draft length cap (EngineCore.set_num_speculative_tokens)."""
        self.client.call("set_num_speculative_tokens", k)

    def stats(self) -> EngineStats:
        return self.client.stats()

    @property
    def model_info(self) -> ModelInfo:
        return self.client.model_info
