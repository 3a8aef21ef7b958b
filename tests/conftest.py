"""Set-up for the whole suite."""

import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors (tests/engine/
# test_kernels.py). The interpreter is picked when triton is first imported, so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
