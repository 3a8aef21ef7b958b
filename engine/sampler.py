"""Batched sampling: the logits processors (vLLM's order: allowed tokens, bad words,
min_tokens, logit bias, penalties), then greedy rows take the argmax; the rest go through
temperature, top-k, top-p and min-p, then draw with the exponential-race trick (argmax p/E, E ~ Exp(1)).

The noise is counter-based: E for vocabulary entry v of the token at position t of a request
with seed s is a hash of (s, t, v), not the next draw of a stateful generator. So a token's
randomness depends on nothing but its request's seed and its position: the same seed gives the
same tokens whatever else is in the batch, however many drafts were verified before it and
whether drafting is on at all (MTP verification accepts a draft exactly when it wins this same
race, see spec_decode.py). Plain torch integer ops, so it runs inside a CUDA graph and gives the
same bits on a CPU and a GPU.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from jetserve.engine.outputs import LogprobsLists
from jetserve.engine.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF


class History(NamedTuple):
    """The tokens a row's next token follows: the prompt's, then the output's so far."""

    prompt: Sequence[int]
    output: Sequence[int]


def process_logits(logits: torch.Tensor, params: list[SamplingParams],
                   histories: list[History] | None) -> torch.Tensor:
    """The per-request logits processors, each row with its own parameters and history."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p, row = params[i], logits[i]
        history = histories[i] if histories is not None else History((), ())
        if p.allowed_token_ids:
            _allow_only(row, p.allowed_token_ids)
        if p.bad_words_token_ids:
            _ban_bad_words(row, p.bad_words_token_ids, history.output)
        if len(history.output) < p.min_tokens:
            _ban(row, set(p.stop_token_ids) | p.eos_token_ids)
        if p.logit_bias:
            _add_bias(row, p.logit_bias)
        if p.repetition_penalty != 1:
            _repetition_penalty(row, p.repetition_penalty, history)
        if p.presence_penalty or p.frequency_penalty:
            _presence_frequency_penalties(row, p.presence_penalty, p.frequency_penalty, history.output)
    return logits


def _ban(row: torch.Tensor, token_ids) -> None:
    if token_ids:
        row[list(token_ids)] = float("-inf")


def _allow_only(row: torch.Tensor, allowed: list[int]) -> None:
    keep = torch.full_like(row, float("-inf"))
    keep[allowed] = 0.0
    row += keep


def _ban_bad_words(row: torch.Tensor, words: list[list[int]], output: Sequence[int]) -> None:
    """A word's last token is banned where the output already ends with the rest of the word."""
    for word in words:
        prefix = word[:-1]
        if not prefix or list(output[len(output) - len(prefix):]) == prefix:
            row[word[-1]] = float("-inf")


def _add_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    ids = torch.tensor(list(bias), device=row.device)
    row[ids] += torch.tensor(list(bias.values()), device=row.device, dtype=row.dtype)


def _repetition_penalty(row: torch.Tensor, penalty: float, history: History) -> None:
    """CTRL's penalty over prompt and output, as vLLM and transformers: positive logits are
    divided by it, negative ones multiplied."""
    seen = torch.tensor(sorted(set(history.prompt) | set(history.output)), dtype=torch.long, device=row.device)
    if len(seen):
        logit = row[seen]
        row[seen] = torch.where(logit > 0, logit / penalty, logit * penalty)


def _presence_frequency_penalties(row: torch.Tensor, presence: float, frequency: float,
                                  output: Sequence[int]) -> None:
    """OpenAI's: logit - count * frequency - (count > 0) * presence, counting the output only."""
    if not len(output):
        return
    counts = torch.bincount(torch.tensor(list(output), device=row.device), minlength=row.shape[-1])
    counts = counts[:row.shape[-1]].to(row.dtype)
    row -= counts * frequency + (counts > 0).to(row.dtype) * presence


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xor-shift-multiply, Mueller's constant) on int64 tensors
    holding 32-bit values: the constant is below 2**28, so no product overflows int64."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from its request's seed (up to 63 bits) and its token's position."""
    seeds, positions = seeds.long(), positions.long()
    key = _mix32((seeds & _MASK32) ^ 0x9E3779B9)
    key = _mix32(key ^ (seeds >> 32) & _MASK32)
    return _mix32(key ^ (positions & _MASK32))


def exponential_noise(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [rows, V] for the tokens at `positions` of requests with `seeds` (one each a row)."""
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    bits = _mix32(_mix32(noise_keys(seeds, positions)[:, None] ^ vocab[None, :]) + vocab[None, :] & _MASK32)
    uniform = ((bits >> 8).float() + 0.5) * 2.0**-24  # (0, 1): 24 bits, exactly representable
    return -torch.log(uniform).to(probs.dtype)


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (rows: sampled requests)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]
    top_k = [p.top_k for p in params]
    if any(top_k):
        vocab = logits.shape[-1]
        k = torch.tensor([min(k, vocab) if k else vocab for k in top_k], device=device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    if (top_p < 1).any():
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token is always kept).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: torch.Tensor,
           positions: torch.Tensor, histories: list[History] | None = None) -> torch.Tensor:
    """logits: [B, V] fp32 → token ids [B]; row i is the token at `positions[i]` of a request
    seeded `seeds[i]` (both [B] int64 tensors on the logits' device). With `histories` the
    logits processors run first (without, the caller has run them)."""
    if histories is not None:
        logits = process_logits(logits, params, histories)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = processed_probs(logits[rows], [params[i] for i in rows])
        if len(rows) < len(params):
            index = torch.tensor(rows, device=logits.device)
            seeds, positions = seeds[index], positions[index]
        tokens[rows] = (probs / exponential_noise(probs, seeds, positions)).argmax(dim=-1)
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num: int) -> LogprobsLists:
    """Per row, the logprob and rank of the token taken there and the `num` most likely tokens,
    from the model's own distribution (vLLM's raw logprobs: before penalties and temperature).
    Ranks count the tokens strictly more likely (1: the most likely), as vLLM's."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(num, dim=-1)
    return LogprobsLists(torch.cat([tokens[:, None], top_ids], 1).tolist(),
                         torch.cat([chosen, top_values], 1).tolist(), ranks.tolist())
