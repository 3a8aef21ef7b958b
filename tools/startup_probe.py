"""Where a process's start goes before the model loads: each step's seconds since the interpreter
began (the device run of issue 26's warm start). `python3 tools/startup_probe.py CHECKPOINT`."""

import sys
import time

import psutil

began = psutil.Process().create_time()
marks = []


def mark(name):
    at = time.time() - began
    print(f"[probe] {name:32s} {at:6.2f} s  (+{at - (marks[-1][1] if marks else 0.0):.2f})", flush=True)
    marks.append((name, at))


mark("interpreter")
import torch  # noqa: E402

mark("import torch")
import triton  # noqa: E402,F401

mark("import triton")
import jetserve.engine.core  # noqa: E402,F401

mark("import jetserve.engine.core")
torch.cuda.init()
mark("torch.cuda.init")
torch.zeros(1, device="cuda")
mark("CUDA context (first tensor)")
from jetserve.engine import EngineArgs  # noqa: E402

config = EngineArgs(model=sys.argv[1], dtype="bfloat16").resolve()
mark("EngineArgs.resolve")
from jetserve.engine.plan import refuse_if_it_cannot_fit  # noqa: E402

refuse_if_it_cannot_fit(config)
mark("fit check (memory plan)")
from jetserve.engine.tokenizer import Tokenizer  # noqa: E402

try:
    Tokenizer.from_pretrained(config.model)
    mark("tokenizer")
except Exception as exc:  # noqa: BLE001 - a random checkpoint may have none
    mark(f"tokenizer ({type(exc).__name__})")
import jetserve.server.app  # noqa: E402,F401

mark("import jetserve.server.app")
