"""The engine core's process, started before its configuration exists.

`jetserve serve` starts it first thing, so the core's interpreter imports torch, Triton and the
model's modules (seconds) while the server imports its own and resolves the configuration,
not after; `MPClient` takes it over and writes the configuration to its stdin. Imports no torch:
starting it must not wait for what it is started to overlap.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jetserve.engine import lifeline


@dataclass
class CoreProcess:
    dir: str  # the IPC directory (its sockets are the core's inbox and outbox)
    dir_lock: int  # the descriptor whose lock marks the directory as a live server's
    process: subprocess.Popen
    sentinel: int  # our end of the lifeline: readable once the core is gone

    @classmethod
    def start(cls) -> CoreProcess:
        path, lock = lifeline.ipc_dir()
        try:
            inbox, outbox = (f"ipc://{Path(path) / name}" for name in ("input", "output"))
            process, sentinel = lifeline.spawn([sys.executable, "-m", "jetserve.engine.core", inbox, outbox],
                                               stdin=subprocess.PIPE)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            os.close(lock)
            raise
        return cls(path, lock, process, sentinel)

    @property
    def input_address(self) -> str:
        return f"ipc://{Path(self.dir) / 'input'}"

    @property
    def output_address(self) -> str:
        return f"ipc://{Path(self.dir) / 'output'}"

    def hand_over(self, payload: bytes) -> None:
        """The configuration, once: the core starts loading as its stdin closes."""
        self.process.stdin.write(payload)
        self.process.stdin.close()

    def close(self) -> None:
        """End the process (a core never handed a configuration exits as its stdin closes) and
        remove its directory."""
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        os.close(self.sentinel)
        shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self.dir_lock)
