"""Batched sampling: the logits processors (vLLM's order: allowed tokens, bad words,
min_tokens, logit bias, penalties), then greedy rows take the argmax; the rest draw with the
exponential race (argmax p/E, E ~ Exp(1); in logs, Gumbel-max) among the tokens top-k, top-p and
min-p keep, at their temperature. On CUDA the draw is one kernel, captured in the decode and
speculative graphs with per-row parameters as static inputs.

The noise is counter-based: E for vocabulary entry v of the token at position t of a request
with seed s is a hash of (s, t, v), not the next draw of a stateful generator. So a token's
randomness depends on nothing but its request's seed and its position: the same seed gives the
same tokens whatever else is in the batch, however many drafts were verified before it and
whether drafting is on at all (MTP verification accepts a draft exactly when it wins this same
race, see spec_decode.py). 32-bit integer mixing: the same bits in torch on a CPU and in the
Triton kernel on a GPU.
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


def _mix32(x):
    """A 32-bit integer finalizer (xor-shift-multiply, Mueller's constant) on Python ints or int64
    tensors holding 32-bit values: the constant is below 2**28, so no product overflows int64."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from its request's seed (up to 63 bits) and its token's position,
    mixed in Python ints (the same bits: a batch's few keys as tensors were ~30 one-element ops,
    a third of a row's noise on a CPU)."""
    keys = []
    for seed, position in zip(seeds.tolist(), positions.tolist()):
        key = _mix32((seed & _MASK32) ^ 0x9E3779B9)
        key = _mix32(key ^ (seed >> 32) & _MASK32)
        keys.append(_mix32(key ^ (position & _MASK32)))
    return torch.tensor(keys, dtype=torch.int64, device=seeds.device)


def exponential_noise(vocab: int, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] fp32 for the tokens at `positions` of requests with `seeds` (one each a row)."""
    ids = torch.arange(vocab, device=seeds.device)
    bits = _mix32(_mix32(noise_keys(seeds, positions)[:, None] ^ ids[None, :]) + ids[None, :] & _MASK32)
    uniform = ((bits >> 8).float() + 0.5) * 2.0**-24  # (0, 1): 24 bits, exactly representable
    return -torch.log(uniform)


def race(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, floor: torch.Tensor | None,
         seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The draw, row by row: greedy rows (temperature 0) take the argmax; the others the Gumbel
    race argmax_v (l_v / T - log E_v) among the tokens min-p keeps (l_v >= max + T log min_p,
    i.e. p_v >= min_p p_max) and at or above `floor` (top-k/top-p). The winner of that race is
    distributed as softmax(l / T) over the kept tokens. One Triton kernel on CUDA
    (model/sampling_kernels.py: the same bits, and graph-capturable); plain torch elsewhere.
    temperature, min_p: float32 [rows]; seeds int64, positions (of the sampled tokens) [rows]."""
    if logits.is_cuda:
        from jetserve.engine.model.sampling_kernels import race as race_kernel  # needs Triton

        seed_words = seeds.long().contiguous().view(torch.int32)  # (lo, hi) pairs
        return race_kernel(logits.float().contiguous(), temperature, min_p, floor, seed_words, positions)
    tokens = logits.argmax(dim=-1)
    rows = (temperature > 0).nonzero().flatten()  # the noise only where it is drawn (a host read: CPU)
    if len(rows):
        logits, t, min_p = logits[rows], temperature[rows, None], min_p[rows]
        cut = torch.where(min_p > 0, logits.amax(-1) + t[:, 0] * torch.log(min_p), float("-inf"))
        if floor is not None:
            cut = torch.maximum(cut, floor[rows])
        score = logits / t - torch.log(exponential_noise(logits.shape[-1], seeds[rows], positions[rows]))
        tokens[rows] = score.masked_fill(logits < cut[:, None], float("-inf")).argmax(-1)
    return tokens


def top_k_top_p_floor(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """Per row, the smallest raw logit that top-k and then top-p (over the top-k renormalised)
    keep; None when no row asks for either. A row that asks for neither keeps everything."""
    if not any(p.top_k or p.top_p < 1 for p in params if not p.greedy):
        return None
    device, vocab = logits.device, logits.shape[-1]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k and not p.greedy else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p if not p.greedy else 1.0 for p in params], device=device)
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    ordered = logits.sort(dim=-1, descending=True).values
    ranks = torch.arange(vocab, device=device)
    in_top_k = ranks[None, :] < top_k[:, None]
    probs = ((ordered - ordered[:, :1]) / temperature[:, None]).exp().masked_fill(~in_top_k, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    # The smallest set whose mass reaches top_p: a rank stays while the mass before it is below top_p.
    kept = (((probs.cumsum(-1) - probs) < top_p[:, None]) & in_top_k).sum(-1)
    kept = torch.where(top_p < 1, kept, top_k)
    return ordered.gather(1, (kept - 1)[:, None]).squeeze(1)


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: torch.Tensor,
           positions: torch.Tensor, histories: list[History] | None = None) -> torch.Tensor:
    """logits: [B, V] fp32 → token ids [B]; row i is the token at `positions[i]` of a request
    seeded `seeds[i]` (both [B] int64 tensors on the logits' device). With `histories` the
    logits processors run first (without, the caller has run them)."""
    if histories is not None:
        logits = process_logits(logits, params, histories)
    temperature, min_p = sampling_rows(params, logits.device)
    return race(logits, temperature, min_p, top_k_top_p_floor(logits, params), seeds, positions)


def sampling_rows(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, what the race reads: temperature (0: greedy) and min_p, float32."""
    temperature = [0.0 if p.greedy else float(p.temperature) for p in params]
    min_p = [0.0 if p.greedy else float(p.min_p) for p in params]
    return (torch.tensor(temperature, dtype=torch.float32, device=device),
            torch.tensor(min_p, dtype=torch.float32, device=device))


def drawn_in_graph(params: SamplingParams) -> bool:
    """Whether a request's tokens can be drawn inside a captured step: everything but the logits
    processors (Python over each row's history) and top-k/top-p (a sort; eager, from the
    graph's logits); logprobs are read on the host after."""
    return not params.processes_logits and (params.greedy or (not params.top_k and params.top_p >= 1))


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
