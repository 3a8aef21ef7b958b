"""Turning a prompt into checked token ids, the same way for every backend.

Token ids travel as one compact array (`array('i')`, 4 bytes an id) from here to the engine
core's sequence: a Python list holds a pointer and an int object for each, ~10x that, and a
queued prompt of a long context would cost the service many times what it cost on the wire.
"""

from __future__ import annotations

from array import array

from jetserve.engine.errors import PromptTooLongError

TOKEN_ID_BYTES = array("i").itemsize  # what one token id of a prompt costs wherever it is kept


def queued_bytes(num_tokens: int, n: int = 1) -> int:
    """What a prompt of `num_tokens` asked for `n` completions holds while it is in the engine:
    its array in the front end and one in each of its sequences in the core (the bytes a
    request arrived in are gone once it is parsed). What `max_queued_bytes` counts."""
    return num_tokens * TOKEN_ID_BYTES * (1 + n)


def token_array(ids) -> array:
    """`ids` as an int32 array: itself when it is one already (no copy), else converted once.
    A value that is no token id (not an int, out of int32) is named in a ValueError."""
    if isinstance(ids, array) and ids.typecode == "i":
        return ids
    try:
        return array("i", ids)
    except (TypeError, OverflowError):
        bad = next(t for t in ids if not isinstance(t, int) or not -2**31 <= t < 2**31)
        raise ValueError(f"prompt_token_ids: {bad!r} is not a token id") from None


def check_prompt(prompt, tokenizer, vocab_size: int, max_model_len: int) -> tuple[str | None, array]:
    """A prompt is a string or {"prompt_token_ids": [...]}; both become checked token ids."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        if not hasattr(ids, "__len__"):  # an iterator: its length is known once it is read
            ids = token_array(ids)
    elif isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer.json; pass {'prompt_token_ids': [...]}")
        text, ids = prompt, tokenizer.encode_at_most(prompt, max_model_len)
    else:
        raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
    if not len(ids):
        raise ValueError("prompt is empty")
    if len(ids) >= max_model_len:  # first: the conversion and the scan below are then bounded by max_model_len
        raise PromptTooLongError(f"prompt is {len(ids)} tokens; max_model_len={max_model_len} "
                                 f"leaves room for at most {max_model_len - 1}")
    ids = token_array(ids)
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt_token_ids: {bad!r} is not a token id of this model (0..{vocab_size - 1})")
    return text, ids
