"""`jetserve tune`: time the tiles of a model's skinny products on this GPU, outside serving.

A serving engine takes its tiles from the shipped table of its GPU family (model/tile_tables.py)
and never times one. This builds an engine that does (`EngineArgs.tune_tiles`): its start-up
times every candidate of every shape it runs, compiling each shape's candidates in parallel, and
keeps the choices in the tile cache (model/tile_cache.py), which every later start on this GPU
and software reads before the table. The result can also be written as a table to ship.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from jetserve.engine.model import tile_tables
from jetserve.engine.model.tile_cache import parse_shapes

log = logging.getLogger(__name__)


def tune(args) -> tile_tables.TileTable:
    """Start a tuning engine on the flags in `args` and return the shipped table of this GPU's
    family with every shape it timed (or read from the tile cache) in its place."""
    import torch

    from jetserve.engine.config import EngineArgs
    from jetserve.engine.llm_engine import LLMEngine
    from jetserve.engine.model.flash_prefill import tuned_config

    engine_args = EngineArgs.from_cli_args(args)
    engine_args.tune_tiles = True
    config = engine_args.resolve()
    if not config.tune_tiles:
        raise ValueError("nothing to tune: tiles are the fused CUDA kernels' (a CUDA GPU with Triton, "
                         "CUDA graphs on, the torch backend)")
    began = time.perf_counter()
    engine = LLMEngine(config)
    kernels = engine.runner.kernels
    log.info("tuned in %.0f s: %s", time.perf_counter() - began, kernels.tuning_summary())
    name = tile_tables.family(torch.cuda.get_device_capability(torch.device(config.device)))
    mc = config.model_config
    chosen = tuned_config(mc.head_dim, mc.num_attention_heads, mc.num_key_value_heads, config.dtype == "float32")
    prefill = tile_tables.PrefillConfig(*chosen) if chosen else tile_tables.shipped(name).prefill
    timed = tile_tables.from_timings(name, kernels.tuning_times, prefill,
                                     f"jetserve tune on {torch.cuda.get_device_name(torch.device(config.device))}")
    return tile_tables.merge(tile_tables.shipped(name), timed)


def table_from_caches(paths: list[str], name: str | None = None) -> tile_tables.TileTable:
    """A table from tile cache files (what `jetserve tune` kept on some machine), over the
    shipped table of their family: each shape's tiles ranked by their timed milliseconds."""
    timed, family = {}, name
    for path in paths:
        doc = json.loads(Path(path).read_text())
        fp = doc.get("fingerprint") if isinstance(doc, dict) else None
        if not isinstance(fp, dict) or not isinstance(fp.get("device"), dict):
            raise ValueError(f"{path}: not a tile cache file (no fingerprint naming its GPU)")
        capability = str(fp["device"].get("capability", ""))
        family = family or ("sm" + capability.replace(".", "") if capability else None)
        for key, entry in parse_shapes(doc).items():
            timed[tuple(key.split("|"))] = dict(zip(entry.candidates, entry.times_ms))
    if not family:
        raise ValueError("the caches name no GPU: pass --family")
    base = tile_tables.shipped(family) if (tile_tables.TABLES / f"{family}.json").exists() else \
        tile_tables.TileTable(family, {})
    source = "tile caches " + ", ".join(Path(p).name for p in paths)
    return tile_tables.merge(base, tile_tables.from_timings(family, timed, base.prefill, source))
