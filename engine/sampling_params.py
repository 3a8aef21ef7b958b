"""SamplingParams with vLLM's names and meanings; invalid values fail here, naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# Every stop string is matched against every token's text: the list is bounded, so a request
# cannot make matching (or its own memory) expensive for the engine that serves everyone.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self):
        def fail(name, why):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            fail("temperature", "must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "must be an integer >= 0 (0 or -1 turn it off)")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1 (or None for up to max_model_len)")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"SamplingParams.stop takes at most {MAX_STOP_STRINGS} strings of at most "
                             f"{MAX_STOP_CHARS} characters, got {len(self.stop)} (longest "
                             f"{max(map(len, self.stop))})")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be token ids >= 0")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
