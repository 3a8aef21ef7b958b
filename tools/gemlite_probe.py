"""Issue 29 on a GPU: would a well-kept library's W4A16 / W8A16 kernels stream the decode
products faster than what the engine runs? GemLite (dropbox/gemlite, Apache-2.0): Triton kernels
for low-bit weights, pure Python, so they would run wherever the engine's Triton kernels run
(a Jetson included), with configs cached per GPU instead of tuned at start.

For each Qwen3 projection, weight format and row count, the product alone (its prologue, as the
engine would run it for a library kernel, is a kernel of its own and not timed here, as for
tinygemm in tools/stream_probe.py): the same quantized integers, scales and zero points
(quant.py's on-the-fly INT8 per channel and INT4 in groups of 128) in GemLite's layout, each
of its kernels that takes this row count timed after its own autotuning ("fast" configs); beside
them the engine's shipped path for the product with its fused prologue, tinygemm (INT4), cuBLAS
on bf16 weights of the same shape, and the float path (dequantize, then cuBLAS). Each is checked
against the fp32 product first and timed as the tuning times a tile (a CUDA graph over cold
copies of the weight). µs; prints a table, writes $OUT/gemlite.json after each product. Run from
the repository root:

    python3 tools/gemlite_probe.py [shapes, default qwen3-4b] [rows, default 1,8]

$GEMLITE_FORMATS: int4,int8 by default; bf16 also takes GemLite's 16-bit kernels.
"""

import json
import os
import sys

import torch

from jetserve.bench.quant import operands, shape_projections
from jetserve.engine.model import int4pack, kernels, quant
from jetserve.engine.model.kernels import cold_copies, graph_time
from jetserve.engine.model.quant_kernels import QuantFusedKernels, quant_matmul
from jetserve.engine.model.tile_tables import for_device

OUT = os.environ.get("OUT", "/tmp/out")
SHAPES = (sys.argv[1] if len(sys.argv) > 1 else "qwen3-4b").split(",")
ROWS = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")]
FORMATS = tuple(os.environ.get("GEMLITE_FORMATS", "int4,int8").split(","))
DEV = torch.device("cuda")


def gemlite_product(w):
    """(call(x, words, matmul type), GemLite's words for w): a QuantizedWeight's integers, zero
    points and scales (bf16, as GemLite keeps them) in its layout, (q - z) * s as quant.py's; a
    bf16 weight as its 16-bit kernels take it."""
    from gemlite.core import DType, GemLiteLinearTriton, forward_functional
    from gemlite.helper import A16Wn

    if isinstance(w, quant.QuantizedWeight):
        linear = A16Wn(device=DEV, dtype=torch.bfloat16, post_scale=False).from_weights(
            quant.integers(w).to(torch.uint8), w.scales.to(torch.bfloat16), quant.zero_points(w).to(torch.bfloat16),
            w.bits, w.group_size)
    else:
        n, k = w.shape
        linear = GemLiteLinearTriton(16, group_size=None, in_features=k, out_features=n, input_dtype=DType.BF16,
                                     output_dtype=DType.BF16)
        linear.pack(w, None, None)

    def call(x, words, matmul_type=-1):
        return forward_functional(x, None, [words] + linear.get_tensor_args()[1:], linear.get_meta_args(), matmul_type)

    return call, linear.W_q


def matmul_types(rows: int, bits: int) -> dict:
    """GemLite's kernels that take `rows` rows: its own choice (-1) and the others that fit."""
    from gemlite.core import GEMLITE_MATMUL_TYPES_MAPPING as TYPES
    from gemlite.core import get_matmul_type

    chosen = get_matmul_type(rows, bits)
    names = ["GEMV_REVSPLITK", "GEMV_SPLITK"] if rows == 1 else ["GEMM_SPLITK"]
    return {f"auto={chosen}": -1} | {name: TYPES[name] for name in names if name != chosen}


def timed_over(call, words: torch.Tensor) -> float:
    """µs of call(words), replayed from a graph over cold copies of the words."""
    return graph_time([lambda c=c: call(c) for c in cold_copies(words)]) * 1e3


def main() -> None:
    table = for_device(DEV)
    rows_out = []
    for shape in SHAPES:
        products = [(name, spec) for name, spec in shape_projections(shape).items() if name != "lm_head"]
        # the largest first: a probe cut short by its time limit keeps the products that weigh most in a step
        for name, (prologue, n, k) in sorted(products, key=lambda p: -p[1][1] * p[1][2]):
            for fmt in FORMATS:
                for m in ROWS:
                    x, w, residual, norm = operands(prologue, n, k, fmt, DEV, m)
                    a = x if prologue == kernels.PLAIN else kernels.run_apart(lambda y: y, prologue, x, residual,
                                                                                  norm, 1e-6, False)
                    a = (a[0] if isinstance(a, tuple) else a).contiguous()  # the product's input
                    dense = quant.dequantize(w, torch.float32) if isinstance(w, quant.QuantizedWeight) else w.float()
                    ref = a.float() @ dense.T
                    row = {"shape": shape, "name": name, "format": fmt, "rows": m, "n": n, "k": k}

                    def check(label, out):
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        row[f"{label}_err"] = err
                        return err < 2e-2

                    quantized = isinstance(w, quant.QuantizedWeight)
                    shipped = (QuantFusedKernels if quantized else kernels.FusedKernels)(table=table)
                    row["shipped_us"] = timed_over(lambda c: shipped.skinny_matmul(
                        prologue, x, w._replace(qweight=c) if quantized else c, residual, norm, 1e-6),
                        w.qweight if quantized else w)
                    row["shipped_tile"] = [None if t is None else list(t) for t in shipped.chosen.values()]
                    bf16 = dense.to(torch.bfloat16)
                    row["bf16_cublas_us"] = timed_over(lambda c: a @ c.T, bf16)
                    if quantized and m > 1:
                        row["float_path_us"] = timed_over(lambda c: quant_matmul(None, kernels.PLAIN, a,
                                                                                 w._replace(qweight=c)), w.qweight)
                    if fmt == "int4" and int4pack.applies(4, w.group_size, n, k, torch.bfloat16, DEV):
                        packed = int4pack.pack(quant.integers(w), quant.zero_points(w), w.scales, w.group_size)
                        if check("tinygemm", int4pack.matmul(a, packed)):
                            row["tinygemm_us"] = timed_over(lambda c: int4pack.matmul(a, packed._replace(packed=c)),
                                                            packed.packed)
                    try:
                        call, words = gemlite_product(w)
                        for label, kind in matmul_types(m, getattr(w, "bits", 16)).items():
                            if check(f"gemlite {label}", call(a, words, kind)):
                                row[f"gemlite {label}_us"] = timed_over(lambda c, kind=kind: call(a, c, kind), words)
                    except Exception as err:  # a library's refusal is a result too: kept, the probe goes on
                        row["gemlite_error"] = f"{type(err).__name__}: {err}"[:300]
                    rows_out.append(row)
                    times = "  ".join(f"{key[:-3]} {value:6.1f}" for key, value in row.items() if key.endswith("_us"))
                    print(f"{shape:10} {name:7} {fmt} rows {m:2}: {times}  {row.get('gemlite_error', '')}", flush=True)
                    save(rows_out)
    try:  # the configs its autotuning chose, for a backend that ships them instead of tuning at start
        from gemlite.core import GemLiteLinearTriton
        GemLiteLinearTriton.cache_config(os.path.join(OUT, "gemlite-configs.json"))
    except Exception as err:
        print(f"gemlite configs not saved: {type(err).__name__}: {err}")


def save(rows: list[dict]) -> None:
    """$OUT/gemlite.json, replaced whole (a reader never meets half a file)."""
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "gemlite.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(DEV), "rows": rows}, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
