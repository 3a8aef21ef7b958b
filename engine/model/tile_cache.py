"""Skinny-matmul tile choices kept on disk, so that an engine times only shapes never timed before.

Timing every candidate tile of every shape (each a fresh Triton compile the first time) costs
minutes at each start on a Jetson. A choice depends only on the shape and on what the file's
name hashes: the GPU (name, SMs, compute capability, memory, L2), the CUDA driver, CUDA, torch
and Triton, and the kernels' source. A changed candidate set misses shape by shape (each entry
keeps the candidates it chose among). One JSON file per such fingerprint, rewritten whole
(jetserve.atomic: a temporary file flushed and renamed over it, under a lock) whenever a shape is
added, so neither concurrent engines nor a kill -9 or a power cut mid-write leave a torn file; a file
that is corrupt, hostile or another device's is ignored with a warning and replaced by the next
write. A full disk keeps the old file and is tried again at the next shape (each write holds all of
this engine's choices). Like Triton's kernel cache, it is only ever a shortcut:
delete it to time every shape again.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import time
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
import triton

from jetserve import atomic
from jetserve.engine.model.kernels import Tile

log = logging.getLogger(__name__)

FORMAT = 1  # the file layout's version, part of the fingerprint
KERNEL_SOURCES = tuple(Path(__file__).with_name(name) for name in ("kernels.py", "quant_kernels.py"))
MAX_FILE_BYTES = 8 << 20  # a larger file is not read
MAX_SHAPES = 4096  # a file holding more starts again from the writer's own shapes
_FIELD_TYPES = tuple(typing.get_type_hints(Tile).values())  # a stored tile's fields must have exactly these
_REQUIRED_FIELDS = Tile._fields.index("stages")  # the fields before the first one added since caches were written
LOCK_WAIT_S = 30.0  # another writer holds the lock for milliseconds: past this, this start keeps nothing


class Entry(NamedTuple):
    """A shape's choice among `candidates` (None: cuBLAS, or the float path), with each one's
    time (ms; inf where it could not run)."""

    tile: Tile | None
    candidates: tuple[Tile | None, ...]
    times_ms: tuple[float, ...]


def fingerprint(device: torch.device, sources: Sequence[Path] = KERNEL_SOURCES) -> dict:
    """Everything besides the shape that a tile's speed depends on."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        gpu = {"name": p.name, "sms": p.multi_processor_count, "capability": f"{p.major}.{p.minor}",
               "memory_gib": round(p.total_memory / 2**30), "l2_bytes": p.L2_cache_size}
    else:  # Triton's interpreter (tests)
        gpu = {"name": device.type}
    digest = hashlib.sha256()
    for path in sources:
        digest.update(Path(path).read_bytes())
    return {"format": FORMAT, "device": gpu, "driver": _driver_version(), "cuda": torch.version.cuda,
            "torch": torch.__version__, "triton": triton.__version__, "kernels": digest.hexdigest()[:16]}


def _driver_version() -> int | None:
    """The CUDA driver's version (12080: 12.8), from libcuda itself: Jetsons have no NVML."""
    try:
        version = ctypes.c_int()
        return version.value if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0 else None
    except (OSError, AttributeError):
        return None


def shape_key(key: tuple) -> str:
    """A FusedKernels shape key as the file's key: "1|1|6144|2560|torch.bfloat16"."""
    return "|".join(map(str, key))


class TileCache:
    """The tile choices of one fingerprint under `directory`: read once when made, looked up in
    memory, and each new choice merged into the file at once (a start cut short keeps what it
    timed)."""

    def __init__(self, directory: str | os.PathLike, fingerprint: dict):
        self.fingerprint = fingerprint
        text = json.dumps(fingerprint, sort_keys=True)
        name = re.sub(r"[^A-Za-z0-9]+", "-", str(fingerprint["device"]["name"])).strip("-")[:40] or "device"
        self.path = Path(directory) / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
        self.shapes, problem = self._read()
        if problem:
            log.warning("tile cache %s ignored (%s): tiles are timed again and the file rewritten", self.path,
                        problem)
        self.added: dict[str, Entry] = {}  # this engine's choices: what it writes
        self.writable = True
        self.disk_full = False  # the last write found no space: said once, tried again at the next shape

    @classmethod
    def for_device(cls, directory: str | os.PathLike, device: torch.device) -> TileCache:
        return cls(directory, fingerprint(device))

    def lookup(self, key: tuple, candidates: Sequence[Tile | None]) -> Entry | None:
        """The stored choice for this shape, if it was made among exactly these candidates."""
        entry = self.shapes.get(shape_key(key))
        return entry if entry is not None and entry.candidates == tuple(candidates) else None

    def store(self, key: tuple, candidates: Sequence[Tile | None], times_ms: Sequence[float],
              tile: Tile | None) -> None:
        """Remember a timed choice, here and in the file (merged with what other engines wrote)."""
        entry = Entry(tile, tuple(candidates), tuple(times_ms))
        self.shapes[shape_key(key)] = self.added[shape_key(key)] = entry
        if not self.writable:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                atomic.clear_leftovers(self.path.parent, self.path.name)
                on_disk, _ = self._read()
                merged = {**on_disk, **self.added}
                self._write(merged if len(merged) <= MAX_SHAPES else self.added)
        except OSError as exc:
            if atomic.no_space(exc):
                if not self.disk_full:
                    log.warning("tile cache %s not written: no space left on its disk; the old file is kept "
                                "and the write tried again at the next shape", self.path)
                self.disk_full = True
                return
            self.writable = False  # one warning, not one a shape
            log.warning("tile cache %s not written (%s): the next start times these tiles again", self.path, exc)
            return
        if self.disk_full:
            self.disk_full = False
            log.info("tile cache %s written again: space was freed", self.path)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise OSError(f"its lock was held for over {LOCK_WAIT_S:.0f} s") from None
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, shapes: dict[str, Entry]) -> None:
        doc = {"fingerprint": self.fingerprint,
               "shapes": {key: {"tile": e.tile, "candidates": e.candidates,
                                "times_ms": [t if math.isfinite(t) else None for t in e.times_ms]}
                          for key, e in sorted(shapes.items())}}
        atomic.write_file(self.path, json.dumps(doc, indent=1))

    def _read(self) -> tuple[dict[str, Entry], str | None]:
        """The file's shapes, or none and what is wrong with it (nothing, if it does not exist)."""
        try:
            if not self.path.is_file():
                return {}, ("not a regular file" if self.path.exists() else None)
            with open(self.path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
            if len(data) > MAX_FILE_BYTES:
                return {}, f"larger than {MAX_FILE_BYTES} bytes"
            return self._parse(json.loads(data)), None
        except (OSError, ValueError, RecursionError) as exc:  # ValueError: not UTF-8, not JSON, malformed
            return {}, f"{type(exc).__name__}: {str(exc)[:200]}"

    def _parse(self, doc) -> dict[str, Entry]:
        if not isinstance(doc, dict) or doc.get("fingerprint") != self.fingerprint:
            raise ValueError("written for another GPU, driver, CUDA, torch, Triton or kernel source")
        return parse_shapes(doc)


def parse_shapes(doc: dict) -> dict[str, Entry]:
    """A cache document's shapes, checked (ValueError names what is wrong)."""
    shapes = doc.get("shapes")
    if not isinstance(shapes, dict) or len(shapes) > MAX_SHAPES:
        raise ValueError(f"'shapes' must be an object of at most {MAX_SHAPES} shapes")
    return {key: _entry(key, value) for key, value in shapes.items()}


def _entry(key: str, value) -> Entry:
    if not (isinstance(value, dict) and isinstance(value.get("candidates"), list)
            and isinstance(value.get("times_ms"), list) and len(value["candidates"]) == len(value["times_ms"])):
        raise ValueError(f"shape {key[:80]!r}: needs 'tile', 'candidates' and as many 'times_ms'")
    candidates = tuple(_tile(key, t) for t in value["candidates"])
    tile = _tile(key, value.get("tile"))
    if tile not in candidates:
        raise ValueError(f"shape {key[:80]!r}: its tile is not one of its candidates")
    times = tuple(math.inf if t is None else t for t in value["times_ms"])
    if not all(type(t) in (int, float) and t >= 0 for t in times):
        raise ValueError(f"shape {key[:80]!r}: times_ms must be non-negative numbers or null")
    return Entry(tile, candidates, times)


def _tile(key: str, value) -> Tile | None:
    """A stored tile: null (cuBLAS) or Tile's fields in order, of exactly their types; the fields
    a later version added (with their defaults) may be missing, as a shipped table reads them."""
    if value is None:
        return None
    if not (isinstance(value, list) and _REQUIRED_FIELDS <= len(value) <= len(_FIELD_TYPES)
            and all(type(v) is t for v, t in zip(value, _FIELD_TYPES))):
        raise ValueError(f"shape {key[:80]!r}: {str(value)[:80]} is not a tile")
    return Tile(*value)
