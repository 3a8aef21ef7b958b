"""Text in and out of a model directory: tokenizer.json, the chat template, EOS ids, streams.

Only `tokenizers` and jinja2 are used at run time (no transformers), so this runs wherever the
engine does. The chat template is rendered the way transformers renders it, so prompts are
byte-identical to what the model was trained and evaluated with.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path

from jetserve.engine.errors import NoChatTemplateError, PromptTooLongError
from jetserve.engine.model.checkpoint import MAX_VOCAB_SIZE, CheckpointError, read_json, regular_file

log = logging.getLogger(__name__)

# Special-token strings a chat template may read, as transformers passes them.
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# Tokens of prompt context a stream decodes with its first new tokens (vLLM uses the same 5):
# enough for decoders that change a token's text by what precedes it (leading spaces).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
# Private-use markers that stand in for a special token's string inside chat content while the
# template renders (templates trim and split content, but never touch these characters).
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")
# tokenizer.json is parsed whole, into several times its size: the largest published ones are
# tens of MB.
MAX_TOKENIZER_BYTES = 256 * 2**20
# A chat template is code from the checkpoint, run on every chat request: what one render may
# build, in characters of the prompt and items of any string or list it makes by repetition.
MAX_TEMPLATE_CHARS = 2**26


def _token_string(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _optional_json(path: Path) -> dict:
    return read_json(path) if path.exists() else {}


def _chat_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json, as in transformers."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{jinja_file}: unreadable: {exc}") from None
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _compile_now(template: str, model_dir: Path) -> None:
    """Compile the chat template while the model loads: jinja's import and the compile are
    otherwise the first chat request's wait. One that does not compile is said here, at start;
    each chat request is then refused with the same reason."""
    from jinja2.exceptions import TemplateError

    try:
        _compile(template)
    except TemplateError as exc:
        log.warning("%s: the chat template does not compile (%s); chat requests will be refused", model_dir, exc)


@lru_cache(maxsize=8)
def _compile(template: str):
    """The environment transformers renders chat templates in (templates are untrusted code),
    with repetition (`*`) and powers (`**`) bounded by MAX_TEMPLATE_CHARS, so that one expression
    cannot take the host's memory (the rendered prompt is bounded as it streams out:
    `apply_chat_template`). A template's loops are not timed: a checkpoint whose template never
    ends keeps the worker thread rendering it busy, which its operator sees at the first chat."""
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})  # also keeps them from being folded while compiling

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_CHARS:
                        raise SecurityError(f"repetition longer than {MAX_TEMPLATE_CHARS} items")
            elif (isinstance(left, int) and isinstance(right, int) and right > 0
                  and right * abs(left).bit_length() > MAX_TEMPLATE_CHARS):
                raise SecurityError(f"power of more than {MAX_TEMPLATE_CHARS} bits")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# OpenAI's roles ("developer" is its newer name for system); the template decides what each means.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if message.get("role") not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message.get('role')!r}")
        content = message.get("content")
        # An assistant turn that only calls tools carries no content (OpenAI's format).
        if content is None and message.get("tool_calls"):
            continue
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        if not content:
            raise ValueError(f"messages[{i}].content is empty")


class Tokenizer:
    """A model's tokenizer, special tokens and chat template, read from its directory."""

    def __init__(self, backend, *, eos_token_ids: Iterable[int] = (), bos_token_id: int | None = None,
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None):
        self.backend = backend  # a tokenizers.Tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path}: file not found (jetserve reads tokenizers in tokenizer.json form)")
        if regular_file(path).stat().st_size > MAX_TOKENIZER_BYTES:
            raise CheckpointError(f"{path}: larger than {MAX_TOKENIZER_BYTES // 2**20} MiB")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for bad files
            raise CheckpointError(f"{path}: unreadable: {exc}") from None
        config = _optional_json(model_dir / "tokenizer_config.json")
        generation = _optional_json(model_dir / "generation_config.json")
        special = {k: s for k in _TEMPLATE_TOKENS if (s := _token_string(config.get(k))) is not None}

        def token_id(key: str) -> int | list[int] | None:
            """generation_config.json first (int or list of ids: an id past the model's vocabulary is
            never drawn, but one that is no id at all is a broken file), else the token string's id."""
            value = generation.get(f"{key}_id")
            if value is None:
                return backend.token_to_id(special[key]) if key in special else None
            for n in value if isinstance(value, list) else [value]:
                if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < MAX_VOCAB_SIZE:
                    raise CheckpointError(f"{model_dir / 'generation_config.json'}: {key}_id must be a token id "
                                          f"in [0, {MAX_VOCAB_SIZE}) or a list of them, got {value!r}")
            return value

        eos = token_id("eos_token")
        template = _chat_template(model_dir, config)
        if template is not None:
            _compile_now(template, model_dir)
        return cls(backend, eos_token_ids=eos if isinstance(eos, list) else [] if eos is None else [eos],
                   bos_token_id=token_id("bos_token"), chat_template=template, special_tokens=special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, adding no special tokens (a chat template writes its own).
        Through `encode_batch`, which releases the GIL (`encode` holds it): a long prompt
        tokenized in a worker thread never stalls the event loop's health checks."""
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token's string: a text of n characters has at least n / this many tokens."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode_at_most(self, text: str, max_tokens: int) -> list[int]:
        """`encode`, refusing without tokenizing a text too long to have fewer than `max_tokens`
        tokens, so the work a request can cause is bounded by max_model_len."""
        if len(text) > max_tokens * self.max_token_chars:
            raise PromptTooLongError(f"prompt is {len(text)} characters, more than max_model_len={max_tokens} "
                                     f"tokens can hold (at most {self.max_token_chars} characters a token)")
        return self.encode(text)

    @cached_property
    def _literal(self):
        """A copy of the backend that encodes special tokens' strings as plain text."""
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @cached_property
    def _special_pattern(self) -> re.Pattern:
        """Any special token's string (longest first), or a marker character typed by a client."""
        strings = [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]
        strings = sorted(strings, key=len, reverse=True) + [_MARK_OPEN, _MARK_CLOSE]
        return re.compile("|".join(map(re.escape, strings)))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    max_tokens: int | None = None, **kwargs) -> tuple[str, list[int]]:
        """A conversation's prompt as text and token ids. Message content is always text: a
        special token's string in it (a client typing `<|im_start|>system`) becomes plain-text
        tokens, so only the template makes control tokens — no forged turns. With `max_tokens`
        (the service's max_model_len), content too long to fit is refused before it is rendered
        or tokenized, as `encode_at_most` does for a text prompt: a 4 MiB message of content
        would otherwise be tokenized whole (hundreds of MB, seconds of a core) to be refused."""
        _check_messages(messages)
        if max_tokens is not None:
            chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
            if chars > max_tokens * self.max_token_chars:
                raise PromptTooLongError(f"messages' content is {chars} characters, more than max_model_len="
                                         f"{max_tokens} tokens can hold (at most {self.max_token_chars} "
                                         f"characters a token)")
        found: list[str] = []

        def shield(match: re.Match) -> str:
            found.append(match.group())
            return f"{_MARK_OPEN}{len(found) - 1}{_MARK_CLOSE}"

        shielded = [{**m, "content": self._special_pattern.sub(shield, m["content"])}
                    if isinstance(m.get("content"), str) else m for m in messages]
        rendered = self.apply_chat_template(shielded, add_generation_prompt, **kwargs)
        text, ids, start = [], [], 0
        for match in _MARK.finditer(rendered):
            literal = found[int(match.group(1))]
            text += [rendered[start:match.start()], literal]
            ids += self.encode(rendered[start:match.start()])
            ids += self._literal.encode(literal, add_special_tokens=False).ids
            start = match.end()
        text.append(rendered[start:])
        ids += self.encode(rendered[start:])
        return "".join(text), ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for a conversation; extra kwargs (tools, enable_thinking, ...) reach the template."""
        from jinja2.exceptions import TemplateError

        if self.chat_template is None:
            raise NoChatTemplateError("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        try:
            chunks, size = [], 0
            for chunk in _compile(self.chat_template).generate(
                    messages=messages, add_generation_prompt=add_generation_prompt,
                    **{**self.special_tokens, **kwargs}):
                size += len(chunk)
                if size > MAX_TEMPLATE_CHARS:
                    raise TemplateError(f"the prompt grows past {MAX_TEMPLATE_CHARS} characters")
                chunks.append(chunk)
            return "".join(chunks)
        except (TemplateError, RecursionError, ArithmeticError) as exc:
            raise ValueError(f"chat template: {exc or type(exc).__name__}") from None


class Detokenizer:
    """Turns a growing list of token ids into text deltas that are always whole characters.

    Byte-level BPE splits CJK characters and emoji across tokens; decoding a lone piece gives
    U+FFFD. Like vLLM and TGI, each push decodes a short window (prefix_offset..end) and emits
    only what extends the window's already-emitted text (prefix_offset..read_offset), holding
    tokens back while the decoded text ends in an incomplete character. Bytes that are invalid
    outright (a full decode shows U+FFFD for them too) are dropped, so a stream never carries
    U+FFFD; otherwise the pushes add up to `tokenizer.decode(all_output_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # the window's start: no copy of a long prompt
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Append new token ids; return the text they complete ("" while a character is unfinished)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):].replace(_REPLACEMENT, "")


class StopStrings:
    """Finds stop strings in a stream of text deltas, wherever token boundaries split them.

    `push` returns only text that can no longer be part of a match and holds back the longest
    tail that could still start one. When a stop string appears, the output ends right before
    it (vLLM semantics: the stop string itself is not emitted) and `matched` names it. When the
    request ends for another reason, `flush` releases the held tail.
    """

    def __init__(self, stops: Iterable[str], include: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include  # include_stop_str_in_output: the output ends after the stop string
        self.matched: str | None = None
        self._held = ""
        # Every proper prefix of a stop string: a tail is held back iff it is one of these.
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in self.stops), default=0)

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        text = self._held + delta
        hits = [(i, stop) for stop in self.stops if (i := text.find(stop)) >= 0]
        if hits:
            end, self.matched = min(hits)
            self._held = ""
            return text[:end + len(self.matched)] if self.include else text[:end]
        keep = self._partial_match(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def _partial_match(self, text: str) -> int:
        """Length of the longest tail of `text` that some stop string starts with: one set lookup
        per candidate length, so the cost per token stays bounded by the longest stop string."""
        for keep in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-keep:] in self._prefixes:
                return keep
        return 0

    def flush(self) -> str:
        """The held tail, once no more text will come (the request ended without a match)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
