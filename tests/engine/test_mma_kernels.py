"""The quantized MMA kernel (model/mma_kernels.py): its PTX run by a small interpreter of the
instructions it uses, lane by lane with the MMA's fragment rules, against the fp64 product of the
dequantized weights; its layout and inner loop as Triton compiles it for sm_90 and sm_87; on a
GPU, the kernel itself against fp32 (outputs poisoned first).

Triton's interpreter runs no inline PTX, so the first test executes the kernel's PTX text here:
the operands each thread holds come from the layout the kernel's Triton code loads (the one
`layout_ok` checks in the compiled kernel), and the thread's results go back to the output
elements that code stores."""

import json
import re

import pytest
import torch

from jetserve.engine.model import quant
from tests.tools import compile_for_gpus, require_module

BF16_ONE = 0x3F80


def _bits16(values: torch.Tensor, half: bool) -> list[int]:
    """The 16-bit patterns of `values` as bf16 or fp16."""
    return values.to(torch.float16 if half else torch.bfloat16).view(torch.int16).to(torch.int32).tolist()


def _value16(bits: int, half: bool) -> float:
    return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(
        torch.float16 if half else torch.bfloat16).item()


def run_ptx(text: str, lanes: list[dict[str, int]], half: bool) -> list[dict[str, float]]:
    """Execute the kernel's PTX for a warp: `lanes` 32 register files ($8-$31 set), returns the
    32 lanes' $0-$7 as floats. Knows what the kernel uses: mov, shr.u32, lop3 (0xEA: (a & b) | c),
    packed 16-bit fma, prmt, and mma.sync m16n8k16 with fp32 accumulators (fragments per the PTX
    ISA)."""
    regs = [dict(r) for r in lanes]

    def value(r, operand):
        operand = operand.strip()
        if operand.startswith("0f"):
            return int(operand[2:], 16)
        if operand.startswith("0x"):
            return int(operand, 16)
        return r[operand]

    for line in [s.strip() for s in text.splitlines()]:
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op.startswith("mma.sync"):
            d, a, b, c = re.findall(r"\{([^}]*)\}", rest)
            d, a, b, c = ([s.strip() for s in part.split(",")] for part in (d, a, b, c))
            A, B = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
            C = torch.zeros(16, 8, dtype=torch.float64)
            for lane, r in enumerate(regs):
                g, t = lane // 4, lane % 4
                for i, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                    word = value(r, a[i])
                    A[row, col], A[row, col + 1] = _value16(word, half), _value16(word >> 16, half)
                for i, k in enumerate((2 * t, 2 * t + 8)):
                    word = value(r, b[i])
                    B[k, g], B[k + 1, g] = _value16(word, half), _value16(word >> 16, half)
                for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                    C[row, col] = _float(value(r, c[i]))
            D = A @ B + C
            for lane, r in enumerate(regs):
                g, t = lane // 4, lane % 4
                for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                    r[d[i]] = _word(D[row, col].item())
            continue
        args = [s.strip() for s in rest.rstrip(";").split(",")]
        for r in regs:
            if op.startswith("mov"):
                r[args[0]] = value(r, args[1])
            elif op == "shr.u32":
                r[args[0]] = (value(r, args[1]) & 0xFFFFFFFF) >> int(args[2])
            elif op == "lop3.b32":
                assert args[4] == "0xEA", line  # (a & b) | c
                r[args[0]] = (value(r, args[1]) & value(r, args[2])) | value(r, args[3])
            elif op.startswith("fma.rn.") and op.endswith("x2"):  # per 16-bit half, rounded once
                a, b, c = (value(r, x) for x in args[1:4])
                halves = [_value16(a >> h, half) * _value16(b >> h, half) + _value16(c >> h, half) for h in (0, 16)]
                lo, hi = _bits16(torch.tensor(halves, dtype=torch.float64), half)
                r[args[0]] = (lo & 0xFFFF) | ((hi & 0xFFFF) << 16)
            elif op == "prmt.b32":
                pool = (value(r, args[1]) & 0xFFFFFFFF) | ((value(r, args[2]) & 0xFFFFFFFF) << 32)
                sel = int(args[3], 16)
                r[args[0]] = sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
            else:
                raise AssertionError(f"an instruction the interpreter does not know: {line}")
    return [{f"${i}": _float(r[f"${i}"]) for i in range(8)} for r in regs]


def _float(word: int) -> float:
    return torch.tensor([word & 0xFFFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def _word(x: float) -> int:
    return torch.tensor([x], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF


def emulated_product(x: torch.Tensor, w: quant.QuantizedWeight) -> torch.Tensor:
    """What `_quant_mma_kernel` computes, its PTX run by `run_ptx`: for each 16 rows, tile of 8
    input rows and span, a warp whose lane l holds, at element v, word 4 (l % 4) + v of rows l // 4
    and l // 4 + 8 and the tile's input row l // 4's columns 16 f + that word (f = 0..7 INT4's
    fields, 0..3 INT8's bytes; two 16-bit elements a register), then the Triton code's arithmetic
    on the results: (part - (offset + z) sums) s once a span (or a row)."""
    from jetserve.engine.model import mma_kernels

    half, bits = x.dtype == torch.float16, w.bits
    text = mma_kernels._asm(half, bits)
    offset = mma_kernels.offset(half, bits)  # what the PTX leaves on each weight
    cols = quant.span(bits)
    (m, k), n = x.shape, w.shape[0]
    words = w.qweight.tolist()
    zeros, scales = quant.zero_points(w).double(), w.scales.double()
    groups = k // w.group_size
    out = torch.zeros(m, n, dtype=torch.float64)
    for tile in range(n // 16):
        rows = torch.arange(16) + 16 * tile
        for first in range(0, m, 8):  # each tile of 8 input rows
            total, sums_total = torch.zeros(16, 8, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
            for span in range(k // cols):
                lanes = []
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    r = {}
                    for v in range(4):
                        j = 16 * span + 4 * t + v
                        r[f"${8 + v}"] = words[16 * tile + g][j] & 0xFFFFFFFF
                        r[f"${12 + v}"] = words[16 * tile + g + 8][j] & 0xFFFFFFFF
                    for f in range(32 // bits):
                        at = [cols * span + 16 * f + 4 * t + v for v in range(4)]
                        vals = x[first + g, at] if first + g < m else torch.zeros(4, dtype=x.dtype)
                        b = _bits16(vals, half)
                        r[f"${16 + 2 * f}"] = (b[0] & 0xFFFF) | ((b[1] & 0xFFFF) << 16)
                        r[f"${16 + 2 * f + 1}"] = (b[2] & 0xFFFF) | ((b[3] & 0xFFFF) << 16)
                    lanes.append(r)
                result = run_ptx(text, lanes, half)
                part, sums = torch.zeros(16, 8, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
                for lane, r in enumerate(result):  # element v of lane l: row l // 4 + 8 (v // 2), input 2 (l % 4) + v % 2
                    for v in range(4):
                        part[lane // 4 + 8 * (v // 2), 2 * (lane % 4) + v % 2] = r[f"${v}"]
                        sums[lane // 4 + 8 * (v // 2), 2 * (lane % 4) + v % 2] = r[f"${4 + v}"]
                if groups == 1:
                    total += part
                    sums_total += sums
                else:
                    g = span * cols // w.group_size
                    total += (part - (offset + zeros[rows, g])[:, None] * sums) * scales[rows, g][:, None]
            if groups == 1:
                total = (total - (offset + zeros[rows, 0])[:, None] * sums_total) * scales[rows, 0][:, None]
            out[first:first + 8, rows] = total[:, :min(8, m - first)].T
    return out


@pytest.mark.parametrize("bits,sym,group,k,rows,dtype", [(4, False, 128, 384, 1, torch.bfloat16),
                                                         (4, True, 256, 512, 3, torch.bfloat16),
                                                         (4, False, 384, 384, 8, torch.float16),
                                                         (4, True, 128, 256, 5, torch.float16),
                                                         (4, False, 128, 256, 13, torch.bfloat16),
                                                         (8, False, 64, 192, 1, torch.bfloat16),
                                                         (8, True, 128, 256, 6, torch.bfloat16),
                                                         (8, False, 192, 192, 8, torch.float16),
                                                         (8, True, 64, 128, 11, torch.float16)])
def test_the_ptx_computes_the_product(bits, sym, group, k, rows, dtype):
    """The kernel's PTX, lane by lane, gives x @ dequant(w)^T: INT4 and INT8 with zero points or
    symmetric, groups of one and several spans and one group a row (384; INT8 192), 1 to 16 input
    rows (past 8: a second tile of 8 in part), bf16 and fp16 inputs, 32 rows (two warps' tiles) by
    two to four spans."""
    torch.manual_seed(rows + group + bits)
    w = quant.quantize(torch.randn(32, k) / k**0.5, bits, group, sym)
    x = torch.randn(rows, k).to(dtype)
    want = x.double() @ quant.dequantize(w, torch.float64).T
    torch.testing.assert_close(emulated_product(x, w), want, rtol=1e-5, atol=1e-5)


def test_mma_kernel_compiles_for_hopper_and_orin():
    """Triton's compiler and ptxas (no GPU) take the kernel for sm_90 and sm_87, INT4 and INT8, at
    each warp count and depth its tiles use; every compile gives the PTX's operands the layout it
    is written for; the inner loop reads nothing through shared memory, runs its 16 MMAs a span,
    and spends fewer instructions a weight than the format's other Triton kernels (tiles/sass.json,
    the plan's counts)."""
    from jetserve.engine import plan

    done = compile_for_gpus("mma", timeout=600)
    counted = json.loads(plan.SASS_COUNTS.read_text())["families"]
    lines = done.stdout.splitlines()
    layouts = [line.split() for line in lines if line.startswith("layout ")]
    assert layouts and all(ok == "True" for *_, ok in layouts), layouts
    loops = [line.split() for line in lines if line.startswith("loop ")]
    assert {(line[2], line[4]) for line in loops} >= {(f"int{b}", d) for b in (4, 8) for d in "124"}, loops
    for _, arch, bits, warps, depth, per_weight, mmas, shared in loops:
        # 16 MMAs a span (ptxas may lift a few of them across the loop's back edge)
        assert 12 * int(depth) <= int(mmas) <= 16 * int(depth) and int(shared) == 0, (arch, bits, warps, depth, mmas)
        # fewer instructions a weight than any other kernel of the format (tiles/sass.json)
        others = [n for family, n in counted["sm" + arch[3:]][bits].items() if family not in ("mma", "tinygemm")]
        assert float(per_weight) < min(others), (arch, bits, warps, depth, per_weight)


@pytest.mark.parametrize("bits,sym,group,k,rows,dtype", [(4, False, 128, 384, 1, torch.bfloat16),
                                                         (4, True, 256, 1024, 5, torch.bfloat16),
                                                         (4, False, 640, 640, 8, torch.float16),
                                                         (4, False, 128, 256, 13, torch.bfloat16),
                                                         (4, True, 128, 384, 16, torch.float16),
                                                         (8, False, 64, 512, 3, torch.bfloat16),
                                                         (8, True, 320, 320, 8, torch.float16),
                                                         (8, True, 128, 256, 12, torch.bfloat16)])
def test_the_kernel_computes_the_product_in_the_interpreter(bits, sym, group, k, rows, dtype):
    """The kernel's Triton code in Triton's interpreter (the span's MMAs by `_span_reference`, the
    PTX being the first test's): every warp count and K split its tiles take, the splits' partial
    sums added in order (all of them at INT4's K = 1024), depths of 1 to 4 spans a warp, groups
    of one and several spans and one a row, zero points or none, INT4 and INT8, 1 to 16 input
    rows (two input tiles past 8), bf16 and fp16, 48 rows (three programs), each output poisoned
    first, against the fp32 product of the dequantized weights."""
    require_module("triton")
    from jetserve.engine.model.quant_kernels import _mma_tiles, mma_matmul

    torch.manual_seed(k + rows)
    w = quant.quantize(torch.randn(48, k) / k**0.5, bits, group, sym)
    x = torch.randn(rows, k).to(dtype)
    want = x.float() @ quant.dequantize(w, torch.float32).T
    tiles = [t for t in _mma_tiles(rows, w, dtype, torch.device("meta")) if t.split_k <= k // quant.span(bits)]
    assert {t.split_k for t in tiles} >= {1, 2} and {t.warps for t in tiles} >= {2, 4}
    assert {t.block_k // 128 for t in tiles} >= ({1, 2} if rows > 8 else {1, 2, 4})
    for tile in tiles:
        out = torch.full((rows, 48), float("nan"), dtype=dtype)
        got = mma_matmul(tile, x, w, out)
        assert got is out
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2, msg=str(tile))


def test_an_mma_tile_runs_the_prologue_apart():
    """A product with a fused prologue (SiLU·up, residual add + RMSNorm) through an MMA tile runs the
    prologue as its own kernel first, whatever the tile says: the MMA kernel reads its inputs
    straight into the operand and fuses none (Triton's interpreter, against torch)."""
    require_module("triton")
    from jetserve.engine.model.kernels import ADD_NORM, SILU_MUL
    from jetserve.engine.model.quant_kernels import MMA_TILES, quant_matmul

    torch.manual_seed(3)
    w = quant.quantize(torch.randn(32, 256) / 16, 4, 128, False)
    dense = quant.dequantize(w, torch.float32)
    tile = MMA_TILES[0]._replace(apart=False)  # as a table could store it for a plain product
    x2 = torch.randn(3, 512).to(torch.bfloat16)
    want = (torch.nn.functional.silu(x2[:, :256].float()) * x2[:, 256:].float()) @ dense.T
    torch.testing.assert_close(quant_matmul(tile, SILU_MUL, x2, w).float(), want, rtol=3e-2, atol=3e-2)
    x, residual = torch.randn(3, 256).to(torch.bfloat16), torch.randn(3, 256).to(torch.bfloat16)
    norm = (torch.rand(256) + 0.5).to(torch.bfloat16)
    out, res_out = quant_matmul(tile, ADD_NORM, x, w, residual, norm, 1e-6)
    h = x.float() + residual.float()
    torch.testing.assert_close(res_out.float(), h, rtol=1e-2, atol=1e-2)
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()
    torch.testing.assert_close(out.float(), normed @ dense.T, rtol=3e-2, atol=3e-2)


def test_the_kernels_domain():
    """Which projections the kernel takes (the span layout's, on a GPU): INT4 or INT8 of 16-bit
    inputs, 16 rows a warp, groups of whole spans (128 columns; INT8 64) or one a row."""
    require_module("triton")
    from jetserve.engine.model.mma_kernels import takes

    for bits, group, n, k, dtype in [(4, 128, 32, 256, torch.bfloat16), (4, 256, 32, 256, torch.float16),
                                     (4, 384, 32, 384, torch.bfloat16), (8, 64, 32, 192, torch.bfloat16),
                                     (8, 192, 32, 192, torch.float16), (8, 128, 16, 256, torch.bfloat16)]:
        assert takes(bits, group, n, k, dtype), (bits, group, n, k, dtype)
    for bits, group, n, k, dtype in [(4, 64, 32, 256, torch.bfloat16), (4, 192, 32, 384, torch.bfloat16),
                                     (4, 128, 40, 256, torch.bfloat16), (4, 128, 32, 192, torch.bfloat16),
                                     (4, 128, 32, 256, torch.float32), (8, 32, 32, 256, torch.bfloat16),
                                     (8, 64, 32, 96, torch.bfloat16), (2, 128, 32, 256, torch.bfloat16),
                                     (16, 128, 32, 256, torch.bfloat16)]:
        assert not takes(bits, group, n, k, dtype), (bits, group, n, k, dtype)


def test_mma_tiles_need_a_gpu():
    """Without compiled PTX (the interpreter, a CPU) no MMA tile is offered: the other tiles
    serve every shape there."""
    require_module("triton")
    from jetserve.engine.model.quant_kernels import fitting_tiles

    w = quant.quantize(torch.randn(64, 256), 4, 128, False)
    tiles = fitting_tiles(1, w)
    assert tiles and not any(t.mma for t in tiles)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel itself needs a GPU")
@pytest.mark.parametrize("bits,sym,group", [(4, False, 128), (4, True, 128), (4, False, 640), (8, True, 640),
                                             (8, False, 128)])
def test_mma_kernel_on_a_gpu(bits, sym, group):
    """Every MMA tile against fp32, fresh random inputs, outputs poisoned first: INT4 and INT8, 1 to
    16 rows, bf16 and fp16, K whole and split."""
    from jetserve.engine.model.quant_kernels import _mma_tiles, mma_matmul

    device = torch.device("cuda")
    torch.manual_seed(group + bits)
    w = quant.quantize(torch.randn(272, 640, device=device) / 640**0.5, bits, group, sym)
    ref_w = quant.dequantize(w, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        for rows in (1, 2, 7, 8, 9, 16):
            x = torch.randn(rows, 640, device=device, dtype=dtype)
            want = x.float() @ ref_w.T
            tiles = _mma_tiles(rows, w, dtype, device)
            assert tiles
            for tile in tiles:
                out = torch.full((rows, 272), float("nan"), dtype=dtype, device=device)
                got = mma_matmul(tile, x, w, out).float()
                assert ((got - want).norm() / want.norm()).item() < 1e-2, (tile, dtype, rows)
