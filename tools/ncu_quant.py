"""Launch quantized products for Nsight Compute: each "shape name method=Tile(...)" argument
twice, outside a graph (bench/results/quant-gemv-h200/NOTES.md has the command).

    ncu --section SpeedOfLight ... -k regex:quant_ python3 tools/ncu_quant.py "qwen3-4b down int4=Tile(4,128,4)"
"""
import sys

import torch

from jetserve.bench.quant import operands, shape_projections
from jetserve.engine.model.kernels import Tile
from jetserve.engine.model.quant_kernels import quant_matmul

for spec in sys.argv[1:]:
    key, tile = spec.split("=", 1)
    shape, name, method = key.split()
    p, n, k = shape_projections(shape)[name]
    x, w, residual, norm = operands(p, n, k, method, torch.device("cuda"), 1)
    t = eval(tile, {"Tile": Tile})  # noqa: S307
    for _ in range(2):
        quant_matmul(t, p, x, w, residual, norm, 1e-6)
    torch.cuda.synchronize()
    print(spec, flush=True)
