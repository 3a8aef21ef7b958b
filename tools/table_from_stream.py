"""A family's shipped tile table updated from a `tools/stream_probe.py` result (stream.json, or
`tools/mma_probe.py`'s mma.json) or a
`tools/quant_gemv_h200.py` sweep (gemv-*.json, one row, its tiles this tree's candidates): for
each product it timed, where one of its tiles beat the shipped choice by more than the
timing's spread, the shape's ranking becomes the timed tiles fastest first (then the table's
old ones, as fallbacks where the first cannot run), as `jetserve tune` ranks them.

The probe times a product alone. That is like for like where the table's entry was itself a
product timed alone (`jetserve tune`), and not where it came from timing whole steps
(tools/step_tiles_probe.py: the bf16 one-row shapes): there, tiles faster alone by up to a fifth
made the 0.6B's step 5% slower (bench/results/quant-rows16-h200). Hence `--rows`, default 16.

    python3 tools/table_from_stream.py STREAM_OR_GEMV_JSON [--table engine/model/tiles/sm90.json] [--rows 16]
"""

import argparse
import json
import sys

import torch
import triton

from jetserve.bench.quant import shape_projections
from jetserve.engine.config import ON_THE_FLY
from jetserve.engine.model import quant
from jetserve.engine.model.kernels import ADD_NORM, NORM, Tile
from jetserve.engine.model.quant_kernels import candidates
from jetserve.engine.model.tile_cache import shape_key
from jetserve.engine.model.tile_tables import MAX_RANKED, TileTable

# A win smaller than this share of the shipped time, or than this many µs, is within what a product
# timed alone tells about it inside a step (bench/results/step-tiles-h200: under 1 µs changes nothing).
MIN_GAIN, MIN_GAIN_US = 0.10, 0.3


def keys(row: dict) -> list[tuple]:
    """The engine's shape keys a probed product's ranking goes to (kernels.FusedKernels,
    QuantFusedKernels): its own, and for q·k·v the first layer's twin, which has no residual to
    add yet (NORM where the probe ran ADD_NORM): the same weights, the rest of the prologue alike."""
    prologue, n, k = shape_projections(row["shape"])[row["name"]]
    prologues = [prologue] + ([NORM] if row["name"] == "qkv" and prologue == ADD_NORM else [])
    if row["format"] == "bf16":
        return [(p, row["rows"], n, k, torch.bfloat16) for p in prologues]
    w = quant.quantize(torch.zeros(8, k), *ON_THE_FLY[row["format"]])  # the format's resolved group size
    return [("quant", p, triton.next_power_of_2(row["rows"]), n, k, w.bits, w.group_size, w.scales.dtype,
             torch.bfloat16) for p in prologues]


def timings(row: dict) -> dict:
    """Tile (None: cuBLAS) → µs, every variant the probe timed for this product."""
    if "times" in row:
        return row["times"]
    shipped = None if row["shipped_tile"] is None else Tile(*row["shipped_tile"])
    out = {shipped: row["shipped_us"]}
    for fields, us in row.get("mma_times", []):  # tools/mma_probe.py's MMA tiles
        out.setdefault(Tile(*fields), us)
    if "prefetch_us" in row:
        out.setdefault(shipped._replace(prefetch=True), row["prefetch_us"])
    for label in ("register", "pipelined", "both"):
        if f"{label}_us" in row:
            out.setdefault(Tile(*row[f"{label}_tile"]), row[f"{label}_us"])
    if "cublas_us" in row:
        out.setdefault(None, row["cublas_us"])
    return out


def gemv_rows(doc: dict) -> list[dict]:
    """A one-row sweep's products as the stream probe's rows: the shipped tile and the swept
    ones this tree would choose among (a tile the engine does not offer would be skipped there)."""
    rows = []
    for label, r in doc.items():
        shape, name, method = label.split()
        prologue, _, k = shape_projections(shape)[name]
        w = quant.quantize(torch.zeros(8, k), *ON_THE_FLY[method])
        offered = set(candidates(1, w, prologue, pdl=True))
        times = {}
        for text, us in r["us"].items():
            tile = eval(text.removeprefix("shipped "), {"Tile": Tile})  # noqa: S307 - the sweep's own repr
            if text.startswith("shipped") or tile in offered:
                times.setdefault(tile, us)
        rows.append({"shape": shape, "name": name, "format": method, "rows": 1, "shipped_us": r["shipped_us"],
                     "times": times})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stream")
    ap.add_argument("--table", default="engine/model/tiles/sm90.json")
    ap.add_argument("--rows", default="16", help="row counts to take from the probe")
    ap.add_argument("--source", default="", help="appended to the table's source line")
    args = ap.parse_args()
    rows = {int(r) for r in args.rows.split(",")}
    table = TileTable.read(args.table)
    changed = 0
    doc = json.load(open(args.stream))
    for row in doc["rows"] if "rows" in doc else gemv_rows(doc):
        if row["rows"] not in rows:
            continue
        times = timings(row)
        best = min(times, key=times.get)
        gain = row["shipped_us"] - times[best]
        if gain <= max(MIN_GAIN * row["shipped_us"], MIN_GAIN_US):
            continue
        ranked = sorted(times, key=times.get)
        for text in map(shape_key, keys(row)):
            old = table.shapes.get(text, [])
            table.shapes[text] = (ranked + [t for t in old if t not in ranked])[:MAX_RANKED]
            changed += 1
            print(f"{text}: {row['shipped_us']:.1f} -> {times[best]:.1f} µs  {best}", file=sys.stderr)
    if args.source:
        table.source = f"{table.source}; {args.source}"
    with open(args.table, "w") as f:
        f.write(table.to_json())
    print(f"{changed} shapes changed in {args.table}", file=sys.stderr)


if __name__ == "__main__":
    main()
