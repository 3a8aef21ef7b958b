"""Issue 29 on a GPU: the quantized MMA kernel (model/mma_kernels.py) against what the engine runs now.

For each Qwen3 projection with its prologue (RMSNorm, residual add, SiLU·up: a kernel of its own
before the MMA, as before torch's kernel), row count (1 to 16) and format as `--quantization`
makes it (INT4: groups of 128 with zero points; INT8: one group a row, symmetric): every MMA
candidate checked against the fp32 product, then timed as the tuning times a tile (a CUDA graph
over cold copies of the weight), beside the shipped table's tile over the same layout, torch's
W4A16 kernel where the engine takes it (model/int4pack.py) and the bf16 product. Also checked, not
timed: INT4 and INT8 symmetric and with zero points, groups of 128 and one a row, fp16 inputs,
outputs poisoned first. Prints a table; writes $OUT/mma.json. From the repository root:

    python3 tools/mma_probe.py [shapes, default qwen3-0.6b,qwen3-4b] [rows, default 1,2,4,8] [formats, default int4]

Rows 9 to 16 take the MMA tiles of two input tiles (at depths whose registers do not spill).
"""

import json
import os
import sys

import torch

from jetserve.atomic import write_file
from jetserve.bench.quant import operands, shape_projections
from jetserve.engine.model import int4pack, kernels, parallel_compile, quant
from jetserve.engine.model.kernels import cold_copies, graph_time, pdl_supported
from jetserve.engine.model.quant_kernels import (QuantFusedKernels, _mma_tiles, fitting_tiles, int4pack_matmul,
                                                 mma_matmul, quant_matmul)
from jetserve.engine.model.tile_tables import for_device

OUT = os.environ.get("OUT", "/tmp/out")
SHAPES = (sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b,qwen3-4b").split(",")
ROWS = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8").split(",")]
FORMATS = (sys.argv[3] if len(sys.argv) > 3 else "int4").split(",")
DEV = torch.device("cuda")


def mma(tile, x, w):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)  # poisoned
    return mma_matmul(tile, x, w, out)


def timed(call, weight) -> float:
    """µs call(weight) takes, replayed from a graph over cold copies of the weight."""
    return graph_time([lambda c=c: call(weight._replace(qweight=c)) for c in cold_copies(weight.qweight)]) * 1e3


def checked(tile, x, w) -> float:
    """The MMA product's error against fp32, relative (norm), raising past tolerance."""
    ref = x.float() @ quant.dequantize(w, torch.float32).T
    out = mma(tile, x, w)
    torch.cuda.synchronize()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        raise SystemExit(f"{tile} {tuple(x.shape)} x {w.shape} bits {w.bits} group {w.group_size} "
                         f"zeros {w.zeros is not None} {x.dtype}: error {err:.3g}")
    return err


def variants() -> None:
    """The formats the table does not time, checked once: symmetric, one group a row, fp16 inputs."""
    torch.manual_seed(0)
    dense = torch.randn(272, 640, device=DEV) / 640**0.5
    tile = _mma_tiles(1, quant.quantize(dense, 4, 128, False), torch.bfloat16, DEV)
    cases = [(quant.quantize(dense, bits, group, sym), torch.randn(m, 640, device=DEV, dtype=dtype))
             for bits in (4, 8) for sym in (False, True) for group in (128, 640)
             for dtype in (torch.bfloat16, torch.float16) for m in (1, 3, 8)]
    with parallel_compile.compile_only():  # every variant's kernel compiled side by side first
        for w, x in cases:
            for t in tile:
                mma(t, x, w)
    for w, x in cases:
        for t in tile:
            checked(t, x, w)
    print(f"variants: {len(tile)} tiles x INT4/INT8 x sym/asym x group 128/640 x bf16/fp16 x rows 1/3/8 within 1e-2",
          flush=True)


def product(tile, prologue, x, w, residual, norm):
    """The engine's product in `tile` with its prologue (apart, for the MMA tiles), its first output."""
    out = quant_matmul(tile, prologue, x, w, residual, norm, 1e-6)
    return out[0] if isinstance(out, tuple) else out


def main() -> None:
    pdl = pdl_supported(DEV)
    table = for_device(DEV)
    variants()
    rows_out = []
    for shape in SHAPES:
        for fmt, (name, (prologue, n, k)) in [(f, p) for f in FORMATS for p in shape_projections(shape).items()]:
            if name == "lm_head":
                continue
            for m in ROWS:
                x, w, residual, norm = operands(prologue, n, k, fmt, DEV, m)
                tiles = [t for t in fitting_tiles(m, w, prologue, pdl, x.dtype) if t.mma]
                with parallel_compile.compile_only():
                    for t in tiles:
                        product(t, prologue, x, w, residual, norm)
                dense = quant.dequantize(w, torch.float32)
                ref = kernels._run(None, prologue, x.float(), dense, None if residual is None else residual.float(),
                                   None if norm is None else norm.float(), 1e-6)
                ref = ref[0] if isinstance(ref, tuple) else ref
                for t in tiles:  # against fp32 (variants() poisons the outputs first)
                    out = product(t, prologue, x, w, residual, norm)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 2e-2:
                        raise SystemExit(f"{shape} {name} rows {m} {t}: error {err:.3g}")
                times = {t: timed(lambda v, t=t: product(t, prologue, x, v, residual, norm), w) for t in tiles}
                best = min(times, key=times.get) if times else None  # none past 8 rows: the others alone
                shipped = QuantFusedKernels(table=table)
                shipped.skinny_matmul(prologue, x, w, residual, norm, 1e-6)
                row = {"shape": shape, "name": name, "format": fmt, "rows": m, "n": n, "k": k,
                       "mma_us": times.get(best, float("inf")), "mma_tile": best and list(best),
                       "mma_times": [[list(t), us] for t, us in times.items()],
                       "shipped_tile": next((None if t is None else list(t) for t in shipped.chosen.values()), None),
                       "shipped_us": timed(lambda v: shipped.skinny_matmul(prologue, x, v, residual, norm, 1e-6), w)}
                if fmt == "int4" and m <= int4pack.MAX_ROWS and n * k >= int4pack.MIN_WEIGHTS:  # tinygemm's domain
                    packed = int4pack.pack(quant.integers(w), quant.zero_points(w), w.scales, w.group_size)
                    row["tinygemm_us"] = graph_time([lambda: int4pack_matmul(prologue, x, packed, residual, norm, 1e-6,
                                                                             pdl)]) * 1e3
                engine = row.get("tinygemm_us", row["shipped_us"])
                row["gain"] = engine / row["mma_us"]
                row["span_gain"] = engine / row["shipped_us"]  # the span layout's table tile against the engine's route
                bx, bw, bres, bnorm = operands(prologue, n, k, "bf16", DEV, m)
                plain = kernels.FusedKernels(table=table)
                row["bf16_us"] = graph_time([lambda c=c: plain.skinny_matmul(prologue, bx, c, bres, bnorm, 1e-6)
                                             for c in cold_copies(bw)]) * 1e3
                rows_out.append(row)
                print(f"{shape:10} {fmt} {name:7} rows {m:2}: engine {engine:7.2f} ({'tinygemm' if 'tinygemm_us' in row else 'span'})"
                      f"  span tile {row['shipped_us']:7.2f}  mma {row['mma_us']:7.2f} {row['gain']:.2f}x"
                      f"  bf16 {row['bf16_us']:7.2f} ({row['bf16_us'] / row['mma_us']:.2f}x)  {row['mma_tile']}", flush=True)
                save(rows_out)


def save(rows: list[dict]) -> None:
    """$OUT/mma.json, replaced whole (jetserve.atomic: a reader never meets half a file)."""
    os.makedirs(OUT, exist_ok=True)
    write_file(os.path.join(OUT, "mma.json"), json.dumps({"device": torch.cuda.get_device_name(DEV), "rows": rows},
                                                         indent=1))


if __name__ == "__main__":
    main()
