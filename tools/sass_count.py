"""Instructions a weight in a quantized product's inner loop, read from the SASS Triton compiles.

Compiles a kernel of engine/model/quant_kernels.py for a GPU family without a GPU (Triton's
compiler and the ptxas/cuobjdump its wheel bundles), finds the innermost loop (the code between a
label and the backward branch to it, the longest such run) and divides its instructions by the
weights one thread multiplies in an iteration. Decode is bound by the bytes of weights or by the
instructions spent on them, whichever is slower; this is the second number.

A kernel is compiled as a launch compiles it: pointer arguments 16-byte aligned (the JIT
specializes on it: torch's allocations are), so loads are vectorized and Triton's pipeline
(Tile.stages) can copy them asynchronously; without that the listing has scalar loads no launch
runs. Beside the count: registers and shared memory a program (from the cubin), so how many
programs an SM holds, and whether the loop's loads are asynchronous copies (cp.async, LDGSTS).

    python tools/sass_count.py [--arch 90 87]     # a table of the kernels' counts
    python tools/sass_count.py --write            # engine/model/tiles/sass.json, for `jetserve plan`
    python tools/sass_count.py --torch-lib DIR/torch/lib/libtorch_cuda.so [--write]

With --torch-lib (a CUDA build's, unpacked from its wheel), also the loop of torch's W4A16 kernel
(`_weight_int4pack_mm`, tinygemm), which the engine's big INT4 projections take (model/int4pack.py):
its SASS as shipped in that library, read with the cuobjdump Triton bundles. The x86 wheels carry
sm_86 but no sm_87 code; sm_86's stands for Orin's (one Ampere instruction set).
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter
from typing import NamedTuple

# Triton's listing (control codes, a tab, the instruction; labels LBBn) or cuobjdump's (/*addr*/, .L_x_n).
_LABEL = re.compile(r"^\s*(\.L_x_\d+|LBB\d+):")
_INSTR = re.compile(r"^(?:[0-9a-fA-F-]{2}:\S:\S:\S:\d+\t|\s*/\*[0-9a-f]{4,}\*/\s+)(?:@!?U?P\w+\s+)?"
                    r"([A-Z][A-Z0-9_.]*)(.*?);")
_TARGET = re.compile(r"(\.L_x_\d+|LBB\d+)")


class LoopCount(NamedTuple):
    instructions: int  # in the innermost loop's body, once per iteration
    weights: int  # a thread multiplies an iteration
    ops: Counter  # instructions by opcode (without modifiers)
    registers: int = 0  # a thread's
    shared: int = 0  # bytes of shared memory a program
    asynchronous: bool = False  # the loop copies global to shared memory (cp.async: LDGSTS)

    @property
    def per_weight(self) -> float:
        return self.instructions / self.weights


class Compiled(NamedTuple):
    sass: str
    registers: int
    shared: int


def inner_loop(sass: str) -> list[str]:
    """The opcodes of the longest run between a label and a backward branch to it."""
    code: list[tuple[str, str]] = []  # (opcode, operands) with labels as ("", name)
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            code.append(("", m.group(1)))
        elif m := _INSTR.match(line):
            code.append((m.group(1), m.group(2)))
    seen: dict[str, int] = {}
    best: list[str] = []
    for i, (op, rest) in enumerate(code):
        if op == "":
            seen[rest] = i
        elif op.startswith("BRA") and (target := _TARGET.search(rest)) and target.group(1) in seen:
            body = [o for o, _ in code[seen[target.group(1)]:i + 1] if o and o != "NOP"]
            if len(body) > len(best):
                best = body
    return best


def compile_kernel(kernel, signature: dict, constexprs: dict, arch: int, num_warps: int):
    """`kernel` compiled for sm_`arch` here (no GPU needed), as a launch with 16-byte aligned
    tensors compiles it: Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {name: signature.get(name, "constexpr") for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if sig[name].startswith("*")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, static + dynamic shared bytes a program) of a one-kernel cubin, as
    cuobjdump reports them (CompiledKernel reads them only when it loads on a GPU)."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_cuobjdump(), "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?SHARED:(\d+)", usage)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_sass(kernel, signature: dict, constexprs: dict, arch: int, num_warps: int) -> Compiled:
    """SASS and resources of `kernel` for sm_`arch`, compiled as `compile_kernel` does."""
    compiled = compile_kernel(kernel, signature, constexprs, arch, num_warps)
    registers, shared = resources(compiled.asm["cubin"])
    return Compiled(compiled.asm["sass"], registers, max(shared, compiled.metadata.shared))


def loop_count(compiled: Compiled, weights: int) -> LoopCount:
    body = inner_loop(compiled.sass)
    return LoopCount(len(body), weights, Counter(op.split(".")[0] for op in body), compiled.registers,
                     compiled.shared, any(op.startswith("LDGSTS") for op in body))


def quant_loop(tile, bits: int, group: int, has_zeros: bool, k: int, rows: int = 1, arch: int = 90,
               dtype: str = "bf16") -> LoopCount:
    """The inner loop of the quantized kernel `tile` runs (quant_kernels.quant_matmul's choice),
    a plain product (no prologue) over K = k."""
    import triton

    from jetserve.engine.model import quant_kernels as qk

    block_m = triton.next_power_of_2(rows)
    kw = k * bits // 32
    kw_split = kw if tile.split_k == 1 else triton.cdiv(triton.cdiv(kw, tile.split_k), tile.block_k) * tile.block_k
    ptrs = {"x_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "norm_w_ptr": f"*{dtype}", "qw_ptr": "*i32",
            "s_ptr": "*fp32", "z_ptr": "*u8" if has_zeros else "*fp32", "out_ptr": f"*{dtype}",
            "res_out_ptr": f"*{dtype}", "M": "i32", "N": "i32", "eps": "fp32", "low_bits": "i32"}
    meta = dict(K=k, NORM=False, ADD=False, SILU=False, BITS=bits, GROUP=group, HAS_ZEROS=has_zeros,
                BLOCK_N=tile.block_n, BLOCK_W=tile.block_k, NORM_BLOCK=1024, KW_SPLIT=kw_split, PDL=False,
                PREFETCH=tile.prefetch)
    if tile.dot:
        kernel = qk._quant_dot_kernel
        meta.update(BLOCK_M=block_m, DOT_M=max(block_m, 16), INTERPRETED=False, STAGES=tile.stages)
    elif tile.one_row:
        kernel = qk._quant_gemv_kernel
        meta.update(EVEN_N=True, STAGES=tile.stages)
    else:
        kernel = qk._quant_skinny_kernel
        meta.update(BLOCK_M=block_m)
    fields = 32 // bits
    return loop_count(compile_sass(kernel, ptrs, meta, arch, tile.warps),
                      tile.block_n * tile.block_k * fields // (32 * tile.warps))


def bf16_loop(tile, k: int, rows: int = 1, arch: int = 90) -> LoopCount:
    """The inner loop of the float skinny product (model/kernels.py) in `tile`, bf16, plain."""
    import triton

    from jetserve.engine.model import kernels

    ptrs = {"x_ptr": "*bf16", "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "res_out_ptr": "*bf16", "M": "i32", "N": "i32", "eps": "fp32"}
    meta = dict(K=k, NORM=False, ADD=False, SILU=False, DOT=tile.dot, IEEE=False, BLOCK_M=triton.next_power_of_2(rows),
                BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, K_SPLIT=k, PDL=False, STAGES=tile.stages,
                PREFETCH=tile.prefetch)
    return loop_count(compile_sass(kernels._skinny_matmul_kernel, ptrs, meta, arch, tile.warps),
                      tile.block_n * tile.block_k // (32 * tile.warps))


_ADDRESSED = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
TINYGEMM = "tinygemm_m16n8k16_chunk_kernel"
TINYGEMM_VARIANT = "BLayout_TC_int4ILi8ELi128EE"  # inner k-tiles 8, groups of 128: what int4pack packs


def addressed_loop(sass: str) -> list[str]:
    """inner_loop for a library's listing, whose branches name addresses: the opcodes between a
    backward branch's target and the branch, the longest such run."""
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_ADDRESSED.match, sass.splitlines()) if m]
    best: list[str] = []
    for at, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < at:
            body = [o for a, o, _ in code if int(target.group(1), 16) <= a <= at and o != "NOP"]
            best = body if len(body) > len(best) else best
    return best


def tinygemm_counts(torch_lib: str, archs=(90, 86)) -> dict[int, LoopCount]:
    """The main loop of torch's W4A16 kernel for each arch in a CUDA build's libtorch_cuda.so. A
    thread's weights an iteration: 4 for each HMMA.16816 it issues (a B fragment is 8 x 16
    weights over a warp's 32 threads)."""
    import subprocess
    import tempfile

    cuobjdump = _cuobjdump()
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([cuobjdump, "-xelf", "all", os.path.abspath(torch_lib)], cwd=tmp, check=True,
                       capture_output=True)
        for name in sorted(os.listdir(tmp)):
            arch = int(re.search(r"sm_(\d+)", name).group(1)) if "sm_" in name else None
            if arch not in archs or arch in counts:
                continue
            path = os.path.join(tmp, name)
            with open(path, "rb") as f:
                if TINYGEMM.encode() not in f.read():
                    continue
            sass = subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout
            for function in re.split(r"\n\s*Function : ", sass)[1:]:
                if TINYGEMM in function.split("\n", 1)[0] and TINYGEMM_VARIANT in function.split("\n", 1)[0]:
                    body = addressed_loop(function)
                    ops = Counter(o.split(".")[0] for o in body)
                    counts[arch] = LoopCount(len(body), 4 * ops["HMMA"], ops)
    return counts


def mma_loop(bits: int = 4, k: int = 2560, warps: int = 4, depth: int = 1, arch: int = 90) -> LoopCount:
    """The quantized MMA kernel's inner loop (model/mma_kernels.py), bf16 inputs, K whole, formats as
    the other kernels are counted (INT4 groups of 128 with zero points, INT8 one group a row,
    symmetric): a thread's iteration is `depth` spans of two rows' four words each."""
    from jetserve.engine.model import mma_kernels

    group, zeros = (128, True) if bits == 4 else (k, False)
    compiled = compile_sass(mma_kernels._quant_mma_kernel,
                            dict(x_ptr="*bf16", qw_ptr="*i32", s_ptr="*fp32", z_ptr="*u8" if zeros else "*fp32",
                                 out_ptr="*bf16", M="i32", N="i32"),
                            dict(K=k, BITS=bits, GROUP=group, HAS_ZEROS=zeros, SLOTS=warps * depth,
                                 SPANS_SPLIT=k * bits // 512, INPUT_TILES=1, PDL=arch >= 90, INTERPRETED=False),
                            arch, warps)
    return loop_count(compiled, 8 * 32 // bits * depth)


def kernel_counts(arch: int) -> dict:
    """Instructions a weight at batch 1 of each weight format's kernels for sm_`arch` (plain
    products, K = 2560): what engine/plan.py projects a board's decode from (tiles/sass.json)."""
    from jetserve.engine.model.kernels import Tile

    fma, dot = Tile(8, 128, 4), Tile(64, 16, 4, dot=True)
    return {"bf16": round(bf16_loop(Tile(4, 1024, 4), 2560, arch=arch).per_weight, 2),
            "int8": {"fma": round(quant_loop(fma, 8, 2560, False, 2560, arch=arch).per_weight, 2),
                     "dot": round(quant_loop(dot, 8, 2560, False, 2560, arch=arch).per_weight, 2),
                     "mma": round(mma_loop(8, arch=arch).per_weight, 2)},
            "int4": {"fma": round(quant_loop(fma, 4, 128, True, 2560, arch=arch).per_weight, 2),
                     "dot": round(quant_loop(dot, 4, 128, True, 2560, arch=arch).per_weight, 2),
                     "mma": round(mma_loop(arch=arch).per_weight, 2)}}


SASS_TABLE = "engine/model/tiles/sass.json"
FAMILIES = {"sm87": 87, "sm90": 90}  # sm_110 (Thor): ptxas-blackwell's listing hides the loop from inner_loop


def main() -> None:
    import json

    from jetserve.engine.model.kernels import Tile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", type=int, default=[90, 87])
    p.add_argument("--write", action="store_true", help=f"write {SASS_TABLE} (every family) instead")
    p.add_argument("--torch-lib", help="a CUDA build's libtorch_cuda.so: count torch's W4A16 kernel too")
    args = p.parse_args()
    tinygemm = tinygemm_counts(args.torch_lib) if args.torch_lib else {}
    for arch, c in sorted(tinygemm.items()):
        top = ", ".join(f"{op} {n}" for op, n in c.ops.most_common(6))
        print(f"sm_{arch} int4 g128, torch's W4A16 kernel (tinygemm): {c.instructions} instructions / {c.weights} "
              f"weights a thread = {c.per_weight:.2f} a weight ({top})", flush=True)
    if args.write:
        import triton

        with open(SASS_TABLE) as f:
            old = json.load(f)
        doc = {"source": f"tools/sass_count.py --write, Triton {triton.__version__}",
               "families": {name: kernel_counts(arch) for name, arch in FAMILIES.items()}}
        for name, arch in FAMILIES.items():  # tinygemm: counted now, else as counted before
            counted = tinygemm.get(arch if arch != 87 else 86)
            before = old["families"].get(name, {}).get("int4", {}).get("tinygemm")
            if counted or before:
                doc["families"][name]["int4"]["tinygemm"] = round(counted.per_weight, 2) if counted else before
        if args.torch_lib:
            version = re.search(r"__version__ = '([^']+)'", open(os.path.join(os.path.dirname(args.torch_lib), "..",
                                                                           "version.py")).read())
            doc["source"] += (f"; tinygemm from torch {version.group(1) if version else '?'}'s libtorch_cuda.so "
                              "(sm_86's for sm87)")
        else:
            doc["source"] = old["source"] if "tinygemm" in old["source"] else doc["source"]
        with open(SASS_TABLE, "w") as f:
            f.write(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc))
        return
    cases = [  # (label, tile, bits (16: bf16), group, zeros, K[, input rows: 1])
        ("bf16, FMA tile (4,1024,4)", Tile(4, 1024, 4), 16, 0, False, 2560),
        ("bf16, FMA tile (4,1024,4), 3 stages, K 9728", Tile(4, 1024, 4, stages=3), 16, 0, False, 9728),
        ("bf16, dot (64,128,4), 16 rows", Tile(64, 128, 4, dot=True), 16, 0, False, 2560),
        ("bf16, dot (64,128,4), 16 rows, 3 stages", Tile(64, 128, 4, dot=True, stages=3), 16, 0, False, 2560),
        ("int4 g128 asym, FMA tile (8,128,4)", Tile(8, 128, 4), 4, 128, True, 2560),
        ("int4 g128 asym, one-row (32,16,2)", Tile(32, 16, 2, one_row=True), 4, 128, True, 2560),
        ("int4 g128 asym, one-row (32,64,4)", Tile(32, 64, 4, one_row=True), 4, 128, True, 2560),
        ("int4 g128 asym, one-row (32,64,4), 3 stages", Tile(32, 64, 4, one_row=True, stages=3), 4, 128, True, 2560),
        ("int4 g128 asym, dot (64,16,4)", Tile(64, 16, 4, dot=True), 4, 128, True, 2560),
        ("int4 g128 asym, dot (64,16,4), 4 stages", Tile(64, 16, 4, dot=True, stages=4), 4, 128, True, 2560),
        ("int4 g128 asym, dot (128,16,4), 4 stages", Tile(128, 16, 4, dot=True, stages=4), 4, 128, True, 2560),
        ("int4 g128 asym, dot (64,16,4), 8 rows", Tile(64, 16, 4, dot=True), 4, 128, True, 2560, 8),
        ("int8 per-row sym, FMA tile (8,128,4)", Tile(8, 128, 4), 8, 2560, False, 2560),
        ("int8 per-row sym, one-row (32,64,4)", Tile(32, 64, 4, one_row=True), 8, 2560, False, 2560),
        ("int8 per-row sym, one-row (32,64,4), 3 stages", Tile(32, 64, 4, one_row=True, stages=3), 8, 2560, False,
         2560),
        ("int8 per-row sym, dot (64,16,4)", Tile(64, 16, 4, dot=True), 8, 2560, False, 2560),
        ("int8 per-row sym, dot (64,16,4), 4 stages", Tile(64, 16, 4, dot=True, stages=4), 8, 2560, False, 2560),
        ("int8 per-row sym, dot (64,16,4), 8 rows", Tile(64, 16, 4, dot=True), 8, 2560, False, 2560, 8),
    ]
    print("kernel | instructions a weight | registers | shared KB | cp.async | programs an SM | weight KB in flight an SM")
    for arch in args.arch:
        for bits, label in ((4, "int4 g128 asym"), (8, "int8 per-row sym")):
            for depth in (1, 2, 4):
                c = mma_loop(bits, depth=depth, arch=arch)
                top = ", ".join(f"{op} {n}" for op, n in c.ops.most_common(5))
                # in flight: a step's spans of 16 rows' 64 bytes a warp, the next step's loaded while it multiplies
                print(f"sm_{arch} {label}, MMA (16 rows a warp, 4 warps, depth {depth}) | {c.per_weight:.2f} "
                      f"({c.instructions}/{c.weights}: {top}) | {c.registers} | {c.shared / 1024:.1f} | no | "
                      f"{programs_an_sm(c, 4, arch)} | {programs_an_sm(c, 4, arch) * 4 * depth}",
                      flush=True)
        for label, tile, bits, group, zeros, k, *rows in cases:
            if bits == 16:
                c = bf16_loop(tile, k, rows=16 if tile.dot else 1, arch=arch)
            else:
                c = quant_loop(tile, bits, group, zeros, k, rows=rows[0] if rows else 1, arch=arch)
            programs = programs_an_sm(c, tile.warps, arch)
            step = tile.block_n * tile.block_k * (2 if bits == 16 else 4)  # bytes of weights a step
            # steps requested ahead: the pipeline's, else the register prefetch's (the one-row kernel's two
            # for formats with groups, quant_kernels._quant_gemv_kernel's AHEAD)
            ahead = tile.stages - 1 if tile.stages else 2 if tile.one_row and group != k else 1
            flight = programs * step * ahead
            top = ", ".join(f"{op} {n}" for op, n in c.ops.most_common(5))
            print(f"sm_{arch} {label} | {c.per_weight:.2f} ({c.instructions}/{c.weights}: {top}) | {c.registers} | "
                  f"{c.shared / 1024:.1f} | {'yes' if c.asynchronous else 'no'} | {programs} | {flight / 1024:.0f}",
                  flush=True)


# An SM's registers and shared memory (sm_90: Hopper; sm_87: Orin's Ampere), and the most programs
# (thread blocks) it holds: what bounds how many of a kernel's programs, so how many bytes of
# weights requested ahead, an SM keeps at once (the grid permitting).
SM_LIMITS = {90: (65536, 228 * 1024, 32), 87: (65536, 164 * 1024, 16)}


def programs_an_sm(count: LoopCount, warps: int, arch: int) -> int:
    registers, shared, most = SM_LIMITS.get(arch, SM_LIMITS[87])
    by_registers = registers // (max(8, -(-count.registers // 8) * 8) * 32 * warps)
    by_shared = shared // (count.shared + 1024) if count.shared else most  # 1 KB a block the driver keeps
    return max(0, min(by_registers, by_shared, most))


if __name__ == "__main__":
    main()
