"""Does capping registers (more warps a scheduler) speed the shipped quantized products at batch 1?"""
import os
import torch
from jetserve.bench.quant import operands, shape_projections
from jetserve.engine.model import quant_kernels
from jetserve.engine.model.kernels import cold_copies, graph_time
from jetserve.engine.model.quant_kernels import QuantFusedKernels, quant_matmul
from jetserve.engine.model.tile_tables import shipped

orig = quant_kernels.launch
CAP = {"reg": None}
def capped(kernel, grid, pdl, *args, **meta):
    if CAP["reg"]:
        meta["maxnreg"] = CAP["reg"]
    return orig(kernel, grid, pdl, *args, **meta)
quant_kernels.launch = capped
table = shipped("sm90")
dev = torch.device("cuda")
for shape in ("qwen3-4b", "qwen3-0.6b"):
    for name, (p, n, k) in shape_projections(shape).items():
        if name == "lm_head":
            continue
        for method in ("int4", "int8"):
            x, w, res, norm = operands(p, n, k, method, dev, 1)
            f = QuantFusedKernels(table=table)
            f.skinny_matmul(p, x, w, res, norm, 1e-6)
            (_, tile), = f.chosen.items()
            copies = [w._replace(qweight=q) for q in cold_copies(w.qweight)]
            row = []
            for reg in (None, 40, 48, 56, 64, 80):
                CAP["reg"] = reg
                try:
                    t = graph_time([lambda c=c: quant_matmul(tile, p, x, c, res, norm, 1e-6) for c in copies])
                    row.append(f"{reg}:{t * 1e3:.2f}")
                except Exception as e:  # noqa: BLE001
                    row.append(f"{reg}:ERR {type(e).__name__}")
            print(shape, name, method, str(tile)[4:60], " ".join(row), flush=True)
