"""Where the MMA kernel's one-row time goes: the kernel as is, without the sums' MMAs, without any
MMA (loads and conversion only), and loads only (the PTX takes the words and returns zeros)."""
import os
import sys

import torch
import triton.language as tl

from jetserve.engine.model import mma_kernels, quant
from jetserve.engine.model.kernels import Tile, cold_copies, graph_time
from jetserve.engine.model.quant_kernels import mma_matmul

mode = sys.argv[1]
text = mma_kernels._asm(False, 4)
text8 = mma_kernels._asm(False, 8)
def strip(t, drop):
    out = []
    for line in t.splitlines():
        if drop == "sums" and "{ones,ones,ones,ones}" in line:
            continue
        if drop == "loads" and line.startswith(("mma.sync", "lop3", "shr", "prmt", "fma")):
            continue
        if drop == "loads" and line == "}":  # the words consumed, so they are loaded
            out += ["xor.b32 t, $8, $9;"] + [f"xor.b32 t, t, ${i};" for i in range(10, 16)] + ["mov.b32 $0, t;"]
        out.append(line)
    return "\n".join(out)
if mode != "full":
    mma_kernels._ASM_BF16 = tl.constexpr(strip(text, mode))
    mma_kernels._ASM8_BF16 = tl.constexpr(strip(text8, mode))
dev = torch.device("cuda")
tiles = [Tile(16, 128, 4, 1, apart=True, pdl=True, mma=True), Tile(16, 128, 4, 2, apart=True, pdl=True, mma=True),
         Tile(16, 256, 4, 1, apart=True, pdl=True, mma=True), Tile(16, 128, 2, 1, apart=True, pdl=True, mma=True),
         Tile(16, 128, 8, 1, apart=True, pdl=True, mma=True)]
for bits, (n, k) in [(4, (19456, 2560)), (4, (6144, 2560)), (4, (2560, 9728)), (8, (19456, 2560))]:
    torch.manual_seed(0)
    w = quant.quantize(torch.randn(n, k, device=dev) / k**0.5, bits, 128 if bits == 4 else k, bits == 8)
    mb = w.qweight.numel() * 4 / 1e6
    for m in (1, 4):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        res = []
        for t in tiles:
            us = graph_time([lambda c=c: mma_matmul(t, x, w._replace(qweight=c), out) for c in cold_copies(w.qweight)]) * 1e3
            res.append(f"w{t.warps}d{t.block_k // 128}s{t.split_k} {us:6.2f}")
        best = min(float(r.split()[-1]) for r in res)
        print(f"[exp] {mode:5} int{bits} {n}x{k} rows {m}: best {best:6.2f} us {mb / best:5.2f} TB/s | " + " | ".join(res), flush=True)
