"""SamplingParams with vLLM's names and meanings; invalid values fail here, naming the field."""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# Every stop string is matched against every token's text: the list is bounded, so a request
# cannot make matching (or its own memory) expensive for the engine that serves everyone.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16
MAX_LOGPROBS = 20
MAX_TOKEN_LIST = 4096  # logit_bias, allowed_token_ids, bad_words
# Above it every token is about as likely already; past float32's range the sampler would divide
# the logits by inf, which makes allowed_token_ids' and logit_bias' masks NaN (any token drawn).
MAX_TEMPERATURE = 100.0
# Token ids and counts are int32 wherever they are kept (prompt arrays, the proto), a seed int64
# (vLLM's bound): a larger integer cannot cross to the engine core, so it is refused here, named.
MAX_INT32 = 2**31 - 1
MIN_SEED, MAX_SEED = -2**63, 2**63 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value) -> bool:
    return _is_int(value) and 0 <= value <= MAX_INT32


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


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
    n: int = 1  # completions of the one prompt, each its own sequence (the prompt's KV is shared)
    presence_penalty: float = 0.0  # subtracted once from a token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (multiplies, if negative) the logit of a token seen in prompt or output
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    logprobs: int | None = None  # None: none; N: the sampled token's logprob and the top N
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id → added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (each word's tokens, as a sequence)
    # Set by the engine from its tokenizer (update_from_tokenizer), as in vLLM.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def update_from_tokenizer(self, tokenizer) -> None:
        """Resolve what needs the model's tokenizer: EOS ids (for min_tokens) and bad words' ids
        (each word as written and with a leading space, as vLLM does)."""
        if tokenizer is None:
            if self.bad_words:
                raise ValueError("SamplingParams.bad_words needs a model with a tokenizer")
            return
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        words = {tuple(tokenizer.encode(w)) for word in self.bad_words or () for w in (word, " " + word.lstrip())}
        self.bad_words_token_ids = [list(w) for w in sorted(words) if w]

    def child(self, index: int) -> SamplingParams:
        """Completion `index` of an n-completion request as a request of its own (vLLM's
        parallel sampling): n = 1 and, when seeded, seed + index, so each differs and a seeded
        request repeats. The prompt's logprobs are the first completion's to compute: the others
        may then read the prompt's KV from the prefix cache."""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + index,
                                   prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    def _check(self):
        def fail(name, why):  # the value shortened: a refused list of thousands is not echoed whole
            raise ValueError(f"SamplingParams.{name} {why}, got {reprlib.repr(getattr(self, name))}")

        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            fail("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_INT32:
            fail("top_k", f"must be an integer in [0, {MAX_INT32}] (0 or -1 turn it off)")
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
        if not all(_is_token_id(t) for t in self.stop_token_ids):
            fail("stop_token_ids", f"must be token ids in [0, {MAX_INT32}]")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        if self.seed is not None and (not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            fail("seed", f"must be an integer in [{MIN_SEED}, {MAX_SEED}]")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            fail("n", f"must be an integer in [1, {MAX_N}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                fail(name, "must be a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            fail("repetition_penalty", "must be a number in (0, 10] (1: off)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT32:
            fail("min_tokens", f"must be an integer in [0, {MAX_INT32}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"must be an integer in [0, {MAX_LOGPROBS}] (or None)")
        if self.logit_bias is not None and not (
                isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_TOKEN_LIST
                and all(_is_token_id(t) and _is_number(b) and -100 <= b <= 100
                        for t, b in self.logit_bias.items())):
            fail("logit_bias", f"must map at most {MAX_TOKEN_LIST} token ids in [0, {MAX_INT32}] to numbers in "
                               "[-100, 100]")
        if self.allowed_token_ids is not None and not (
                isinstance(self.allowed_token_ids, list) and 0 < len(self.allowed_token_ids) <= MAX_TOKEN_LIST
                and all(_is_token_id(t) for t in self.allowed_token_ids)):
            fail("allowed_token_ids", f"must be a non-empty list of at most {MAX_TOKEN_LIST} token ids in "
                                      f"[0, {MAX_INT32}]")
        if self.bad_words is not None and not (
                isinstance(self.bad_words, list) and len(self.bad_words) <= MAX_TOKEN_LIST
                and all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_CHARS for w in self.bad_words)):
            # Bounded as stop strings are: the engine core tokenizes each word in its step loop,
            # which every other stream waits on, then matches it at every step.
            fail("bad_words", f"must be a list of at most {MAX_TOKEN_LIST} non-empty strings of at most "
                              f"{MAX_STOP_CHARS} characters")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the model does not have are named here, not met as an index error later."""
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            bad = next((t for t in getattr(self, name) or () if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"SamplingParams.{name}: {bad} is not a token id of this model "
                                 f"(0..{vocab_size - 1})")

    @property
    def needs_history(self) -> bool:
        """Whether sampling must see the sequence's tokens (penalties, bad words, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.bad_words_token_ids or self.min_tokens)

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before greedy's argmax (so a graph's argmax will not do)."""
        return self.needs_history or bool(self.logit_bias or self.allowed_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
