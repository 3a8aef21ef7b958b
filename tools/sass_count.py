"""Instructions a weight in a quantized product's inner loop, read from the SASS Triton compiles.

Compiles a kernel of engine/model/quant_kernels.py for a GPU family without a GPU (Triton's
compiler and the ptxas/cuobjdump its wheel bundles), finds the innermost loop (the code between a
label and the backward branch to it, the longest such run) and divides its instructions by the
weights one thread multiplies in an iteration. Decode is bound by the bytes of weights or by the
instructions spent on them, whichever is slower; this is the second number.

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

    @property
    def per_weight(self) -> float:
        return self.instructions / self.weights


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


def compile_sass(kernel, signature: dict, constexprs: dict, arch: int, num_warps: int) -> str:
    """SASS of `kernel` for sm_`arch`, compiled here (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {name: signature.get(name, "constexpr") for name in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return compiled.asm["sass"]


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
                BLOCK_N=tile.block_n, BLOCK_W=tile.block_k, NORM_BLOCK=1024, KW_SPLIT=kw_split, PDL=False)
    if tile.dot:
        kernel = qk._quant_dot_kernel
        meta.update(BLOCK_M=block_m, DOT_M=max(block_m, 16), INTERPRETED=False)
    elif tile.one_row:
        kernel = qk._quant_gemv_kernel
        meta.update(EVEN_N=True)
    else:
        kernel = qk._quant_skinny_kernel
        meta.update(BLOCK_M=block_m)
    sass = compile_sass(kernel, ptrs, meta, arch, tile.warps)
    body = inner_loop(sass)
    fields = 32 // bits
    weights = tile.block_n * tile.block_k * fields // (32 * tile.warps)
    return LoopCount(len(body), weights, Counter(op.split(".")[0] for op in body))


def bf16_loop(tile, k: int, rows: int = 1, arch: int = 90) -> LoopCount:
    """The inner loop of the float skinny product (model/kernels.py) in `tile`, bf16, plain."""
    import triton

    from jetserve.engine.model import kernels

    ptrs = {"x_ptr": "*bf16", "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "res_out_ptr": "*bf16", "M": "i32", "N": "i32", "eps": "fp32"}
    meta = dict(K=k, NORM=False, ADD=False, SILU=False, DOT=tile.dot, IEEE=False, BLOCK_M=triton.next_power_of_2(rows),
                BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, K_SPLIT=k, PDL=False)
    body = inner_loop(compile_sass(kernels._skinny_matmul_kernel, ptrs, meta, arch, tile.warps))
    return LoopCount(len(body), tile.block_n * tile.block_k // (32 * tile.warps), Counter(o.split(".")[0] for o in body))


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

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
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


def kernel_counts(arch: int) -> dict:
    """Instructions a weight at batch 1 of each weight format's kernels for sm_`arch` (plain
    products, K = 2560): what engine/plan.py projects a board's decode from (tiles/sass.json)."""
    from jetserve.engine.model.kernels import Tile

    fma, dot = Tile(8, 128, 4), Tile(64, 16, 4, dot=True)
    return {"bf16": round(bf16_loop(Tile(4, 1024, 4), 2560, arch=arch).per_weight, 2),
            "int8": {"fma": round(quant_loop(fma, 8, 2560, False, 2560, arch=arch).per_weight, 2),
                     "dot": round(quant_loop(dot, 8, 2560, False, 2560, arch=arch).per_weight, 2)},
            "int4": {"fma": round(quant_loop(fma, 4, 128, True, 2560, arch=arch).per_weight, 2),
                     "dot": round(quant_loop(dot, 4, 128, True, 2560, arch=arch).per_weight, 2)}}


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
    cases = [  # (label, tile, bits, group, zeros, K)
        ("int4 g128 asym, FMA tile (8,128,4)", Tile(8, 128, 4), 4, 128, True, 2560),
        ("int4 g128 asym, one-row (32,16,2)", Tile(32, 16, 2, one_row=True), 4, 128, True, 2560),
        ("int4 g128 asym, dot (64,16,4)", Tile(64, 16, 4, dot=True), 4, 128, True, 2560),
        ("int8 per-row sym, FMA tile (8,128,4)", Tile(8, 128, 4), 8, 2560, False, 2560),
        ("int8 per-row sym, one-row (32,64,4)", Tile(32, 64, 4, one_row=True), 8, 2560, False, 2560),
        ("int8 per-row sym, dot (64,16,4)", Tile(64, 16, 4, dot=True), 8, 2560, False, 2560),
    ]
    for arch in args.arch:
        c = bf16_loop(Tile(4, 1024, 4), 2560, arch=arch)
        print(f"sm_{arch} bf16, FMA tile (4,1024,4): {c.instructions} / {c.weights} = {c.per_weight:.2f} a weight")
        for label, tile, bits, group, zeros, k in cases:
            c = quant_loop(tile, bits, group, zeros, k, arch=arch)
            top = ", ".join(f"{op} {n}" for op, n in c.ops.most_common(6))
            print(f"sm_{arch} {label}: {c.instructions} instructions / {c.weights} weights a thread = "
                  f"{c.per_weight:.2f} a weight ({top})", flush=True)


if __name__ == "__main__":
    main()
