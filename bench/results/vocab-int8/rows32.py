"""The INT8 vocab projection past 16 rows: 16 rows a pass (as shipped), one pass of the tensor-core
kernel at 32 / 64 rows (not a candidate today), the float path, and bf16 in its shipped tile."""
import torch

from jetserve.engine.config import ON_THE_FLY
from jetserve.engine.model import kernels, quant, tile_tables
from jetserve.engine.model.kernels import PLAIN, FusedKernels, cold_copies, graph_time
from jetserve.engine.model.quant_kernels import DOT_TILES, QuantFusedKernels, quant_matmul

dev = torch.device("cuda")
shipped = QuantFusedKernels(table=tile_tables.shipped("sm90"))
bf = FusedKernels(table=tile_tables.shipped("sm90"))
for k in (1024, 2560):
    torch.manual_seed(k)
    dense = torch.randn(151936, k, device=dev) / k**0.5
    w = quant.quantize(dense, *ON_THE_FLY["int8"])
    wb = dense.to(torch.bfloat16)
    del dense
    copies = [w._replace(qweight=c) for c in cold_copies(w.qweight)]
    for m in (32, 64):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ quant.dequantize(w, torch.float32).T
        now = graph_time([lambda c=c: shipped.skinny_matmul(PLAIN, x, c) for c in copies])
        bf.skinny_matmul(PLAIN, x, wb)
        bt = bf.chosen[(PLAIN, m, *wb.shape, x.dtype)]
        b16 = graph_time([lambda c=c: kernels._run(bt, PLAIN, x, c, None, None, 0.0) if bt else
                          torch.nn.functional.linear(x, c) for c in cold_copies(wb)])
        dots = {}
        for t in DOT_TILES:
            if t.apart:
                continue
            try:
                got = quant_matmul(t, PLAIN, x, w).float()
                err = ((got - ref).norm() / ref.norm()).item()
                dots[t] = (graph_time([lambda c=c, t=t: quant_matmul(t, PLAIN, x, c) for c in copies]), err)
            except Exception as exc:  # noqa: BLE001
                print(f"[rows32] {t}: {type(exc).__name__} {str(exc)[:80]}")
        best = min(dots, key=lambda t: dots[t][0])
        print(f"[rows32] K={k} rows {m}: 16 a pass {now * 1e3:7.1f} us | one dot pass {dots[best][0] * 1e3:7.1f} us "
              f"(err {dots[best][1]:.1e}, {best}) | bf16 {b16 * 1e3:7.1f} us ({bt})", flush=True)
