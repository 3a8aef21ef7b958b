"""Issue 29 on the H200: the tensor-core W4A16/W8A16 kernel's candidates (quant_kernels.DOT_TILES)
timed beside the shipped sm90 table's choice for the same product (bf16, INT8, INT4), Qwen3 4B
and 0.6B projections, 1/2/4/8 rows, each timed as the start-up tuning does (CUDA graph over cold
copies of the weight), every kernel against fp32 (fresh random inputs, output poisoned first).
Prints a table; writes $OUT/dot.json (per shape key: ms per tile) for the shipped table's rows."""

import json
import os
import sys
import time

import torch

from jetserve.engine.config import ON_THE_FLY
from jetserve.bench.quant import _relative_error, operands, precompile, shape_projections
from jetserve.engine.model import kernels, quant
from jetserve.engine.model.kernels import FusedKernels, Tile, cold_copies, graph_time
from jetserve.engine.model.quant_kernels import QuantFusedKernels, fitting_tiles, quant_matmul
from jetserve.engine.model.tile_cache import shape_key
from jetserve.engine.model.tile_tables import shipped

OUT = os.environ.get("OUT", "/tmp/out")
# "shape:rows,rows;shape:rows": which products and row counts
plan = {s.split(":")[0]: [int(r) for r in s.split(":")[1].split(",")]
        for s in (sys.argv[1] if len(sys.argv) > 1 else "qwen3-4b:1,2,4,8;qwen3-0.6b:1,2,4,8").split(";")}
shapes = list(plan)
dev = torch.device("cuda")
table = shipped("sm90")
began = time.time()
variants = []
for shape in shapes:
    for name, (prologue, n, k) in shape_projections(shape).items():
        if name == "lm_head":
            continue
        for rows in plan[shape]:
            for method in ("int8", "int4"):
                w = quant.quantize(torch.zeros(1, k), *ON_THE_FLY[method])
                variants += [(method, prologue, k, rows, t) for t in fitting_tiles(rows, w, prologue, True) if t.dot and t.pdl]
precompile(sorted(set(variants), key=str), "dot kernels")
print(f"[dot] compiled {len(set(variants))} in {time.time() - began:.0f} s", flush=True)
result = {}
path = os.path.join(OUT, "dot.json")
for shape in shapes:
    for name, (prologue, n, k) in shape_projections(shape).items():
        if name == "lm_head":
            continue
        for rows in plan[shape]:
            line = {}
            for method in ("bf16", "int8", "int4"):
                x, weight, residual, norm = operands(prologue, n, k, method, dev, rows)
                fused = (FusedKernels if method == "bf16" else QuantFusedKernels)(table=table)
                fused.skinny_matmul(prologue, x, weight, residual, norm, 1e-6)
                (key, shipped_tile), = fused.chosen.items()
                copies = cold_copies(weight) if method == "bf16" else [weight._replace(qweight=q) for q in
                                                                      cold_copies(weight.qweight)]
                run = (lambda t, w: kernels._run(t, prologue, x, w, residual, norm, 1e-6)) if method == "bf16" else (
                    lambda t, w: quant_matmul(t, prologue, x, w, residual, norm, 1e-6))
                times = {str(shipped_tile): graph_time([lambda w=w: run(shipped_tile, w) for w in copies])}
                if method != "bf16":
                    dense = quant.dequantize(weight, torch.float32)
                    for t in fitting_tiles(rows, weight, prologue, True):
                        if not (t.dot and t.pdl):
                            continue
                        try:
                            times[str(t)] = graph_time([lambda w=w, t=t: run(t, w) for w in copies])
                        except Exception as exc:  # noqa: BLE001
                            print(f"[dot] {shape} {name} {rows} {t}: {type(exc).__name__} {str(exc)[:200]}", flush=True)
                            continue
                    best = min((v, t) for t, v in times.items() if "dot=True" in t)[1]
                    tile = eval(best, {"Tile": Tile})  # noqa: S307 - our own repr
                    torch.full((1 << 26,), float("nan"), device=dev)  # freed: the next outputs start poisoned
                    line[method + "_err"] = _relative_error(lambda *a: quant_matmul(tile, *a), prologue, x, weight,
                                                            residual, norm)
                result[shape_key(key)] = times
                line[method] = times
            def best(m, dot):
                c = {t: v for t, v in line[m].items() if ("dot=True" in t) == dot}
                return min(c.values()) * 1e3 if c else float("nan")
            print(f"[dot] {shape} {name:8} rows {rows}: bf16 {best('bf16', False):6.1f} | int8 shipped "
                  f"{best('int8', False):6.1f} dot {best('int8', True):6.1f} | int4 shipped {best('int4', False):6.1f} "
                  f"dot {best('int4', True):6.1f} µs, dot error {line.get('int8_err')} / {line.get('int4_err')} "
                  f"({time.time() - began:.0f} s)", flush=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=0)
