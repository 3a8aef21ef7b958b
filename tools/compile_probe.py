"""Do Triton compiles overlap in compile_only()'s threads on this host? Times the same number of
fresh skinny-matmul specialisations (new K each, so nothing is cached) compiled serially, as
launches, and inside compile_only(). Run on a GPU machine; prints one line each."""

import os
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-probe-")

import torch  # noqa: E402

from jetserve.engine.model import kernels, parallel_compile  # noqa: E402

x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
tiles = [t for t in kernels.candidate_tiles(1, kernels.PLAIN, kernels.pdl_supported(x.device)) if t][:12]


def compile_all(k: int) -> None:
    w = torch.randn(512, k, device="cuda", dtype=torch.bfloat16)
    for tile in tiles:
        kernels._run(tile, kernels.PLAIN, x[:, :k].contiguous(), w, None, None, 0.0)


for label, k, context in (("serial", 1024, None), ("threads", 2048, parallel_compile.compile_only)):
    torch.cuda.synchronize()
    began = time.perf_counter()
    if context:
        with context():
            compile_all(k)
    compile_all(k)  # runs them (compiled above, or compiled now)
    torch.cuda.synchronize()
    print(f"[probe] {len(tiles)} skinny-matmul specialisations, {label}: {time.perf_counter() - began:.1f} s "
          f"({parallel_compile.workers()} compiler threads)", flush=True)
