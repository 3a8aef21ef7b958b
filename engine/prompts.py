"""Turning a prompt into checked token ids, the same way for every backend."""

from __future__ import annotations

from jetserve.engine.errors import PromptTooLongError


def check_prompt(prompt, tokenizer, vocab_size: int, max_model_len: int) -> tuple[str | None, list[int]]:
    """A prompt is a string or {"prompt_token_ids": [...]}; both become checked token ids."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
    elif isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer.json; pass {'prompt_token_ids': [...]}")
        text, ids = prompt, tokenizer.encode_at_most(prompt, max_model_len)
    else:
        raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt is empty")
    if len(ids) >= max_model_len:  # first: the scan below is then bounded by max_model_len
        raise PromptTooLongError(f"prompt is {len(ids)} tokens; max_model_len={max_model_len} "
                                 f"leaves room for at most {max_model_len - 1}")
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt_token_ids: {bad!r} is not a token id of this model (0..{vocab_size - 1})")
    return text, ids
