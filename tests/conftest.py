"""Set-up for the whole suite."""

import importlib.util
import os

import pytest

# What `pip install -e ".[test]"` brings beyond `.[serve]` (and torch, which the package never pins).
TEST_MODULES = ("torch", "transformers", "openai", "hypothesis", "pytest_timeout", "grpc_tools", "psycopg",
                "aiomqtt", "PIL")


def _missing(name):
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a parent that fails, or a module blocked in sys.modules
        return True


MISSING = [name for name in TEST_MODULES if _missing(name)]
if MISSING:
    # Before any test file (or a folder's conftest) imports them: one clear line, not a collection
    # error per file.
    pytest.exit('the tests need the test extras: pip install -e ".[test]" (and torch); missing: %s'
                % ", ".join(MISSING), returncode=pytest.ExitCode.USAGE_ERROR)

import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors (tests/engine/
# test_kernels.py). The interpreter is picked when triton is first imported, so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CPU engines run eagerly in the suite (compiling a decode step takes tens of seconds, per engine
# and process): torch's own switch, read by EngineArgs.resolve and inherited by the servers the
# tests start. tests/engine/test_cpu_graphs.py turns it off for its own engines.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
