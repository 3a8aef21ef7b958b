"""Batched sampling: greedy rows take the argmax; the rest go through temperature, top-k,
top-p and min-p, then draw with the exponential-race trick (argmax p/E, E ~ Exp(1)).

The noise is counter-based: E for vocabulary entry v of the token at position t of a request
with seed s is a hash of (s, t, v), not the next draw of a stateful generator. So a token's
randomness depends on nothing but its request's seed and its position: the same seed gives the
same tokens whatever else is in the batch, however many drafts were verified before it and
whether drafting is on at all (MTP verification accepts a draft exactly when it wins this same
race, see spec_decode.py). Plain torch integer ops, so it runs inside a CUDA graph and gives the
same bits on a CPU and a GPU.
"""

from __future__ import annotations

import torch

from jetserve.engine.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF


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
           positions: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] fp32 → token ids [B]; row i is the token at `positions[i]` of a request
    seeded `seeds[i]` (both [B] int64 tensors on the logits' device)."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = processed_probs(logits[rows], [params[i] for i in rows])
        if len(rows) < len(params):
            index = torch.tensor(rows, device=logits.device)
            seeds, positions = seeds[index], positions[index]
        tokens[rows] = (probs / exponential_noise(probs, seeds, positions)).argmax(dim=-1)
    return tokens
