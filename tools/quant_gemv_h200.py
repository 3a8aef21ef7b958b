"""Issue 29 on the H200: the one-row W4A16/W8A16 kernel (quant_kernels._quant_gemv_kernel,
requests two steps ahead) over a sweep of tiles, beside the shipped sm90 table's choice for the
same product, Qwen3 4B and 0.6B projections at batch 1, each timed as the start-up tuning does
(CUDA graph over cold copies of the weight), the fastest against fp32 (fresh random inputs,
output poisoned first). Prints a table; writes $OUT/gemv-<shapes>-<formats>.json (per product: µs
per tile), which tools/table_from_stream.py takes into the table.

    python3 tools/quant_gemv_h200.py [SHAPES] [FORMATS]   # e.g. qwen3-4b int8
    $GEMV_PRODUCTS: the projections swept (default every one but the vocab's: qkv,o,gate_up,down)
    $GEMV_SPLITS: the K splits tried (default 1,2,4; narrow products, few programs, want more)"""

import itertools
import json
import os
import sys
import time

import torch

from jetserve.bench.quant import _relative_error, _weight_bytes, operands, precompile, shape_projections
from jetserve.engine.model import kernels
from jetserve.engine.model.kernels import Tile, cold_copies, graph_time
from jetserve.engine.model.quant_kernels import QuantFusedKernels, quant_matmul
from jetserve.engine.model.tile_tables import shipped

OUT = os.environ.get("OUT", "/tmp/out")
shapes = (sys.argv[1] if len(sys.argv) > 1 else "qwen3-4b,qwen3-0.6b").split(",")
methods = (sys.argv[2] if len(sys.argv) > 2 else "int4,int8").split(",")
products_swept = os.environ.get("GEMV_PRODUCTS", "qkv,o,gate_up,down").split(",")
splits_swept = tuple(int(s) for s in os.environ.get("GEMV_SPLITS", "1,2,4").split(","))
result_file = os.path.join(OUT, f"gemv-{'-'.join(shapes)}-{'-'.join(methods)}.json")
dev = torch.device("cuda")
table = shipped("sm90")


def sweep(method: str, prologue: int, k: int) -> list[Tile]:
    """Tiles of 8 to 32 words a thread, steps that divide K's words, split K as $GEMV_SPLITS says."""
    bits = 4 if method == "int4" else 8
    row_words, group_words = k * bits // 32, (128 if method == "int4" else k) * bits // 32
    out = []
    for bn, bk, warps, split in itertools.product((8, 16, 32, 64), (16, 32, 64, 128), (4, 8), splits_swept):
        per_thread = bn * bk // (32 * warps)
        if not 8 <= per_thread <= 32 or row_words % bk or bk % 16 or (bk < group_words and group_words % bk):
            continue
        if split > 1 and row_words // split < bk:
            continue
        out.append(Tile(bn, bk, warps, split, pdl=True, one_row=True))
        if prologue != kernels.PLAIN and split == 1 and per_thread == 16:
            out.append(Tile(bn, bk, warps, split, apart=True, pdl=True, one_row=True))
    return out


def main() -> None:
    began = time.time()
    products = [(shape, name, p, n, k, m) for shape in shapes for name, (p, n, k) in shape_projections(shape).items()
                if name in products_swept for m in methods]
    variants = sorted({(m, p, k, 1, t) for _, _, p, _, k, m in products for t in sweep(m, p, k)}, key=str)
    precompile(variants, "gemv kernels")
    print(f"[gemv] compiled {len(variants)} in {time.time() - began:.0f} s", flush=True)
    result, lines = {}, []
    for shape, name, prologue, n, k, method in products:
        x, weight, residual, norm = operands(prologue, n, k, method, dev, 1)
        fused = QuantFusedKernels(table=table)
        fused.skinny_matmul(prologue, x, weight, residual, norm, 1e-6)
        (_, shipped_tile), = fused.chosen.items()
        copies = [weight._replace(qweight=q) for q in cold_copies(weight.qweight)]
        run = lambda t, w: quant_matmul(t, prologue, x, w, residual, norm, 1e-6)  # noqa: E731
        times = {"shipped " + str(shipped_tile): graph_time([lambda w=w: run(shipped_tile, w) for w in copies])}
        for t in sweep(method, prologue, k):
            try:
                times[str(t)] = graph_time([lambda w=w, t=t: run(t, w) for w in copies])
            except Exception as exc:  # noqa: BLE001
                print(f"[gemv] {shape} {name} {method} {t}: {type(exc).__name__} {str(exc)[:200]}", flush=True)
        best = min((v, t) for t, v in times.items() if not t.startswith("shipped"))[1]
        tile = eval(best, {"Tile": Tile})  # noqa: S307 - our own repr
        torch.full((1 << 26,), float("nan"), device=dev)  # freed: the next outputs start poisoned
        err = _relative_error(lambda *a: quant_matmul(tile, *a), prologue, x, weight, residual, norm)
        ship_ms = times["shipped " + str(shipped_tile)]
        gbps = _weight_bytes(weight) / (times[best] * 1e-3) / 1e9
        top = sorted((v, t) for t, v in times.items() if not t.startswith("shipped"))[:5]
        result[f"{shape} {name} {method}"] = {"n": n, "k": k, "bytes": _weight_bytes(weight), "shipped": str(shipped_tile),
                                              "shipped_us": ship_ms * 1e3, "best": best, "best_us": times[best] * 1e3,
                                              "GBps": gbps, "relative_error": err, "us": {t: v * 1e3 for t, v in times.items()}}
        line = (f"{shape:10} {name:8} {method}: shipped {ship_ms * 1e3:6.2f} µs, gemv {times[best] * 1e3:6.2f} µs "
                f"({gbps:5.0f} GB/s, err {err:.4f}) {best.replace('Tile', '')[:70]}")
        lines.append(line)
        print(line, "| next:", ", ".join(f"{v * 1e3:.2f}" for v, _ in top[1:]), f"({time.time() - began:.0f} s)", flush=True)
        with open(result_file, "w") as f:
            json.dump(result, f, indent=0)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
