"""Triton kernels for the CUDA hot path: one launch where plain torch takes several.

A decode step of a small model is bound by kernel count, not arithmetic, so each kernel here
replaces a chain of elementwise torch ops. Each rounds to the activation dtype exactly where
the torch code it replaces rounds, so the fused and the plain path differ only in reduction
order. Used on CUDA only: the CPU path stays plain torch (exact against transformers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x (of x + residual, also returned as the new residual) in one launch."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res = residual.reshape(-1, n) if residual is not None else x2
    _rms_norm_kernel[(x2.shape[0],)](x2, res, weight, out, res_out, n, eps, HAS_RESIDUAL=residual is not None,
                                     BLOCK=triton.next_power_of_2(n))
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * n_cols + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate|up concatenated on the last dim."""
    n = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * n)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


@triton.jit
def _rope_half(x1, x2, c, s, dtype):
    """NeoX RoPE on the two halves, rounding like `x * cos + rotate_half(x) * sin`."""
    o1 = (x1 * c).to(dtype).to(tl.float32) + (-(x2 * s)).to(dtype).to(tl.float32)
    o2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    return o1.to(dtype), o2.to(dtype)


@triton.jit
def _qk_norm_rope_store_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                               eps, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF_PAD)
    dm = d < half
    row = qkv_ptr + t * (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    x1 = tl.load(row + h * HEAD_DIM + d, mask=dm, other=0.0)
    x2 = tl.load(row + h * HEAD_DIM + half + d, mask=dm, other=0.0)
    dtype = x1.dtype
    is_q = h < NUM_HEADS
    if is_q:
        w1, w2 = tl.load(qw_ptr + d, mask=dm), tl.load(qw_ptr + half + d, mask=dm)
    else:
        w1, w2 = tl.load(kw_ptr + d, mask=dm), tl.load(kw_ptr + half + d, mask=dm)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    inv = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / HEAD_DIM + eps)
    n1 = (w1.to(tl.float32) * (f1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    n2 = (w2.to(tl.float32) * (f2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + t * HEAD_DIM + d, mask=dm).to(tl.float32)
    s = tl.load(sin_ptr + t * HEAD_DIM + d, mask=dm).to(tl.float32)
    o1, o2 = _rope_half(n1, n2, c, s, dtype)
    if is_q:
        out = q_ptr + (t * NUM_HEADS + h) * HEAD_DIM
        tl.store(out + d, o1, mask=dm)
        tl.store(out + half + d, o2, mask=dm)
    else:
        kvh = h - NUM_HEADS
        dst = tl.load(slot_ptr + t).to(tl.int64) * NUM_KV_HEADS * HEAD_DIM + kvh * HEAD_DIM
        tl.store(k_cache_ptr + dst + d, o1, mask=dm)
        tl.store(k_cache_ptr + dst + half + d, o2, mask=dm)
        v = row + (NUM_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM
        tl.store(v_cache_ptr + dst + d, tl.load(v + d, mask=dm), mask=dm)
        tl.store(v_cache_ptr + dst + half + d, tl.load(v + half + d, mask=dm), mask=dm)


def qk_norm_rope_store(qkv, q_weight, k_weight, cos, sin, slot_mapping, k_cache, v_cache, eps: float,
                       num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """From the fused qkv projection: per-head RMSNorm and RoPE of q and k, k and v written into
    their cache slots; returns q [T, H, D]. Replaces ~30 small launches with one."""
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _qk_norm_rope_store_kernel[(t, num_heads + num_kv_heads)](
        qkv, q_weight, k_weight, cos, sin, slot_mapping, q, k_cache, v_cache, eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2))
    return q


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, ctx_ptr, out_ptr, scale, table_stride, q_len,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    b = t // q_len
    # Query j of a q_len-token step sits at position ctx - q_len + j; padded rows still see one key.
    limit = tl.maximum(tl.load(ctx_ptr + b) - q_len + t % q_len + 1, 1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    heads = kvh * GROUP + g
    row = t.to(tl.int64) * NUM_KV_HEADS * GROUP * HEAD_DIM
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row + heads[:, None] * HEAD_DIM + d[None, :], mask=q_mask, other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for start in range(0, limit, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < limit
        block = tl.load(tables_ptr + b * table_stride + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        at = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS * HEAD_DIM + kvh * HEAD_DIM
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:  # fp32 models: no tf32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_cache_ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    out = (acc / l[:, None]).to(q.dtype)
    tl.store(out_ptr + row + heads[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, q_len: int, block_size: int,
                    scale: float) -> torch.Tensor:
    """Attention for steps where every sequence has `q_len` new tokens (decode: 1, verify: 1+k).
    q: [B * q_len, H, D]; caches: [slots, KVH, D]; block_tables: [B, W]; context_lens: [B]
    (after this step's tokens). Each program walks only its own sequence's blocks, up to its own
    length: no gathered copy of the batch's context, and one launch per layer whatever the
    lengths, so the step can live in a CUDA graph."""
    t, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _paged_attention_kernel[(t, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale, block_tables.stride(0), q_len,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=128,
        IEEE=q.dtype == torch.float32, num_warps=8)
    return out


@triton.autotune(configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
                          for n, k, w in ((8, 1024, 4), (16, 512, 4), (16, 1024, 8), (32, 256, 4), (32, 512, 8),
                                          (64, 128, 4), (64, 256, 8))], key=["N", "K"])
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


def _triton_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x, weight, out, n, k)
    return out


_use_triton_gemv: dict[tuple, bool] = {}


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T. A batch-1 decode step is all matrix-vector products, where
    cuBLAS reaches about a third of the memory bandwidth on the H200 (measured: 1.35 TB/s over a
    Qwen3-0.6B step); the Triton kernel streams each weight row once with many loads in flight.
    On first use of a weight shape (graph warm-up runs first) its block shape is tuned and it is
    timed against cuBLAS; the faster one serves that shape from then on."""
    key = (*weight.shape, weight.dtype)
    if key not in _use_triton_gemv:
        ours = triton.testing.do_bench(lambda: _triton_gemv(x, weight), return_mode="median")
        cublas = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, weight), return_mode="median")
        _use_triton_gemv[key] = ours < cublas
    return _triton_gemv(x, weight) if _use_triton_gemv[key] else torch.nn.functional.linear(x, weight)
