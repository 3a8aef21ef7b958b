"""The seeded draw as Triton kernels, so that sampling runs inside the CUDA graphs.

Per row: greedy (temperature 0) takes the first argmax; otherwise the Gumbel race
argmax_v (l_v / T - log E_v) over the tokens kept by min-p (l_v >= max + T log min_p) and by a
floor from top-k/top-p (computed by sampler.py where a row asks for them), with
E_v = -log(u_v), u_v from the counter-based hash of (seed, position, v) — the same bits as
`sampler.exponential_noise`. A row is raced by several programs, each over a chunk of the
vocabulary (one program scanning a 151,936-entry row alone would take tens of µs), then the best
chunk is picked; the parameters may be a sequence's, shared by its `rows_per_param` verify
rows. In torch this was ~40 launches over [rows, vocab] int64 tensors, eagerly after the graph.
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
def _row_max(row, vocab, V_BLOCK: tl.constexpr):
    """The largest logit of a row (min-p's reference), scanned whole by each program that needs it."""
    top = tl.full([V_BLOCK], float("-inf"), tl.float32)
    for offset in range(0, vocab, V_BLOCK):
        v = offset + tl.arange(0, V_BLOCK)
        top = tl.maximum(top, tl.load(row + v, mask=v < vocab, other=float("-inf")))
    return tl.max(top, axis=0)


@triton.jit
def _keep_best(score, v, vocab, best_score, best_index):
    """The running best (score, first index at it) after one block of scores at ids v."""
    value = tl.max(score, axis=0)
    index = tl.min(tl.where(score == value, v, vocab), axis=0)
    take = value > best_score
    return tl.where(take, value, best_score), tl.where(take, index, best_index)


@triton.jit
def chunk_argmax(row, s, vocab, V_BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """(largest logit, its first index) over a row's entries [s·CHUNK, (s+1)·CHUNK)."""
    best_score = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    for offset in range(0, CHUNK, V_BLOCK):
        v = s * CHUNK + offset + tl.arange(0, V_BLOCK)
        x = tl.load(row + v, mask=v < vocab, other=float("-inf"))
        best_score, best_index = _keep_best(x, v, vocab, best_score, best_index)
    return best_score, best_index


@triton.jit
def best_split(score_ptr, index_ptr, r, splits, S_BLOCK: tl.constexpr):
    """Row r's pick among its splits' (score, index): the index of the first split with the best
    score, so the first argmax overall, as torch.argmax."""
    i = tl.arange(0, S_BLOCK)
    score = tl.load(score_ptr + r * splits + i, mask=i < splits, other=float("-inf"))
    index = tl.load(index_ptr + r * splits + i, mask=i < splits, other=0)
    first = tl.min(tl.where(score == tl.max(score, axis=0), i, S_BLOCK), axis=0)
    return tl.sum(tl.where(i == first, index, 0), axis=0).to(tl.int64)


@triton.jit
def _argmax_splits_kernel(logits_ptr, score_ptr, index_ptr, vocab, splits, V_BLOCK: tl.constexpr,
                          CHUNK: tl.constexpr):
    """Program (row r, split s): the largest logit of chunk s and its first index into score/index[r, s]."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    best_score, best_index = chunk_argmax(logits_ptr + r.to(tl.int64) * vocab, s, vocab, V_BLOCK, CHUNK)
    tl.store(score_ptr + r * splits + s, best_score)
    tl.store(index_ptr + r * splits + s, best_index)


# Not specialized on the values of what varies step to step: each (== 1, divisible by 16) class would
# be a compile of its own, first met on a request's path.
@triton.jit(do_not_specialize=["position_offset", "rows_per_param"])
def _race_kernel(logits_ptr, temperature_ptr, min_p_ptr, floor_ptr, seed_ptr, position_ptr, position_offset,
                 score_ptr, index_ptr, vocab, splits, rows_per_param, HAS_FLOOR: tl.constexpr,
                 V_BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Program (row r, split s): the best (score, index) over vocabulary entries [s·CHUNK,
    (s+1)·CHUNK) into score/index[r, s] — for a greedy row the chunk's largest logit and its
    first index, otherwise the race's winner among the entries min-p and the floor keep."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    p = r // rows_per_param
    row = logits_ptr + r.to(tl.int64) * vocab
    temperature = tl.load(temperature_ptr + p)
    best_score = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    if temperature == 0:
        best_score, best_index = chunk_argmax(row, s, vocab, V_BLOCK, CHUNK)
    else:
        cut = tl.full([], float("-inf"), tl.float32)
        min_p = tl.load(min_p_ptr + p)
        if min_p > 0:
            cut = _row_max(row, vocab, V_BLOCK) + temperature * tl.log(min_p)
        if HAS_FLOOR:
            cut = tl.maximum(cut, tl.load(floor_ptr + r))
        seed_lo = tl.load(seed_ptr + 2 * p)
        seed_hi = tl.load(seed_ptr + 2 * p + 1).to(tl.uint32, bitcast=True)
        key = _mix32((seed_lo ^ _GOLDEN).to(tl.uint32, bitcast=True))
        key = _mix32(key ^ seed_hi)
        position = (tl.load(position_ptr + r) + position_offset).to(tl.uint32)
        key = _mix32(key ^ position)
        for offset in range(0, CHUNK, V_BLOCK):
            v = s * CHUNK + offset + tl.arange(0, V_BLOCK)
            x = tl.load(row + v, mask=v < vocab, other=float("-inf"))
            vu = v.to(tl.uint32)
            bits = _mix32(_mix32(key ^ vu) + vu)
            uniform = ((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24
            score = x / temperature - tl.log(-tl.log(uniform))
            score = tl.where((v < vocab) & (x >= cut), score, float("-inf"))
            best_score, best_index = _keep_best(score, v, vocab, best_score, best_index)
    tl.store(score_ptr + r * splits + s, best_score)
    tl.store(index_ptr + r * splits + s, best_index)


@triton.jit
def _race_final_kernel(score_ptr, index_ptr, out_ptr, splits, S_BLOCK: tl.constexpr):
    """A row's token: the index of its first split with the best score (the first argmax overall)."""
    r = tl.program_id(0)
    tl.store(out_ptr + r, best_split(score_ptr, index_ptr, r, splits, S_BLOCK))


CHUNK = 4096  # vocabulary entries one program races: a row of 151,936 (Qwen3) over 38 programs, not one


def _splits(vocab: int) -> tuple[int, int, int]:
    """(V_BLOCK, CHUNK, splits) for rows of `vocab` entries."""
    v_block = min(2048, triton.next_power_of_2(vocab))
    chunk = max(v_block, min(CHUNK, triton.next_power_of_2(vocab)))
    return v_block, chunk, triton.cdiv(vocab, chunk)


def argmax_splits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest logit and its first index per chunk of the vocabulary, (score fp32,
    index int32) [rows, splits], for `best_split` in the kernel that consumes the argmax (see
    the module docstring: one program a row is too few)."""
    logits = logits.contiguous()
    rows, vocab = logits.shape
    v_block, chunk, splits = _splits(vocab)
    score = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    _argmax_splits_kernel[(rows, splits)](logits, score, index, vocab, splits, V_BLOCK=v_block, CHUNK=chunk)
    return score, index


def race(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, floor: torch.Tensor | None,
         seeds: torch.Tensor, positions: torch.Tensor, position_offset: int = 0, rows_per_param: int = 1
         ) -> torch.Tensor:
    """Token ids [rows] int64. logits [rows, V] fp32; per parameter row (a row's is row //
    rows_per_param): temperature and min_p float32, seeds as int32 pairs (lo, hi: an int64
    tensor viewed as int32); per row: floor (raw-logit lower bound from top-k/top-p, or None)
    and the sampled token's position minus `position_offset`. Two launches: the race split over
    the vocabulary (a greedy row's splits find their largest logit), the pick among the splits.
    A min-p row's programs each read its whole row for the largest logit: a separate reduction
    launched for every row cost more than that in every step, min-p or not."""
    rows, vocab = logits.shape
    # Positions as int32 whoever built them: a second dtype would be a second variant, compiled
    # on the first request that brings it.
    positions = positions.to(torch.int32)
    v_block, chunk, splits = _splits(vocab)
    score = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    _race_kernel[(rows, splits)](logits, temperature, min_p, floor if floor is not None else logits,
                                 seeds, positions, position_offset, score, index, vocab, splits, rows_per_param,
                                 HAS_FLOOR=floor is not None, V_BLOCK=v_block, CHUNK=chunk)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _race_final_kernel[(rows,)](score, index, out, splits, S_BLOCK=triton.next_power_of_2(splits))
    return out
