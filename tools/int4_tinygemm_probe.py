"""Issue 29 on the H200: torch's own W4A16 product (`torch._weight_int4pack_mm`, the tinygemm
tensor-core kernel in ATen's CUDA build, sm80+, so also Orin and Thor) against the shipped INT4
kernel of quant_kernels and against bf16 cuBLAS, for the Qwen3 projections at 1 to 8 rows, each
timed as the start-up tuning times a tile (CUDA graph over cold copies of the weight), the
product alone (no fused prologue). The same random weight in both formats: our INT4 g128
(asymmetric, integer zero points) re-expressed as tinygemm's (q - 8) * s + (8 - z) * s, checked
against the fp32 product of the dequantized weight. Prints a table; writes $OUT/tinygemm.json."""

import json
import os
import sys

import torch

from jetserve.bench.quant import operands, shape_projections
from jetserve.engine.model import int4pack, kernels, quant
from jetserve.engine.model.kernels import cold_copies, graph_time
from jetserve.engine.model.quant_kernels import QuantFusedKernels
from jetserve.engine.model.tile_tables import shipped

OUT = os.environ.get("OUT", "/tmp/out")
shapes = (sys.argv[1] if len(sys.argv) > 1 else "qwen3-4b,qwen3-0.6b").split(",")
rows_list = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,4,8").split(",")]
dev = torch.device("cuda")


def to_tinygemm(w: quant.QuantizedWeight, inner_k_tiles: int):
    """(packed weight, scales and zeros) of tinygemm's layout for the same integers."""
    q = quant.integers(w)  # [N, K] in 0..15
    z = quant.zero_points(w).float()
    s = w.scales.float()
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    sz = torch.stack([s, (8 - z) * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/g, N, 2]
    return torch._convert_weight_to_int4pack(packed, inner_k_tiles), sz


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def main() -> None:
    result, lines = {}, []
    table = shipped("sm90")
    for shape in shapes:
        for name, (_, n, k) in shape_projections(shape).items():
            if name == "lm_head":
                continue
            for m in rows_list:
                x, w, _, _ = operands(kernels.PLAIN, n, k, "int4", dev, m)
                ref = x.float() @ quant.dequantize(w, torch.float32).t()
                row = {"n": n, "k": k, "rows": m}
                fused = QuantFusedKernels(table=table)
                ours = fused.skinny_matmul(kernels.PLAIN, x, w)
                row["ours_err"] = rel_err(ours, ref)
                copies = [w._replace(qweight=c) for c in cold_copies(w.qweight)]
                f2 = QuantFusedKernels(table=table)
                row["ours_us"] = graph_time([lambda c=c: f2.skinny_matmul(kernels.PLAIN, x, c) for c in copies]) * 1e3
                dense = quant.dequantize(w, torch.bfloat16)
                dcopies = cold_copies(dense)
                row["bf16_us"] = graph_time([lambda d=d: torch.nn.functional.linear(x, d) for d in dcopies]) * 1e3
                if m > 16:  # what the engine runs there: cuBLAS over the weight dequantized from tinygemm's layout
                    from jetserve.engine.model.quant_kernels import dequantize_int4pack

                    p8 = to_tinygemm(w, 8)
                    p8 = int4pack.Int4PackedWeight(*p8, w.group_size)
                    row["dequant_int4pack_err"] = rel_err(torch.nn.functional.linear(x, dequantize_int4pack(
                        p8, torch.bfloat16)), ref)
                    row["dequant_int4pack_us"] = graph_time([lambda c=c: torch.nn.functional.linear(
                        x, dequantize_int4pack(p8._replace(packed=c), torch.bfloat16)) for c in cold_copies(p8.packed)]) * 1e3
                for tiles in (8, 4, 2):
                    if k % (tiles * 16):
                        continue
                    try:
                        packed, sz = to_tinygemm(w, tiles)
                        out = torch._weight_int4pack_mm(x, packed, w.group_size, sz)
                        row[f"tinygemm{tiles}_err"] = rel_err(out, ref)
                        pcopies = cold_copies(packed)
                        row[f"tinygemm{tiles}_us"] = graph_time(
                            [lambda p=p: torch._weight_int4pack_mm(x, p, w.group_size, sz) for p in pcopies]) * 1e3
                    except Exception as exc:  # noqa: BLE001
                        row[f"tinygemm{tiles}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                key = f"{shape} {name} m{m}"
                result[key] = row
                best = min((v, t) for t, v in row.items() if t.startswith("tinygemm") and t.endswith("_us"))\
                    if any(t.startswith("tinygemm") and t.endswith("_us") for t in row) else (float("nan"), "-")
                line = (f"{key:24} bf16 {row['bf16_us']:7.2f}  ours {row['ours_us']:7.2f} (err {row['ours_err']:.4f})  "
                        f"tinygemm {best[0]:7.2f} [{best[1]}] (err {row.get(best[1].replace('_us', '_err'), float('nan')):.4f})")
                if "dequant_int4pack_us" in row:
                    line += f"  dequantized + cuBLAS {row['dequant_int4pack_us']:7.2f} (err {row['dequant_int4pack_err']:.4f})"
                lines.append(line)
                print(line, {t: v for t, v in row.items() if t.endswith("error")} or "", flush=True)
                with open(os.path.join(OUT, "tinygemm.json"), "w") as f:
                    json.dump(result, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
