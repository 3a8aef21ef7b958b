"""The tensor-core quantized kernel at 16 rows: before (a7902fa, row sums across threads) and after
(row sums on the tensor cores), same tile, same operands; µs per product, graph over cold copies."""
import importlib.util
import os
import sys

import torch

from jetserve.bench.quant import operands, shape_projections
from jetserve.engine.model import quant, quant_kernels as new
from jetserve.engine.model.kernels import Tile, cold_copies, graph_time

spec = importlib.util.spec_from_file_location("jetserve.engine.model.quant_kernels_old", ".ab/quant_kernels_old.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
cases = [("qwen3-4b", "down", "int8"), ("qwen3-4b", "gate_up", "int8"), ("qwen3-0.6b", "gate_up", "int4"),
         ("qwen3-4b", "qkv", "int8")]
if dev.type == "cpu":
    cases = cases[2:3]
tiles = [Tile(64, 16, 4, 4, apart=True, pdl=dev.type == "cuda", dot=True, stages=3),
         Tile(64, 16, 4, 4, pdl=dev.type == "cuda", dot=True)]
for shape, name, fmt in cases:
    prologue, n, k = shape_projections(shape)[name]
    if dev.type == "cpu":
        n, k = 64, 256
    x, w, res, norm = operands(prologue, n, k, fmt, dev, 16)
    ref = new.quant_matmul(None, prologue, x.float(), quant.QuantizedWeight(*w), None if res is None else res.float(),
                           None if norm is None else norm.float(), 1e-6)
    ref = ref[0] if isinstance(ref, tuple) else ref
    for tile in tiles:
        out = []
        for label, mod in (("before", old), ("after", new)):
            got = mod.quant_matmul(tile, prologue, x, w, res, norm, 1e-6)
            got = got[0] if isinstance(got, tuple) else got
            err = ((got.float() - ref).norm() / ref.norm()).item()
            t = graph_time([lambda c=c: mod.quant_matmul(tile, prologue, x, w._replace(qweight=c), res, norm, 1e-6)
                            for c in cold_copies(w.qweight)]) * 1e3 if dev.type == "cuda" else 0.0
            out.append(f"{label} {t:7.1f} us (err {err:.1e})")
        print(f"[dot16] {shape} {name} {fmt} rows 16 {tuple(tile)[:4]} st{tile.stages}: " + "; ".join(out), flush=True)
