"""Tile choices shipped with the package, per GPU family: an engine starts without timing a tile.

Timing every candidate tile of every skinny product (a Triton compile each) took minutes at each
fresh start, and a Jetson meets a fresh start after every JetPack, driver, torch or Triton update.
So the choices are data: `tiles/<family>.json` beside this module (sm90: H100/H200, sm87: Jetson
Orin, sm110: Thor), each mapping a shape key (`FusedKernels`' key as text, tile_cache.shape_key)
to its tiles ranked fastest first, and the flash prefill kernel's configuration. `jetserve tune`
writes such a table from timings (bench machine, or a device at install time); a table not
measured on its family says how it was derived (`derive`).

A choice is only a speed hint, never a correctness input: every listed tile computes the same
product. So a table needs no fingerprint: a driver or Triton update keeps it valid, and a tile
the running GPU cannot take (PDL before Hopper) is read without that feature or skipped.

The rule for a shape no table lists: the choice of the nearest shape the table has of the same
kind (prologue, row bucket, weight format and dtype), nearest in log N and log K — a projection's
best tile follows its weight's proportions, not its model; a kind the table lacks entirely takes
the first tile that fits, as an untimed engine always did.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from jetserve.engine.model.kernels import Tile
from jetserve.engine.model.tile_cache import shape_key

log = logging.getLogger(__name__)

TABLES = Path(__file__).with_name("tiles")
FORMAT = 1
MAX_RANKED = 4  # tiles kept a shape: the best, and the next best where the best cannot run here


class PrefillConfig(NamedTuple):
    """The flash prefill kernel's launch configuration (flash_prefill._CONFIGS)."""

    block_n: int = 64
    warps: int = 4
    stages: int = 3


def family(capability: tuple[int, int]) -> str:
    """A compute capability's table name: (9, 0) → "sm90"."""
    return f"sm{capability[0]}{capability[1]}"


def _split(key: str) -> tuple[str, tuple[int, int]] | None:
    """A shape key's kind (every field but N and K) and its (N, K); None for a key of no known form."""
    parts = key.split("|")
    at = 3 if parts[0] == "quant" else 2  # ("quant", prologue, rows, N, K, ...) or (prologue, rows, N, K, dtype)
    try:
        n, k = int(parts[at]), int(parts[at + 1])
    except (IndexError, ValueError):
        return None
    return "|".join(parts[:at] + parts[at + 2:]), (n, k)


class TileTable:
    """One family's shipped choices: ranked tiles by shape key, read once."""

    def __init__(self, name: str, shapes: dict[str, list[Tile | None]], prefill: PrefillConfig = PrefillConfig(),
                 source: str = ""):
        self.name, self.shapes, self.prefill, self.source = name, shapes, prefill, source
        self._kinds: dict[str, list[tuple[tuple[float, float], str]]] = {}
        for key in shapes:
            split = _split(key)
            if split:
                kind, (n, k) = split
                self._kinds.setdefault(kind, []).append(((math.log2(n), math.log2(k)), key))

    @classmethod
    def read(cls, path: str | Path) -> TileTable:
        doc = json.loads(Path(path).read_text())
        if doc.get("format") != FORMAT:
            raise ValueError(f"{path}: format {doc.get('format')!r}, this jetserve reads {FORMAT}")
        shapes = {key: [None if t is None else Tile(*t) for t in ranked] for key, ranked in doc["shapes"].items()}
        return cls(doc["family"], shapes, PrefillConfig(*doc.get("prefill", PrefillConfig())), doc.get("source", ""))

    def to_json(self) -> str:
        """The table as a file: one shape a line, so a re-tuned table diffs shape by shape."""
        head = json.dumps({"format": FORMAT, "family": self.name, "source": self.source, "prefill": list(self.prefill)})
        lines = [f"{json.dumps(key)}: {json.dumps([None if t is None else _fields(t) for t in ranked])}"
                 for key, ranked in sorted(self.shapes.items())]
        return head[:-1] + ', "shapes": {\n' + ",\n".join(lines) + "\n}}\n"

    def ranked(self, key: tuple) -> tuple[list[Tile | None], str]:
        """The ranked tiles for this shape and where they came from: "table" (the shape itself),
        "nearest" (the rule), or "" (nothing of its kind)."""
        text = shape_key(key)
        if text in self.shapes:
            return self.shapes[text], "table"
        split = _split(text)
        if split is None or split[0] not in self._kinds:
            return [], ""
        n, k = (math.log2(v) for v in split[1])
        _, nearest = min((abs(n - a) + abs(k - b), other) for (a, b), other in self._kinds[split[0]])
        return self.shapes[nearest], "nearest"

    def choose(self, key: tuple, candidates: Sequence[Tile | None], default: Tile | None) -> tuple[Tile | None, str]:
        """The first ranked tile this engine can run (one of `candidates`, read without PDL, and
        so without the prefetch it comes with, where the candidates have none), and its source;
        else `default`, the first tile that fits."""
        ranked, source = self.ranked(key)
        allowed = set(candidates)
        for tile in ranked:
            for option in (tile, tile._replace(pdl=False, prefetch=False) if tile else None):
                if option in allowed:
                    return option, source
        return default, "default"


def _fields(tile: Tile) -> list:
    """A tile as the file stores it: its fields in order, those added after the format's first
    eight (stages, prefetch) left out at their defaults, so older files and diffs stay as they were."""
    fields = list(tile)
    while len(fields) > _STORED_FIELDS and fields[-1] == Tile._field_defaults[Tile._fields[len(fields) - 1]]:
        fields.pop()
    return fields


_STORED_FIELDS = Tile._fields.index("dot") + 1

EMPTY = TileTable("none", {})


@lru_cache(maxsize=None)
def shipped(name: str) -> TileTable:
    """The shipped table of this family, else that of the nearest family shipped (by compute
    capability: the same generation's tiles suit it best), else an empty one."""
    tables = {p.stem: p for p in TABLES.glob("sm*.json")}
    if not tables:
        return EMPTY
    number = int(name[2:]) if name[2:].isdigit() else 0
    nearest = name if name in tables else min(tables, key=lambda t: (abs(int(t[2:]) - number), -int(t[2:])))
    try:
        table = TileTable.read(tables[nearest])
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged install: untimed tiles, still correct
        log.warning("tile table %s unreadable (%s): first-fit tiles", tables[nearest], exc)
        return EMPTY
    if nearest != name:
        log.info("no tile table for %s: using %s's", name, nearest)
    return table


def for_device(device) -> TileTable:
    """The table for a torch device (CUDA: by its compute capability; otherwise none)."""
    import torch

    if getattr(device, "type", device) != "cuda":
        return EMPTY
    return shipped(family(torch.cuda.get_device_capability(device)))


def from_timings(name: str, timed: dict[tuple, dict[Tile | None, float]], prefill: PrefillConfig,
                 source: str) -> TileTable:
    """A table from `FusedKernels.tuning_times` (ms per candidate, per shape): each shape's
    MAX_RANKED fastest tiles that ran."""
    shapes = {}
    for key, times in timed.items():
        ranked = sorted((t for t in times.items() if math.isfinite(t[1])), key=lambda item: item[1])
        if ranked:
            shapes[shape_key(key)] = [tile for tile, _ in ranked[:MAX_RANKED]]
    return TileTable(name, shapes, prefill, source)


def merge(base: TileTable, new: TileTable) -> TileTable:
    """`base` with every shape of `new` replaced or added (a tuning run's shapes over a shipped table)."""
    return TileTable(base.name, {**base.shapes, **new.shapes}, new.prefill, new.source or base.source)


def derive(source: TileTable, name: str, pdl: bool, note: str) -> TileTable:
    """A table for a family nobody timed yet, from a measured one: each shape keeps the source's
    ranking (a product's best tile follows its weight's shape and the memory pipe more than the
    SM count), read without PDL where the family has none, and then without the L2 prefetch
    (Tile.prefetch): it fills the boundary PDL opens, and a Jetson's L2 is a small fraction of
    a discrete GPU's, which a whole program's share of the weights could overrun."""
    shapes = {}
    for key, ranked in source.shapes.items():
        out: list[Tile | None] = []
        for tile in ranked:
            tile = tile._replace(pdl=tile.pdl and pdl, prefetch=tile.prefetch and pdl) if tile is not None else None
            if tile not in out:
                out.append(tile)
        shapes[key] = out
    return TileTable(name, shapes, source.prefill, note)
