"""The seeded draw as one Triton kernel, so that sampling runs inside the CUDA graphs.

Per row: greedy (temperature 0) takes the first argmax; otherwise the Gumbel race
argmax_v (l_v / T - log E_v) over the tokens kept by min-p (l_v >= max + T log min_p) and by a
floor from top-k/top-p (computed by sampler.py where a row asks for them), with
E_v = -log(u_v), u_v from the counter-based hash of (seed, position, v) — the same bits as
`sampler.exponential_noise`. One program a row; the parameters may be a sequence's, shared by
its `rows_per_param` verify rows. In torch this was ~40 launches over [rows, vocab] int64
tensors, eagerly after the graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_GOLDEN = tl.constexpr(0x9E3779B9 - 2**32)  # sampler.noise_keys' constant, as an int32


@triton.jit
def _mix32(x):
    """sampler._mix32 on uint32 (products wrap mod 2**32, as its masked int64 ones)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _race_kernel(logits_ptr, temperature_ptr, min_p_ptr, floor_ptr, seed_ptr, position_ptr, position_offset,
                 out_ptr, vocab, rows_per_param, HAS_FLOOR: tl.constexpr, V_BLOCK: tl.constexpr):
    r = tl.program_id(0)
    p = r // rows_per_param
    row = logits_ptr + r.to(tl.int64) * vocab
    temperature = tl.load(temperature_ptr + p)
    best_score = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    if temperature == 0:
        for start in range(0, vocab, V_BLOCK):
            v = start + tl.arange(0, V_BLOCK)
            x = tl.load(row + v, mask=v < vocab, other=float("-inf"))
            value = tl.max(x, axis=0)
            index = tl.min(tl.where(x == value, v, vocab), axis=0)
            take = value > best_score
            best_index = tl.where(take, index, best_index)
            best_score = tl.where(take, value, best_score)
    else:
        cut = tl.full([], float("-inf"), tl.float32)
        min_p = tl.load(min_p_ptr + p)
        if min_p > 0:
            top = tl.full([], float("-inf"), tl.float32)
            for start in range(0, vocab, V_BLOCK):
                v = start + tl.arange(0, V_BLOCK)
                top = tl.maximum(top, tl.max(tl.load(row + v, mask=v < vocab, other=float("-inf")), axis=0))
            cut = top + temperature * tl.log(min_p)
        if HAS_FLOOR:
            cut = tl.maximum(cut, tl.load(floor_ptr + r))
        seed_lo = tl.load(seed_ptr + 2 * p)
        seed_hi = tl.load(seed_ptr + 2 * p + 1).to(tl.uint32, bitcast=True)
        key = _mix32((seed_lo ^ _GOLDEN).to(tl.uint32, bitcast=True))
        key = _mix32(key ^ seed_hi)
        position = (tl.load(position_ptr + r) + position_offset).to(tl.uint32)
        key = _mix32(key ^ position)
        for start in range(0, vocab, V_BLOCK):
            v = start + tl.arange(0, V_BLOCK)
            x = tl.load(row + v, mask=v < vocab, other=float("-inf"))
            vu = v.to(tl.uint32)
            bits = _mix32(_mix32(key ^ vu) + vu)
            uniform = ((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24
            score = x / temperature - tl.log(-tl.log(uniform))
            score = tl.where((v < vocab) & (x >= cut), score, float("-inf"))
            value = tl.max(score, axis=0)
            index = tl.min(tl.where(score == value, v, vocab), axis=0)
            take = value > best_score
            best_index = tl.where(take, index, best_index)
            best_score = tl.where(take, value, best_score)
    tl.store(out_ptr + r, best_index.to(tl.int64))


def race(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, floor: torch.Tensor | None,
         seeds: torch.Tensor, positions: torch.Tensor, position_offset: int = 0, rows_per_param: int = 1
         ) -> torch.Tensor:
    """Token ids [rows] int64. logits [rows, V] fp32; per parameter row (a row's is row //
    rows_per_param): temperature and min_p float32, seeds as int32 pairs (lo, hi: an int64
    tensor viewed as int32); per row: floor (raw-logit lower bound from top-k/top-p, or None)
    and the sampled token's position minus `position_offset`."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _race_kernel[(rows,)](logits, temperature, min_p, floor if floor is not None else logits, seeds, positions,
                          position_offset, out, vocab, rows_per_param, HAS_FLOOR=floor is not None,
                          V_BLOCK=min(2048, triton.next_power_of_2(vocab)))
    return out
