"""Instructions a weight in the tensor-core quantized kernel's loop (quant_kernels._quant_dot_kernel)
for INT8 (one group a row) with its prologue fused: add + RMSNorm (the gate·up product, K = 2560)
and SiLU·up (the down product, K = 9728), by input rows 2, 4, 8, 16; tile (64, 16, 4) split 4 ways
and pipelined (stages 3), and unsplit with the register prefetch (stages 0). Compiled here, no GPU:
tools/sass_count.py's method.

    python3 bench/results/dot-int8-inputs-sass/prologues.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import sass_count  # noqa: E402
import triton  # noqa: E402

from jetserve.engine.model import quant_kernels as qk  # noqa: E402
from jetserve.engine.model.kernels import Tile  # noqa: E402


def per_weight(arch, rows, k, norm, add, silu, tile, bits=8):
    block_m = triton.next_power_of_2(rows)
    ptrs = {"x_ptr": "*bf16", "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp32",
            "z_ptr": "*fp32", "out_ptr": "*bf16", "res_out_ptr": "*bf16", "M": "i32", "N": "i32", "eps": "fp32"}
    kw = k * bits // 32
    kw_split = kw if tile.split_k == 1 else triton.cdiv(triton.cdiv(kw, tile.split_k), tile.block_k) * tile.block_k
    meta = dict(K=k, NORM=norm, ADD=add, SILU=silu, BITS=bits, GROUP=k, HAS_ZEROS=False, BLOCK_N=tile.block_n,
                BLOCK_W=tile.block_k, NORM_BLOCK=1024 // block_m, KW_SPLIT=kw_split, PDL=False, PREFETCH=False,
                BLOCK_M=block_m, DOT_M=max(block_m, 16), INTERPRETED=False, STAGES=tile.stages)
    compiled = sass_count.compile_sass(qk._quant_dot_kernel, ptrs, meta, arch, tile.warps)
    return sass_count.loop_count(compiled, tile.block_n * tile.block_k * (32 // bits) // (32 * tile.warps)).per_weight


for arch in (90, 87):
    for name, (norm, add, silu, k) in {"add + norm (gate·up)": (True, True, False, 2560),
                                       "SiLU·up (down)": (False, False, True, 9728)}.items():
        for tile in (Tile(64, 16, 4, 4, dot=True, stages=3), Tile(64, 16, 4, dot=True)):
            counts = [per_weight(arch, rows, k, norm, add, silu, tile) for rows in (2, 4, 8, 16)]
            print(f"| sm_{arch} | {name} | {tile.stages} | " + " | ".join(f"{c:.2f}" for c in counts) + " |", flush=True)
