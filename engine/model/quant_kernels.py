"""W8A16 and W4A16 skinny matmuls: model/kernels.py's decode-path product over quantized weights.

The same fusion as the float kernel (RMSNorm, residual add + RMSNorm or SiLU·up before the
product, see `_input_chunk`), the same tiling (each program streams BLOCK_N weight rows once for
every input row), but the weights arrive as int8 or packed int4 and are dequantized in
registers: w = (q - z) * s per group in fp32, as `quant.dequantize` computes it, so the two
differ only in reduction order. Per-channel scales multiply the finished dot products instead. Decode on a GPU, a Jetson most of all, is
bound by the bytes of weights read a token: INT8 halves them, INT4 quarters them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.engine.model.kernels import (ADD_NORM, NORM, SILU_MUL, FusedKernels, _cold_copies,
                                           _input_chunk, _normalized, _row_inv_rms, _torch_variant,
                                           graph_time)
from jetserve.engine.model.quant import QuantizedWeight, dequantize


@triton.jit
def _as_float(q):
    """Non-negative int32 below 2**23 → 2**23 + q in fp32: OR-ed into the bits of 2**23
    (0x4B000000) and bit cast, full-rate ALU work, where an int-to-float conversion runs at a
    fraction of the rate and, done for every weight, bounds the kernel before memory does.
    Differences of two such values are exact."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _quant_skinny_kernel(x_ptr, res_ptr, norm_w_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, res_out_ptr, M, N,
                         K: tl.constexpr, eps, NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr,
                         BITS: tl.constexpr, SIGNED: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[M, N] = a(x)[M, K] @ dequant(w)[N, K]^T, a() the prologue as in `_skinny_matmul_kernel`.
    Each weight is (q - z) * s in fp32: q from its byte or nibble (a tile's columns share words,
    groups, which the loads see as constant runs and fetch once), z and s of its group; with one
    group a row (GROUP == K) the scale multiplies the finished dot products instead."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    GROUPS: tl.constexpr = K // GROUP
    PER_ROW: tl.constexpr = GROUP == K
    if NORM:  # first pass: each row's mean square
        inv = _row_inv_rms(x_ptr, res_ptr, res_out_ptr, rows, row_mask, K, eps, ADD, SILU, dtype, BLOCK_M, BLOCK_K)
    if PER_ROW:
        offset = _as_float(tl.zeros([BLOCK_N], tl.int32) + 128 * SIGNED)
        if HAS_ZEROS:
            offset = _as_float(tl.load(z_ptr + n64, mask=n_mask, other=0).to(tl.int32))
    acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols < K
        mask = n_mask[:, None] & k_mask[None, :]
        if BITS == 4:  # requested first: the prologue runs while they arrive
            word = tl.load(qw_ptr + n64[:, None] * (K // 8) + (cols // 8)[None, :], mask=mask, other=0)
            q = (word >> ((cols % 8) * 4)[None, :]) & 15
        else:
            q = tl.load(qw_ptr + n64[:, None] * K + cols[None, :], mask=mask, other=0).to(tl.int32) + 128 * SIGNED
        if PER_ROW:
            w = _as_float(q) - offset[:, None]
        else:
            at = n64[:, None] * GROUPS + (cols // GROUP)[None, :]
            w = _as_float(q)
            if HAS_ZEROS:
                w = w - _as_float(tl.load(z_ptr + at, mask=mask, other=0).to(tl.int32))
            else:
                w = w - _as_float(tl.zeros_like(q) + 128 * SIGNED)
            w = w * tl.load(s_ptr + at, mask=mask, other=0.0)
        a = _input_chunk(x_ptr, res_ptr, res_out_ptr, rows, cols, row_mask[:, None] & k_mask[None, :], K,
                         pid == 0, ADD, SILU, dtype)
        if NORM:
            a = _normalized(a, inv, norm_w_ptr, cols, k_mask, dtype)
        acc3 += a.to(tl.float32)[:, None, :] * w[None, :, :]
    acc = tl.sum(acc3, axis=2)
    if PER_ROW:
        acc = acc * tl.load(s_ptr + n64, mask=n_mask, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * N + n[None, :], acc.to(dtype), mask=row_mask[:, None] & n_mask[None, :])


# (BLOCK_N, BLOCK_K, warps) tried for each shape, as in kernels._TILES.
TILES = [(4, 512, 4), (8, 256, 4), (2, 1024, 4), (16, 128, 4), (4, 1024, 8), (8, 512, 8), (16, 256, 8),
         (2, 2048, 8), (32, 128, 8), (1, 1024, 4), (8, 128, 4), (4, 256, 4), (2, 512, 4)]
_MAX_PRODUCTS_PER_THREAD = 64


def fitting_tiles(rows: int, weight: QuantizedWeight) -> list[tuple[int, int, int]]:
    """Tiles this shape can take: few enough products a thread; fp32 scales (the loader's)."""
    if weight.scales.dtype != torch.float32:
        return []
    return [t for t in TILES if triton.next_power_of_2(rows) * t[0] * t[1] <= _MAX_PRODUCTS_PER_THREAD * 32 * t[2]]


def quant_matmul(tile, prologue, x, weight: QuantizedWeight, residual=None, norm_weight=None, eps=0.0):
    """One launch of the fused kernel in `tile`; None: dequantize and take the float path."""
    if tile is None:
        return _torch_variant(prologue, x, dequantize(weight, x.dtype), residual, norm_weight, eps)
    block_n, block_k, warps = tile
    m, (n, k) = x.shape[0], weight.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if prologue == ADD_NORM else out
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    _quant_skinny_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight.qweight,
        weight.scales, zeros, out, res_out, m, n, k, eps, NORM=prologue in (NORM, ADD_NORM), ADD=prologue == ADD_NORM,
        SILU=prologue == SILU_MUL, BITS=weight.bits, SIGNED=weight.qweight.dtype == torch.int8,
        GROUP=weight.group_size, HAS_ZEROS=weight.zeros is not None,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    if prologue == NORM:
        return out, x
    return (out, res_out) if prologue == ADD_NORM else out


class QuantFusedKernels(FusedKernels):
    """`FusedKernels` that also multiply by quantized weights (a `QuantizedWeight` where a float
    weight would be), each shape in the tile timed fastest, kept per engine like the float tiles.
    Dequantize-then-cuBLAS is no candidate: it reads the weights twice and writes them once."""

    def skinny_matmul(self, prologue, x, weight, residual=None, norm_weight=None, eps=0.0):
        if not isinstance(weight, QuantizedWeight):
            return super().skinny_matmul(prologue, x, weight, residual, norm_weight, eps)
        x, residual = x.contiguous(), residual if residual is None else residual.contiguous()
        key = ("quant", prologue, triton.next_power_of_2(x.shape[0]), *weight.shape, weight.bits, weight.group_size,
               weight.scales.dtype, x.dtype)
        tile = self.chosen[key] if key in self.chosen else self._choose_quant_tile(key, prologue, x, weight,
                                                                                   residual, norm_weight, eps)
        return quant_matmul(tile, prologue, x, weight, residual, norm_weight, eps)

    def _choose_quant_tile(self, key, prologue, x, weight, residual, norm_weight, eps):
        tiles = fitting_tiles(x.shape[0], weight)
        if not tiles or not self.tile_timing:
            self.chosen[key] = tiles[0] if tiles else None
            return self.chosen[key]
        if torch.cuda.is_current_stream_capturing():  # first seen in a capture: untimed this time
            return tiles[0]
        copies = [weight._replace(qweight=q) for q in _cold_copies(weight.qweight)]
        times = [graph_time([lambda w=w, t=t: quant_matmul(t, prologue, x, w, residual, norm_weight, eps)
                             for w in copies]) for t in tiles]
        self.chosen[key] = tiles[times.index(min(times))]
        self.tuning_times[key] = dict(zip(tiles, times))
        return self.chosen[key]
