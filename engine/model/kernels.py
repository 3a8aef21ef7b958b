"""Triton kernels for the CUDA hot path: one launch where plain torch takes several.

A decode step of a small model is bound by kernel count and memory latency, not arithmetic:
- elementwise chains run as one kernel each (residual add + RMSNorm, q/k norm + RoPE + KV
  store, SiLU·up);
- the skinny matmul: a decode step's products are matrix-vector products (a few rows), and one
  kernel streams each weight once with the RMSNorm or SiLU·up before it fused in; its tile per
  shape comes from the shipped table of the GPU's family (tile_tables.py), or from `jetserve
  tune`, which times every candidate against cuBLAS plus the separate kernel (which wins some big
  shapes);
- paged attention walks only each sequence's own blocks, split over the context when the batch
  is too small to fill the GPU (flash-decoding); in a decode or verify step it also makes its
  queries and the new keys (q/k norm + RoPE + KV store) from the qkv projection.
Each rounds to the activation dtype exactly where the torch code it replaces rounds, so the
fused and the plain path differ only in reduction order. Used on CUDA (and by the tests in
Triton's interpreter): the CPU path stays plain torch (exact against transformers).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from jetserve.engine.config import INVARIANT_ROWS
from jetserve.engine.model import parallel_compile
from jetserve.engine.model.attention import FreshQKV
from jetserve.engine.model.flash_prefill import prefill_attention

if TYPE_CHECKING:
    from jetserve.engine.model.tile_cache import TileCache
    from jetserve.engine.model.tile_tables import TileTable

log = logging.getLogger(__name__)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs the kernels on CPU tensors


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PDL:  # the product after it may start and request its weights now
        gdc_launch_dependents()
        gdc_wait()
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             pdl: bool = False):
    """RMSNorm of x (of x + residual, also returned as the new residual) in one launch; `pdl`:
    a programmatic dependent launch (see `launch`)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res = residual.reshape(-1, n) if residual is not None else x2
    launch(_rms_norm_kernel, (x2.shape[0],), pdl, x2, res, weight, out, res_out, n, eps,
           HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * n_cols + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up for gate|up concatenated on the last dim."""
    n = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * n)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    launch(_silu_mul_kernel, (x.shape[0], triton.cdiv(n, block)), pdl, x, out, n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


@triton.jit
def _head_inputs(src, cs_rows, live, w_ptr, cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """What `_norm_rope` makes heads of, a row each: row i's HEAD_DIM values at `src[i]` and its
    rotate_half partners, the norm's weights (both orders), cos/sin row `cs_rows[i]`. Loaded
    apart from the arithmetic, so a kernel can issue all its loads before any sum waits on them."""
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_PAD)
    dm = d < HEAD_DIM
    partner = tl.where(d < half, d + half, d - half)  # rotate_half's source of each column
    mask = live[:, None] & dm[None, :]
    at = cs_rows.to(tl.int64)[:, None] * HEAD_DIM + (d % half)[None, :]
    return (tl.load(src[:, None] + d[None, :], mask=mask, other=0.0),
            tl.load(src[:, None] + partner[None, :], mask=mask, other=0.0),
            tl.load(w_ptr + d, mask=dm, other=0.0), tl.load(w_ptr + partner, mask=dm, other=0.0),
            tl.load(cos_ptr + at, mask=mask, other=0.0), tl.load(sin_ptr + at, mask=mask, other=0.0))


@triton.jit
def _norm_rope(x, xp, w, wp, c, s, eps, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Heads of q or k from `_head_inputs`: RMSNorm over each head, then NeoX RoPE, rounding like
    `apply_rope(rms_norm(x))` (x * cos + rotate_half(x) * sin); [rows, HEAD_PAD] in the
    activation dtype, each row's sums its own. One function for both kernels that make q and k
    (the attention's own for decode steps, `qk_norm_rope_store` for the rest)."""
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_PAD)
    dtype = x.dtype
    c, s = c.to(tl.float32), s.to(tl.float32)
    f, fp = x.to(tl.float32), xp.to(tl.float32)
    inv = tl.rsqrt(tl.sum(f * f, axis=1) / HEAD_DIM + eps)[:, None]
    n = (w.to(tl.float32)[None, :] * (f * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    rot = ((wp.to(tl.float32)[None, :] * (fp * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32) * s).to(dtype)
    rot = tl.where((d < half)[None, :], -rot, rot)
    return ((n * c).to(dtype).to(tl.float32) + rot.to(tl.float32)).to(dtype)


@triton.jit
def _kv_inputs(qkv_ptr, tokens, live, slot_ptr, kw_ptr, cos_ptr, sin_ptr, kvh, NUM_HEADS: tl.constexpr,
               NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """For `_store_kv`: kv head `kvh` of the `live` ones of `tokens` (rows of qkv): k's
    `_head_inputs`, v, and where in the cache they go."""
    width: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM  # a qkv row
    src = qkv_ptr + tokens.to(tl.int64) * width + (NUM_HEADS + kvh) * HEAD_DIM
    x, xp, w, wp, c, s = _head_inputs(src, tokens, live, kw_ptr, cos_ptr, sin_ptr, HEAD_DIM, HEAD_PAD)
    d = tl.arange(0, HEAD_PAD)
    v = tl.load(src[:, None] + NUM_KV_HEADS * HEAD_DIM + d[None, :], mask=live[:, None] & (d < HEAD_DIM)[None, :])
    dst = tl.load(slot_ptr + tokens, mask=live, other=0).to(tl.int64) * NUM_KV_HEADS * HEAD_DIM + kvh * HEAD_DIM
    return x, xp, w, wp, c, s, v, dst


@triton.jit
def _store_kv(x, xp, w, wp, c, s, v, dst, live, k_cache_ptr, v_cache_ptr, eps, HEAD_DIM: tl.constexpr,
              HEAD_PAD: tl.constexpr):
    """k normed and rotated, and v, into their cache slots `dst` (from `_kv_inputs`)."""
    d = tl.arange(0, HEAD_PAD)
    mask = live[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(k_cache_ptr + dst[:, None] + d[None, :], _norm_rope(x, xp, w, wp, c, s, eps, HEAD_DIM, HEAD_PAD),
             mask=mask)
    tl.store(v_cache_ptr + dst[:, None] + d[None, :], v, mask=mask)


@triton.jit
def _query_inputs(qkv_ptr, t, kvh, qw_ptr, cos_ptr, sin_ptr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """`_head_inputs` of token t's queries of kv head `kvh`: [GROUP_PAD, HEAD_PAD] tiles."""
    g = tl.arange(0, GROUP_PAD)
    width: tl.constexpr = (GROUP + 2) * NUM_KV_HEADS * HEAD_DIM
    src = qkv_ptr + t.to(tl.int64) * width + (kvh * GROUP + g) * HEAD_DIM
    return _head_inputs(src, t + 0 * g, g < GROUP, qw_ptr, cos_ptr, sin_ptr, HEAD_DIM, HEAD_PAD)


@triton.jit
def _qk_norm_rope_store_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                               eps, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                               HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Program (t, kvh): token t's queries of kv head kvh into q, its key and value into the cache."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    qx, qxp, qw, qwp, qc, qs = _query_inputs(qkv_ptr, t, kvh, qw_ptr, cos_ptr, sin_ptr, GROUP, GROUP_PAD,
                                             NUM_KV_HEADS, HEAD_DIM, HEAD_PAD)
    one = tl.arange(0, 1)  # the key: a tile of one row
    kx, kxp, kw, kwp, kc, ks, v, dst = _kv_inputs(qkv_ptr, t + one, one < 1, slot_ptr, kw_ptr, cos_ptr, sin_ptr, kvh,
                                                  GROUP * NUM_KV_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_PAD)
    q = _norm_rope(qx, qxp, qw, qwp, qc, qs, eps, HEAD_DIM, HEAD_PAD)
    tl.store(q_ptr + (t.to(tl.int64) * NUM_KV_HEADS * GROUP + kvh * GROUP + g[:, None]) * HEAD_DIM + d[None, :], q,
             mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :])
    _store_kv(kx, kxp, kw, kwp, kc, ks, v, dst, one < 1, k_cache_ptr, v_cache_ptr, eps, HEAD_DIM, HEAD_PAD)


def _pads(num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, int]:
    """A kv head's query rows and a head's columns as the attention kernels tile them (tl.dot's
    smallest tile is 16 x 16)."""
    return dict(GROUP_PAD=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
                HEAD_PAD=max(16, triton.next_power_of_2(head_dim)))


def qk_norm_rope_store(qkv, q_weight, k_weight, cos, sin, slot_mapping, k_cache, v_cache, eps: float,
                       num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """From the fused qkv projection: per-head RMSNorm and RoPE of q and k, k and v written into
    their cache slots; returns q [T, H, D]. Replaces ~30 small launches with one. A decode or
    verify step does this inside its attention kernel instead (`paged_attention`'s `fresh`)."""
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    group = num_heads // num_kv_heads
    _qk_norm_rope_store_kernel[(t, num_kv_heads)](
        qkv, q_weight, k_weight, cos, sin, slot_mapping, q, k_cache, v_cache, eps, GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEAD_PAD=_pads(num_heads, num_kv_heads, head_dim)["HEAD_PAD"])  # no dot here: no 16-row tile
    return q


# Not specialized on the values of what varies step to step: each (== 1, divisible by 16) class would
# be a compile of its own, first met on a request's path.
@triton.jit(do_not_specialize=["table_stride"])
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, ctx_ptr, rows_ptr, out_ptr, part_ptr,
                            lse_ptr, qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr, scale, eps, table_stride,
                            q_len, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, PER_TOKEN: tl.constexpr,
                            FRESH: tl.constexpr, FRESH_ROWS: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    token = t
    if PER_TOKEN:  # listed tokens of any mix: each one's (row in q, sequence, keys it sees); row -1: padding
        token = tl.load(rows_ptr + 3 * t)
        b = tl.load(rows_ptr + 3 * t + 1)
        limit = tl.where(token < 0, 0, tl.maximum(tl.load(rows_ptr + 3 * t + 2), 1))  # padding walks no key
    else:
        b = t // q_len
        # Query j of a q_len-token step sits at position ctx - q_len + j; padded rows still see one key.
        first = tl.load(ctx_ptr + b) - q_len  # position of the sequence's first new token
        limit = tl.maximum(first + t % q_len + 1, 1)
    per_split = tl.cdiv(tl.cdiv(limit, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, limit)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    heads = kvh * GROUP + g
    row = tl.maximum(token, 0).to(tl.int64) * NUM_KV_HEADS * GROUP * HEAD_DIM
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    if FRESH:  # uniform steps: q and the new keys straight from the qkv projection (`fresh`)
        qx, qxp, qw, qwp, qc, qs = _query_inputs(qkv_ptr, t, kvh, qw_ptr, cos_ptr, sin_ptr, GROUP, GROUP_PAD,
                                                 NUM_KV_HEADS, HEAD_DIM, HEAD_PAD)  # in flight meanwhile
        # The new keys among those this program reads (none in most programs), into the cache
        # before it reads them: the programs of a sequence's last token read them all between
        # their splits, and others that read one store the same values again.
        rows = tl.arange(0, FRESH_ROWS)
        new = tl.maximum(lo, first) + rows
        live = new < hi
        kx, kxp, kw, kwp, kc, ks, new_v, dst = _kv_inputs(qkv_ptr, b * q_len + new - first, live, slot_ptr, kw_ptr,
                                                          cos_ptr, sin_ptr, kvh, GROUP * NUM_KV_HEADS, NUM_KV_HEADS,
                                                          HEAD_DIM, HEAD_PAD)
        _store_kv(kx, kxp, kw, kwp, kc, ks, new_v, dst, live, k_cache_ptr, v_cache_ptr, eps, HEAD_DIM, HEAD_PAD)
        tl.debug_barrier()  # the stores seen by all the program's threads
        q = _norm_rope(qx, qxp, qw, qwp, qc, qs, eps, HEAD_DIM, HEAD_PAD)
    else:
        q = tl.load(q_ptr + row + heads[:, None] * HEAD_DIM + d[None, :], mask=q_mask, other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(tables_ptr + b * table_stride + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        at = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS * HEAD_DIM + kvh * HEAD_DIM
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0)  # in flight with k
        if IEEE:  # fp32 models: no tf32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    if SPLITS == 1:
        live = (g < tl.where(token >= 0, GROUP, 0))[:, None] & (d < HEAD_DIM)[None, :]  # padding writes nothing
        tl.store(out_ptr + row + heads[:, None] * HEAD_DIM + d[None, :], (acc / l[:, None]).to(q.dtype), mask=live)
    else:  # this split's share, normalized, and its log-sum-exp; an empty split weighs nothing
        at = (t.to(tl.int64) * NUM_KV_HEADS * GROUP + heads) * SPLITS + split
        l = tl.maximum(l, 1e-30)  # empty: m = -inf, acc = 0
        tl.store(lse_ptr + at, m + tl.log(l), mask=g < GROUP)
        tl.store(part_ptr + at[:, None] * HEAD_DIM + d[None, :], acc / l[:, None], mask=q_mask)


@triton.jit
def _combine_splits_kernel(part_ptr, lse_ptr, out_ptr, rows_ptr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                           NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                           PER_TOKEN: tl.constexpr):
    th = tl.program_id(0).to(tl.int64)  # program's token * heads + head
    out_th = th
    if PER_TOKEN:  # the listed token's row in the output
        out_th = tl.load(rows_ptr + 3 * (th // NUM_HEADS)).to(tl.int64) * NUM_HEADS + th % NUM_HEADS
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_PAD)
    lse = tl.load(lse_ptr + th * SPLITS + s, mask=s < SPLITS, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    mask = (s < SPLITS)[:, None] & (d < HEAD_DIM)[None, :]
    parts = tl.load(part_ptr + (th * SPLITS + s[:, None]) * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * w[:, None], axis=0)
    tl.store(out_ptr + out_th * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < tl.where(out_th >= 0, HEAD_DIM, 0))


MAX_SPLITS = 16


def _num_splits(programs: int, device: torch.device) -> int:
    """Context splits per (token, kv head): enough programs to fill the GPU once to twice over. At batch 1
    a model has a handful of kv heads, and one program walking a whole context is latency bound."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    # A power of two: SPLITS is a constexpr, and the warm-up compiles every count a step can bring.
    return 1 << (min(MAX_SPLITS, triton.cdiv(2 * sms, programs)).bit_length() - 1)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, q_len: int, block_size: int,
                    scale: float, num_splits: int | None = None, token_rows: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, fresh: FreshQKV | None = None) -> torch.Tensor:
    """Attention for steps where every sequence has `q_len` new tokens (decode: 1, verify: 1+k).
    q: [B * q_len, H, D]; caches: [slots, KVH, D]; block_tables: [B, W]; context_lens: [B]
    (after this step's tokens). Each program walks only its own sequence's blocks, up to its own
    length, or a slice of them when the batch is too small to fill the GPU (flash-decoding: the
    slices' results are combined by their log-sum-exp). No gathered copy of the batch's context,
    and fixed launch shapes whatever the lengths, so the step can live in a CUDA graph.
    `num_splits` overrides the split count (benchmarks compare against one split; batch-invariant
    mode fixes it). `token_rows` [n, 3] int32 lists the tokens to attend, each as (row in q, its
    sequence, keys it sees; row -1: padding, nothing written), for steps of any mix: every token
    (batch-invariant mode's prefill chunks) or a mixed step's decodes (attention.decode_rows);
    then q_len is unused and only the listed rows of `out` (given, or new) are written.
    `fresh` (uniform steps; q is then None): each program makes its queries, and stores the new
    keys it reads, from the qkv projection, as `qk_norm_rope_store` would have."""
    num_kv_heads, head_dim = k_cache.shape[1:]
    if fresh is None:
        tokens, num_heads, dtype = q.shape[0], q.shape[1], q.dtype
    elif token_rows is not None:
        raise ValueError("listed tokens take q made apart (qk_norm_rope_store)")
    else:
        tokens, dtype = fresh.qkv.shape[0], fresh.qkv.dtype
        num_heads = fresh.qkv.shape[1] // head_dim - 2 * num_kv_heads
    t = tokens if token_rows is None else token_rows.shape[0]
    device = k_cache.device
    out = torch.empty(tokens, num_heads, head_dim, dtype=dtype, device=device) if out is None else out
    if t == 0:
        return out
    pads = _pads(num_heads, num_kv_heads, head_dim)
    splits = num_splits or _num_splits(t * num_kv_heads, device)
    part = torch.empty(t, num_heads, splits, head_dim, dtype=torch.float32, device=device) if splits > 1 else out
    lse = torch.empty(t, num_heads, splits, dtype=torch.float32, device=device) if splits > 1 else out
    rows = context_lens if token_rows is None else token_rows
    makes_q = fresh is not None
    if not makes_q:  # the kernel's pointers for making q go unread: any tensor
        fresh = FreshQKV(q, q, q, q, q, context_lens, 0.0)
    # A program stores at most q_len new keys, in one tile: one row at q_len 1 (a decode; Triton
    # compiles q_len == 1 apart anyway), else a tile of the queries' rows.
    assert q_len <= pads["GROUP_PAD"], "uniform steps are at most MAX_UNIFORM_Q tokens a sequence"
    fresh_rows = 1 if q_len == 1 else pads["GROUP_PAD"]
    _paged_attention_kernel[(t, num_kv_heads, splits)](
        out if makes_q else q, k_cache, v_cache, block_tables, context_lens, rows, out, part, lse, *fresh[:-1], scale,
        fresh.eps, block_tables.stride(0), max(q_len, 1), GROUP=num_heads // num_kv_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=32, SPLITS=splits, IEEE=dtype == torch.float32,
        PER_TOKEN=token_rows is not None, FRESH=makes_q, FRESH_ROWS=fresh_rows, num_warps=4, **pads)
    if splits > 1:
        _combine_splits_kernel[(t * num_heads,)](part, lse, out, rows, SPLITS=splits,
                                                  SPLITS_PAD=triton.next_power_of_2(splits), NUM_HEADS=num_heads,
                                                  HEAD_DIM=head_dim, HEAD_PAD=pads["HEAD_PAD"],
                                                  PER_TOKEN=token_rows is not None)
    return out


# What the skinny matmul computes from its input rows before the product.
PLAIN, NORM, ADD_NORM, SILU_MUL = 0, 1, 2, 3
SKINNY_MAX_ROWS = 64  # decode batches and MTP verifies (batch x (k+1)); above, cuBLAS GEMMs with the elementwise kernels
INVARIANT_MAX_ROWS = 65535 * INVARIANT_ROWS  # batch-invariant rows a product takes: the grid's limit (a step's budget stays far below)
DOT_MIN_ROWS = 16  # tl.dot's smallest tile: from here every product runs on tensor cores; below, rows are padded to it


@triton.jit
def input_chunk(x_ptr, res_ptr, res_out_ptr, rows, cols, mask, K: tl.constexpr, STORE_SUM, ADD: tl.constexpr,
                 SILU: tl.constexpr, dtype: tl.constexpr):
    """Columns `cols` of the product's input rows before any norm: x, x + residual (stored to
    res_out when STORE_SUM), or SiLU(gate) * up, rounded like the torch path (silu_mul, rms_norm)."""
    x_stride: tl.constexpr = 2 * K if SILU else K
    a = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if SILU:
        up = tl.load(x_ptr + rows[:, None] * x_stride + K + cols[None, :], mask=mask, other=0.0)
        g = a.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype)
        a = (act.to(tl.float32) * up.to(tl.float32)).to(dtype)
    if ADD:
        r = tl.load(res_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)
        a = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)
        if STORE_SUM:
            tl.store(res_out_ptr + rows[:, None] * K + cols[None, :], a, mask=mask)
    return a


@triton.jit
def row_inv_rms(x_ptr, res_ptr, res_out_ptr, rows, row_mask, K: tl.constexpr, eps, ADD: tl.constexpr,
                 SILU: tl.constexpr, dtype: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS of each input row (after the prologue's add or SiLU·up): a first pass over K, for
    inputs too wide to keep in registers until the norm is known."""
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        h = input_chunk(x_ptr, res_ptr, res_out_ptr, rows, cols, row_mask[:, None] & (cols < K)[None, :],
                         K, False, ADD, SILU, dtype).to(tl.float32)
        ss += tl.sum(h * h, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def normalized(a, inv, norm_w_ptr, cols, k_mask, dtype: tl.constexpr):
    y = (a.to(tl.float32) * inv[:, None]).to(dtype)
    nw = tl.load(norm_w_ptr + cols, mask=k_mask, other=0.0)
    return (nw.to(tl.float32)[None, :] * y.to(tl.float32)).to(dtype)


# M not specialized on its divisibility by 16, which varies step to step (a compile each class, first
# met on a request's path); M == 1, plain decoding at batch 1, keeps a variant of its own.
@triton.jit(do_not_specialize_on_alignment=["M"])
def _skinny_matmul_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, out_ptr, res_out_ptr, M, N, K: tl.constexpr, eps,
                          NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr, DOT: tl.constexpr,
                          IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          K_SPLIT: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr,
                          PREFETCH: tl.constexpr):
    """out[M, N] = a(x)[M, K] @ w[N, K]^T for a few rows, a() being the prologue: nothing, RMSNorm
    (of x + residual, whose sum the first column of programs also stores) or SiLU(gate) * up.
    Program (i, j) streams BLOCK_N weight rows once for all M input rows, over input columns
    [j K_SPLIT, (j + 1) K_SPLIT): with several, each writes fp32 partial sums that
    `_sum_splits_kernel` adds in order (deterministic), so a small N still fills the GPU. The
    inputs are tiny and come from L2. The products are FMAs in registers (up to 8 rows) or
    tensor-core dots (DOT, from 16 rows, and below where the tile says so: rows padded to 16). The
    next tile's weights are requested before this one is multiplied (STAGES 0), or STAGES - 1
    tiles ahead into shared memory by Triton's pipeline (Tile.stages); the first tile's, and with
    PREFETCH (Tile.prefetch) all the program's weights into L2, before waiting for the previous
    kernel (PDL: a programmatic dependent launch starts while it ends, and weights are never
    written by a step), the prologue runs while they arrive."""
    pid = tl.program_id(0)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # one block of rows (batch-invariant: of 16)
    row_mask = rows < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    dtype = x_ptr.dtype.element_ty  # the activations' (out may hold fp32 partial sums)
    if STAGES == 0 or K_SPLIT <= BLOCK_K:  # the pipeline requests its own first tiles
        w = _weights(w_rows, n_mask, k_lo, k_hi, BLOCK_K)
    if PREFETCH:
        prefetch_l2(w_ptr + tl.minimum(n, N - 1)[:, None].to(tl.int64) * K, k_lo, k_hi, BLOCK_N,
                    1024 // w_ptr.dtype.element_ty.primitive_bitwidth)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if K_SPLIT <= BLOCK_K:  # the program's columns in one tile
        cols = k_lo + tl.arange(0, BLOCK_K)
        k_mask = cols < k_hi
        a = input_chunk(x_ptr, res_ptr, res_out_ptr, rows, cols, row_mask[:, None] & k_mask[None, :], K, pid == 0,
                         ADD, SILU, dtype)
        if NORM:
            if K_SPLIT >= K:  # the tile is the whole row
                af = a.to(tl.float32)
                inv = tl.rsqrt(tl.sum(af * af, axis=1) / K + eps)
            else:
                inv = row_inv_rms(x_ptr, res_ptr, res_out_ptr, rows, row_mask, K, eps, ADD, SILU, dtype, BLOCK_M,
                                   BLOCK_K)
            a = normalized(a, inv, norm_w_ptr, cols, k_mask, dtype)
        if DOT:
            acc = _dot(a, w, IEEE)
        else:
            acc = tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    else:
        inv = tl.zeros([BLOCK_M], tl.float32)
        if NORM:  # first pass: each row's mean square
            inv = row_inv_rms(x_ptr, res_ptr, res_out_ptr, rows, row_mask, K, eps, ADD, SILU, dtype, BLOCK_M,
                               BLOCK_K)
        if DOT and STAGES > 0:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                a = _prologue(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, rows, row_mask, k0, k_hi, inv, pid == 0, K,
                              NORM, ADD, SILU, dtype, BLOCK_K)
                acc += _dot(a, _weights(w_rows, n_mask, k0, k_hi, BLOCK_K), IEEE)
        elif DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                cur = w
                w = _weights(w_rows, n_mask, k0 + BLOCK_K, k_hi, BLOCK_K)  # the next tile, in flight meanwhile
                a = _prologue(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, rows, row_mask, k0, k_hi, inv, pid == 0, K,
                              NORM, ADD, SILU, dtype, BLOCK_K)
                acc += _dot(a, cur, IEEE)
        else:
            # Products accumulate elementwise and are reduced once at the end: an iteration is
            # loads and FMAs, with no cross-thread reduction between one tile's loads and the next's.
            acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
            if STAGES > 0:
                for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                    a = _prologue(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, rows, row_mask, k0, k_hi, inv, pid == 0,
                                  K, NORM, ADD, SILU, dtype, BLOCK_K)
                    w = _weights(w_rows, n_mask, k0, k_hi, BLOCK_K)
                    acc3 += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            else:
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    cur = w
                    w = _weights(w_rows, n_mask, k0 + BLOCK_K, k_hi, BLOCK_K)
                    a = _prologue(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, rows, row_mask, k0, k_hi, inv, pid == 0,
                                  K, NORM, ADD, SILU, dtype, BLOCK_K)
                    acc3 += a.to(tl.float32)[:, None, :] * cur.to(tl.float32)[None, :, :]
            acc = tl.sum(acc3, axis=2)
    out_mask = row_mask[:, None] & n_mask[None, :]
    if K_SPLIT >= K:
        tl.store(out_ptr + rows[:, None] * N + n[None, :], acc.to(dtype), mask=out_mask)
    else:  # this split's partial sums, [split, M, N] fp32
        tl.store(out_ptr + (tl.program_id(1) * M + rows[:, None]) * N + n[None, :], acc, mask=out_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = the sum of a split-K product's partials [SPLITS, size], added in split order."""
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = at < size
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.load(part_ptr + at, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * size + at, mask=mask, other=0.0)
    tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(part: torch.Tensor, out: torch.Tensor, pdl: bool) -> torch.Tensor:
    """Write into `out` the in-order sum of `part` [splits, *out.shape] (fp32)."""
    block = 1024
    launch(_sum_splits_kernel, (triton.cdiv(out.numel(), block),), pdl, part, out, out.numel(), SPLITS=part.shape[0],
           BLOCK=block, num_warps=4)
    return out


def launch(kernel, grid, pdl: bool, *args, **meta):
    """Launch a kernel that takes a PDL flag; with it, as a programmatic dependent launch: the
    kernel may start while the one before it in the stream still runs, so each of ours first
    requests what no step writes (its weights), then lets its own successor start and waits
    (`gdc_wait`) for its predecessor's writes before reading anything else. A chain of such
    launches streams weights without a gap between kernels (CUDA graphs keep the edges)."""
    if pdl:
        meta["launch_pdl"] = True
    return kernel[grid](*args, PDL=pdl, **meta)


@triton.jit
def _prefetch(ptrs):
    """Ask L2 for the cache lines at `ptrs`: a hint that holds no register and waits for
    nothing (an instruction has to return a value: a zero, unused)."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.constexpr_function
def prefetch_per_row(rows):
    """Lines `prefetch_l2` asks for a row an iteration: 128 over all the rows (one a thread at 4
    warps), at least one."""
    return max(1, 128 // rows)


@triton.jit
def prefetch_columns(c, hi, ROWS: tl.constexpr, LINE: tl.constexpr):
    """The columns `prefetch_l2` asks for in a row from column `c` on: a line apart, clamped to
    hi - 1. As `c` goes from the first column to the last + LINE - 1 by all of them at a time,
    every line holding a column below `hi` holds one of them, whatever the row's alignment."""
    return tl.minimum(c + tl.arange(0, prefetch_per_row(ROWS)) * LINE, hi - 1)


@triton.jit
def prefetch_l2(rows, lo, hi, ROWS: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for columns [lo, hi) of the ROWS rows `rows` ([ROWS, 1] pointers, each to a row's
    column 0, every one valid), LINE columns a cache line. Prefetches hold no registers, so a
    program's whole share of the weights is requested at once where its loads keep a step or a
    few in flight: the memory starts streaming while the previous kernel ends (PDL), and the
    first steps' loads meet their lines on the way."""
    for c in range(lo, hi + LINE - 1, prefetch_per_row(ROWS) * LINE):
        _prefetch(rows + prefetch_columns(c, hi, ROWS, LINE)[None, :])


def prefetching(tile: Tile) -> bool:
    """Whether `tile`'s launch asks L2 for its weights first: not in Triton's interpreter, which
    runs no inline assembly (a prefetch changes no result)."""
    return tile.prefetch and not INTERPRETED


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel starts while the previous one ends): Hopper and
    later; not Orin (sm_87), not Triton's interpreter."""
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _weights(w_rows, n_mask, k0, k_hi, BLOCK_K: tl.constexpr):
    """The weight tile of columns [k0, k0 + BLOCK_K), those below k_hi."""
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + cols[None, :], mask=n_mask[:, None] & (cols < k_hi)[None, :], other=0.0)


@triton.jit
def _prologue(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, rows, row_mask, k0, k_hi, inv, store_sum, K: tl.constexpr,
              NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr, dtype: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns [k0, k0 + BLOCK_K) of the product's input after its prologue (`inv`: each row's 1 / RMS)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    k_mask = cols < k_hi
    a = input_chunk(x_ptr, res_ptr, res_out_ptr, rows, cols, row_mask[:, None] & k_mask[None, :], K, store_sum,
                     ADD, SILU, dtype)
    if NORM:
        a = normalized(a, inv, norm_w_ptr, cols, k_mask, dtype)
    return a


@triton.jit
def _dot(a, w, IEEE: tl.constexpr):
    """a [M, K] @ w [N, K]^T on tensor cores, in fp32; fp32 models without tf32 rounding."""
    if IEEE:
        return tl.dot(a, tl.trans(w), input_precision="ieee")
    return tl.dot(a, tl.trans(w))


class Tile(NamedTuple):
    """How a skinny product runs: BLOCK_N weight rows a program, BLOCK_K columns (the quantized
    kernel: BLOCK_W words) a step, `warps` warps; the columns split over `split_k` programs whose
    fp32 partial sums a second kernel adds in order (a small N still fills the GPU); `apart`:
    the prologue (norm, SiLU·up) as its own kernel first, so no program recomputes it (the fused
    kernel computes it once per program, over the whole row); `pdl`: programmatic dependent
    launches (see `launch`), which help some shapes and slow others; `one_row`: the quantized
    products' kernel for one input row (quant_kernels._quant_gemv_kernel), a field, so a tile
    stored in the tile cache says which kernel it is; `dot`: tensor-core dots, the input rows
    padded to DOT_MIN_ROWS below it (the padding is free where the weights' bytes bound the
    product, and the FMA tiles' per-row products and cross-thread sums are not); `stages`: 0, a
    program holds the next step's weights in registers while it multiplies this one's (one step
    in flight); from 2, Triton's software pipeline copies them asynchronously into shared memory
    `stages` - 1 steps ahead (cp.async), so a program keeps several steps' bytes in flight
    without the registers to hold them; `prefetch`: a program first asks L2 for every weight
    byte it will read (`prefetch_l2`), before it waits for the previous kernel under PDL, so the
    memory streams across the kernels' boundary and a program's first steps find their bytes
    on the way; `mma`: the W4A16 product whose threads load their share of an MMA's operand
straight from the span layout (model/mma_kernels.py; block_n 16 rows, block_k a span of 128
columns, `split_k` as above). Tables and caches store a tile as these fields, in order."""

    block_n: int
    block_k: int
    warps: int
    split_k: int = 1
    apart: bool = False
    pdl: bool = False
    one_row: bool = False
    dot: bool = False
    stages: int = 0
    prefetch: bool = False
    mma: bool = False


# Tiles tried for each shape; an FMA tile holds BLOCK_M * BLOCK_N * BLOCK_K products. Main's
# tiles that some Qwen3 0.6B/4B projection chose on the H200 (bench/results/kernels-h200,
# quant-h200), then the same with the prologue apart; last, pipelined ones (Tile.stages): the
# one-step register prefetch keeps a program's next tile, and no more, in flight, where a
# decode product's time is the wait for its weights.
_TILES = [Tile(4, 1024, 4), Tile(2, 2048, 4), Tile(8, 1024, 4), Tile(2, 4096, 4), Tile(16, 512, 4),
          Tile(2, 1024, 8), Tile(4, 512, 8), Tile(8, 256, 8),  # the last three small enough for 8 rows
          Tile(4, 1024, 4, apart=True), Tile(8, 1024, 4, apart=True), Tile(2, 4096, 4, apart=True),
          Tile(2, 1024, 8, apart=True),
          Tile(4, 1024, 4, stages=3), Tile(8, 256, 8, stages=3), Tile(4, 1024, 4, apart=True, stages=3)]
# Tensor-core tiles (16-64 rows): narrow N for many programs on small weights, wide K for bytes in
# flight; split K where N / BLOCK_N programs would leave most of the GPU idle; pipelined last, the
# narrowest with K whole so that a fused norm runs once a row and no sum kernel follows (the batch-32
# step's chosen tiles pay a norm kernel before and a sum kernel after: bench/results/profile-h200-b32).
_DOT_TILES = [Tile(16, 256, 4, dot=True), Tile(32, 128, 4, dot=True), Tile(32, 256, 4, dot=True),
              Tile(64, 128, 4, dot=True), Tile(64, 64, 4, dot=True), Tile(128, 64, 8, dot=True),
              Tile(16, 256, 4, 4, dot=True), Tile(16, 128, 4, 8, dot=True), Tile(32, 128, 4, 4, dot=True),
              Tile(16, 256, 4, apart=True, dot=True), Tile(16, 256, 4, 4, True, dot=True),
              Tile(64, 128, 4, dot=True, stages=3), Tile(32, 128, 4, 4, dot=True, stages=3),
              Tile(16, 256, 4, 4, True, dot=True, stages=3), Tile(16, 128, 4, dot=True, stages=3)]
_UNTUNED_BYTES = 256 * 1024  # weights this small take the first tile that fits: nothing to gain from timing
_MAX_PRODUCTS_PER_THREAD = 64  # more spills registers


def candidate_tiles(rows: int, prologue: int = PLAIN, pdl: bool = False,
                    dtype: torch.dtype = torch.bfloat16) -> list[Tile | None]:
    """Tiles a product of `rows` rows (a power of two) of `dtype` activations may take, cuBLAS
    (None) first; a plain product has no prologue to run apart. Below DOT_MIN_ROWS the
    tensor-core tiles compete with the FMA tiles, from one row: an FMA tile spends a conversion
    and an FMA on every weight, a tensor-core one a fraction of an instruction, its padding rows
    costing no weight bytes (tools/sass_count.py counts both). Pipelined tiles: each stage holds
    the input rows' tile beside the weights', so past DOT_MIN_ROWS only for 16-bit activations:
    fp32's stages at 64 rows outgrow the shared memory a Jetson Orin gives a program, 16-bit ones
    fit it (compiled for sm_87: tests/engine/hopper_compile.py, bench/results/prefetch-sass)."""
    tiles = _DOT_TILES if rows >= DOT_MIN_ROWS else [
        t for t in _TILES if rows * t.block_n * t.block_k <= _MAX_PRODUCTS_PER_THREAD * 32 * t.warps] + _DOT_TILES
    staged = rows <= DOT_MIN_ROWS or dtype.itemsize == 2
    tiles = [t for t in tiles if not (t.apart and prologue == PLAIN) and (t.stages == 0 or staged)]
    return [None] + with_pdl(tiles, pdl)


def with_pdl(tiles: list[Tile], pdl: bool) -> list[Tile]:
    """Where the GPU has programmatic dependent launches: every tile with them, then each of
    those asking L2 for its weights before it waits (Tile.prefetch: the boundary PDL opens is
    what the prefetch fills), and the plain tiles (K whole, the prologue fused) also without, as
    main ran them; else the tiles as they are."""
    if not pdl:
        return tiles
    return ([t._replace(pdl=True) for t in tiles] + [t._replace(pdl=True, prefetch=True) for t in tiles]
            + [t for t in tiles if t.split_k == 1 and not t.apart])


def torch_variant(prologue, x, weight, residual, norm_weight, eps):
    """The same computation as separate kernels: the elementwise kernel, then cuBLAS."""
    if prologue == SILU_MUL:
        return torch.nn.functional.linear(silu_mul(x), weight)
    if prologue == PLAIN:
        return torch.nn.functional.linear(x, weight)
    if prologue == NORM:
        return torch.nn.functional.linear(rms_norm(x, norm_weight, eps), weight), x
    y, res_out = rms_norm(x, norm_weight, eps, residual)
    return torch.nn.functional.linear(y, weight), res_out


def run_apart(product, prologue, x, residual, norm_weight, eps, pdl: bool):
    """The prologue as its own kernel, then `product` (of the prologue's output, a plain product);
    the same results as a fused kernel."""
    if prologue == SILU_MUL:
        return product(silu_mul(x, pdl))
    if prologue == NORM:
        return product(rms_norm(x, norm_weight, eps, pdl=pdl)), x
    y, res_out = rms_norm(x, norm_weight, eps, residual, pdl=pdl)
    return product(y), res_out


def split_k(k: int, tile: Tile, unit: int) -> tuple[int, int]:
    """(columns a program, programs along K) for `tile` over K = k: whole steps of `unit`."""
    per = triton.cdiv(triton.cdiv(k, tile.split_k), unit) * unit
    splits = triton.cdiv(k, per)
    return (k, 1) if splits == 1 else (per, splits)


def _run(tile, prologue, x, weight, residual, norm_weight, eps, row_block: int | None = None):
    """The product in `tile` (None: cuBLAS); `row_block`: rows a program (batch-invariant mode's
    fixed block), else all of them in one."""
    if tile is None:
        return torch_variant(prologue, x, weight, residual, norm_weight, eps)
    if tile.apart and prologue != PLAIN:
        return run_apart(lambda y: _run(tile, PLAIN, y, weight, None, None, eps, row_block), prologue, x, residual,
                         norm_weight, eps, tile.pdl)
    m, (n, k) = x.shape[0], weight.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if prologue == ADD_NORM else out
    block_m = row_block or max(triton.next_power_of_2(m), DOT_MIN_ROWS if tile.dot else 1)
    k_split, splits = split_k(k, tile, tile.block_k)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    launch(_skinny_matmul_kernel, (triton.cdiv(n, tile.block_n), splits, triton.cdiv(m, block_m)), tile.pdl,
           x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight, weight,
           target, res_out, m, n, k, eps, NORM=prologue in (NORM, ADD_NORM), ADD=prologue == ADD_NORM,
           SILU=prologue == SILU_MUL, DOT=tile.dot, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
           BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, K_SPLIT=k_split, STAGES=tile.stages,
           PREFETCH=prefetching(tile), num_warps=tile.warps)
    if splits > 1:
        sum_splits(target, out, tile.pdl)
    if prologue == NORM:
        return out, x
    return (out, res_out) if prologue == ADD_NORM else out


def graph_time(calls: list[Callable[[], object]], repeat: int = 8) -> float:
    """GPU time (ms) of one call, captured in a CUDA graph as the engine replays it: launched
    eagerly, a kernel this short is timed by the host's launch overhead instead."""
    for call in calls:  # compile, pick cuBLAS algorithms
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for call in calls:
                call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * repeat * len(calls))


def cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight, plus scratch copies of its shape until together they pass twice the L2
    cache (at most 16 in all): timed in turn, each is read from memory like in a step, not
    from L2."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    extra = min(15, -(-2 * l2 // (weight.numel() * weight.element_size())) - 1)
    return [weight] + [torch.empty_like(weight) for _ in range(max(0, extra))]


class FusedKernels:
    """The Triton kernels as one engine uses them. The runner makes one and hands it to the model:
    the tile chosen for each skinny-matmul shape is this object's state, so two engines in one
    process (tests, benchmarks) never share or clobber it. A shape's tile is looked up, never
    timed on the way to serving: the choice `jetserve tune` timed on this GPU and software
    (`tile_cache`), else the shipped table of the GPU's family (`table`, tile_tables.py), else the
    first tile that fits. Only a tuning engine (`tile_timing`: `jetserve tune`) times the shapes a
    start brings (the runner's `tune_kernels`) and keeps them in the tile cache; timing captures
    CUDA graphs, so it needs them. `freeze()` marks the start's end: a shape first seen later is
    recorded in `untuned` (its kernel compiles on a request's path: the runner's warm-up missed it).

    `batch_invariant` (docs/engine.md): a row's results do not depend on the other rows of its
    step. Where the order of a reduction varies otherwise: a tile per row count (its BLOCK_K and
    split-K set the order of the sums), FMA tiles for few rows and tensor-core dots for more,
    cuBLAS above SKINNY_MAX_ROWS (its reduction depends on M), attention split over the context
    by how many programs the batch brings, and prefill chunks in another attention kernel. In the
    mode every product of any row count takes one tensor-core tile per (prologue, N, K), the one
    chosen for INVARIANT_ROWS rows, over blocks of INVARIANT_ROWS rows (a row's block computes
    the same whatever the others hold); attention splits every context into MAX_SPLITS pieces
    (their bounds a function of the row's own length), and prefill rows take the decode kernel
    one token a program (`AttentionMetadata.build`'s `invariant`). The elementwise kernels and
    the norms already reduce each row by itself."""

    SKINNY_MAX_ROWS = SKINNY_MAX_ROWS
    # Decode and verify steps' attention makes q and stores the new keys itself (`paged_attention`'s
    # `fresh`), a launch less a layer; not in batch-invariant mode, whose every row takes the
    # kernel that makes a prefill row's, so that a position's q rounds alike in any step.
    attention_from_qkv = True
    rms_norm = staticmethod(rms_norm)
    silu_mul = staticmethod(silu_mul)
    qk_norm_rope_store = staticmethod(qk_norm_rope_store)

    def __init__(self, tile_timing: bool = False, tile_cache: TileCache | None = None, table: TileTable | None = None,
                 batch_invariant: bool = False):
        from jetserve.engine.model.tile_tables import EMPTY

        self.batch_invariant = batch_invariant
        if batch_invariant:  # every product takes the fused kernel: one reduction order for any row count
            self.SKINNY_MAX_ROWS = INVARIANT_MAX_ROWS
            self.attention_from_qkv = False
        self.tile_timing = tile_timing
        self.tile_cache = tile_cache  # choices `jetserve tune` timed here: taken before the table's
        self.table = table or EMPTY
        self.frozen = False
        self.untuned: set[tuple] = set()  # shapes first seen after freeze()
        self.cached: set[tuple] = set()  # shapes whose tile came from the tile cache
        self.sources: dict[tuple, str] = {}  # where each choice came from: tuned, table, nearest, default
        self.chosen: dict[tuple, tuple[int, int, int] | None] = {}
        self.tuning_times: dict[tuple, dict[tuple[int, int, int] | None, float]] = {}  # ms per candidate tile

    def paged_attention(self, q, k_cache, v_cache, block_tables, context_lens, q_len: int, block_size: int,
                        scale: float, token_rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
                        fresh: FreshQKV | None = None) -> torch.Tensor:
        """The paged decode kernel (`paged_attention`). MAX_SPLITS splits in batch-invariant mode
        (any batch alike) and for listed tokens (`token_rows`: one kernel variant whatever their
        count, so a mixed step of a new shape compiles nothing)."""
        splits = MAX_SPLITS if self.batch_invariant or token_rows is not None else None
        return paged_attention(q, k_cache, v_cache, block_tables, context_lens, q_len, block_size, scale, splits,
                               token_rows, out, fresh)

    def prefill_attention(self, *args, **kwargs):
        """The flash prefill kernel in the table's configuration; a tuning engine autotunes it."""
        return prefill_attention(*args, **kwargs, config=None if self.tile_timing else self.table.prefill)

    def runs_on(self, x: torch.Tensor) -> bool:
        """Whether x takes these kernels: CUDA tensors, or any under Triton's interpreter (tests)."""
        return x.is_cuda or INTERPRETED

    def tuning_summary(self) -> str:
        """For the start log: where this engine's tiles came from."""
        counts = {source: list(self.sources.values()).count(source)
                  for source in ("tuned", "table", "nearest", "default")}
        where = f"tuned tiles from {self.tile_cache.path}" if self.tile_cache else "no tile cache"
        timed = len(self.tuning_times) - len(self.cached)
        return (f"{counts['tuned']} shapes tuned on this GPU ({timed} timed now), {counts['table']} from the "
                f"{self.table.name} table, {counts['nearest']} from its nearest shape, {counts['default']} first-fit "
                f"({where})")

    def freeze(self) -> None:
        """Start-up tuning is over: no shape is timed from now on."""
        self.frozen = True

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ weight [N, K]^T for M <= SKINNY_MAX_ROWS. A decode step's products are
        matrix-vector products, far from the memory's bandwidth in cuBLAS (bench/results/kernels-h200)."""
        return self.skinny_matmul(PLAIN, x, weight)

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual) @ weight^T, x + residual) in one launch: the norm before a
        projection never makes a round trip through memory."""
        if residual is None:
            return self.skinny_matmul(NORM, x, weight, None, norm_weight, eps)
        return self.skinny_matmul(ADD_NORM, x, weight, residual, norm_weight, eps)

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """(SiLU(gate) * up) @ weight^T in one launch (the MLP's down projection)."""
        return self.skinny_matmul(SILU_MUL, gate_up, weight)

    def skinny_matmul(self, prologue, x, weight, residual=None, norm_weight=None, eps=0.0):
        """The fused kernel in the tile found fastest for this shape, or the separate kernels
        where cuBLAS wins."""
        x, residual = x.contiguous(), residual if residual is None else residual.contiguous()  # the kernel's layout
        rows = INVARIANT_ROWS if self.batch_invariant else triton.next_power_of_2(x.shape[0])  # the mode: any M alike
        key = (prologue, rows, *weight.shape, x.dtype)
        tile = self.chosen[key] if key in self.chosen else self._choose_tile(key, prologue, x, weight, residual,
                                                                             norm_weight, eps)
        return _run(tile, prologue, x, weight, residual, norm_weight, eps, self._row_block)

    @property
    def _row_block(self) -> int | None:
        return INVARIANT_ROWS if self.batch_invariant else None

    def _choose_tile(self, key, prologue, x, weight, residual, norm_weight, eps):
        """A new shape's tile (None: cuBLAS), remembered (see the class docstring); batch-invariant:
        a tensor-core tile, never cuBLAS."""
        tiles = candidate_tiles(key[1], prologue, pdl_supported(x.device), key[-1])
        if self.batch_invariant:
            tiles = [t for t in tiles if t is not None and t.dot]
        timed = self.tile_timing and not self.frozen and weight.numel() * weight.element_size() >= _UNTUNED_BYTES
        if self._untimed(key, tiles, timed, default=tiles[0] if self.batch_invariant else tiles[1]):
            return self.chosen[key]
        block = self._row_block
        with parallel_compile.compile_only():  # every candidate's compile at once
            for t in tiles:
                if t is not None:
                    _run(t, prologue, x, weight, residual, norm_weight, eps, block)
        weights = cold_copies(weight)
        times = [self._time([lambda w=w, t=t: _run(t, prologue, x, w, residual, norm_weight, eps, block)
                             for w in weights]) for t in tiles]
        self._record(key, tiles, times)
        log.debug("skinny matmul %s: %s (%.2f µs; cuBLAS %.2f µs)", key, self.chosen[key] or "cuBLAS",
                  min(times) * 1e3, times[0] * 1e3)
        return self.chosen[key]

    def _untimed(self, key, tiles, timed: bool, default) -> bool:
        """Choose without timing where this shape is not to be timed (or is being captured): the
        tile cache's choice, else the table's, else `default`; True when chosen."""
        if self.frozen:
            self.untuned.add(key)
            log.warning("skinny matmul %s first seen after start-up: its kernel compiles on a request's path", key)
        if self._from_cache(key, tiles):
            return True
        if timed and not torch.cuda.is_current_stream_capturing():
            return False
        self.chosen[key], self.sources[key] = self.table.choose(key, tiles, default)
        return True

    def _from_cache(self, key, tiles) -> bool:
        """Take the tile cache's choice for this shape, if it was made among these candidates."""
        entry = self.tile_cache.lookup(key, tiles) if self.tile_cache else None
        if entry:
            self.chosen[key], self.tuning_times[key] = entry.tile, dict(zip(tiles, entry.times_ms))
            self.cached.add(key)
            self.sources[key] = "tuned"
        return entry is not None

    def _record(self, key, tiles, times) -> None:
        """Keep the fastest of the timed tiles, here and in the tile cache."""
        self.chosen[key] = tiles[times.index(min(times))]
        self.tuning_times[key] = dict(zip(tiles, times))
        self.sources[key] = "tuned"
        if self.tile_cache:
            self.tile_cache.store(key, tiles, times, self.chosen[key])

    @staticmethod
    def _time(calls) -> float:
        """ms a call, as `graph_time`; a tile this GPU cannot run (registers, shared memory) never wins."""
        try:
            return graph_time(calls)
        except triton.runtime.errors.OutOfResources:
            return float("inf")
