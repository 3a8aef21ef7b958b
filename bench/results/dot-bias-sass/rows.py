"""Instructions a weight in the tensor-core quantized kernel's loop (quant_kernels._quant_dot_kernel)
by input rows, sm_90 and sm_87, K = 2560: tools/sass_count.py's count, compiled here (no GPU).

    python3 bench/results/dot-bias-sass/rows.py 90 87
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import sass_count  # noqa: E402

from jetserve.engine.model.kernels import Tile  # noqa: E402

for arch in map(int, sys.argv[1:] or ["90", "87"]):
    for bits, group, zeros, name in ((8, 2560, False, "int8 sym, one group a row"), (4, 128, True, "int4 g128 asym"),
                                     (4, 128, False, "int4 g128 sym")):
        for tile in (Tile(64, 16, 4, dot=True), Tile(64, 16, 4, dot=True, stages=4)):
            counts = [sass_count.quant_loop(tile, bits, group, zeros, 2560, rows=rows, arch=arch).per_weight
                      for rows in (1, 2, 4, 8, 16)]
            print(f"| sm_{arch} | {name} | {tile.stages} | " + " | ".join(f"{c:.2f}" for c in counts) + " |", flush=True)
