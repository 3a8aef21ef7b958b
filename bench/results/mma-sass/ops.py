"""The MMA kernel's inner loops by opcode (ops.txt); run from the repository root."""
import sys

sys.path.insert(0, "tools")
import sass_count as sc  # noqa: E402
from jetserve.engine.model import mma_kernels as mk  # noqa: E402
for arch in (90, 87):
    for warps, zeros, group in ((4, True, 128), (1, True, 128), (4, False, 2560)):
        c = sc.compile_sass(mk._int4_mma_kernel, dict(x_ptr="*bf16", qw_ptr="*i32", s_ptr="*fp32", z_ptr="*u8", out_ptr="*bf16", M="i32", N="i32"),
                            dict(K=2560, GROUP=group, HAS_ZEROS=zeros, WARPS=warps, SPANS_SPLIT=20, INPUT_TILES=1, PDL=arch==90, INTERPRETED=False), arch, warps)
        n = sc.loop_count(c, 16 * 128 // 32 * 1)  # a thread: 2 rows x 4 words x 8 weights = 64 weights an iteration
        n = n._replace(weights=64)
        print(arch, warps, zeros, group, "instr/iter", n.instructions, "per weight %.2f" % n.per_weight, "regs", c.registers, n.ops.most_common(12))
