"""Set-up for the whole suite."""

import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors (tests/engine/
# test_kernels.py). The interpreter is picked when triton is first imported, so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CPU engines run eagerly in the suite (compiling a decode step takes tens of seconds, per engine
# and process): torch's own switch, read by EngineArgs.resolve and inherited by the servers the
# tests start. tests/engine/test_cpu_graphs.py turns it off for its own engines.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
