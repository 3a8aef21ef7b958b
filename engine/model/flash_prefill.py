"""Flash-attention prefill over the paged KV cache: one Triton launch for a whole mixed step
(two when a tile's context is cut into pieces).

A step holds several sequences (prefill chunks and decodes), each with `q_len` new tokens at the
end of a context of `ctx_len` tokens; their keys and values are already in the cache (the q/k
norm + RoPE kernel stores them), so a chunk attends to its own tokens and to the context cached
before it the same way: through its block table. The queries are cut into tiles of BLOCK_M rows
of one sequence, and a tile's keys into pieces when the step has too few tiles to fill the GPU
(the work list comes from the host, attention.prefill_plan). One program takes an item (a tile,
or one piece of its keys) for one query head: it streams the keys in BLOCK_N-wide blocks with an
online softmax (flash attention), unmasked below the tile's first position and causally masked
on the diagonal. A tile's only piece writes its output; pieces write a partial result and its
log-sum-exp, which a second kernel merges. Keys are gathered through the block table row by row
(a row is one token's head, contiguous), so no gathered copy of the context and no [q, ctx] mask
ever exist; GQA reads the kv head of its group. Triton rather than a library kernel: FlashAttention's paged kernels
need sm80+ builds that Jetson's JetPack wheels lack, while Triton compiles this one for the H200
and Orin alike, and its interpreter lets CI check it on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.engine.model.attention import PREFILL_BLOCK_M, PrefillWork

LOG2E = 1.4426950408889634


@triton.jit
def _attend(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, start, hi, q_pos, d, kvh, qk_scale,
            NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """One BLOCK_N-wide block of keys from `start`: the online-softmax update (base 2)."""
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < hi
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
    k = tl.load(k_cache_ptr + row[None, :] + d[:, None], mask=valid[None, :] & (d < HEAD_DIM)[:, None],
                other=0.0)  # [D, N]
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None] & (d < HEAD_DIM)[None, :],
                other=0.0)  # [N, D]
    if IEEE:  # fp32 models: no tf32 rounding
        s = tl.dot(q, k, input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, k) * qk_scale
    if CAUSAL:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = m_new
    if CAUSAL:  # a row that has seen no key of its piece yet (a piece past its position): no -inf - -inf
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i * alpha + tl.sum(p, axis=1)


# Not specialized on the values of what varies step to step: each (== 1, divisible by 16) class would
# be a compile of its own, first met on a request's path.
@triton.jit(do_not_specialize=["table_stride", "num_items"])
def _prefill_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, lse_ptr, tables_ptr, table_stride,
                              query_start_ptr, ctx_ptr, items_ptr, num_items, qk_scale, NUM_HEADS: tl.constexpr,
                              NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              IEEE: tl.constexpr):
    item = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (NUM_HEADS // NUM_KV_HEADS)
    b = tl.load(items_ptr + item)
    m0 = tl.load(items_ptr + num_items + item)  # the tile's first row within its sequence
    lo = tl.load(items_ptr + 2 * num_items + item)  # the piece's keys: [lo, hi)
    hi = tl.load(items_ptr + 3 * num_items + item)
    part = tl.load(items_ptr + 4 * num_items + item)
    q_first = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_first
    first_pos = tl.load(ctx_ptr + b) - q_len  # position of the sequence's first new token
    rows = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_PAD)
    q_mask = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    at = (q_first + rows).to(tl.int64)[:, None] * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + at, mask=q_mask, other=0.0)
    q_pos = first_pos + rows
    table_row = tables_ptr + b.to(tl.int64) * table_stride
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    full = (first_pos + m0) // BLOCK_N * BLOCK_N  # keys every row of the tile sees: no mask
    for start in range(lo, tl.minimum(full, hi), BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, start, hi, q_pos, d, kvh,
                                qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, IEEE)
    for start in range(tl.maximum(full, lo), hi, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, start, hi, q_pos, d, kvh,
                                qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, IEEE)
    seen = l_i > 0  # rows past q_len, or before this piece's keys, saw none
    l_i = tl.where(seen, l_i, 1.0)
    o = acc / l_i[:, None]
    if part < 0:
        tl.store(out_ptr + at, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:  # one piece of the tile's keys: its normalized output and log-sum-exp (base 2), merged later
        slot = (part * NUM_HEADS + h).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], o, mask=q_mask)
        tl.store(lse_ptr + slot, tl.where(seen, m_i + tl.math.log2(l_i), float("-inf")), mask=rows < q_len)


# Not specialized on the values of what varies step to step: each (== 1, divisible by 16) class would
# be a compile of its own, first met on a request's path.
@triton.jit(do_not_specialize=["num_merges"])
def _merge_pieces_kernel(part_ptr, lse_ptr, out_ptr, query_start_ptr, merges_ptr, num_merges,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    """A tile's output from its pieces: each weighed by its share of the softmax denominator."""
    merge = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(merges_ptr + merge)
    m0 = tl.load(merges_ptr + num_merges + merge)
    first = tl.load(merges_ptr + 2 * num_merges + merge)
    count = tl.load(merges_ptr + 3 * num_merges + merge)
    q_first = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_first
    rows = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_PAD)
    mask = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for j in range(count):
        slot = ((first + j) * NUM_HEADS + h).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        lse = tl.load(lse_ptr + slot, mask=rows < q_len, other=float("-inf"))
        o = tl.load(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_ref)
        w = tl.math.exp2(lse - m_ref)
        acc = acc * alpha[:, None] + o * w[:, None]
        l = l * alpha + w
        m = m_new
    at = (q_first + rows).to(tl.int64)[:, None] * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + d[None, :]
    tl.store(out_ptr + at, (acc / tl.where(l > 0, l, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


# The configurations `jetserve tune` tries once per (head shape, dtype): BLOCK_N keys a block,
# warps, software-pipelining depth; a serving engine launches the one its tile table names
# (tile_tables.PrefillConfig). Every BLOCK_N divides attention.PREFILL_MIN_PIECE, where pieces start.
_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
            for n, w, s in ((64, 4, 3), (64, 8, 3), (128, 8, 2), (32, 4, 3))]
_tuned_kernel = triton.autotune(_CONFIGS, key=["HEAD_DIM", "NUM_HEADS", "NUM_KV_HEADS", "IEEE"])(
    _prefill_attention_kernel)


def tuned_config(head_dim: int, num_heads: int, num_kv_heads: int, ieee: bool):
    """The configuration autotuning chose for this head shape, as (BLOCK_N, warps, stages); None if none ran."""
    for key, cfg in _tuned_kernel.cache.items():
        if tuple(key[:4]) == (head_dim, num_heads, num_kv_heads, ieee):
            return cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages
    return None


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, context_lens: torch.Tensor, work: PrefillWork, scale: float,
                      block_size: int, block_m: int = PREFILL_BLOCK_M, config=None) -> torch.Tensor:
    """Causal attention of every new token of a step over its sequence's cached context.
    q: [T, H, D] (sequences' tokens in order); caches: [slots, KVH, D] with this step's keys and
    values already stored; block_tables: [B, W] int32; query_start_loc: [B + 1] int32 (where each
    sequence's tokens start in q, vLLM's name); context_lens: [B] int32, after this step's
    tokens; work: from attention.prefill_plan with the same `block_m`; `config`: a
    tile_tables.PrefillConfig, or None to autotune among _CONFIGS. Returns [T, H, D]."""
    t, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if t == 0:
        return out
    num_items, num_merges = work.items.shape[1], work.merges.shape[1]
    head_pad = max(16, triton.next_power_of_2(head_dim))
    # Partial results of the pieces (at least one slot: one kernel variant whatever the plan).
    part = torch.empty(max(1, work.num_parts), num_heads, block_m, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(max(1, work.num_parts), num_heads, block_m, dtype=torch.float32, device=q.device)
    args = (q, k_cache, v_cache, out, part, lse, block_tables, block_tables.stride(0), query_start_loc, context_lens,
            work.items, num_items, scale * LOG2E)
    shape = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_PAD=head_pad,
                 BLOCK_SIZE=block_size, BLOCK_M=block_m, IEEE=q.dtype == torch.float32)
    if q.is_cuda and config is None:
        _tuned_kernel[(num_items, num_heads)](*args, **shape)
    elif q.is_cuda:
        _prefill_attention_kernel[(num_items, num_heads)](*args, **shape, BLOCK_N=config.block_n,
                                                           num_warps=config.warps, num_stages=config.stages)
    else:  # Triton's interpreter (tests): small blocks
        _prefill_attention_kernel[(num_items, num_heads)](*args, **shape, BLOCK_N=16)
    if num_merges:
        _merge_pieces_kernel[(num_merges, num_heads)](part, lse, out, query_start_loc, work.merges, num_merges,
                                                       NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
                                                       BLOCK_M=block_m, num_warps=8)
    return out
