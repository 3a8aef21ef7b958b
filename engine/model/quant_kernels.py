"""W8A16 and W4A16 skinny matmuls: model/kernels.py's decode-path product over quantized weights.

The same fusion as the float kernel (RMSNorm, residual add + RMSNorm or SiLU·up before the
product, see `input_chunk`), but the weights arrive as int32 words of packed 8- or 4-bit
integers in quant.py's span layout and are dequantized in registers, exactly (q - z) * s in
fp32 as `quant.dequantize` computes it, so the two differ only in reduction order. Decode on a
GPU, a Jetson most of all, is bound by the bytes of weights read a token: INT8 halves them, INT4
quarters them — if dequantizing costs few enough instructions a weight to keep up with memory
(a GPU's bandwidth delivers INT4 weights at a sizeable share of its FP32 instruction rate, so
every instruction a weight counts).
One input row also has its own kernel, `_quant_gemv_kernel`, timed among the same candidates;
up to 16 rows of 16-bit activations, so does a tensor-core kernel, `_quant_dot_kernel`, whose
conversion costs about one instruction a weight and no FMA (the dot does the products). The
instructions a weight of each: tools/sass_count.py.

Also here, as they need Triton: the products of many rows (prefill) dequantize a weight in one
pass before cuBLAS, from the span layout (`dequantized`) or from tinygemm's
(`dequantize_int4pack`, model/int4pack.py), whose few-row products `int4pack_matmul` routes.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from jetserve.engine.model import int4pack, parallel_compile
from jetserve.engine.model.int4pack import Int4PackedWeight
from jetserve.engine.model.kernels import (ADD_NORM, DOT_MIN_ROWS, INTERPRETED, NORM, PLAIN, SILU_MUL, FusedKernels,
                                           Tile, cold_copies, input_chunk, launch, normalized, pdl_supported,
                                           prefetch_l2, prefetching, row_inv_rms, run_apart, split_k, sum_splits,
                                           torch_variant, with_pdl)
from jetserve.engine.model.mma_kernels import (MAX_INPUT_ROWS, ROWS, SPAN_COLUMNS, _quant_mma_kernel,
                                               launched_layout_ok)
from jetserve.engine.model.mma_kernels import slots as mma_slots
from jetserve.engine.model.mma_kernels import takes as mma_takes
from jetserve.engine.model.quant import MAX_DEQUANTIZED, QuantizedWeight, dequantize, float_product, quant_rows, span

log = logging.getLogger(__name__)
_MMA_WARNED: list[bool] = []  # the MMA kernel's fallback warning, once a process


@triton.jit
def _as_float(q):
    """Non-negative int32 below 2**23 → 2**23 + q in fp32: OR-ed into the bits of 2**23
    (0x4B000000) and bit cast, full-rate ALU work, where an int-to-float conversion runs at a
    fraction of the rate and, done for every weight, bounds the kernel before memory does.
    Differences of two such values are exact."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True)


# M not specialized on its divisibility by 16, which varies step to step (a compile each class, first
# met on a request's path); M == 1, plain decoding at batch 1, keeps a variant of its own.
@triton.jit(do_not_specialize_on_alignment=["M"])
def _quant_skinny_kernel(x_ptr, res_ptr, norm_w_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, res_out_ptr, M, N,
                         K: tl.constexpr, eps, low_bits, NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr,
                         BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, NORM_BLOCK: tl.constexpr,
                         KW_SPLIT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """out[M, N] = a(x)[M, K] @ dequant(w)[N, K]^T, a() the prologue as in `_skinny_matmul_kernel`.

    A program streams BLOCK_N rows of words, BLOCK_W words a row at a time (consecutive threads,
    consecutive words), the next tile requested before this one is multiplied. Field i of the
    tile's words is one weight tile whose activations are a contiguous run (quant.py's span
    layout); each weight costs one mask-and-OR into the bits of 2**23 where the field lies (bit
    cast: q times a power of two, exactly, with no shift and no int-to-float conversion), a
    subtraction and an FMA; the power of two is taken off the activation, once for all the
    tile's rows. Zero point and scale come once a word where a word's fields share a group:
    sum_i a_i (q_i - z) s = (sum_i a_i q_i - z sum_i a_i) s, the activations' sum shared by all
    the tile's rows; with one group a row, once a row at the end.
    Smaller groups take both per weight.
    Program (i, j) takes words [j KW_SPLIT, (j + 1) KW_SPLIT) of its rows: with several, fp32
    partial sums that `sum_splits` adds in order. The first words (with PREFETCH, all the
    program's, into L2: kernels.Tile.prefetch) are requested before waiting for the previous
    kernel (PDL, see kernels.launch)."""
    pid = tl.program_id(0)
    w_lo = tl.program_id(1) * KW_SPLIT
    FIELDS: tl.constexpr = 32 // BITS
    SPAN: tl.constexpr = 16 * FIELDS  # input columns a span of 16 words holds
    KW: tl.constexpr = K // FIELDS  # words a row
    GROUPS: tl.constexpr = K // GROUP
    WHOLE: tl.constexpr = GROUP % SPAN == 0  # all fields of a word in one group
    MID: tl.constexpr = 1 << (BITS - 1)  # the zero point of symmetric formats
    EVEN: tl.constexpr = KW % BLOCK_W == 0  # no partial tile: the column masks fold away
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    row_words = qw_ptr + n.to(tl.int64)[:, None] * KW
    row_groups = n.to(tl.int64)[:, None] * GROUPS
    t = tl.arange(0, BLOCK_W)
    field0 = (t // 16) * SPAN + t % 16  # input column of field 0 of the tile's word t, from the tile's first
    dtype = x_ptr.dtype.element_ty  # the activations' (out may hold fp32 partial sums)
    w_hi = tl.minimum(w_lo + KW_SPLIT, KW)
    words = tl.load(row_words + w_lo + t[None, :], mask=n_mask[:, None] & (w_lo + t < w_hi)[None, :],
                    other=0)  # in flight first
    if PREFETCH:
        _prefetch_weight(qw_ptr, s_ptr, z_ptr, tl.minimum(n, N - 1), w_lo, w_hi, K, BITS, GROUP, HAS_ZEROS, BLOCK_N)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    if NORM:  # first pass: each row's mean square
        inv = row_inv_rms(x_ptr, res_ptr, res_out_ptr, rows, row_mask, K, eps, ADD, SILU, dtype, BLOCK_M,
                           NORM_BLOCK)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_W], tl.float32)
    a_sum = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    for w0 in range(w_lo, w_hi, BLOCK_W):
        word = w0 + t
        w_mask = n_mask[:, None] & ((word < KW) | EVEN)[None, :]
        if WHOLE and GROUPS > 1:  # this tile's zero points and scales, used after the fields
            at = row_groups + ((word // 16) * SPAN // GROUP)[None, :]
            scale = tl.load(s_ptr + at, mask=w_mask, other=0.0)
            if HAS_ZEROS:
                zero = _as_float(tl.load(z_ptr + at, mask=w_mask, other=0).to(tl.int32)) - 8388608.0
        cur = words
        following = word + BLOCK_W
        words = tl.load(row_words + following[None, :], mask=n_mask[:, None] & (following < w_hi)[None, :], other=0)
        if WHOLE and GROUPS > 1:
            part = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_W], tl.float32)
            a_part = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
        high = cur >> 16  # the upper half word's fields, moved down once a word
        for i in tl.static_range(FIELDS):
            cols = w0 * FIELDS + field0 + i * 16
            k_mask = (cols < K) | EVEN
            a = input_chunk(x_ptr, res_ptr, res_out_ptr, rows, cols, row_mask[:, None] & k_mask[None, :], K,
                             pid == 0, ADD, SILU, dtype)
            if NORM:
                a = normalized(a, inv, norm_w_ptr, cols, k_mask, dtype)
            a = a.to(tl.float32)
            # Field i masked where it lies in its half word: q * 2**place exactly, no shift a weight;
            # its activation takes the 2**-place instead (exact, a power of two). The masks come from
            # `low_bits`, an argument: held in registers, not rematerialized as constants each use.
            place = (i % (FIELDS // 2)) * BITS
            if i < FIELDS // 2:
                q = _as_float(cur & (low_bits << place)) - 8388608.0
            else:
                q = _as_float(high & (low_bits << place)) - 8388608.0
            a_w = a * (1.0 / (1 << place))
            if not WHOLE:
                at = row_groups + (cols // GROUP)[None, :]
                wk_mask = n_mask[:, None] & k_mask[None, :]
                if HAS_ZEROS:
                    zero_i = _as_float(tl.load(z_ptr + at, mask=wk_mask, other=0).to(tl.int32)) - 8388608.0
                    q = q - zero_i * (1 << place)
                else:
                    q = q - MID * (1 << place)
                acc += a_w[:, None, :] * (q * tl.load(s_ptr + at, mask=wk_mask, other=0.0))[None, :, :]
            elif GROUPS > 1:
                part += a_w[:, None, :] * q[None, :, :]
                a_part += a
            else:
                acc += a_w[:, None, :] * q[None, :, :]
                a_sum += a
        if WHOLE and GROUPS > 1:
            if HAS_ZEROS:
                part -= zero[None, :, :] * a_part[:, None, :]
            else:
                part -= MID * a_part[:, None, :]
            acc += part * scale[None, :, :]
    out = tl.sum(acc, axis=2)
    if WHOLE and GROUPS == 1:  # (sum a q - z sum a) s, a row's zero point and scale applied once
        if HAS_ZEROS:
            zero = tl.load(z_ptr + n, mask=n_mask, other=0).to(tl.float32)
        else:
            zero = tl.zeros([BLOCK_N], tl.float32) + MID
        out = (out - zero[None, :] * tl.sum(a_sum, axis=1)[:, None]) * tl.load(s_ptr + n, mask=n_mask, other=0.0)
    if KW_SPLIT >= KW:
        tl.store(out_ptr + rows[:, None] * N + n[None, :], out.to(dtype), mask=row_mask[:, None] & n_mask[None, :])
    else:  # this split's partial sums, [split, M, N] fp32
        tl.store(out_ptr + (tl.program_id(1) * M + rows[:, None]) * N + n[None, :], out,
                 mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _group_of(s_ptr, z_ptr, n, w0, K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
              HAS_ZEROS: tl.constexpr, BLOCK_W: tl.constexpr):
    """The scale and stored zero point of the group of each word of the tile at word w0 of rows
    n, [BLOCK_N, 1] where the tile is one group, [BLOCK_N, BLOCK_W] where it spans several (a
    load a word and row, but the same address for a span's 16 words); requested tiles ahead like
    the words. Placeholders for formats with one group a row."""
    GROUPS: tl.constexpr = K // GROUP
    FIELDS: tl.constexpr = 32 // BITS
    if GROUPS == 1:
        return tl.zeros([n.shape[0], 1], tl.float32), tl.zeros([n.shape[0], 1], tl.int32)
    if BLOCK_W * FIELDS <= GROUP:
        at = (n * GROUPS + w0 * FIELDS // GROUP)[:, None]
    else:  # the span layout: word w holds columns of span w // 16, SPAN columns from (w // 16) * SPAN
        word = w0 + tl.arange(0, BLOCK_W)
        at = (n * GROUPS)[:, None] + ((word // 16) * (16 * FIELDS) // GROUP)[None, :]
    zero = tl.load(z_ptr + at).to(tl.int32) if HAS_ZEROS else tl.zeros(at.shape, tl.int32) + (1 << (BITS - 1))
    return tl.load(s_ptr + at), zero


@triton.jit
def _prefetch_weight(qw_ptr, s_ptr, z_ptr, n, w_lo, w_hi, K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                     HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Ask L2 for words [w_lo, w_hi) of rows n (each valid) and their groups' scales and zero
    points (kernels.prefetch_l2): a step's scales are a load a row, each from its own line, whose
    wait no other load a step hides. A split's words start on a span (16 words), so they hold the
    columns [w_lo, w_hi) * FIELDS."""
    FIELDS: tl.constexpr = 32 // BITS
    GROUPS: tl.constexpr = K // GROUP
    prefetch_l2(qw_ptr + n.to(tl.int64)[:, None] * (K // FIELDS), w_lo, w_hi, BLOCK_N, 32)
    if GROUPS > 1:
        g_lo = w_lo * FIELDS // GROUP
        g_hi = (w_hi * FIELDS + GROUP - 1) // GROUP
        prefetch_l2(s_ptr + n.to(tl.int64)[:, None] * GROUPS, g_lo, g_hi, BLOCK_N,
                    1024 // s_ptr.dtype.element_ty.primitive_bitwidth)
        if HAS_ZEROS:
            prefetch_l2(z_ptr + n.to(tl.int64)[:, None] * GROUPS, g_lo, g_hi, BLOCK_N,
                        1024 // z_ptr.dtype.element_ty.primitive_bitwidth)


@triton.jit
def _gemv_tile(acc, cur, scale, zero, w0, x_ptr, res_ptr, res_out_ptr, norm_w_ptr, inv, low_bits, store_sum,
               K: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr, BITS: tl.constexpr,
               GROUP: tl.constexpr, BLOCK_W: tl.constexpr):
    """acc + one tile of words [BLOCK_N, BLOCK_W] (from word w0 of its rows, with their groups'
    `scale` and `zero`, see `_group_of`) times the input row's matching columns, for
    `_quant_gemv_kernel`; also the sum of those inputs a column, for formats whose zero points
    come in once a row."""
    FIELDS: tl.constexpr = 32 // BITS
    SPAN: tl.constexpr = 16 * FIELDS
    one = tl.arange(0, 1)
    t = tl.arange(0, BLOCK_W)
    field0 = (t // 16) * SPAN + t % 16  # input column of field 0 of the tile's word t, from the tile's first
    dtype = x_ptr.dtype.element_ty
    part = tl.zeros(cur.shape, tl.float32)
    a_sum = tl.zeros([1, BLOCK_W], tl.float32)
    high = cur >> 16  # the upper half word's fields, moved down once a word
    for i in tl.static_range(FIELDS):
        cols = w0 * FIELDS + field0 + i * 16
        a = input_chunk(x_ptr, res_ptr, res_out_ptr, one, cols, (cols < K)[None, :], K, store_sum, ADD, SILU, dtype)
        if NORM:
            a = normalized(a, inv, norm_w_ptr, cols, cols < K, dtype)
        a = a.to(tl.float32)
        place = (i % (FIELDS // 2)) * BITS  # field i masked where it lies: q * 2**place, its input * 2**-place
        if i < FIELDS // 2:
            q = _as_float(cur & (low_bits << place)) - 8388608.0
        else:
            q = _as_float(high & (low_bits << place)) - 8388608.0
        part += (a * (1.0 / (1 << place))) * q
        a_sum += a
    if K // GROUP == 1:  # zero points and scales once a row, at the end
        acc += part
    elif BLOCK_W * FIELDS <= GROUP:  # one group: the tile's sums a row first
        zero = _as_float(zero) - 8388608.0
        acc += (tl.sum(part, axis=1, keep_dims=True) - zero * tl.sum(a_sum, axis=1, keep_dims=True)) * scale
    else:
        acc += (part - (_as_float(zero) - 8388608.0) * a_sum) * scale
    return acc, a_sum


@triton.jit
def _quant_gemv_kernel(x_ptr, res_ptr, norm_w_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, res_out_ptr, N, K: tl.constexpr,
                       eps, low_bits, NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr, BITS: tl.constexpr,
                       GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                       NORM_BLOCK: tl.constexpr, KW_SPLIT: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr,
                       STAGES: tl.constexpr, PREFETCH: tl.constexpr):
    """out[1, N] = a(x)[1, K] @ dequant(w)[N, K]^T for one input row (batch-1 decode), a() the
    prologue as in `_quant_skinny_kernel`, whose span layout it reads.

    Decode's products are short: a program makes a few steps over K, so each step's wait for
    memory is exposed unless the requests run ahead of the arithmetic. The words and their
    groups' scales and zero points are requested AHEAD steps ahead, every load unmasked: rows
    past N read row N - 1 (their results are not stored), K is a whole number of steps, and a
    split's last requests repeat its last step (cache hits, never used). Nothing moves between
    threads in the loop: the tiles are 2-D [BLOCK_N, BLOCK_W], a thread's input columns are
    loaded straight into the layout of its words (a tile of one row, small enough for Triton to
    load it in any layout), each shared by the thread's rows of that word. A weight costs a
    mask-and-OR into the bits of 2**23, a subtraction and an FMA; the zero point comes in once a
    row and group through the inputs' sum, sum_i a_i (q_i - z) = sum_i a_i q_i - z sum_i a_i.
    Program (i, j) takes words [j KW_SPLIT, (j + 1) KW_SPLIT) as in `_quant_skinny_kernel`.
    With STAGES (kernels.Tile.stages), Triton's pipeline requests the steps STAGES - 1 ahead
    into shared memory instead of the registers' AHEAD; with PREFETCH (kernels.Tile.prefetch),
    all the program's words are asked of L2 before waiting for the previous kernel."""
    pid = tl.program_id(0)
    FIELDS: tl.constexpr = 32 // BITS
    KW: tl.constexpr = K // FIELDS
    GROUPS: tl.constexpr = K // GROUP
    w_lo = tl.program_id(1) * KW_SPLIT
    w_last = tl.minimum(w_lo + KW_SPLIT, KW) - BLOCK_W
    one = tl.arange(0, 1)
    n_out = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n = n_out if EVEN_N else tl.minimum(n_out, N - 1)
    tile_words = qw_ptr + n.to(tl.int64)[:, None] * KW + tl.arange(0, BLOCK_W)[None, :]
    dtype = x_ptr.dtype.element_ty
    # AHEAD steps in flight first: two where each step's groups bring scales and zero points too
    # (more loads a step to wait for), one for formats with one group a row (registers kept for
    # occupancy)
    AHEAD: tl.constexpr = 1 if GROUPS == 1 else 2
    if STAGES == 0:
        words = tl.load(tile_words + w_lo)
        scale, zero = _group_of(s_ptr, z_ptr, n, w_lo, K, BITS, GROUP, HAS_ZEROS, BLOCK_W)
        words2, scale2, zero2 = words, scale, zero  # the second step's, where AHEAD is 2
        if AHEAD == 2:
            w_next = tl.minimum(w_lo + BLOCK_W, w_last)
            words2 = tl.load(tile_words + w_next)
            scale2, zero2 = _group_of(s_ptr, z_ptr, n, w_next, K, BITS, GROUP, HAS_ZEROS, BLOCK_W)
    if PREFETCH:
        _prefetch_weight(qw_ptr, s_ptr, z_ptr, n, w_lo, w_last + BLOCK_W, K, BITS, GROUP, HAS_ZEROS, BLOCK_N)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    inv = tl.zeros([1], tl.float32)
    if NORM:  # first pass: the row's mean square
        inv = row_inv_rms(x_ptr, res_ptr, res_out_ptr, one, one < 1, K, eps, ADD, SILU, dtype, 1, NORM_BLOCK)
    acc = tl.zeros([BLOCK_N, BLOCK_W if GROUPS == 1 or BLOCK_W * FIELDS > GROUP else 1], tl.float32)
    a_total = tl.zeros([1, BLOCK_W], tl.float32)
    if STAGES > 0:
        for w0 in tl.range(w_lo, w_last + BLOCK_W, BLOCK_W, num_stages=STAGES):
            scale, zero = _group_of(s_ptr, z_ptr, n, w0, K, BITS, GROUP, HAS_ZEROS, BLOCK_W)
            acc, a_sum = _gemv_tile(acc, tl.load(tile_words + w0), scale, zero, w0, x_ptr, res_ptr, res_out_ptr,
                                    norm_w_ptr, inv, low_bits, pid == 0, K, NORM, ADD, SILU, BITS, GROUP, BLOCK_W)
            a_total += a_sum
    else:
        for w0 in range(w_lo, w_last + BLOCK_W, BLOCK_W):
            w_ahead = tl.minimum(w0 + AHEAD * BLOCK_W, w_last)
            words3 = tl.load(tile_words + w_ahead)
            scale3, zero3 = _group_of(s_ptr, z_ptr, n, w_ahead, K, BITS, GROUP, HAS_ZEROS, BLOCK_W)
            acc, a_sum = _gemv_tile(acc, words, scale, zero, w0, x_ptr, res_ptr, res_out_ptr, norm_w_ptr, inv,
                                    low_bits, pid == 0, K, NORM, ADD, SILU, BITS, GROUP, BLOCK_W)
            a_total += a_sum
            if AHEAD == 2:
                words, scale, zero = words2, scale2, zero2
                words2, scale2, zero2 = words3, scale3, zero3
            else:
                words, scale, zero = words3, scale3, zero3
    out = tl.sum(acc, axis=1)
    if GROUPS == 1:  # (sum a q - z sum a) s, a row's zero point and scale applied once
        if HAS_ZEROS:
            zero = tl.load(z_ptr + n).to(tl.float32)
        else:
            zero = tl.zeros([BLOCK_N], tl.float32) + (1 << (BITS - 1))
        out = (out - zero * tl.sum(a_total, axis=1)) * tl.load(s_ptr + n)
    if KW_SPLIT >= KW:
        tl.store(out_ptr + n_out, out.to(dtype), mask=n_out < N)
    else:  # this split's partial sums, [split, 1, N] fp32
        tl.store(out_ptr + tl.program_id(1) * N + n_out, out, mask=n_out < N)


@triton.jit
def _nibbles(words, bias, MAGIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """The eight nibbles of each word [BLOCK_N, BLOCK_W] as 16-bit floats MAGIC_VALUE + q (+ 16 - z
    for stored zero points), exact: each pair (nibble t, t + 4) masked where it lies in the two
    half words of one 32-bit value and added to `bias`, the bits of the float MAGIC_VALUE (128.0
    for bf16, 1024.0 for fp16) in both halves, plus 16 - z there for stored zero points
    (`_nibble_bias`; the sum, at most 31, stays below MAGIC's lowest bit, and with MAGIC alone
    the add is an OR, one logic instruction with the mask): no conversion instruction.
    [BLOCK_N, 8 BLOCK_W]: slot 8 j + 4 a + 2 b + c holds nibble a + 2 b + 4 c of word j, each
    word's eight slots together in the thread that loaded it, so they reach shared memory (on
    their way to the tensor cores) in 16-byte stores; the inputs follow this order
    (`_slot_columns`, `_int8_slot_inputs`)."""
    pairs = tl.join(words, words >> 4)
    pairs = tl.join(pairs, pairs >> 8)  # [BLOCK_N, BLOCK_W, a, b]: the word shifted by 4 a + 8 b
    p = (pairs & 0x000F000F) + bias
    lo = p.to(tl.int16).to(tl.float16 if MAGIC == 0x64006400 else tl.bfloat16, bitcast=True)
    hi = (p >> 16).to(tl.int16).to(tl.float16 if MAGIC == 0x64006400 else tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, 8 * BLOCK_W])


@triton.jit
def _nibble_bias(zero, MAGIC: tl.constexpr, BITS: tl.constexpr):
    """`_nibbles`' bias for rows whose zero points are `zero` (int32 [BLOCK_N]), [BLOCK_N, 1, a, 1]:
    MAGIC plus 16 - the zero point's nibble that nibble a of a word pairs with, in both half
    words (INT8: z = 16 z_hi + z_lo, the low nibble (a = 0) takes z_lo, the high one z_hi; INT4:
    z, whichever nibble). The zero point thus comes off each weight in the integers, where the
    bits are made, and the dot needs no sum of its inputs: such a sum is a reduction across the
    threads every step, a chain of shuffles between the loads and the dot."""
    if BITS == 8:
        z_hi = zero // 16
        both = tl.join(zero - 16 * z_hi, z_hi)  # [BLOCK_N, a]
    else:
        both = tl.join(zero, zero)
    return (MAGIC + (16 - both) * 0x00010001)[:, None, :, None]


@triton.jit
def _slot_offsets(dtype: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_W: tl.constexpr):
    """What comes off each slot of `_nibbles` after it is a float, [1, slots] in `dtype`: the
    magic value, and 16 (stored zero points, `_nibble_bias`) or the symmetric formats' zero
    point's nibble for the slot (INT8: 128 = 16 * 8 + 0, so 8 off the high nibbles (a = 1) and
    none off the low; INT4: 8), an immediate the same for every row, where its bias is MAGIC
    alone (an OR)."""
    magic_value: tl.constexpr = 1024.0 if dtype == tl.float16 else 128.0
    slot = tl.arange(0, 8 * BLOCK_W)
    if HAS_ZEROS:
        offsets = tl.zeros(slot.shape, tl.float32) + (magic_value + 16.0)
    elif BITS == 8:
        offsets = tl.where((slot // 4) % 2 == 0, magic_value, magic_value + 8.0)
    else:
        offsets = tl.zeros(slot.shape, tl.float32) + (magic_value + 8.0)
    return offsets.to(dtype)[None, :]


@triton.jit
def _slot_columns(w0, BLOCK_W: tl.constexpr):
    """INT4: the input column each slot of `_nibbles` (words from w0) multiplies, quant.py's span
    layout putting field f of word 16 s + j on column 128 s + 16 f + j, and slot 8 j + 4 a + 2 b
    + c holding field a + 2 b + 4 c. Gathered in this order, each input is read once."""
    k = tl.arange(0, 8 * BLOCK_W)
    word = w0 + k // 8
    return (word // 16) * 128 + ((k // 4) % 2 + 2 * ((k // 2) % 2) + 4 * (k % 2)) * 16 + word % 16


@triton.jit
def _int8_slot_inputs(a, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """INT8's inputs [BLOCK_M, 4 BLOCK_W], a step's columns as they lie, in `_nibbles`' slot order
    [BLOCK_M, 8 BLOCK_W]: slot 8 j + 4 a + 2 b + c holds nibble a of field b + 2 c of word j, on
    column 64 s + 16 (b + 2 c) + j (word 16 s + j), the high nibble's input its column's times 16
    (exact). Each column is in two slots: read once and reordered here (a few input rows against
    the weights' BLOCK_N), where gathering them in slot order reads each twice and does the
    prologue's work twice."""
    a = tl.join(a, (a.to(tl.float32) * 16.0).to(a.dtype))  # [m, column, a]
    a = tl.reshape(tl.permute(a, (0, 2, 1)), [BLOCK_M, 2, BLOCK_W // 16, 2, 2, 16])  # [m, a, s, c, b, j]
    return tl.reshape(tl.permute(a, (0, 2, 5, 1, 4, 3)), [BLOCK_M, 8 * BLOCK_W])


@triton.jit
def _dot16(w, offsets, a, INTERPRETED: tl.constexpr):
    """(w - offsets) @ a for 16-bit floats, fp32 sums. Triton's interpreter does 16-bit floats'
    arithmetic on their bit patterns, so it takes them in fp32 there: the same values (the
    difference and the products are exact either way)."""
    if INTERPRETED:
        return tl.dot(w.to(tl.float32) - offsets.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    return tl.dot(w - offsets, a)


@triton.jit
def _dot_step(acc, bias, words, w0, x_ptr, res_ptr, res_out_ptr, norm_w_ptr, s_ptr, z_ptr, rows, row_mask, n_in, inv,
              store_sum, K: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr,
              BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, DOT_M: tl.constexpr, INTERPRETED: tl.constexpr):
    """One step of `_quant_dot_kernel`: `words` [BLOCK_N, BLOCK_W] from word w0 of rows n_in times
    the input rows' matching columns, added to acc [BLOCK_N, DOT_M], scaled by its group's scales
    where a row has several groups (with one, the kernel scales once at the end). The zero points
    come off the weights as their bits are made (`_nibble_bias`: `bias`, the rows' own where they
    have one group, else this step's group's)."""
    FIELDS: tl.constexpr = 32 // BITS
    GROUPS: tl.constexpr = K // GROUP
    tl.static_assert(BLOCK_W % 16 == 0, "a step of whole spans (_nibbles)")
    dtype = x_ptr.dtype.element_ty
    HALF: tl.constexpr = dtype == tl.float16
    MAGIC: tl.constexpr = 0x64006400 if HALF else 0x43004300
    # K a whole number of steps: every column < K
    cols = w0 * FIELDS + tl.arange(0, FIELDS * BLOCK_W) if BITS == 8 else _slot_columns(w0, BLOCK_W)
    a = input_chunk(x_ptr, res_ptr, res_out_ptr, rows, cols, row_mask[:, None], K, store_sum, ADD, SILU, dtype)
    if NORM:
        a = normalized(a, inv, norm_w_ptr, cols, cols < K, dtype)
    if BITS == 8:
        a = _int8_slot_inputs(a, BLOCK_M, BLOCK_W)
    if BLOCK_M < DOT_M:
        a = tl.reshape(tl.broadcast_to(a[None, :, :], [DOT_M // BLOCK_M, BLOCK_M, 8 * BLOCK_W]), [DOT_M, 8 * BLOCK_W])
    scale = tl.full([BLOCK_N], 1.0, tl.float32)  # with one group a row, applied once at the end
    if GROUPS > 1:
        at = n_in * GROUPS + w0 // (GROUP // FIELDS)
        if HAS_ZEROS:
            bias = _nibble_bias(tl.load(z_ptr + at).to(tl.int32), MAGIC, BITS)
        scale = tl.load(s_ptr + at)
    part = _dot16(_nibbles(words, bias, MAGIC, BLOCK_N, BLOCK_W), _slot_offsets(dtype, BITS, HAS_ZEROS, BLOCK_W),
                  tl.trans(a), INTERPRETED)
    return acc + part if GROUPS == 1 else acc + part * scale[:, None]


# M not specialized on its divisibility by 16, which varies step to step (a compile each class, first
# met on a request's path); M == 1, plain decoding at batch 1, keeps a variant of its own.
@triton.jit(do_not_specialize_on_alignment=["M"])
def _quant_dot_kernel(x_ptr, res_ptr, norm_w_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, res_out_ptr, M, N, K: tl.constexpr,
                      eps, NORM: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr, BITS: tl.constexpr,
                      GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_W: tl.constexpr, NORM_BLOCK: tl.constexpr, KW_SPLIT: tl.constexpr, PDL: tl.constexpr,
                      DOT_M: tl.constexpr, INTERPRETED: tl.constexpr, STAGES: tl.constexpr,
                      PREFETCH: tl.constexpr):
    """out[M, N] = a(x)[M, K] @ dequant(w)[N, K]^T on tensor cores, a() the prologue as in
    `_quant_skinny_kernel`. The BLOCK_M input rows' prologue is computed once, then repeated to
    the dot's DOT_M >= 16 rows (free: the weights' bytes bound the product, each read once for
    all rows; the copies' results are not stored).

    The weights become the dot's 16-bit operand with a few instructions for two (`_nibbles`:
    INT4 a nibble a weight; INT8 two nibbles, the high one's input times 16, exact), each slot
    already its share of q - z, a small integer exact in 16 bits (`_nibble_bias`,
    `_slot_offsets`), and the dot sums inputs times q - z with fp32 accumulation. Scales once a
    group and row after each step (a step is at most a group: BLOCK_W divides the group's
    words), or once a row at the end. Program (i, j) takes words [j KW_SPLIT, (j + 1) KW_SPLIT)
    as in `_quant_skinny_kernel`. The next step's words are in flight while a step multiplies
    (STAGES 0), or STAGES - 1 steps' in shared memory through Triton's pipeline
    (kernels.Tile.stages); with PREFETCH (kernels.Tile.prefetch), all the program's words are
    asked of L2 first."""
    pid = tl.program_id(0)
    FIELDS: tl.constexpr = 32 // BITS
    KW: tl.constexpr = K // FIELDS
    GROUPS: tl.constexpr = K // GROUP
    dtype = x_ptr.dtype.element_ty
    w_lo = tl.program_id(1) * KW_SPLIT
    w_hi = tl.minimum(w_lo + KW_SPLIT, KW)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n_in = tl.minimum(n, N - 1)  # rows past N read row N - 1 (not stored): every weight load unmasked
    tile_words = qw_ptr + n_in.to(tl.int64)[:, None] * KW + tl.arange(0, BLOCK_W)[None, :]
    if STAGES == 0:
        words = tl.load(tile_words + w_lo)  # in flight first
    if PREFETCH:
        _prefetch_weight(qw_ptr, s_ptr, z_ptr, n_in, w_lo, w_hi, K, BITS, GROUP, HAS_ZEROS, BLOCK_N)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    inv = tl.zeros([BLOCK_M], tl.float32)
    if NORM:  # first pass: each row's mean square
        inv = row_inv_rms(x_ptr, res_ptr, res_out_ptr, rows, row_mask, K, eps, ADD, SILU, dtype, BLOCK_M,
                          NORM_BLOCK)
    MAGIC: tl.constexpr = 0x64006400 if dtype == tl.float16 else 0x43004300  # as _nibbles'
    # _nibbles' bias: MAGIC alone for a constant zero point; stored ones' made here where a row has
    # one group, else each step's (_dot_step)
    bias = MAGIC
    if HAS_ZEROS and GROUPS == 1:
        bias = _nibble_bias(tl.load(z_ptr + n_in).to(tl.int32), MAGIC, BITS)
    acc = tl.zeros([BLOCK_N, DOT_M], tl.float32)
    if STAGES > 0:  # Triton's pipeline requests the words STAGES - 1 steps ahead, into shared memory
        for w0 in tl.range(w_lo, w_hi, BLOCK_W, num_stages=STAGES):
            acc = _dot_step(acc, bias, tl.load(tile_words + w0), w0, x_ptr, res_ptr, res_out_ptr, norm_w_ptr, s_ptr,
                            z_ptr, rows, row_mask, n_in, inv, pid == 0, K, NORM, ADD, SILU, BITS, GROUP, HAS_ZEROS,
                            BLOCK_M, BLOCK_N, BLOCK_W, DOT_M, INTERPRETED)
    else:
        # num_stages=1: the words' register prefetch alone; Triton would pipeline the inputs' loads
        # (through shared memory, with its bookkeeping in the loop) for inputs L2 holds
        for w0 in tl.range(w_lo, w_hi, BLOCK_W, num_stages=1):
            cur = words
            words = tl.load(tile_words + tl.minimum(w0 + BLOCK_W, w_hi - BLOCK_W))  # the next step's, in flight
            acc = _dot_step(acc, bias, cur, w0, x_ptr, res_ptr, res_out_ptr, norm_w_ptr, s_ptr, z_ptr, rows,
                            row_mask, n_in, inv, pid == 0, K, NORM, ADD, SILU, BITS, GROUP, HAS_ZEROS, BLOCK_M,
                            BLOCK_N, BLOCK_W, DOT_M, INTERPRETED)
    if GROUPS == 1:
        acc = acc * tl.load(s_ptr + n_in)[:, None]
    out_rows = tl.arange(0, DOT_M)
    mask = n_mask[:, None] & (out_rows < M)[None, :]
    if KW_SPLIT >= KW:
        tl.store(out_ptr + out_rows[None, :] * N + n[:, None], acc.to(dtype), mask=mask)
    else:  # this split's partial sums, [split, M, N] fp32
        tl.store(out_ptr + (tl.program_id(1) * M + out_rows[None, :]) * N + n[:, None], acc, mask=mask)


# Tiles tried for each shape, as in kernels._TILES (`block_k`: BLOCK_W words a row at a time, a
# power of two, at least a span). Triton lays consecutive words on consecutive threads, one each,
# so where BLOCK_W spans all threads a thread holds all BLOCK_N rows of its word and computes an
# activation's prologue once for them. The first nine were the fastest, or close, for some Qwen3
# 0.6B/4B projection at batch 1 (bench/results/quant-h200); (2, 128, 4) and (1, 256, 8) also fit
# 8 rows. Then the later candidates that won some projection there: two words a thread, the
# prologue apart (a fused program spends about as many instructions on its activations as on its
# weights), split K for the narrow down projection. Wider tiles (four words a thread, more bytes
# in flight a program) won nowhere, so they are not tried.
TILES = [Tile(8, 128, 4), Tile(16, 128, 4), Tile(4, 128, 4), Tile(8, 64, 2), Tile(4, 64, 2), Tile(8, 32, 1),
         Tile(8, 256, 8), Tile(1, 256, 8), Tile(2, 128, 4), Tile(8, 256, 4),
         Tile(8, 128, 4, apart=True), Tile(8, 64, 2, apart=True), Tile(8, 256, 8, apart=True),
         Tile(4, 128, 4, 4), Tile(8, 256, 8, 2)]
_MAX_WORDS_PER_THREAD = 16  # accumulators a thread holds per word: more spills registers


# Candidates for one input row (`one_row`: `_quant_gemv_kernel`, BLOCK_N rows of block_k words a
# step), timed beside TILES: the ones that were fastest or second for some Qwen3 0.6B/4B projection
# at batch 1, INT8 and INT4, in a sweep of 8 to 32 words a thread (bench/results/quant-gemv-h200).
# Many rows a program: the input's columns (and a fused prologue's work on them) are shared by
# all of a thread's rows; split K where N / BLOCK_N programs leave the GPU part empty. The last,
# a step of one span, fits every K of whole spans (the demo's), where the wider steps do not; then
# pipelined ones (kernels.Tile.stages); last, K split 8 or 16 ways, for the narrow products (o,
# down) whose few rows would leave a program a long row and the GPU a fraction of a wave.
GEMV_TILES = [Tile(32, 64, 4, apart=True, one_row=True), Tile(32, 128, 8, apart=True, one_row=True),
              Tile(64, 64, 8, apart=True, one_row=True), Tile(16, 64, 4, 4, one_row=True),
              Tile(32, 128, 8, one_row=True), Tile(64, 128, 8, 4, one_row=True), Tile(64, 128, 8, one_row=True),
              Tile(64, 64, 4, 4, one_row=True), Tile(16, 128, 8, one_row=True), Tile(8, 128, 4, one_row=True),
              Tile(32, 128, 8, 2, one_row=True), Tile(64, 64, 8, 2, one_row=True), Tile(32, 64, 4, 4, one_row=True),
              Tile(32, 16, 2, 4, one_row=True),
              Tile(32, 64, 4, apart=True, one_row=True, stages=3), Tile(32, 128, 8, one_row=True, stages=3),
              Tile(64, 64, 4, 4, one_row=True, stages=3),
              Tile(16, 64, 4, 8, one_row=True), Tile(32, 64, 4, 8, one_row=True), Tile(32, 128, 8, 8, one_row=True),
              Tile(64, 128, 8, 8, one_row=True), Tile(16, 64, 4, 16, one_row=True), Tile(32, 64, 4, 16, one_row=True)]
_MAX_GEMV_WORDS_PER_THREAD = 32  # its accumulators: one a word, rows sharing the inputs


def _gemv_tiles(rows: int, weight: QuantizedWeight) -> list[Tile]:
    """The one-row kernel's candidates for this weight: one row, groups of whole spans, K a
    whole number of steps, a step within one group or over whole groups."""
    group_words, row_words = weight.group_size * weight.bits // 32, weight.qweight.shape[1]
    if rows != 1 or weight.group_size % span(weight.bits):
        return []
    return [t for t in GEMV_TILES if row_words % t.block_k == 0 and (group_words % t.block_k == 0 or
                                                                     t.block_k % group_words == 0)]


# Tensor-core candidates (`_quant_dot_kernel`, `dot`): BLOCK_N weight rows a program (the dot's M),
# 16 words a step (a group of 128 INT4 weights, 64 INT8), K split 4 or 8 ways where N / BLOCK_N
# programs would leave the memory pipe part empty (the narrow o and down projections); the
# prologue fused or apart; pipelined last (kernels.Tile.stages: several steps' words in flight a
# program, where the register prefetch holds one). The last splits K 16 ways: more programs in
# flight where few rows leave each with little to multiply (bench/results/quant-rows16-float-h200).
DOT_TILES = [Tile(64, 16, 4, dot=True), Tile(32, 16, 4, dot=True), Tile(32, 16, 4, 4, dot=True),
             Tile(32, 16, 4, 8, dot=True), Tile(64, 16, 4, 4, dot=True), Tile(16, 16, 2, 8, dot=True),
             Tile(64, 16, 4, apart=True, dot=True), Tile(32, 16, 4, 4, apart=True, dot=True),
             Tile(64, 16, 4, dot=True, stages=4), Tile(64, 16, 4, 4, dot=True, stages=3),
             Tile(128, 16, 4, dot=True, stages=4), Tile(64, 16, 4, 4, apart=True, dot=True, stages=3),
             Tile(64, 16, 4, 16, apart=True, dot=True, stages=3)]


def _dot_tiles(rows: int, weight: QuantizedWeight, dtype: torch.dtype) -> list[Tile]:
    """The tensor-core kernel's candidates for this weight: up to 16 rows (one dot tile; more
    take the float path: dequantize + cuBLAS, untimed against this kernel), any skinny count
    past MAX_DEQUANTIZED weights (a vocab projection, which the float path does not take), of
    16-bit inputs, groups of whole steps (or one a row), K a whole number of steps."""
    group_words, row_words = weight.group_size * weight.bits // 32, weight.qweight.shape[1]
    big = weight.shape[0] * weight.shape[1] > MAX_DEQUANTIZED
    if (rows > DOT_MIN_ROWS and not big) or dtype not in (torch.bfloat16, torch.float16):
        return []
    return [t for t in DOT_TILES if group_words % t.block_k == 0 and row_words % t.block_k == 0]


# The quantized MMA kernel's candidates (model/mma_kernels.py: 16 rows a warp, block_k a warp's
# spans a step, its depth): warps a program, K split over programs where N / 16 programs leave the
# GPU part empty (the narrow o and down projections, and every product of the 0.6B); depths 1 to 4,
# more spans in flight a warp against fewer programs an SM, which of them wins a shape is timed;
# the prologue always apart (its inputs are loaded straight into the MMA's operand, with no room
# for a norm).
MMA_TILES = [Tile(16, 128, 4, apart=True, mma=True), Tile(16, 128, 2, apart=True, mma=True),
             Tile(16, 128, 4, 2, apart=True, mma=True), Tile(16, 128, 4, 4, apart=True, mma=True),
             Tile(16, 128, 4, 8, apart=True, mma=True), Tile(16, 128, 2, 4, apart=True, mma=True),
             Tile(16, 128, 2, 8, apart=True, mma=True), Tile(16, 128, 1, 8, apart=True, mma=True),
             Tile(16, 256, 4, apart=True, mma=True), Tile(16, 256, 4, 2, apart=True, mma=True),
             Tile(16, 256, 4, 4, apart=True, mma=True), Tile(16, 256, 2, 2, apart=True, mma=True),
             Tile(16, 256, 2, 4, apart=True, mma=True), Tile(16, 512, 4, apart=True, mma=True),
             Tile(16, 512, 2, 2, apart=True, mma=True), Tile(16, 512, 1, 4, apart=True, mma=True)]
MMA_MAX_DEPTH_TWO_TILES = 2  # two tiles of inputs hold twice the sums: at depth 4 a thread's registers spill


def _mma_tiles(rows: int, weight: QuantizedWeight, dtype: torch.dtype, device: torch.device | None) -> list[Tile]:
    """The MMA kernel's candidates: compiled code on a GPU (never in the interpreter, which runs no
    PTX; a meta device asks what a GPU would offer); INT4 or INT8 of 16-bit inputs, up to 16 rows
    (two tiles of 8), N a multiple of 16, groups of whole spans or one a row."""
    n, k = weight.shape
    if (device is None or device.type not in ("cuda", "meta") or rows > MAX_INPUT_ROWS
            or not mma_takes(weight.bits, weight.group_size, n, k, dtype)):
        return []
    tiles = [t for t in MMA_TILES if rows <= 8 or t.block_k <= MMA_MAX_DEPTH_TWO_TILES * SPAN_COLUMNS]
    if device.type == "meta":
        return tiles
    if INTERPRETED:
        return []
    # first, the default of a shape no table lists: the fewest K splits that give every SM two programs
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    split = next((s for s in (1, 2, 4, 8) if n // ROWS * s >= 2 * sms), 8)
    first = Tile(ROWS, SPAN_COLUMNS, 4, split, apart=True, mma=True)
    return [first] + [t for t in tiles if t != first]


def fitting_tiles(rows: int, weight: QuantizedWeight, prologue: int = PLAIN, pdl: bool = False,
                  dtype: torch.dtype = torch.bfloat16) -> list[Tile]:
    """Tiles this shape can take, the untimed default first: few enough accumulators a thread;
    fp32 scales (the loader's); a plain product has no prologue to run apart; with and without
    PDL as `kernels.with_pdl` (the MMA tiles with it where the GPU has it: they have no L2
    prefetch)."""
    if weight.scales.dtype != torch.float32:
        return []
    fma = [t for t in TILES if triton.next_power_of_2(rows) * t.block_n * t.block_k <= _MAX_WORDS_PER_THREAD * 32 * t.warps]
    fma += [t for t in _gemv_tiles(rows, weight) if t.block_n * t.block_k <= _MAX_GEMV_WORDS_PER_THREAD * 32 * t.warps]
    # the tensor-core tiles last: a shape no table lists keeps the first FMA tile, as before them
    tiles = with_pdl([t for t in fma + _dot_tiles(rows, weight, dtype) if not (t.apart and prologue == PLAIN)], pdl)
    mma = [t._replace(pdl=pdl, apart=prologue != PLAIN) for t in _mma_tiles(rows, weight, dtype, weight.qweight.device)]
    mma = [t for t in mma if t.split_k <= weight.shape[1] // span(weight.bits)]
    # An INT4 shape no table lists takes an MMA tile up to 8 rows: at most 27% slower than the fastest
    # at one row and the fastest at four, where the first FMA tile was up to 4.7x slower
    # (bench/results/mma-h200). Past 8 rows (two tiles of inputs), and INT8, it is a candidate.
    return mma + tiles if rows <= 8 and weight.bits == 4 else tiles + mma


def candidates(rows: int, weight: QuantizedWeight, prologue: int = PLAIN, pdl: bool = False,
               dtype: torch.dtype = torch.bfloat16) -> list[Tile | None]:
    """What a product of this shape is chosen among: the fitting tiles and, past one row, the
    float path (None, last: never the untimed default). A dequantizing pass and cuBLAS read the
    weights three times over, and can still beat the kernels' tiles where too few programs keep
    the memory busy; not past MAX_DEQUANTIZED weights (a vocab projection), whose float copy
    would be the step's biggest tensor. None at all where no tile fits: the float path, unchosen."""
    tiles: list[Tile | None] = list(fitting_tiles(rows, weight, prologue, pdl, dtype))
    n, k = weight.shape
    return tiles + [None] if tiles and rows > 1 and n * k <= MAX_DEQUANTIZED else tiles


def quant_matmul(tile, prologue, x, weight: QuantizedWeight, residual=None, norm_weight=None, eps=0.0):
    """The fused kernel in `tile` (with the partial sums' addition where it splits K, after the
    prologue's own kernel where it runs apart); None: dequantize and take the float path."""
    if tile is None:
        if weight.shape[0] * weight.shape[1] > MAX_DEQUANTIZED:  # a block of rows at a time (float_product)
            product = lambda y: float_product(y, weight, dequantized)  # noqa: E731
            return product(x) if prologue == PLAIN else run_apart(product, prologue, x, residual, norm_weight, eps, False)
        return torch_variant(prologue, x, dequantized(weight, x.dtype), residual, norm_weight, eps)
    if (tile.apart or tile.mma) and prologue != PLAIN:  # the MMA kernel fuses no prologue
        return run_apart(lambda y: quant_matmul(tile, PLAIN, y, weight), prologue, x, residual, norm_weight, eps,
                         tile.pdl)
    m, (n, k) = x.shape[0], weight.shape
    block_m = triton.next_power_of_2(m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if tile.mma:
        return mma_matmul(tile, x, weight, out)
    res_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if prologue == ADD_NORM else out
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    kw_split, splits = split_k(weight.qweight.shape[1], tile, tile.block_k)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    args = (x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight.qweight,
            weight.scales, zeros, target, res_out)
    meta = dict(NORM=prologue in (NORM, ADD_NORM), ADD=prologue == ADD_NORM, SILU=prologue == SILU_MUL,
                BITS=weight.bits, GROUP=weight.group_size, HAS_ZEROS=weight.zeros is not None, BLOCK_N=tile.block_n,
                BLOCK_W=tile.block_k, NORM_BLOCK=min(triton.next_power_of_2(k), 4096 // block_m), KW_SPLIT=kw_split,
                PREFETCH=prefetching(tile), num_warps=tile.warps)
    grid = (triton.cdiv(n, tile.block_n), splits)
    if tile.dot:
        launch(_quant_dot_kernel, grid, tile.pdl, *args, m, n, k, eps, BLOCK_M=block_m, DOT_M=max(block_m, DOT_MIN_ROWS),
               INTERPRETED=INTERPRETED, STAGES=tile.stages, **meta)
    elif tile.one_row:
        launch(_quant_gemv_kernel, grid, tile.pdl, *args, n, k, eps, (1 << weight.bits) - 1,
               EVEN_N=n % tile.block_n == 0, STAGES=tile.stages, **meta)
    else:
        launch(_quant_skinny_kernel, grid, tile.pdl, *args, m, n, k, eps, (1 << weight.bits) - 1, BLOCK_M=block_m,
               **meta)
    if splits > 1:
        sum_splits(target, out, tile.pdl)
    if prologue == NORM:
        return out, x
    return (out, res_out) if prologue == ADD_NORM else out


def mma_matmul(tile: Tile, x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> torch.Tensor:
    """x @ dequant(weight)^T into `out` by the MMA kernel (model/mma_kernels.py), K split over
    `tile.split_k` programs of whole spans where it asks (then their partial sums added in order)."""
    (m, k), n = x.shape, weight.shape[0]
    per, splits = split_k(k, tile, span(weight.bits))
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    compiled = launch(_quant_mma_kernel, (n // ROWS, splits), tile.pdl, x, weight.qweight, weight.scales, zeros, target,
                      m, n, k, BITS=weight.bits, GROUP=weight.group_size, HAS_ZEROS=weight.zeros is not None,
                      SLOTS=mma_slots(tile), SPANS_SPLIT=per // span(weight.bits), INPUT_TILES=1 if m <= 8 else 2,
                      INTERPRETED=INTERPRETED, num_warps=tile.warps)
    if launched_layout_ok(compiled, tile.warps) is False:  # another Triton's layout: its result is not the product
        if not _MMA_WARNED:
            _MMA_WARNED.append(True)
            log.warning("this Triton lays out the quantized MMA kernel's operands otherwise: its products are "
                        "computed by dequantizing instead")
        return torch.matmul(x, dequantized(weight, x.dtype).T, out=out)
    return out if splits == 1 else sum_splits(target, out, tile.pdl)


# The rows a step looks up vary step to step, and so may where their ids start: neither is specialized
# on, so serving never meets a variant the warm-up did not compile.
@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["ids_ptr"])
def _dequantize_span_kernel(qw_ptr, s_ptr, z_ptr, ids_ptr, out_ptr, N, K, BITS: tl.constexpr, GROUP: tl.constexpr,
                            HAS_ZEROS: tl.constexpr, GATHER: tl.constexpr, BLOCK_N: tl.constexpr):
    """BLOCK_N rows of one span of words (quant.py's layout) → their weights, (q - z) * s in fp32,
    cast once: the same bits as quant.dequantize. GATHER: output row r is weight row ids[r]."""
    FIELDS: tl.constexpr = 32 // BITS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1)
    e = tl.arange(0, 16 * FIELDS)  # column within the span: field e // 16 of word e % 16
    mask = (rows < N)[:, None]
    source = tl.load(ids_ptr + rows, mask=rows < N, other=0).to(tl.int64) if GATHER else rows.to(tl.int64)
    words = tl.load(qw_ptr + source[:, None] * (K * BITS // 32) + c * 16 + (e % 16)[None, :], mask=mask, other=0)
    q = (words >> (BITS * (e // 16))[None, :]) & ((1 << BITS) - 1)
    k = c * 16 * FIELDS + e
    g = source[:, None] * (K // GROUP) + (k // GROUP)[None, :]
    scale = tl.load(s_ptr + g, mask=mask, other=0.0)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + g, mask=mask, other=0).to(tl.int32)
    else:
        zero = 1 << (BITS - 1)
    w = (q - zero).to(tl.float32) * scale
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantized(w: QuantizedWeight, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
    """quant.dequantize, in one Triton pass on a GPU (prefill's products of many rows, where the
    torch version's temporaries make it several times the product's own time); `ids`: only those
    rows, in their order (a quantized embedding's lookups)."""
    if not (w.qweight.is_cuda or INTERPRETED):
        return dequantize(w if ids is None else quant_rows(w, ids), dtype)
    n, k = w.shape if ids is None else (ids.numel(), w.shape[1])
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    if n == 0:
        return out
    block_n = 16
    grid = (triton.cdiv(n, block_n), k // span(w.bits))
    _dequantize_span_kernel[grid](w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales,
                                  ids if ids is not None else w.scales, out, n, k, BITS=w.bits, GROUP=w.group_size,
                                  HAS_ZEROS=w.zeros is not None, GATHER=ids is not None, BLOCK_N=block_n,
                                  num_warps=4)
    return out


@triton.jit
def _dequantize_int4pack_kernel(packed_ptr, sz_ptr, out_ptr, N, K, GROUP: tl.constexpr, INNER: tl.constexpr):
    """One (8 rows, 16 INNER columns) tile of tinygemm's layout → its weights, (q - 8) * s + m.

    Word j of lane t of the tile holds, in nibble p = 4 low + i, weight (n, k) with
    n = 8 tile_n + t // 4 and k = 16 INNER tile_k + 32 j + 8 i + 2 (t % 4) + low (torch's
    matrix_to_m16n8k16_Bint4_layout, CUDA: the m16n8k16 B fragment of each lane, two k-tiles a word)."""
    tile_n = tl.program_id(0)
    tile_k = tl.program_id(1)
    J: tl.constexpr = INNER // 2
    e = tl.arange(0, 256 * J)  # one weight each: (lane, word, nibble)
    t = e // (8 * J)
    j = (e // 8) % J
    p = e % 8
    word = tl.load(packed_ptr + ((tile_n * tl.num_programs(1) + tile_k) * 32 + t) * J + j)
    q = (word >> (4 * p)) & 0xF
    n = tile_n * 8 + t // 4
    k = tile_k * 16 * INNER + 32 * j + 8 * (p % 4) + 2 * (t % 4) + p // 4
    at = ((k // GROUP) * N + n) * 2
    scale = tl.load(sz_ptr + at).to(tl.float32)
    offset = tl.load(sz_ptr + at + 1).to(tl.float32)
    tl.store(out_ptr + n.to(tl.int64) * K + k, ((q - 8).to(tl.float32) * scale + offset).to(out_ptr.dtype.element_ty))


def dequantize_int4pack(w: Int4PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A weight in tinygemm's layout (model/int4pack.py) as a [N, K] `dtype` matrix, for the
    products of many rows (prefill), where cuBLAS over it beats the W4A16 kernel: one pass that
    reads the packed words and writes the weights."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=w.packed.device)
    grid = (w.packed.shape[0], w.packed.shape[1])
    _dequantize_int4pack_kernel[grid](w.packed, w.scales_zeros, out, n, k, GROUP=w.group_size,
                                      INNER=w.packed.shape[3] * 2, num_warps=4)
    return out


def int4pack_matmul(prologue, x, weight: Int4PackedWeight, residual=None, norm_weight=None, eps=0.0, pdl=False):
    """A product over a weight in tinygemm's layout, the prologue as its own kernel first: the W4A16
    kernel up to int4pack.MAX_ROWS rows, beyond them cuBLAS over the dequantized weight."""
    if x.shape[0] > int4pack.MAX_ROWS:
        return torch_variant(prologue, x, dequantize_int4pack(weight, x.dtype), residual, norm_weight, eps)
    if prologue == PLAIN:
        return int4pack.matmul(x, weight)
    return run_apart(lambda y: int4pack.matmul(y, weight), prologue, x, residual, norm_weight, eps, pdl)


class QuantFusedKernels(FusedKernels):
    """`FusedKernels` that also multiply by quantized weights (a `QuantizedWeight` where a float
    weight would be), each shape in the tile timed fastest, kept per engine like the float tiles.
    Past one row the float path (dequantize, then cuBLAS: `quant_matmul(None, ...)`) is a
    candidate too (`candidates`): it reads the weights twice and writes them once, yet at 16
    rows it beat every tile the H200 timed (bench/results/quant-rows16-float-h200)."""

    def skinny_matmul(self, prologue, x, weight, residual=None, norm_weight=None, eps=0.0):
        if isinstance(weight, Int4PackedWeight):
            return int4pack_matmul(prologue, x.contiguous(), weight, residual, norm_weight, eps, pdl_supported(x.device))
        if not isinstance(weight, QuantizedWeight):
            return super().skinny_matmul(prologue, x, weight, residual, norm_weight, eps)
        x, residual = x.contiguous(), residual if residual is None else residual.contiguous()
        key = ("quant", prologue, triton.next_power_of_2(x.shape[0]), *weight.shape, weight.bits, weight.group_size,
               weight.scales.dtype, x.dtype)
        tile = self.chosen[key] if key in self.chosen else self._choose_quant_tile(key, prologue, x, weight,
                                                                                   residual, norm_weight, eps)
        return quant_matmul(tile, prologue, x, weight, residual, norm_weight, eps)

    def _choose_quant_tile(self, key, prologue, x, weight, residual, norm_weight, eps):
        """As `FusedKernels._choose_tile`; None where no tile fits: dequantize and take the float path."""
        tiles = candidates(x.shape[0], weight, prologue, pdl_supported(x.device), x.dtype)
        if not tiles:
            self.chosen[key] = None
            return None
        if self._untimed(key, tiles, self.tile_timing and not self.frozen, default=tiles[0]):
            return self.chosen[key]
        with parallel_compile.compile_only():  # every candidate's compile at once
            for t in tiles:
                quant_matmul(t, prologue, x, weight, residual, norm_weight, eps)
        copies = [weight._replace(qweight=q) for q in cold_copies(weight.qweight)]
        times = [self._time([lambda w=w, t=t: quant_matmul(t, prologue, x, w, residual, norm_weight, eps)
                             for w in copies]) for t in tiles]
        self._record(key, tiles, times)
        return self.chosen[key]

