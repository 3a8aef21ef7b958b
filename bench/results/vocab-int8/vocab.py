"""The INT8 vocab projection's tiles (QuantizationConfig.vocab) timed on this GPU, rows 1-16, for
the Qwen3-0.6B and 4B shapes, beside the bf16 projection's shipped choice; the timed keys merged into
this tree's sm90 table (and a copy under $OUT)."""
import os
import sys

import torch

from jetserve.engine.config import ON_THE_FLY, VOCAB_QUANTIZATION
from jetserve.engine.model import kernels, quant, tile_tables
from jetserve.engine.model.kernels import PLAIN, FusedKernels, cold_copies, graph_time
from jetserve.engine.model.quant_kernels import QuantFusedKernels

dev = torch.device("cuda")
rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16").split(",")]
fused = QuantFusedKernels(tile_timing=True)
shipped = FusedKernels(table=tile_tables.shipped("sm90"))
for k in (1024, 2560):
    torch.manual_seed(k)
    dense = torch.randn(151936, k, device=dev) / k**0.5
    w = quant.quantize(dense, *ON_THE_FLY[VOCAB_QUANTIZATION])
    wb = dense.to(torch.bfloat16)
    del dense
    for m in rows_list:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        fused.skinny_matmul(PLAIN, x, w)
        shipped.skinny_matmul(PLAIN, x, wb)
        bkey = (PLAIN, 1 << (m - 1).bit_length(), *wb.shape, x.dtype)
        btile = shipped.chosen[bkey]
        bf16 = graph_time([lambda c=c: kernels._run(btile, PLAIN, x, c, None, None, 0.0) for c in cold_copies(wb)]) \
            if btile is not None else graph_time([lambda c=c: torch.nn.functional.linear(x, c) for c in cold_copies(wb)])
        qkey = [q for q in fused.tuning_times if q[2] == 1 << (m - 1).bit_length() and q[4] == k][-1]
        times = fused.tuning_times[qkey]
        best = min(times, key=times.get)
        ref = x.float() @ quant.dequantize(w, torch.float32).T
        got = fused.skinny_matmul(PLAIN, x, w).float()
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"[vocab] K={k} rows {m}: int8 {times[best] * 1e3:7.1f} us ({best}) | bf16 {bf16 * 1e3:7.1f} us "
              f"({btile}) | {bf16 / times[best]:.2f}x | rel. error {err:.1e}", flush=True)
    del w, wb
name = "sm90"
path = tile_tables.TABLES / f"{name}.json"
base = tile_tables.TileTable.read(path)
timed = tile_tables.from_timings(name, fused.tuning_times, base.prefill, "")
source = base.source + f"; the INT8 vocab projection's rows 1-16 timed on an {torch.cuda.get_device_name(dev)} (bench/results/vocab-int8)"
table = tile_tables.TileTable(name, {**base.shapes, **timed.shapes}, base.prefill, source)
path.write_text(table.to_json())
out = os.environ.get("OUT", "/tmp/res")
os.makedirs(out, exist_ok=True)
(tile_tables.Path(out) / "sm90-vocab.json").write_text(table.to_json())
print(f"[vocab] {len(timed.shapes)} keys into {path}")
