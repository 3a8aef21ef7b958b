"""Batched sampling: greedy rows take the argmax; the rest go through temperature, top-k,
top-p and min-p, then draw with the exponential-race trick (argmax p/E, E ~ Exp(1)), which
lets a request with a seed draw its noise from its own generator: same seed, same tokens,
whatever else is in the batch."""

from __future__ import annotations

import torch

from jetserve.engine.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.seed is None or params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


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


def exponential_noise(shape_like: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise per row: from the row's own generator when it has one, else the global one."""
    noise = torch.empty_like(shape_like)
    unseeded = [row for row, generator in enumerate(generators) if generator is None]
    if len(unseeded) == len(generators):
        return noise.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    if unseeded:
        noise[unseeded] = torch.empty_like(noise[unseeded]).exponential_()
    return noise


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, V] fp32 → token ids [B]."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = processed_probs(logits[rows], [params[i] for i in rows])
        noise = exponential_noise(probs, [generators[i] for i in rows])
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens
