"""Prefill's quantized products on the H200: cuBLAS over the weight dequantized by torch ops
(quant.dequantize, the old path) against the same over one Triton pass
(quant_kernels.dequantized), beside the bf16 product, for the Qwen3 projections in quant.py's
span layout (INT8 per channel, INT4 g128), each timed as the start-up tuning times a tile (CUDA
graph over cold copies of the weight). Prints a table; writes $OUT/dequant.json."""

import json
import os
import sys

import torch
import torch.nn.functional as F

from jetserve.bench.quant import operands, shape_projections
from jetserve.engine.model import kernels, quant
from jetserve.engine.model.kernels import cold_copies, graph_time
from jetserve.engine.model.quant_kernels import dequantized

OUT = os.environ.get("OUT", "/tmp/out")
shapes = (sys.argv[1] if len(sys.argv) > 1 else "qwen3-4b,qwen3-0.6b").split(",")
rows_list = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "64,1024").split(",")]
methods = (sys.argv[3] if len(sys.argv) > 3 else "int8,int4").split(",")
dev = torch.device("cuda")


def main() -> None:
    result = {}
    for shape in shapes:
        for name, (_, n, k) in shape_projections(shape).items():
            if name == "lm_head":
                continue
            for method in methods:
                for m in rows_list:
                    x, w, _, _ = operands(kernels.PLAIN, n, k, method, dev, m)
                    assert torch.equal(dequantized(w, torch.bfloat16), quant.dequantize(w, torch.bfloat16))
                    copies = [w._replace(qweight=c) for c in cold_copies(w.qweight)]
                    dense = cold_copies(quant.dequantize(w, torch.bfloat16))
                    row = {
                        "bf16_us": graph_time([lambda d=d: F.linear(x, d) for d in dense]) * 1e3,
                        "torch_dequant_us": graph_time([lambda c=c: F.linear(x, quant.dequantize(c, x.dtype))
                                                        for c in copies]) * 1e3,
                        "triton_dequant_us": graph_time([lambda c=c: F.linear(x, dequantized(c, x.dtype))
                                                         for c in copies]) * 1e3,
                        "pass_alone_us": graph_time([lambda c=c: dequantized(c, x.dtype) for c in copies]) * 1e3}
                    key = f"{shape} {name} {method} m{m}"
                    result[key] = row
                    print(f"{key:28} " + "  ".join(f"{t} {v:8.2f}" for t, v in row.items()), flush=True)
                    with open(os.path.join(OUT, "dequant.json"), "w") as f:
                        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
