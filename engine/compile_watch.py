"""Kernels a process first compiles after its engine started: each one stalled a request.

Every kernel a request can reach is to be compiled (or loaded from Triton's cache) while the
engine starts: its warm-up and graph capture run every step shape. A Triton kernel specialised
for the first time later — a shape or an integer argument's divisibility the warm-up missed —
compiles on the path of the request that brought it, for as long as the compiler takes on that
host (far longer on a Jetson's CPU). Triton calls `jit_post_compile_hook` once per new
specialisation in a process (compiled, or read from its disk cache); this module counts them,
and each one after an engine marked itself started is logged with its kernel's name, so the miss
is found and added to the warm-up instead of being felt as a silent request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

_lock = threading.Lock()
_local = threading.local()  # .starting: how deep this thread is inside engines' start-ups
_count = 0
_after_start = 0
_any_started = False
_installed = False


def install() -> bool:
    """Hook Triton's compiler (idempotent, chaining a hook already set); False without Triton's hook."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        previous = runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            _seen(kwargs.get("fn"))
            return previous(*args, **kwargs) if previous else None

        runtime.jit_post_compile_hook = hook
        _installed = True
        return True


@contextmanager
def starting() -> Iterator[None]:
    """An engine's start-up runs inside this: its compiles are expected; once one has ended, a
    compile outside every start-up is a request's."""
    global _any_started
    _local.starting = getattr(_local, "starting", 0) + 1
    try:
        yield
    finally:
        _local.starting -= 1
        _any_started = True


def _seen(fn) -> None:
    global _count, _after_start
    late = _any_started and not getattr(_local, "starting", 0)
    with _lock:
        _count += 1
        _after_start += late
    if late:
        log.warning("kernel %s compiled while serving: a request waited for it (the start-up warm-up missed it)",
                    getattr(fn, "name", fn))


def count() -> int:
    """Kernel specialisations this process has compiled or loaded so far."""
    return _count


def after_start() -> int:
    """Of those, the ones compiled outside every engine's start-up, after one had started."""
    return _after_start
