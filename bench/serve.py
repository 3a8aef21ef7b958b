"""The service at engine speed: a gRPC load generator in the shape of vLLM's serving benchmark.

Each server variant (`--server NAME:FLAGS`, e.g. the engine core in a thread or in its own
process, or an older install through PYTHONPATH=...) is started as `jetserve serve` in its own
process; this process only sends requests and reads streams (grpc.aio). N concurrent streams
(`--concurrency`) or a Poisson request rate (`--request-rate`), random prompt token ids (fresh
for every request: no prefix-cache hits), `--output-len` tokens each, greedy, EOS ignored; a
warm-up round first, then `--repeats` timed rounds (min and median reported). TTFT, ITL (per
message, i.e. per engine step as vLLM counts it) and TPOT p50/p90/p99 and total tok/s, next to
the engine's own step time for the same batch, measured in the same run with `LLMEngine`
alone (no server), so "of engine" = served tok/s ÷ (batch ÷ engine step).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time

from jetserve.bench.common import SHAPES, median, percentile, write_results


def add_arguments(p):
    p.add_argument("--model", help="checkpoint directory (default: random weights of --shape)")
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", default="1,8,32", help="concurrent streams, comma-separated")
    p.add_argument("--request-rate", type=float, help="requests/s, Poisson arrivals (instead of --concurrency)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="requests per stream in a timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting (min and median)")
    p.add_argument("--server", action="append", metavar="NAME:FLAGS",
                   help="a server variant: extra `jetserve serve` flags, and ENV=VALUE words for its environment "
                        "(default: thread:--no-engine-core-process and process:--engine-core-process)")
    p.add_argument("--serve-flags", default="", help="flags every server gets (e.g. --cudagraph-capture-sizes 1,8,32)")
    p.add_argument("--engine-steps", type=int, default=64, help="decode steps timed per batch (engine alone)")


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def run(args) -> dict:
    import tempfile
    from pathlib import Path

    concurrency = _ints(args.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _random_model(args, Path(tmp) / args.shape)
        engine = _engine_alone(args, model, concurrency)
        servers = args.server or ["thread:--no-engine-core-process", "process:--engine-core-process"]
        results = {}
        for spec in servers:
            name, _, flags = spec.partition(":")
            results[name] = _serve_and_load(args, model, flags, concurrency, engine)
    result = {"model": args.model or args.shape, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "request_rate": args.request_rate, "engine": engine, "servers": results, "env": _env(engine)}
    write_results(args.out, result, {"serve": _plot(result)})
    _print_table(result)
    return result


def _random_model(args, path):
    import torch

    from jetserve.bench.common import random_checkpoint

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else (
        "cpu" if args.device == "auto" else args.device)
    random_checkpoint(args.shape, path, torch.bfloat16 if device.startswith("cuda") else torch.float32,
                      torch.device("cpu"))
    return str(path)


def _engine_alone(args, model, batches) -> dict:
    """The engine's own step (median ms) at each batch, and a 128-token prefill, with no server."""
    import random

    from jetserve.engine import EngineArgs, SamplingParams
    from jetserve.engine.llm_engine import LLMEngine

    config = EngineArgs(model=model, device=args.device, dtype=args.dtype, max_num_seqs=max(batches),
                        cudagraph_capture_sizes=list(batches),
                        max_model_len=args.prompt_len + args.output_len + args.engine_steps + 16,
                        max_num_batched_tokens=max(512, args.prompt_len * max(batches))).resolve()
    if config.device == "cpu":  # the threads the engine core process takes there (core.py)
        import torch
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    engine = LLMEngine(config)
    vocab = config.model_config.vocab_size
    rng = random.Random(1)
    ids = iter(range(10**9))

    def prompt():
        return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)]}

    def timed_step():
        _sync(config.device)
        start = time.perf_counter()
        outputs = engine.step()
        _sync(config.device)
        return time.perf_counter() - start, outputs

    out = {"device": config.device, "dtype": config.dtype, "cuda_graphs": bool(config.cuda_graphs),
           "step_ms": {}, "prefill_ms": None}
    params = SamplingParams(temperature=0, max_tokens=args.engine_steps + 4, ignore_eos=True)
    for warm in (True, False):  # a first pass warms every shape (Triton, graphs) up
        prefills = []
        for _ in range(3):
            engine.add_request(str(next(ids)), prompt(), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            prefills.append(timed_step()[0])
        out["prefill_ms"] = median(prefills) * 1e3
        for batch in batches:
            for _ in range(batch):
                engine.add_request(str(next(ids)), prompt(), params)
            while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
                engine.step()
            times = [timed_step()[0] for _ in range(args.engine_steps if not warm else 4)]
            for request_id in list(engine.requests):
                engine.abort(request_id)
            out["step_ms"][batch] = median(times) * 1e3
    del engine
    _free(config.device)
    return out


def _sync(device):
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def _free(device):
    import gc
    gc.collect()
    if device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_and_load(args, model, flags, concurrency, engine) -> dict:
    words = shlex.split(flags) + shlex.split(args.serve_flags)
    env = dict(os.environ, **dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w)))
    flags = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
    port = _free_port()
    command = [sys.executable, "-m", "jetserve.cli", "serve", "--model", model, "--device", args.device,
               "--dtype", args.dtype, "--port", str(port), "--metrics-port", "0", "--log-level", "WARNING",
               "--max-num-seqs", str(max(concurrency)),
               "--max-model-len", str(args.prompt_len + args.output_len + 16), *flags]
    server = subprocess.Popen(command, env=env, cwd="/")
    try:
        target = "127.0.0.1:%d" % port
        _wait_serving(target, server)
        import asyncio
        return asyncio.run(_load_all(args, target, concurrency, engine))
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_serving(target, server):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while server.poll() is None:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError("the server exited (code %s) before serving" % server.returncode)


async def _load_all(args, target, concurrency, engine) -> dict:
    import random

    import grpc

    from jetserve.v1 import inference_pb2 as pb
    from jetserve.v1 import inference_pb2_grpc as pb_grpc

    rng = random.Random(0)
    vocab = await _vocab(target)
    out = {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        async def one(output_len):
            ids = [rng.randrange(vocab) for _ in range(args.prompt_len)]  # fresh: no prefix-cache hit
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingOptions(
                temperature=0, max_tokens=output_len, ignore_eos=True))
            start = time.perf_counter()
            stamps, tokens = [], 0
            async for reply in stub.Generate(request):
                if reply.token_ids:
                    stamps.append(time.perf_counter())
                    tokens += len(reply.token_ids)
            return start, stamps, tokens

        idle_ttft = []
        for _ in range(3 + 8):  # an idle server's TTFT for one prompt (the first 3 warm up)
            start, stamps, _ = await one(1)
            idle_ttft.append((stamps[0] - start) * 1e3)
        out["idle_ttft_ms"] = median(idle_ttft[3:])

        for c in concurrency:
            await _round(one, c, 1, None, args.output_len)  # warm-up
            runs = [await _round(one, c, args.rounds, args.request_rate, args.output_len)
                    for _ in range(args.repeats)]
            engine_tok_s = c * 1e3 / engine["step_ms"][c]
            best = max(runs, key=lambda r: r["tok_s"])
            out[c] = {"runs": runs, "tok_s_max": best["tok_s"], "tok_s_median": median([r["tok_s"] for r in runs]),
                      "engine_tok_s": engine_tok_s, "of_engine": median([r["tok_s"] for r in runs]) / engine_tok_s,
                      "tpot_over_step": median([r["tpot_ms"]["p50"] for r in runs]) / engine["step_ms"][c]}
    return out


async def _round(one, concurrency, rounds, rate, output_len) -> dict:
    """`concurrency` streams, each sending `rounds` requests back to back (or, with a rate, that
    many requests in all at Poisson arrivals); latencies and total throughput."""
    import asyncio
    import random

    results = []

    async def stream():
        for _ in range(rounds):
            results.append(await one(output_len))

    start = time.perf_counter()
    if rate:
        rng, tasks = random.Random(1), []
        for _ in range(concurrency * rounds):
            tasks.append(asyncio.create_task(one(output_len)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    else:
        await asyncio.gather(*(stream() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ttft = [(s[0] - t0) * 1e3 for t0, s, _ in results]
    itl = [(b - a) * 1e3 for _, s, _ in results for a, b in zip(s, s[1:])]
    tpot = [(s[-1] - s[0]) * 1e3 / (n - 1) for _, s, n in results if n > 1]
    tokens = sum(n for _, _, n in results)

    def pcts(values):
        return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}

    return {"tok_s": tokens / wall, "ttft_ms": pcts(ttft), "itl_ms": pcts(itl), "tpot_ms": pcts(tpot),
            "requests": len(results), "tokens": tokens, "messages": sum(len(s) for _, s, _ in results)}


async def _vocab(target) -> int:
    import grpc

    from jetserve.v1 import inference_pb2 as pb
    from jetserve.v1 import inference_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        info = await pb_grpc.InferenceServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest())
    return info.vocab_size


def _env(engine) -> dict:
    import torch

    from jetserve.bench.common import environment
    return {**environment(torch.device(engine["device"])), "cpus": len(os.sched_getaffinity(0))}


def _print_table(result):
    engine = result["engine"]
    print("\n| server | streams | engine step ms | engine tok/s | served tok/s (median) | of engine | "
          "TPOT p50/p90/p99 ms | ITL p50/p99 ms | TTFT p50/p99 ms | idle TTFT ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, runs in result["servers"].items():
        for c, r in runs.items():
            if c == "idle_ttft_ms":
                continue
            best = min(r["runs"], key=lambda x: x["tpot_ms"]["p50"])
            print("| %s | %s | %.2f | %.0f | %.0f | %.0f%% | %.2f / %.2f / %.2f | %.2f / %.2f | %.1f / %.1f | %.1f |" % (
                name, c, engine["step_ms"][c], r["engine_tok_s"], r["tok_s_median"], 100 * r["of_engine"],
                best["tpot_ms"]["p50"], best["tpot_ms"]["p90"], best["tpot_ms"]["p99"], best["itl_ms"]["p50"],
                best["itl_ms"]["p99"], best["ttft_ms"]["p50"], best["ttft_ms"]["p99"], runs["idle_ttft_ms"]))
    print("engine alone: %d-token prefill %.2f ms" % (result["prompt_len"], engine["prefill_ms"]))


def _plot(result):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    engine = result["engine"]
    batches = sorted(engine["step_ms"])
    left.plot(batches, [b * 1e3 / engine["step_ms"][b] for b in batches], "k--o", label="engine alone")
    for name, runs in result["servers"].items():
        cs = [c for c in runs if c != "idle_ttft_ms"]
        left.plot(cs, [runs[c]["tok_s_median"] for c in cs], "-o", label="%s (gRPC)" % name)
        right.bar([f"{name}\n{c}" for c in cs], [runs[c]["of_engine"] * 100 for c in cs])
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrent streams")
    left.set_ylabel("tokens/s")
    left.legend()
    right.axhline(90, color="k", ls="--", lw=1)
    right.set_ylabel("% of the engine's tok/s at that batch")
    fig.suptitle("jetserve bench serve: %s, prompt %d, output %d (%s)" % (
        result["model"], result["prompt_len"], result["output_len"], result["env"].get("gpu", "CPU")))
    return fig
