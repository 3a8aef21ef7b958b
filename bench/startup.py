"""Start-up as a user meets it: `jetserve serve` launched, time until SERVING and the first answer.

Each run launches the real server (`python -m jetserve.cli serve`, the flags given) with its own
caches (jetserve's, Triton's and inductor's under one directory): `fresh` with empty ones, as a
new device or one after a JetPack/driver/torch/Triton update; `warm` again over the caches the
fresh run left. It records the seconds from launch to gRPC health SERVING, to the first streamed
token of a short fresh prompt and to that request's end, each start-up phase the engine logged
(`start-up: <phase> in <s> s`: import, weights, kernels chosen, KV plan, kernels compiled, graph
capture or CPU programs) and every kernel the server compiled after it started serving (the
engine logs each: a request waited for it). With --long-prompt N, two fresh N-token prompts
follow (max_tokens 1, beside --beside streams decoding): the first one's TTFT against the
second's shows what a request pays for anything first used at that length. With --settle S they
come S seconds after the first answer, once the server has done what it defers past SERVING.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PHASE = re.compile(r"start-up: (.+?) in ([0-9.]+) s")
LATE = "compiled while serving"


def add_arguments(p):
    p.add_argument("--shape", default="demo", help="demo (the bundled model), or a random-weight Qwen3 shape: "
                                                   "qwen3-0.6b, qwen3-4b")
    p.add_argument("--model", help="serve this checkpoint instead of --shape")
    p.add_argument("--serve-flags", default="", help="more `jetserve serve` flags, e.g. '--dtype bfloat16 "
                                                     "--quantization int4'")
    p.add_argument("--runs", default="fresh,warm", help="fresh and/or warm, in order (warm reuses fresh's caches)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--long-prompt", type=int, default=0, help="tokens of the two long prompts (0: none)")
    p.add_argument("--beside", type=int, default=0, help="streams decoding while the long prompts run")
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds the server idles after its first answer, before the long prompts (its work "
                        "deferred past SERVING done): their TTFT in steady state rather than in its first seconds")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take to serve")
    p.add_argument("--work", help="folder for the random checkpoint and the caches (default: a temporary one)")


def run(args) -> dict:
    from jetserve.bench.common import write_results

    work = Path(args.work or tempfile.mkdtemp(prefix="jetserve-startup-"))
    model = args.model or _model(args.shape, work)
    caches = work / "caches"
    result = {"bench": "startup", "model": args.model or args.shape, "serve_flags": args.serve_flags, "runs": {}}
    for name in args.runs.split(","):
        if name == "fresh" and caches.exists():
            subprocess.run(["rm", "-rf", str(caches)], check=True)
        result["runs"][name] = _one(args, model, caches, name)
        _print_run(name, result["runs"][name])
    figures = {"startup": _plot(result)} if args.out else {}
    write_results(args.out, result, figures)
    return result


def _model(shape: str, work: Path) -> str:
    if shape == "demo":
        return "demo"
    path = work / shape
    if not (path / "config.json").exists():
        import torch

        from jetserve.bench.common import random_checkpoint

        random_checkpoint(shape, path, torch.bfloat16, torch.device("cpu"))
    return str(path)


def _one(args, model: str, caches: Path, name: str) -> dict:
    from jetserve.bench.common import free_port, stop_server, wait_serving

    env = dict(os.environ, JETSERVE_CACHE_DIR=str(caches / "jetserve"), TRITON_CACHE_DIR=str(caches / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), PYTHONUNBUFFERED="1")
    port = free_port()
    log_path = caches.parent / f"serve-{name}.log"
    caches.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "jetserve.cli", "serve", "--model", model, "--port", str(port),
               "--openai-port", "0", "--metrics-port", "0", "--log-level", "INFO", *shlex.split(args.serve_flags)]
    with open(log_path, "w") as log_file:
        launched = time.monotonic()
        server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd="/")
        copier = threading.Thread(target=_timestamped, args=(server.stdout, log_file, launched), daemon=True)
        copier.start()
        try:
            target = "127.0.0.1:%d" % port
            out = {"serving_s": round(wait_serving(target, server, launched + args.timeout) - launched, 2)}
            first, done = _generate(target, args.prompt_len, 8, seed=1)
            out["first_token_s"], out["first_answer_s"] = round(first - launched, 2), round(done - launched, 2)
            if args.long_prompt:
                time.sleep(args.settle)
                out["long_prompt_ttft_s"] = _long_prompts(target, args.long_prompt, args.beside)
        finally:
            stop_server(server)
            copier.join(10)
    text = log_path.read_text(errors="replace")
    out["phases_s"] = {m.group(1): float(m.group(2)) for m in PHASE.finditer(text)}
    out["late_compiles"] = [line.split(" kernel ", 1)[-1].split(" compiled")[0]
                            for line in text.splitlines() if LATE in line]
    out["log"] = str(log_path)
    return out


def _timestamped(stream, log_file, launched: float) -> None:
    """The server's output into the log, each line (and each progress bar's update) stamped with
    the seconds since launch: the timeline between the phases the engine logs."""
    for line in iter(stream.readline, b""):
        for part in line.decode(errors="replace").replace("\r", "\n").splitlines():
            if part.strip():
                log_file.write(f"[{time.monotonic() - launched:7.2f}] {part.strip()}\n")
    log_file.flush()


def _generate(target: str, prompt_len: int, max_tokens: int, seed: int) -> tuple[float, float]:
    """One request of fresh random ids (no prefix-cache hit): (first token, end) on the monotonic clock."""
    import random

    import grpc

    from jetserve.v1 import inference_pb2 as pb
    from jetserve.v1 import inference_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        vocab = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).vocab_size or 1000
        ids = [rng.randrange(vocab) for _ in range(prompt_len)]
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingOptions(
            temperature=0, max_tokens=max_tokens, ignore_eos=True))
        first = None
        for reply in stub.Generate(request, timeout=900):
            if reply.token_ids and first is None:
                first = time.monotonic()
        return first, time.monotonic()


def _long_prompts(target: str, tokens: int, beside: int) -> list[float]:
    """TTFTs of two fresh `tokens`-token prompts in turn, `beside` streams decoding meanwhile."""
    stop = threading.Event()

    def decode(seed):
        while not stop.is_set():
            _generate(target, 16, 64, seed)

    streams = [threading.Thread(target=decode, args=(100 + i,), daemon=True) for i in range(beside)]
    for stream in streams:
        stream.start()
    try:
        ttfts = []
        for seed in (2, 3):
            sent = time.monotonic()
            first, _ = _generate(target, tokens, 1, seed)
            ttfts.append(round(first - sent, 3))
        return ttfts
    finally:
        stop.set()
        for stream in streams:
            stream.join(120)


def _print_run(name: str, run: dict) -> None:
    phases = ", ".join(f"{k} {v:.1f}" for k, v in run["phases_s"].items())
    long = f"; long prompt TTFT first/second {run['long_prompt_ttft_s']}" if "long_prompt_ttft_s" in run else ""
    print(f"[startup] {name}: SERVING {run['serving_s']:.1f} s, first answer {run['first_answer_s']:.1f} s "
          f"({phases}); {len(run['late_compiles'])} kernels compiled while serving{long}", file=sys.stderr)


def _plot(result: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = list(runs)
    phases = list(dict.fromkeys(p for run in runs.values() for p in run["phases_s"]))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(names)))
    for row, name in enumerate(names):
        left = 0.0
        for phase in phases:
            width = runs[name]["phases_s"].get(phase, 0.0)
            ax.barh(row, width, left=left, label=phase if row == 0 else None)
            left += width
        ax.plot([runs[name]["serving_s"]], [row], "k|", markersize=20)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds from launch (bars: logged phases; tick: SERVING)")
    ax.set_title(f"jetserve serve start-up: {result['model']} {result['serve_flags']}")
    ax.legend(fontsize=7, loc="lower right")
    return fig
