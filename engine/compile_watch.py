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
_seen_reprs: dict[str, list[str]] = {}  # kernel name -> its specialisations so far (Triton's repr)


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
            _seen(kwargs.get("fn"), describe(kwargs.get("compile")))
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


def _seen(fn, spec: str | None = None) -> None:
    global _count, _after_start
    late = _any_started and not getattr(_local, "starting", 0)
    name = getattr(fn, "name", fn)
    with _lock:
        _count += 1
        _after_start += late
        earlier = _seen_reprs.setdefault(str(name), [])
        differs = specialisation_change(earlier, spec) if late and spec else ""
        if spec:
            earlier.append(spec)
    if late:
        log.warning("kernel %s compiled while serving: a request waited for it (the start-up warm-up missed it)%s",
                    name, f"; new in this variant: {differs}" if differs else "")


def describe(compile: dict | None) -> str | None:
    """A variant as `name: type {attributes} = constant` per argument, from what Triton hands
    its hook (signature, the attributes it specialised on, the constexprs); None if it hands
    something else."""
    try:
        attrs, constants = (compile.get("configs") or [{}])[0], compile.get("constants") or {}
        args = []
        for i, (name, kind) in enumerate(compile["signature"].items()):
            text = f"{name}: {kind}"
            if attrs.get((i,)):
                text += f" {attrs[(i,)]}"
            if (i,) in constants:
                text += f" = {constants[(i,)]}"
            args.append(text)
        return f"num_warps={compile.get('num_warps')}, num_stages={compile.get('num_stages')} | " + " | ".join(args)
    except (AttributeError, KeyError, TypeError, IndexError):
        return None


def specialisation_change(earlier: list[str], spec: str) -> str:
    """What sets a new variant apart from the nearest one compiled before (`describe`'s fields),
    so a miss names the argument that caused it."""
    new = spec.split(" | ")
    best = min((e.split(" | ") for e in earlier), key=lambda old: sum(a != b for a, b in zip(old, new)),
               default=None)
    if best is None or len(best) != len(new):
        return spec[:400]
    return "; ".join(f"{b} (was {a})" for a, b in zip(best, new) if a != b)[:400]


def count() -> int:
    """Kernel specialisations this process has compiled or loaded so far."""
    return _count


def after_start() -> int:
    """Of those, the ones compiled outside every engine's start-up, after one had started."""
    return _after_start
