"""OpenAI's request bodies (plus vLLM's extra sampling fields), and how they become SamplingParams.

Unknown fields are ignored, as OpenAI's own server and vLLM do; values are range-checked by
SamplingParams, which names the field. Known fields asking for what this server does not do (a JSON
answer, tool calls, best_of) are refused, not ignored: the client would rely on an answer it did
not get.
"""

from __future__ import annotations

import dataclasses
import reprlib
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jetserve.engine import SamplingParams
from jetserve.engine.prompts import token_array
from jetserve.engine.sampling_params import MAX_LOGPROBS, MAX_N
from jetserve.server.guard import MAX_CHAT_MESSAGES

# Bounds that keep one request from asking for unbounded work; the engine checks the rest.
MAX_STOP = 16
MAX_PROMPTS = 64
MAX_TOKEN_LIST = 4096


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields both endpoints share: OpenAI's, then vLLM's extras. Strict, as OpenAI
    is: `true` is no count and "2" no number (lax parsing would make `"prompt": [true, false]`
    the token ids 1 and 0); an integer is still a float."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = Field(None, max_length=MAX_STOP)
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=MAX_TOKEN_LIST)
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = Field(None, max_length=MAX_TOKEN_LIST)
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    allowed_token_ids: Optional[list[int]] = Field(None, max_length=MAX_TOKEN_LIST)
    bad_words: Optional[list[str]] = Field(None, max_length=MAX_TOKEN_LIST)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        """Fields left unset keep SamplingParams' defaults."""
        given = dict(self)
        given.update(max_tokens=max_tokens, logprobs=logprobs)
        if self.logit_bias is not None:
            try:
                given["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias: keys must be token ids (integers as strings)") from None
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{name: value for name, value in given.items()
                                 if name in known and value is not None})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def one_of(shapes: str):
    """A wrap validator for a union field: a value in none of its shapes fails every branch, and
    pydantic names the first one it tried ("prompt.str: Input should be a valid string", said of
    a number); one message naming every shape instead."""
    def check(cls, value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be " + shapes) from None
    return classmethod(check)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None  # OpenAI's legacy field: refused unless it asks for what n returns

    _prompt_shapes = field_validator("prompt", mode="wrap")(
        one_of("a string, a list of strings, a list of token ids or a list of such lists"))

    def prompts(self) -> list:
        """Each prompt as the engine takes it: text, or {"prompt_token_ids": an int32 array}
        (prompts.token_array: 4 bytes an id where the parsed list holds a Python int and a slot)."""
        p = self.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(t, int) for t in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise ValueError("prompt is empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError("prompt: at most %d prompts a request, got %d" % (MAX_PROMPTS, len(prompts)))
        if any(not isinstance(x, str) and len(x) > MAX_TOKEN_LIST * 64 for x in prompts):
            raise ValueError("prompt: a token list is longer than any model's context")
        return [x if isinstance(x, str) else {"prompt_token_ids": token_array(x)} for x in prompts]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    _content_shapes = field_validator("content", mode="wrap")(
        one_of('a string or a list of text parts ({"type": "text", "text": ...}): this server reads text only'))

    def as_dict(self) -> dict:
        """The template's form: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., max_length=MAX_CHAT_MESSAGES)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # read only to refuse them (`refuse_unsupported`); functions and function_call are OpenAI's
    # older names for tools and tool_choice, echo vLLM's extra (the last message before the answer)
    response_format: Optional[dict] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    functions: Optional[list] = None
    function_call: Optional[Union[str, dict]] = None
    echo: bool = False

    def refuse_unsupported(self) -> None:
        """Output constraints and tool calls are not made here: an answer that ignored them would
        be text the client cannot parse or a tool call it waits for in vain."""
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"response_format {reprlib.repr(kind)} is not supported: this server does not "
                             "constrain its output (only 'text')")
        for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
            if getattr(self, tools) and getattr(self, choice) != "none":
                raise ValueError(f"{tools} are not supported: this server makes no tool calls (with {choice} "
                                 "'none' the model is asked for text)")
            if getattr(self, choice) not in (None, "none", "auto"):  # 'required' or a named one, tools or not
                raise ValueError(f"{choice} {reprlib.repr(getattr(self, choice))} asks for a tool call: this server "
                                 "makes none (leave it unset, or 'none')")
        if self.echo:
            raise ValueError("echo is not supported: the answer holds the new message only")

    def requested_max_tokens(self) -> Optional[int]:
        """max_completion_tokens is OpenAI's newer name; max_tokens is kept for older clients."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None
