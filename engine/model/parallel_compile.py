"""Compile a step's Triton kernels side by side instead of one after another.

A cold start compiles every kernel specialisation its steps use, and launched one by one each
waits for the compiler before the next is even known. Inside `compile_only()`, a launch compiles
instead of running (Triton's warm-up), and the compile goes to a pool of threads through
Triton's own asynchronous mode; leaving the block waits for them all. A dry pass over a step
inside it therefore queues every kernel that step needs at once, and the real pass after it finds
each one compiled. Nothing runs inside: tensors the kernels would write keep whatever they held,
so only code whose host side depends on shapes alone (the runner's warm-up steps) belongs there.
Where Triton has no asynchronous mode, the block compiles serially, as a plain launch would.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

log = logging.getLogger(__name__)

MAX_WORKERS = 16  # compiler threads at most: each holds a compile's memory


def workers() -> int:
    """One compiler thread per CPU core this process may use, within MAX_WORKERS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


@contextmanager
def compile_only(threads: int | None = None) -> Iterator[None]:
    """Triton launches inside compile (in `threads` threads) without running; see the module docstring."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton: compiled serially, as launched
        AsyncCompileMode = None
    original = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        return original(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = warm
    try:
        if AsyncCompileMode is None:
            yield
        else:
            # A kernel that fails to compile here (a tile too big for this GPU) fails again, with
            # its error, where the real pass launches it: the callers handle it there.
            with ThreadPoolExecutor(threads or workers(), thread_name_prefix="triton-compile") as pool, \
                    AsyncCompileMode(pool, ignore_errors=True):
                yield
    finally:
        JITFunction.run = original
