"""Issues 29 and 30 on a GPU: do more weight bytes in flight make the decode products faster?
Two levers against what the engine runs now, product by product: the pipelined tiles
(kernels.Tile.stages, Triton's cp.async software pipeline) and the L2 prefetch (Tile.prefetch: a
program asks for all its weights before it waits for the previous kernel).

For each Qwen3 projection (its fused prologue), weight format (bf16, INT8, INT4) and row count:
the shipped table's tile and its prefetching twin; the fastest pipelined candidate, the fastest
of their register-prefetch twins (the same tiles with stages 0) and the fastest pipelined one
that prefetches; each timed as the tuning times a tile (a CUDA graph over cold copies of the
weight, so each launch follows another product's, as in a step), all compiled at once first; for
INT4 also torch's W4A16 kernel (what the engine's large INT4 projections take,
model/int4pack.py; the product alone, as the engine runs a fused prologue as a kernel of its
own before it), cuBLAS for bf16 and, past one row, for the dequantized weights (the float path
prefill takes: `quant_matmul(None, ...)`, the dequantizing pass included). Every candidate's result is checked against the fp32 product
first. Prints a table; writes $OUT/stream.json. Run from the repository root:

    python3 tools/stream_probe.py [shapes, default qwen3-0.6b,qwen3-4b] [rows, default 1,16]

$STREAM_FORMATS: the weight formats to time (default bf16,int8,int4).
"""

import json
import os
import sys

import torch
import triton

from jetserve.bench.quant import operands, shape_projections
from jetserve.engine.model import int4pack, kernels, parallel_compile, quant
from jetserve.engine.model.kernels import cold_copies, graph_time, pdl_supported
from jetserve.engine.model.quant_kernels import QuantFusedKernels, fitting_tiles, quant_matmul
from jetserve.engine.model.tile_tables import for_device

OUT = os.environ.get("OUT", "/tmp/out")
SHAPES = (sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b,qwen3-4b").split(",")
ROWS = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,16").split(",")]
FORMATS = tuple(os.environ.get("STREAM_FORMATS", "bf16,int8,int4").split(","))
DEV = torch.device("cuda")


def product(tile, prologue, x, w, residual, norm):
    """The engine's product in `tile` (None: cuBLAS), its first output."""
    if isinstance(w, quant.QuantizedWeight):
        out = quant_matmul(tile, prologue, x, w, residual, norm, 1e-6)
    else:
        out = kernels._run(tile, prologue, x, w, residual, norm, 1e-6)
    return out[0] if isinstance(out, tuple) else out


def timed(call, weight) -> float:
    """µs call(weight) takes, replayed from a graph over cold copies of the weight."""
    if isinstance(weight, quant.QuantizedWeight):
        return graph_time([lambda c=c: call(weight._replace(qweight=c)) for c in cold_copies(weight.qweight)]) * 1e3
    return graph_time([lambda c=c: call(c) for c in cold_copies(weight)]) * 1e3


def main() -> None:
    pdl = pdl_supported(DEV)
    table = for_device(DEV)
    rows_out = []
    for shape in SHAPES:
        for name, (prologue, n, k) in shape_projections(shape).items():
            for fmt in [f for f in FORMATS if name != "lm_head" or f == "bf16"]:
                for m in ROWS:
                    x, w, residual, norm = operands(prologue, n, k, fmt, DEV, m)
                    quantized = isinstance(w, quant.QuantizedWeight)
                    if quantized and 1 < m <= int4pack.MAX_ROWS and int4pack.applies(w.bits, w.group_size, n, k,
                                                                                     torch.bfloat16, DEV):
                        continue  # the engine takes tinygemm here, never a tile (one row: timed against them)
                    if quantized:
                        tiles, shipped = fitting_tiles(m, w, prologue, pdl), QuantFusedKernels(table=table)
                    else:
                        tiles = kernels.candidate_tiles(triton.next_power_of_2(m), prologue, pdl)[1:]
                        shipped = kernels.FusedKernels(table=table)
                    shipped.skinny_matmul(prologue, x, w, residual, norm, 1e-6)
                    ships = next(iter(shipped.chosen.values()))  # None: cuBLAS, or the float path
                    # the pipelined candidates, each one's register-prefetch twin and prefetching twin, and the
                    # shipped tile's prefetching twin, as this GPU launches them
                    staged = [t for t in tiles if t.stages and t.pdl == pdl and not t.prefetch]
                    twins = [t._replace(stages=0) for t in staged] + [t._replace(prefetch=True) for t in staged]
                    if ships is not None:
                        twins.append(ships._replace(prefetch=True))
                    tiles = list(dict.fromkeys(staged + [t for t in twins if t in tiles]))
                    with parallel_compile.compile_only():  # every candidate's compile at once
                        for tile in tiles:
                            product(tile, prologue, x, w, residual, norm)
                    dense = quant.dequantize(w, torch.float32) if quantized else w.float()
                    ref = product(None, prologue, x.float(), dense, None if residual is None else residual.float(),
                                  None if norm is None else norm.float())
                    times = {}
                    for tile in tiles:
                        out = product(tile, prologue, x, w, residual, norm)
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        if not err < 2e-2:
                            raise SystemExit(f"{shape} {name} {fmt} rows {m} {tile}: error {err:.3g}")
                        times[tile] = timed(lambda v, t=tile: product(t, prologue, x, v, residual, norm), w)
                    row = {"shape": shape, "name": name, "format": fmt, "rows": m, "n": n, "k": k,
                           "shipped_tile": None if ships is None else list(ships),
                           "shipped_us": timed(lambda v: shipped.skinny_matmul(prologue, x, v, residual, norm, 1e-6),
                                               w)}
                    if ships is not None and ships._replace(prefetch=True) in times:
                        row["prefetch_us"] = times[ships._replace(prefetch=True)]
                    for label, pool in (("register", [t for t in times if t.stages == 0 and not t.prefetch]),
                                        ("pipelined", [t for t in times if t.stages > 0 and not t.prefetch]),
                                        ("both", [t for t in times if t.stages > 0 and t.prefetch])):
                        if pool:
                            best = min(pool, key=times.get)
                            row[f"{label}_us"], row[f"{label}_tile"] = times[best], list(best)
                    if not quantized or m > 1:  # quantized: dequantize + cuBLAS, as prefill's many rows take it
                        row["cublas_us"] = timed(lambda v: product(None, prologue, x, v, residual, norm), w)
                    elif w.bits == 4 and m <= int4pack.MAX_ROWS and int4pack.applies(4, w.group_size, n, k,
                                                                                     torch.bfloat16, DEV):
                        integers, zeros = quant.integers(w), quant.zero_points(w)
                        packed = int4pack.pack(integers, zeros, w.scales, w.group_size)
                        a = x if prologue == kernels.PLAIN else kernels.run_apart(lambda y: y, prologue, x, residual,
                                                                                  norm, 1e-6, False)
                        a = a[0] if isinstance(a, tuple) else a
                        row["tinygemm_us"] = graph_time([lambda: int4pack.matmul(a, packed)]) * 1e3
                    rows_out.append(row)
                    line = (f"{shape:10} {name:7} {fmt:4} rows {m:2}: shipped {row['shipped_us']:7.1f}"
                            + "".join(f"  {key[:-3]} {row[key]:7.1f}" for key in (
                                "prefetch_us", "register_us", "pipelined_us", "both_us", "tinygemm_us", "cublas_us")
                                if key in row) + f"  {row.get('pipelined_tile', '')}")
                    print(line, flush=True)
                    save(rows_out)  # after each product: a run cut short keeps what it timed


def save(rows: list[dict]) -> None:
    """$OUT/stream.json, replaced whole (a reader never meets half a file)."""
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "stream.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else str(DEV), "rows": rows}, f,
                  indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
