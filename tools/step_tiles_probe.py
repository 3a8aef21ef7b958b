"""Tiles for a speculative step's skinny products, chosen by timing the whole step they run in.

`jetserve tune` times each product's candidate tiles alone (its graph replayed over cold copies
of its weight). Inside a step the neighbours differ: a programmatic dependent launch overlaps the
kernel before it, a prologue kept apart is one more launch in the chain, L2 holds other weights.
This probe builds an engine of a Qwen3 shape with random weights and one MTP layer, drafting k
fixed, and for each product shape the k-draft step's verify (k + 1 rows) and draft heads use,
tries every candidate tile with the others as chosen, timing the captured step (the fastest of a
few replays of a graph of it); it keeps the fastest and moves on to the next shape (one pass of
coordinate descent). The plain decode step is timed before and after (shapes it shares change it
too). With --k 0 the step is the plain decode step and the shapes its products at --batch rows;
with --quantization the weights are INT8/INT4 made on the fly and the quantized products' shapes
are the ones tried (quant_kernels.candidates). Printed last: the table entries
(tiles/<family>.json lines) of the shapes whose choice changed, fastest first; --table writes
those whose step gain passes MIN_GAIN into that table file.

    python tools/step_tiles_probe.py --shape qwen3-0.6b --k 3 --out RESULT.json
    python tools/step_tiles_probe.py --shape qwen3-4b --k 0 --quantization int8 --table engine/model/tiles/sm90.json

Needs a CUDA GPU; compiles each candidate once (side by side, parallel_compile).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="sequences a step (the captured bucket)")
    ap.add_argument("--repeats", type=int, default=3, help="graph timings a tile (the fastest counts)")
    ap.add_argument("--quantization", choices=("int8", "int4"), help="weights made so at load; their products tried")
    ap.add_argument("--table", type=Path, help="a tiles/<family>.json to write the changed shapes' rankings into")
    ap.add_argument("--keys", default="", help="comma-separated parts of the shape keys to try (default: every one)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from jetserve.bench.mtp import _random_checkpoint_with_mtp
    from jetserve.engine import LLM
    from jetserve.engine.model import kernels as K
    from jetserve.engine.model import parallel_compile
    from jetserve.engine.model.quant_kernels import candidates as quant_candidates
    from jetserve.engine.model.tile_cache import shape_key

    device = torch.device("cuda")
    scratch = tempfile.TemporaryDirectory()
    _random_checkpoint_with_mtp(args.shape, Path(scratch.name), torch.bfloat16, device)
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "adaptive": False} if args.k else None
    llm = LLM(scratch.name, speculative_config=spec,
              dtype="bfloat16", max_num_seqs=args.batch, cudagraph_capture_sizes=[args.batch], max_model_len=1024,
              enable_prefix_caching=False, tile_cache_dir="none", quantization=args.quantization)
    runner = llm.engine.core.runner
    kernels, graphs = runner.kernels, runner.graphs
    rows = 1 << (args.batch * (args.k + 1) - 1).bit_length()  # the shape keys' row bucket (a power of two)
    draft_rows = runner.model.draft_head.shape[0]
    plain = lambda: graphs._step(None, 1, args.batch)  # noqa: E731  over the static inputs capture left
    step = (lambda: graphs._step(args.k, args.k + 1, args.batch)) if args.k else plain

    def timed(call) -> float:
        return min(K.graph_time([call]) for _ in range(args.repeats))

    with torch.inference_mode():
        before = {"step_ms": timed(step), "plain_ms": timed(plain)}
        print(f"[probe] as chosen: k={args.k} step {before['step_ms']:.4f} ms, plain {before['plain_ms']:.4f} ms",
              flush=True)
        quantized = bool(args.quantization)
        keys = [key for key in kernels.chosen if (key[0] == "quant") == quantized and
                (key[quantized + 1] == rows or (args.k and key[quantized + 1] == 1 and key[quantized + 2] == draft_rows))
                and (not args.keys or any(part in shape_key(key) for part in args.keys.split(",")))]
        shapes = {}
        for key in keys:
            original = kernels.chosen[key]
            tiles = (_quant_tiles(quant_candidates(key[2], _weight_like(key), key[1], K.pdl_supported(device), key[8]),
                                  key[2], original) if quantized
                     else K.candidate_tiles(key[1], key[0], K.pdl_supported(device)))
            with parallel_compile.compile_only():
                for tile in tiles:
                    kernels.chosen[key] = tile
                    step()
            times = {}
            for tile in tiles:
                kernels.chosen[key] = tile
                try:
                    times[tile] = timed(step)
                except Exception as error:  # a tile this GPU cannot run (registers, shared memory)
                    print(f"[probe] {shape_key(key)} {tile}: {type(error).__name__}", flush=True)
            ranked = sorted(times, key=times.get)
            kernels.chosen[key] = ranked[0]
            shapes[shape_key(key)] = {"was": original, "was_ms": times.get(original), "best": ranked[0],
                                      "best_ms": times[ranked[0]],
                                      "ranked": [[None if t is None else list(t), round(times[t], 5)] for t in ranked]}
            print(f"[probe] {shape_key(key)}: {original} {times.get(original, float('nan')):.4f} ms -> "
                  f"{ranked[0]} {times[ranked[0]]:.4f} ms", flush=True)
            write(args, before, None, shapes)  # a run cut short keeps the shapes it finished
        after = {"step_ms": timed(step), "plain_ms": timed(plain)}
    print(f"[probe] chosen here: k={args.k} step {after['step_ms']:.4f} ms, plain {after['plain_ms']:.4f} ms; "
          f"ratio {before['step_ms'] / before['plain_ms']:.3f} -> {after['step_ms'] / after['plain_ms']:.3f}")
    changed = {key: s for key, s in shapes.items() if s["best"] != s["was"]}
    for key, s in changed.items():  # tiles/<family>.json lines
        top = [t for t, _ in s["ranked"][:4]]
        print(f"{json.dumps(key)}: {json.dumps(top)},")
    write(args, before, after, shapes)
    if args.table:
        write_table(args.table, changed, f"step tiles {args.shape} k={args.k} batch {args.batch}"
                    + (f" {args.quantization}" if args.quantization else ""))
    scratch.cleanup()
    return 0


# A shape's new choice goes into the table where it takes more than this share off the step: a
# graph replay's timing varies by a few tenths of a percent between runs of the same step.
MIN_GAIN = 0.005


def _weight_like(key: tuple):
    """A weight of the quantized shape key's format, which is all `candidates` reads of it."""
    from jetserve.engine.model.quant import QuantizedWeight

    _, _, _, n, k, bits, group, scales_dtype, _ = key
    return QuantizedWeight(torch.empty(n, k * bits // 32, dtype=torch.int32), torch.empty(n, k // group, dtype=scales_dtype),
                           None, bits, group)


def _quant_tiles(tiles: list, rows: int, original) -> list:
    """The quantized candidates worth a step's timing: not the L2-prefetching twins, nor at one
    row the tensor-core tiles (padded to 16 rows), which no one-row product chose in the
    products' own timings (bench/results/quant-gemv-h200, stream-h200); the current choice always."""
    kept = [t for t in tiles if t is None or not (t.prefetch or (rows == 1 and t.dot))]
    return kept + [original] if original not in kept else kept


def write_table(path: Path, changed: dict, source: str) -> None:
    """The changed shapes whose new tile gains MIN_GAIN of the step, ranked as timed, into `path`."""
    from jetserve.engine.model.kernels import Tile
    from jetserve.engine.model.tile_tables import MAX_RANKED, TileTable

    table, taken = TileTable.read(path), 0
    for key, s in changed.items():
        if s["was_ms"] is None or s["was_ms"] - s["best_ms"] <= MIN_GAIN * s["was_ms"]:
            continue
        ranked = [None if t is None else Tile(*t) for t, _ in s["ranked"]]
        table.shapes[key] = (ranked + [t for t in table.shapes.get(key, []) if t not in ranked])[:MAX_RANKED]
        taken += 1
        print(f"[probe] table: {key} {s['was_ms']:.4f} -> {s['best_ms']:.4f} ms", flush=True)
    table.source = f"{table.source}; {source}"
    path.write_text(table.to_json())
    print(f"[probe] {taken} of {len(changed)} changed shapes written into {path}", flush=True)


def write(args, before: dict, after: dict | None, shapes: dict) -> None:
    if not args.out:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    listed = {key: {**s, "was": None if s["was"] is None else list(s["was"]),
                    "best": None if s["best"] is None else list(s["best"])} for key, s in shapes.items()}
    args.out.write_text(json.dumps({"shape": args.shape, "k": args.k, "batch": args.batch, "before": before,
                                    "after": after, "shapes": listed}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
