"""W4A16 and W8A16 products of 1 to 16 rows on tensor cores, read straight from quant.py's span layout.

Decode's quantized products are bound by the instructions a weight costs as much as by its bytes:
a GPU's memory delivers INT4 weights at a sizeable share of its issue rate, so each instruction a
weight counts (quant_kernels.py's tensor-core kernel spends most of its own moving the dequantized
weights into the dot's operand layout through shared memory; tiles/sass.json counts them all).
Here each thread's loaded words already are its share of an m16n8k16 MMA's weight operand, so
nothing moves between threads:

- The MMA sums over its 16 k indices in any order, so lane l (t = l % 4) is given the columns of
  word j = 4 t + v (v = 0..3) of its two rows (l // 4 and l // 4 + 8): a 16-byte load of four
  consecutive words a row, the four lanes of a row reading a span's 64 bytes side by side.
- INT4: a word's eight fields are weights on columns 16 f + j of its span (quant.py). Fields f
  and f + 4 lie 16 bits apart, so one LOP3 (mask, OR with the bits of 128.0 in both halves)
  makes the pair 128 + q as two exact bf16: the magic-number conversion, a shift and a logic
  instruction for two weights, no conversion instruction. The 128 comes off the sums, once a
  span (128 times the inputs' sum, a cancellation below the bf16 output's rounding). fp16's
  magic number is 1024, eight times the cancellation, so there a packed FMA a pair takes it off
  the weights instead (exact). Fields (2 s, 2 s + 4) and (2 s + 1, 2 s + 5) are the operand's
  two k pairs of step s.
- INT8: a word's four bytes are weights on columns 16 b + j. The same LOP3 on its nibbles makes
  a byte's low half 128 + l and, with a magic number whose last mantissa bit is worth 16, its
  high half 2048 + 16 h; both take the byte's input, so the MMA sums (q + 2176) times it, every
  value exact.
- The inputs are the operand B: lane l holds input row l // 4's same columns, its two 16-bit
  loads of pairs made one register by a PRMT; input rows past M load zeros (the MMA's n is 8:
  up to 8 rows, MTP's verify and small batches, at the cost of one; 9 to 16 rows multiply each
  span's words by a second tile of 8).
- The MMA sums inputs times the operand in fp32; a second MMA, of ones, sums the inputs, so
  sum a (q - z) s = (part - (offset + z) sum a) s once a span and row (a span is within one
  group: groups are whole spans).

The kernel is inline PTX inside Triton, and an MMA is a warp's collective: it is correct only
where Triton gives each thread the elements described above (a blocked layout of four
consecutive elements a thread, 32 threads along a row, a warp a row of slots). `launched_layout_ok` reads
that layout from each compiled kernel once; where another Triton lays it out otherwise, the
product is computed the float way instead (quant_kernels.mma_matmul), never wrongly.
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ROWS = 16  # weight rows a warp: the MMA's m
MAX_INPUT_ROWS = 16  # two tiles of the MMA's n = 8
SPAN_COLUMNS = 128  # INT4 columns a span of 16 words holds (quant.span(4)); INT8's span holds 64

# One MMA step: the operand B's registers b0, b1 made by PRMT from the inputs of the fields in each
# k pair ({inputs}), then the weights' pairs (a0-a3: rows l // 4 and l // 4 + 8) times them into
# $0-$3 and an operand of `ones` times them into $4-$7 (the inputs' sums); {type}: the activations'
# bf16 or f16.
_STEP = """{inputs}
mma.sync.aligned.m16n8k16.row.col.f32.{type}.{type}.f32 {{$0,$1,$2,$3}}, {{{a0},{a1},{a2},{a3}}}, {{b0,{b1}}}, {{$0,$1,$2,$3}};
mma.sync.aligned.m16n8k16.row.col.f32.{type}.{type}.f32 {{$4,$5,$6,$7}}, {{ones,ones,ones,ones}}, {{b0,{b1}}}, {{$4,$5,$6,$7}};
"""


def _pairs(word: str, first: int, half: bool, bits: int) -> str:
    """The four pairs of nibbles p, p + 4 (bits 4 p and 4 p + 16) of `word` into registers
    q{first}..q{first + 3}: each pair two exact 16-bit values by one LOP3 (mask, OR with a magic
    number's bits), less the magic number by a packed FMA for fp16. INT4: the nibbles are fields,
    magic + q. INT8: nibble p is byte p // 2's low (p even: magic + l) or high half (p odd: a magic
    number 16 times larger, whose last mantissa bit is worth 16: magic16 + 16 h), so the pairs of
    a byte's two nibbles sum to (q + magic + magic16) times its input."""
    lines = []
    for p in range(4):
        source = word
        if p:
            lines.append(f"shr.u32 t, {word}, {4 * p};")
            source = "t"
        high = bits == 8 and p % 2
        lines.append(f"lop3.b32 q{first + p}, {source}, mask, {'magic16' if high else 'magic'}, 0xEA;")  # (a & b) | c
        if half:
            lines.append(f"fma.rn.f16x2 q{first + p}, q{first + p}, one, {'unmagic16' if high else 'unmagic'};")
    return "\n".join(lines)


# bf16 and fp16 constants, both halves: (type, magic, magic16, -magic, -magic16, one); magic's last
# mantissa bit is worth 1 (128.0 in bf16, 1024.0 in fp16), magic16's 16 (2048.0, 16384.0)
_HALF = ("f16", "0x64006400", "0x74007400", "0xE400E400", "0xF400F400", "0x3C003C00")
_BF16 = ("bf16", "0x43004300", "0x45004500", "0xC300C300", "0xC500C500", "0x3F803F80")


def offset(half: bool, bits: int) -> float:
    """What the PTX leaves on each weight (q + offset times its input): the magic numbers, fp16's
    taken off by the packed FMA (exact), bf16's off the sums once a span (see _asm)."""
    return 0.0 if half else 128.0 if bits == 4 else 128.0 + 2048.0


def _asm(half: bool, bits: int = 4) -> str:
    """A span's products for one thread: operands $8-$11 row l // 4's words v = 0..3, $12-$15 row
    l // 4 + 8's, then the inputs, two registers each (v = 0, 1 and v = 2, 3): INT4 those of
    fields f = 0..7, INT8 of bytes b = 0..3. An INT8 byte's two nibbles take two k indices with
    the same input, so its k pairs' inputs are one register, and the operand of ones is one half
    there: the second MMA still sums each input once."""
    kind, magic, magic16, unmagic, unmagic16, one = _HALF if half else _BF16
    ones = one if bits == 4 else ("0x38003800" if half else "0x3F003F00")  # 1.0, or 0.5
    body = ["{", ".reg .b32 q<8>, t, b0, b1, one, ones, mask, magic, magic16, unmagic, unmagic16;",
            f"mov.b32 one, {one};", f"mov.b32 ones, {ones};", "mov.b32 mask, 0x000F000F;",
            f"mov.b32 magic, {magic};", f"mov.b32 magic16, {magic16};", f"mov.b32 unmagic, {unmagic};",
            f"mov.b32 unmagic16, {unmagic16};"]
    body += [f"mov.b32 ${i}, 0f00000000;" for i in range(8)]
    for v in range(4):
        body += [_pairs(f"${8 + v}", 0, half, bits), _pairs(f"${12 + v}", 4, half, bits)]
        sel = "0x5410" if v % 2 == 0 else "0x7632"  # the low or the high 16 bits of both
        reg = lambda f: f"${16 + 2 * f + v // 2}"  # noqa: E731 - the inputs of field (INT8: byte) f
        for s in range(2):
            if bits == 4:  # k pairs (fields 2 s, 2 s + 4) and (2 s + 1, 2 s + 5)
                inputs = (f"prmt.b32 b0, {reg(2 * s)}, {reg(2 * s + 4)}, {sel};\n"
                          f"prmt.b32 b1, {reg(2 * s + 1)}, {reg(2 * s + 5)}, {sel};")
                b1 = "b1"
            else:  # nibbles 2 s, 2 s + 4 (bytes s, s + 2, low) and 2 s + 1, 2 s + 5 (the same bytes, high)
                inputs, b1 = f"prmt.b32 b0, {reg(s)}, {reg(s + 2)}, {sel};", "b0"
            body.append(_STEP.format(inputs=inputs, b1=b1, type=kind, a0=f"q{2 * s}", a1=f"q{4 + 2 * s}",
                                     a2=f"q{2 * s + 1}", a3=f"q{5 + 2 * s}"))
    body.append("}")
    return "\n".join(body)


_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 24))
_ASM_BF16 = tl.constexpr(_asm(half=False))
_ASM_F16 = tl.constexpr(_asm(half=True))
_CONSTRAINTS8 = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 16))
_ASM8_BF16 = tl.constexpr(_asm(half=False, bits=8))
_ASM8_F16 = tl.constexpr(_asm(half=True, bits=8))


@triton.jit
def _span_product(w0, w1, x_at, col, mask, HALF: tl.constexpr, BITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """(part, input sums) of one span for one tile of 8 input rows, fp32 (see _asm): the inputs
    of its fields (INT4: f = 0..7; INT8: bytes b = 0..3) on columns col + 16 f + the thread's
    word, loaded here."""
    x0 = tl.load(x_at + col, mask=mask, other=0.0)
    x1 = tl.load(x_at + col + 16, mask=mask, other=0.0)
    x2 = tl.load(x_at + col + 32, mask=mask, other=0.0)
    x3 = tl.load(x_at + col + 48, mask=mask, other=0.0)
    if BITS == 4:
        x4 = tl.load(x_at + col + 64, mask=mask, other=0.0)
        x5 = tl.load(x_at + col + 80, mask=mask, other=0.0)
        x6 = tl.load(x_at + col + 96, mask=mask, other=0.0)
        x7 = tl.load(x_at + col + 112, mask=mask, other=0.0)
        if INTERPRETED:
            return _span_reference(w0, w1, x0, x1, x2, x3, x4, x5, x6, x7, HALF, BITS)
        part, sums = tl.inline_asm_elementwise(_ASM_F16 if HALF else _ASM_BF16, _CONSTRAINTS,
                                               [w0, w1, x0, x1, x2, x3, x4, x5, x6, x7],
                                               dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        if INTERPRETED:
            return _span_reference(w0, w1, x0, x1, x2, x3, x0, x1, x2, x3, HALF, BITS)
        part, sums = tl.inline_asm_elementwise(_ASM8_F16 if HALF else _ASM8_BF16, _CONSTRAINTS8,
                                               [w0, w1, x0, x1, x2, x3],
                                               dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    return part, sums


@triton.jit
def _span_reference(w0, w1, x0, x1, x2, x3, x4, x5, x6, x7, HALF: tl.constexpr, BITS: tl.constexpr):
    """What the PTX of `_span_product` computes from the same operands, in plain Triton: the
    interpreter runs no PTX, so the kernel's tests run this in its place (and the PTX itself in a
    PTX interpreter of their own). A warp's element 16 g + 4 t + v holds word 4 t + v of rows g
    (w0) and g + 8 (w1) and input row g's columns of it (x_f: field f; INT8 the first four);
    its results are output row g + 8 (v // 2) against input row 2 t + v % 2, the sum of (q + what
    the PTX leaves on a weight) times the input, and the sum of the inputs."""
    W: tl.constexpr = w0.shape[0]
    FIELDS: tl.constexpr = 32 // BITS
    offset = 0.0 if HALF else (128.0 if BITS == 4 else 2176.0)  # mma_kernels.offset
    low = tl.zeros([W, 8, 8], tl.float32)  # [warp, output row g, input row]
    high = tl.zeros([W, 8, 8], tl.float32)  # output row g + 8
    sums = tl.zeros([W, 8], tl.float32)
    words0 = tl.reshape(w0, [W, 8, 16])
    words1 = tl.reshape(w1, [W, 8, 16])
    for f in tl.static_range(FIELDS):
        x = x0 if f == 0 else x1 if f == 1 else x2 if f == 2 else x3 if f == 3 else x4 if f == 4 else x5 if f == 5 \
            else x6 if f == 6 else x7
        x = tl.reshape(x.to(tl.float32), [W, 8, 16])  # [warp, input row, word]
        q0 = ((words0 >> (BITS * f)) & ((1 << BITS) - 1)).to(tl.float32) + offset
        q1 = ((words1 >> (BITS * f)) & ((1 << BITS) - 1)).to(tl.float32) + offset
        low += tl.sum(q0[:, :, None, :] * x[:, None, :, :], axis=3)
        high += tl.sum(q1[:, :, None, :] * x[:, None, :, :], axis=3)
        sums += tl.sum(x, axis=2)
    both = tl.join(tl.reshape(low, [W, 8, 4, 2]), tl.reshape(high, [W, 8, 4, 2]))  # [W, g, t, parity, half]
    part = tl.reshape(tl.permute(both, (0, 1, 2, 4, 3)), [W, 128])
    sums = tl.broadcast_to(tl.reshape(sums, [W, 1, 4, 1, 2]), [W, 8, 4, 2, 2])
    return part, tl.reshape(sums, [W, 128])


@triton.jit
def _scaled(acc, sums, part, a_sum, s_ptr, z_ptr, col, out_n, K: tl.constexpr, OFFSET: tl.constexpr,
            GROUPS: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """acc and sums after the span at column col: with several groups a row, the span's
    (part - (offset + z) sums) s at once; with one, the raw sums (scaled once at the end,
    `_store`). The group's addresses are made here, after the MMAs, not held across them."""
    if GROUPS == 1:
        return acc + part, sums + a_sum
    g = (col * GROUPS) // K + out_n[None, :] * GROUPS  # the span's group, each output row's
    zero = tl.load(z_ptr + g).to(tl.float32) if HAS_ZEROS else 0.0  # else in OFFSET
    return acc + (part - (OFFSET + zero) * a_sum) * tl.load(s_ptr + g), sums


@triton.jit
def _store(acc, sums, out_ptr, s_ptr, z_ptr, out_m, out_n, M, N, OFFSET: tl.constexpr, GROUPS: tl.constexpr,
           HAS_ZEROS: tl.constexpr, WHOLE: tl.constexpr, dtype: tl.constexpr):
    """The slots' sums added and stored: out[out_m, out_n], or this split's fp32 partial sums."""
    out = tl.sum(acc, axis=0)
    if GROUPS == 1:
        zero = tl.load(z_ptr + out_n).to(tl.float32) if HAS_ZEROS else 0.0  # else in OFFSET
        out = (out - (OFFSET + zero) * tl.sum(sums, axis=0)) * tl.load(s_ptr + out_n)
    mask = out_m < M
    if WHOLE:
        tl.store(out_ptr + out_m * N + out_n, out.to(dtype), mask=mask)
    else:  # this split's partial sums, [split, M, N] fp32
        tl.store(out_ptr + (tl.program_id(1) * M + out_m) * N + out_n, out, mask=mask)


@triton.jit(do_not_specialize_on_alignment=["M"])
def _quant_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K: tl.constexpr, BITS: tl.constexpr,
                      GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, SLOTS: tl.constexpr, SPANS_SPLIT: tl.constexpr,
                      INPUT_TILES: tl.constexpr, PDL: tl.constexpr, INTERPRETED: tl.constexpr = False):
    """out[M, N] = x[M, K] @ dequant(w)[N, K]^T, M <= 8 INPUT_TILES, N a multiple of 16: program
    (i, j) takes rows [16 i, 16 i + 16) over spans [j SPANS_SPLIT, (j + 1) SPANS_SPLIT), its slot s
    the spans s, s + SLOTS, ... of them, the next step's words in flight while it multiplies, each
    span's words multiplied by every tile of 8 input rows; the slots' sums added at the end (and
    the splits' by sum_splits where there are several). A slot is a row of the [SLOTS, 128]
    operands: Triton gives row s to warp s % num_warps, so a warp holds SLOTS / num_warps spans a
    step (the tile's depth), all their loads issued before its first MMA waits on one. More spans
    in flight cost registers, so programs an SM: which depth a shape takes is the tables'
    timing."""
    HALF: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    # what comes off each weight's q besides a stored zero point: what the PTX leaves (offset()), and
    # a symmetric format's zero point, 2 ** (BITS - 1)
    OFFSET: tl.constexpr = (0.0 if HALF else (128.0 if BITS == 4 else 2176.0)) + (0.0 if HAS_ZEROS else 1 << (BITS - 1))
    KW: tl.constexpr = K * BITS // 32
    GROUPS: tl.constexpr = K // GROUP
    SPAN: tl.constexpr = 512 // BITS  # columns a span of 16 words holds
    SPANS: tl.constexpr = K // SPAN
    e = tl.arange(0, 128)  # lane * 4 + v: the layout _asm assumes
    lane = e // 4
    v = e % 4
    w = tl.arange(0, SLOTS)
    row = tl.program_id(0) * 16 + lane // 4  # the operand's row l // 4; + 8 for the other
    word = 4 * (lane % 4) + v  # of the span
    c_lo = tl.program_id(1) * SPANS_SPLIT
    c_hi = tl.minimum(c_lo + SPANS_SPLIT, SPANS)
    words0 = qw_ptr + row.to(tl.int64)[None, :] * KW + word[None, :]
    in_row = lane // 4  # the input row of lane l's operand B (+ 8 in the second input tile)
    x_at = x_ptr + in_row[None, :] * K + word[None, :]
    x_mask = (in_row < M)[None, :] & (w < SLOTS)[:, None]
    x_mask2 = (in_row + 8 < M)[None, :] & (w < SLOTS)[:, None]
    # the output element each thread holds: c0, c1 row l // 4, c2, c3 row l // 4 + 8; input rows 2 t, 2 t + 1
    out_n = tl.program_id(0) * 16 + lane // 4 + 8 * (v // 2)
    out_m = 2 * (lane % 4) + v % 2
    cw = tl.minimum(c_lo + w, c_hi - 1)[:, None] * 16  # each slot's first span
    cur0 = tl.load(words0 + cw)
    cur1 = tl.load(words0 + cw + 8 * KW)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([SLOTS, 128], tl.float32)
    sums = tl.zeros([SLOTS, 128], tl.float32)
    if INPUT_TILES == 2:
        acc2 = tl.zeros([SLOTS, 128], tl.float32)
        sums2 = tl.zeros([SLOTS, 128], tl.float32)
    for c0 in range(c_lo, c_hi, SLOTS):
        c = c0 + w
        nxt = tl.minimum(c + SLOTS, c_hi - 1)[:, None] * 16
        next0 = tl.load(words0 + nxt)
        next1 = tl.load(words0 + nxt + 8 * KW)
        col = (tl.minimum(c, c_hi - 1) * SPAN)[:, None]
        part, a_sum = _span_product(cur0, cur1, x_at, col, x_mask & (c < c_hi)[:, None], HALF, BITS, INTERPRETED)
        acc, sums = _scaled(acc, sums, part, a_sum, s_ptr, z_ptr, col, out_n, K, OFFSET, GROUPS, HAS_ZEROS)
        if INPUT_TILES == 2:
            part, a_sum = _span_product(cur0, cur1, x_at + 8 * K, col, x_mask2 & (c < c_hi)[:, None], HALF, BITS,
                                        INTERPRETED)
            acc2, sums2 = _scaled(acc2, sums2, part, a_sum, s_ptr, z_ptr, col, out_n, K, OFFSET, GROUPS, HAS_ZEROS)
        cur0 = next0
        cur1 = next1
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    _store(acc, sums, out_ptr, s_ptr, z_ptr, out_m, out_n, M, N, OFFSET, GROUPS, HAS_ZEROS, SPANS_SPLIT >= SPANS, dtype)
    if INPUT_TILES == 2:
        _store(acc2, sums2, out_ptr, s_ptr, z_ptr, out_m + 8, out_n, M, N, OFFSET, GROUPS, HAS_ZEROS,
               SPANS_SPLIT >= SPANS, dtype)


def takes(bits: int, group_size: int, out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes a projection of this format and shape on a GPU: INT4 or INT8 of
    16-bit inputs, 16 rows a warp, groups of whole spans (quant.span) or one a row."""
    span = 512 // bits if bits in (4, 8) else 0
    return (span > 0 and dtype in (torch.bfloat16, torch.float16) and out_features % ROWS == 0
            and in_features % span == 0 and (group_size % span == 0 or group_size == in_features))


def slots(tile) -> int:
    """The kernel's SLOTS for a tile (kernels.Tile): its warps times its depth, the spans a warp
    takes a step (block_k, a whole number of spans)."""
    return tile.warps * tile.block_k // SPAN_COLUMNS


EXPECTED_LAYOUT = "sizePerThread = [1, 4], threadsPerWarp = [1, 32], warpsPerCTA = [{warps}, 1], order = [1, 0]"


def operand_layout(ttgir: str) -> str | None:
    """The layout of the inline PTX's operands in a compiled kernel's TritonGPU IR, or None."""
    layouts = dict(re.findall(r"^#(\w+) = #ttg\.blocked<\{(.*)\}>$", ttgir, re.M))
    used = re.search(r"elementwise_inline_asm.*-> tensor<[^,]*, #(\w+)>", ttgir)
    return layouts.get(used.group(1)) if used else None


_LAYOUTS: dict[int, bool] = {}  # id of a compiled kernel → whether its PTX's operands are laid out as written for


def launched_layout_ok(compiled, warps: int) -> bool | None:
    """Whether a launched kernel (what Triton's launch returns) has the operand layout the PTX
    assumes, read once from its TritonGPU IR; None where the launch only compiled."""
    asm = getattr(compiled, "asm", None)
    if asm is None:
        return None
    key = id(compiled)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = operand_layout(asm["ttgir"]) == EXPECTED_LAYOUT.format(warps=warps)
    return _LAYOUTS[key]
