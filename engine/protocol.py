"""The seam between the service and an engine: what a front end (gRPC, HTTP) may rely on.

Both the torch engine (`AsyncLLM`) and the TensorRT-LLM backend implement `EngineClient`, so the
servers depend on this contract, not on either engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from jetserve.engine.outputs import RequestOutput
    from jetserve.engine.sampling_params import SamplingParams
    from jetserve.engine.tokenizer import Tokenizer


# vLLM's buckets for the tokens computed per engine step (iteration_tokens_total).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineStats:
    """A snapshot of an engine's state and counters (GetStats, metrics, the agent's health)."""

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
    # The draft policy's view, refreshed at most once a second: per batch bucket, the draft length
    # it would choose now and the step's measured seconds for k = 0.. (0.0: not measured); the
    # acceptance estimate per draft position.
    draft_buckets: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    draft_step_costs_s: list[list[float]] = field(default_factory=list)
    acceptance_estimates: list[float] = field(default_factory=list)
    # The draft heads' vocabulary (engine/draft_vocab.py): its size, and the share of the tokens
    # emitted before its last ranking that it held (1.0 until then; acceptance cannot pass it).
    draft_vocab_size: int = 0
    draft_vocab_coverage: float = 0.0
    # Steps by the tokens they computed: a count per ITERATION_TOKENS_BUCKETS bound (+Inf last), and their sum.
    iteration_tokens: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """What a client may ask about the loaded model (GetModelInfo, /v1/models, metrics labels)."""

    model: str
    served_model_name: str  # what clients call it (/v1/models, metrics' model_name)
    architecture: str
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    num_mtp_layers: int
    num_speculative_tokens: int  # the draft length in use now (0: drafting off)
    cuda_graphs: bool
    backend: str
    max_num_seqs_limit: int  # what SetLimits may set at most: the started values
    num_speculative_tokens_limit: int


class EngineClient(Protocol):
    """A loaded engine as a server sees it. `generate` streams deltas; leaving it early aborts."""

    tokenizer: Tokenizer | None
    last_heartbeat: float  # time.monotonic() of the engine loop's last turn: stale means wedged

    @property
    def model_info(self) -> ModelInfo: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def generate(self, prompt, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None:
        """Stop a request and free its resources; its stream, if still read, ends with a last
        delta whose finish_reason is "abort"."""

    def set_max_num_seqs(self, n: int) -> None: ...

    def set_num_speculative_tokens(self, k: int) -> None: ...

    def stats(self) -> EngineStats: ...
