"""On-disk cache of compiled CPU programs (AOTInductor packages), so that a restart loads in
seconds what the first start compiled in a minute.

An entry is one `.pt2` file named by the digest of everything its code and constants depend on
(`program_key`: the model's weights, the source of the code traced into it, the input layout,
torch's version, the CPU's vector ISA and the thread count its loops were compiled for) and by
the digest of its own bytes. Entries are written whole or not at all (jetserve.atomic: a temporary
file flushed and renamed into place), so a kill -9, a power cut or a second engine compiling the
same key never leaves half a file under a valid name; an entry whose bytes do not match its name,
that does not load, or whose program disagrees with the eager step (`CPUGraphs` checks every
program before use) is removed and compiled again. The directory keeps the `MAX_ENTRIES` most recently used entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from jetserve import atomic

log = logging.getLogger(__name__)

MAX_ENTRIES = 8  # a few models × two programs; older ones are deleted


def weights_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of named tensors' names, shapes, dtypes and bytes: every byte, since a program bakes
    the weights in as constants (reading them all is cheap beside compiling)."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def source_digest(paths: Iterable[str | Path]) -> str:
    """sha256 of the files whose code a program traces (a changed line compiles anew)."""
    digest = hashlib.sha256()
    for path in sorted(map(str, paths)):
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def program_key(**parts) -> str:
    """The entry name for a program described by `parts` (JSON-able), on this torch and CPU."""
    parts |= {"torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:40]


def file_digest(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class ProgramCache:
    """`.pt2` entries under one directory, named `<key>.<sha256 of the file, 16 digits>.pt2`: a
    file whose bytes no longer match its name (truncated, overwritten, bit rot) is never loaded,
    so a damaged program cannot crash the process that loads it."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def path(self, key: str) -> Path | None:
        """The entry of `key`, if there is one."""
        return next(iter(sorted(self.directory.glob(f"{key}.*.pt2"))), None)

    def load(self, key: str, loader: Callable[[str], object]):
        """The entry's program through `loader`, or None when there is none, its bytes do not
        match its digest or it does not load (then it is removed, with a warning)."""
        path = self.path(key)
        if path is None:
            return None
        if not file_digest(path).startswith(path.suffixes[-2][1:]):
            self.discard(key, "its contents do not match the digest in its name")
            return None
        try:
            program = loader(str(path))
        except Exception as exc:  # a foreign or stale program: compile again
            self.discard(key, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None
        os.utime(path)  # most recently used
        return program

    def store(self, key: str, write: Callable[[str], None]) -> Path:
        """Write an entry through `write(path)` (which may load and check it there) into a temporary
        file, then flush it and rename it into place in lieu of the key's older entry
        (jetserve.atomic: a kill -9 or a power cut leaves the old entry or the new, never a torn
        one under a valid name). A full disk raises (OSError ENOSPC) and leaves no temporary file."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._prune()  # first too: compiles killed at every start leave no pile of temporary files
        with atomic.Staged(self.directory / key, suffix=".pt2") as staged:
            write(staged.temp)
            path = self.directory / f"{key}.{file_digest(staged.temp)[:16]}.pt2"
            staged.publish(path)
        self._remove(key, keep=path)  # after: a kill between the two leaves both entries, each whole
        self._prune()
        return path

    def discard(self, key: str, why: str) -> None:
        log.warning("CPU program cache: %s is unusable (%s); compiling it again", self.path(key), why)
        self._remove(key)

    def _remove(self, key: str, keep: Path | None = None) -> None:
        for path in self.directory.glob(f"{key}.*.pt2"):
            if path != keep:
                path.unlink(missing_ok=True)

    def _prune(self) -> None:
        """Keep the newest MAX_ENTRIES entries, and the temporary files of compiles still running
        (another engine's: it holds a lock on its file; those a killed compile left are removed)."""
        entries = sorted(self.directory.glob("[!.]*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True)
        for stale in entries[MAX_ENTRIES:]:
            stale.unlink(missing_ok=True)
        atomic.clear_leftovers(self.directory, suffix=".pt2")
