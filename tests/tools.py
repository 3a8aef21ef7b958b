"""What a test needs from the machine: a program (mosquitto, openssl, systemd-analyze, ...), a
Python module, a PostgreSQL server.

Missing, the test skips where a developer runs it and says how to get it; where CI runs
(`CI=true`, as .ci/run installs everything) it fails, so a tool lost from CI cannot turn its tests
into quiet passes. GPU tests are not this: they skip without a GPU everywhere (`-m gpu`).
"""

import importlib
import os
import shutil

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("true", "1")


def missing(what, how=None):
    """Skip the test, or fail it under CI: `what` is not on this machine (`how` gets it)."""
    message = "%s is not available%s" % (what, " (%s)" % how if how else "")
    if IN_CI:
        pytest.fail("CI=true: " + message, pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require_tool(*names, how=None):
    """The path of each program in `names` (one path for one name), or `missing`."""
    paths = [shutil.which(name) for name in names]
    absent = [name for name, path in zip(names, paths) if path is None]
    if absent:
        missing(" and ".join(absent), how or "bash .ci/run installs it")
    return paths[0] if len(paths) == 1 else paths


def require_module(name, how=None):
    """The imported module `name`, or `missing` (as pytest.importorskip, failing under CI)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing("Python module %r" % name, how or "pip install -e '.[test]' installs it")


def compile_for_gpus(*args: str, timeout: int = 280):
    """`python -m tests.engine.hopper_compile ARGS` with Triton's interpreter off (its compiler
    and ptxas, no GPU needed), from the repository root; its run, once it said it compiled."""
    import subprocess
    import sys

    require_module("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.engine.hopper_compile", *args], env=env,
                          capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
    return done
