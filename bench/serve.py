"""The service at engine speed: a gRPC load generator in the shape of vLLM's serving benchmark.

Each server variant (`--server NAME:FLAGS`, e.g. the engine core in a thread or in its own
process, or an older install through PYTHONPATH=...) is started as `jetserve serve` in its own
process. N concurrent streams (`--concurrency`, each sending `--rounds` requests back to back) or
a Poisson request rate (`--request-rate`), random prompt token ids (fresh for every request: no
prefix-cache hits), `--output-len` tokens each (one or several lengths), greedy, EOS ignored; a
warm-up run with the timed settings first, then `--repeats` timed runs (min and median). TTFT,
ITL (per message, i.e. per engine step as vLLM counts it) and TPOT p50/p90/p99 and tok/s, two ways:
whole run (every token over first request sent → last token, ramp and tail included: vLLM's
serving benchmark's output throughput) and steady state (the tokens delivered while every
stream decodes: from the moment the last stream got its first token until the first stream
got its last).

The engine alone (`LLMEngine` in this process, built from the servers' own engine flags, async
scheduling included) in the same run gives two baselines. "The engine's tok/s at that batch":
batch × steps ÷ the time of `--engine-steps` consecutive decode steps of that many sequences
(no prefill in them; synchronised at both ends only, so async scheduling overlaps as it does
when serving), timed around the run's mean context (prompt + half the output), median of three
windows. "of step" = served tok/s ÷ that, steady state (the issue's ratio: decode against
decode) and whole run (which the streams' prefills keep below 100% on their own). And the very
same workload (same arrivals, prompt and output lengths) driven by the engine with no server
("of engine" = whole-run served ÷ that: what the service costs, admission included). Idle TTFT
is split into the engine's prefill and the service's own part (gRPC and admission; IPC and the
core's loop).

The load comes from `--client-processes` processes (grpc.aio each, streams spread over them, one
start time): each reports the CPU it used over its run, so a client that was the bottleneck
shows (`client_cpu`: the busiest process's CPU-seconds per second, near 1.0 = bound). The
server's CPU per delivered token is read from /proc (front end, and core process).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

from jetserve.bench.common import SHAPES, free_port, median, percentile, stop_server, wait_serving, write_results


def add_arguments(p):
    p.add_argument("--model", help="checkpoint directory, or demo (default: random weights of --shape)")
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", default="1,8,32", help="concurrent streams, comma-separated")
    p.add_argument("--request-rate", type=float, help="also a run of Poisson arrivals at this many requests/s "
                                                      "(as many requests as the largest concurrency's run)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", default="256", help="output tokens per request, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream in a timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting (min and median)")
    p.add_argument("--server", action="append", metavar="NAME:FLAGS",
                   help="a server variant: extra `jetserve serve` flags, and ENV=VALUE words for its environment "
                        "(default: process:--engine-core-process)")
    p.add_argument("--serve-flags", default="",
                   help="engine flags every server and the engine alone get (e.g. --speculative-config ...)")
    p.add_argument("--engine-steps", type=int, default=64, help="decode steps in each timed window (engine alone)")
    p.add_argument("--client-processes", type=int,
                   help="load generator processes (default: one per 8 streams, at most half the CPUs)")


def _ints(text):
    return [int(x) for x in text.split(",") if x]


_START = time.monotonic()


def _progress(text: str) -> None:
    """Where the run is, with the seconds since it began (stderr: stdout is the results')."""
    print("[bench serve %5.0f s] %s" % (time.monotonic() - _START, text), file=sys.stderr, flush=True)


def run(args) -> dict:
    import tempfile
    from pathlib import Path

    from jetserve import DEMO_MODEL, demo_model_dir

    concurrency, output_lens = _ints(args.concurrency), _ints(args.output_len)
    settings = [Setting(f"{c}x{o}", c, o) for o in output_lens for c in concurrency]
    if args.request_rate:
        settings += [Setting("%g/s x%d" % (args.request_rate, o), max(concurrency), o, args.request_rate)
                     for o in output_lens]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _random_model(args, Path(tmp) / args.shape)
        if model == DEMO_MODEL and not os.path.isdir(model):
            model = demo_model_dir()  # a path: `serve` adds no demo defaults the engine alone would lack
        engine_flags = ["--model", model, "--device", args.device, "--dtype", args.dtype,
                        "--max-num-seqs", str(max(concurrency)),
                        "--max-model-len", str(args.prompt_len + max(max(output_lens), 3 * args.engine_steps) + 16),
                        "--cudagraph-capture-sizes", ",".join(map(str, concurrency)),
                        *shlex.split(args.serve_flags)]
        _progress("engine flags: %s" % " ".join(engine_flags))
        engine = _engine_alone(args, engine_flags, settings)
        result = {"model": args.model or args.shape, "prompt_len": args.prompt_len, "output_lens": output_lens,
                  "rounds": args.rounds, "request_rate": args.request_rate, "engine_flags": engine_flags[2:],
                  "engine": engine, "servers": {}, "env": _env(engine)}
        for spec in args.server or ["process:--engine-core-process"]:
            name, _, flags = spec.partition(":")
            result["servers"][name] = _serve_and_load(args, engine_flags, flags, settings, engine)
            _print_table(dict(result, servers={name: result["servers"][name]}))
            write_results(args.out, result, {"serve": _plot(result)})  # each server's, kept if a later one fails
    return result


def _random_model(args, path):
    import torch

    from jetserve.bench.common import random_checkpoint

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else (
        "cpu" if args.device == "auto" else args.device)
    random_checkpoint(args.shape, path, torch.bfloat16 if device.startswith("cuda") else torch.float32,
                      torch.device("cpu"))
    return str(path)


# -- the engine alone ----------------------------------------------------------------------------

def _engine_alone(args, engine_flags, settings) -> dict:
    """With no server: the engine's decode tok/s at each batch and output length (the module's
    docstring says how), a `prompt_len` prefill, and the timed workloads themselves (tok/s,
    TTFT), on an engine built from the servers' own flags."""
    import random

    from jetserve.engine import EngineArgs, SamplingParams
    from jetserve.engine.core import Abort, AddRequest, EngineCore

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    config = EngineArgs.from_cli_args(parser.parse_known_args(engine_flags)[0]).resolve()
    if config.device == "cpu":  # the threads the engine core process takes there (core.py)
        import torch
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    engine = EngineCore(config)  # the core alone: text is the front end's
    vocab = config.model_config.vocab_size
    rng = random.Random(1)
    ids = iter(range(10**9))

    def prompt():
        return [rng.randrange(vocab) for _ in range(args.prompt_len)]

    def finish():
        """Every request out (an async step's last launch is waited for by the next timing's sync)."""
        engine.abort(Abort(list(engine.requests)))

    def timed_steps(n):
        """Seconds a step over `n` consecutive steps, synchronised at both ends only."""
        _sync(config.device)
        start = time.perf_counter()
        for _ in range(n):
            engine.step()
        _sync(config.device)
        return (time.perf_counter() - start) / n

    out = {"device": config.device, "dtype": config.dtype, "cuda_graphs": bool(config.cuda_graphs),
           "async_scheduling": config.async_scheduling, "num_speculative_tokens": config.num_speculative_tokens,
           "engine_steps": args.engine_steps, "step_ms": {}, "step_ms_windows": {}, "prefill_ms": None,
           "workload": {}}
    most = config.max_model_len - args.prompt_len
    for warm in (True, False):  # a first pass warms every shape (Triton, graphs) up
        prefills = []
        for _ in range(3):
            engine.add_request(AddRequest(str(next(ids)), prompt(), SamplingParams(
                temperature=0, max_tokens=1, ignore_eos=True), time.monotonic()))
            prefills.append(timed_steps(1))
            finish()
        out["prefill_ms"] = median(prefills) * 1e3
        for setting in settings:
            if setting.rate:
                continue
            steps = args.engine_steps if not warm else 4
            for _ in range(setting.concurrency):
                engine.add_request(AddRequest(str(next(ids)), prompt(), SamplingParams(
                    temperature=0, max_tokens=most, ignore_eos=True), time.monotonic()))
            # Every prompt computed and the context where the three windows centre on the run's mean.
            first = max(1, setting.output_len // 2 - 3 * steps // 2)
            while engine.scheduler.waiting or any(s.num_output_tokens < first for s in engine.scheduler.running):
                engine.step()
            windows = [timed_steps(steps) * 1e3 for _ in range(3)]
            finish()
            out["step_ms"][setting.name], out["step_ms_windows"][setting.name] = median(windows), windows
        _progress("engine alone%s: step %s ms, %d-token prefill %.2f ms" % (
            " (warm-up)" if warm else "", {b: round(t, 3) for b, t in out["step_ms"].items()}, args.prompt_len,
            out["prefill_ms"]))
    for setting in settings:
        output = SamplingParams(temperature=0, max_tokens=setting.output_len, ignore_eos=True)
        runs = [_engine_workload(engine, args, setting, prompt, output, ids)
                for _ in range(1 + args.repeats)][1:]  # the first warms this workload's shapes up
        out["workload"][setting.name] = {"tok_s_median": median([r["tok_s"] for r in runs]),
                                         "tok_s_min": min(r["tok_s"] for r in runs),
                                         "tok_s_max": max(r["tok_s"] for r in runs),
                                         "ttft_ms_p50": median([r["ttft_ms_p50"] for r in runs])}
        _progress("engine alone, workload %s: %.0f tok/s" % (setting.name,
                                                              out["workload"][setting.name]["tok_s_median"]))
    engine = None  # freed (the closures above share the name, so not `del`) before _free
    _free(config.device)
    return out


@dataclass(frozen=True)
class Setting:
    """A timed run's shape: `concurrency` streams of `rounds` requests each, or (with `rate`) as
    many requests at Poisson arrivals; `output_len` tokens each."""

    name: str
    concurrency: int
    output_len: int
    rate: float | None = None


def _arrivals(args, setting) -> list[float]:
    """Offsets (s) of a Poisson run's requests from its start; [] for a closed loop."""
    import random

    if not setting.rate:
        return []
    rng, t, times = random.Random(1), 0.0, []
    for _ in range(setting.concurrency * args.rounds):
        times.append(t)
        t += rng.expovariate(setting.rate)
    return times


def _engine_workload(engine, args, setting, prompt, params, ids) -> dict:
    """The served workload driven by the engine itself, between its steps: `concurrency` streams
    each sending its next request when its last one finishes, or the Poisson arrivals."""
    from jetserve.engine.core import AddRequest

    arrivals = _arrivals(args, setting)
    left = {} if arrivals else {stream: args.rounds for stream in range(setting.concurrency)}  # requests to send
    sent, owner, first, tokens = {}, {}, [], 0

    def send(stream):
        request_id = str(next(ids))
        engine.add_request(AddRequest(request_id, prompt(), params, time.monotonic()))
        sent[request_id], owner[request_id] = time.perf_counter(), stream
        if stream is not None:
            left[stream] -= 1

    start = time.perf_counter()
    for stream in list(left):
        send(stream)
    while engine.has_work() or arrivals:
        now = time.perf_counter() - start
        while arrivals and arrivals[0] <= now:
            arrivals.pop(0)
            send(None)
        if not engine.has_work():
            time.sleep(max(0.0, arrivals[0] - now))
            continue
        for out in engine.step():
            n = len(out.token_ids)
            if n and out.request_id in sent:
                first.append((time.perf_counter() - sent.pop(out.request_id)) * 1e3)
            tokens += n
            stream = owner[out.request_id]
            if out.finish_reason is not None and stream is not None and left[stream]:
                send(stream)
    return {"tok_s": tokens / (time.perf_counter() - start), "ttft_ms_p50": percentile(first, 50)}


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


# -- the servers and their load ----------------------------------------------------------------

def _serve_and_load(args, engine_flags, flags, settings, engine) -> dict:
    words = shlex.split(flags)
    env = dict(os.environ, **dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w)))
    flags = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
    port = free_port()
    command = [sys.executable, "-m", "jetserve.cli", "serve", *engine_flags, "--port", str(port),
               "--metrics-port", "0", "--openai-port", "0", "--log-level", "WARNING", *flags]
    server = subprocess.Popen(command, env=env, cwd="/")
    try:
        target = "127.0.0.1:%d" % port
        wait_serving(target, server)
        _progress("server %s serving" % (flags or "(no extra flags)"))
        return _load_all(args, target, settings, engine, server.pid)
    finally:
        stop_server(server)


def _load_all(args, target, settings, engine, server_pid) -> dict:
    import multiprocessing

    vocab = _vocab(target)
    processes = args.client_processes or max(1, min(-(-max(s.concurrency for s in settings) // 8), len(os.sched_getaffinity(0)) // 2))
    seeds = iter(range(10**9))

    def job(**kw):
        return {"target": target, "vocab": vocab, "prompt_len": args.prompt_len, "rounds": args.rounds,
                "streams": 0, "arrivals": None, "sequential": 0, "seed": next(seeds), **kw}

    out = {"client_processes": processes, "settings": {}}
    # spawn, not fork: grpc's C core does not survive a fork of a process that used it
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.map(_client_ready, range(processes), chunksize=1)
        idle = _run_jobs(pool, [job(sequential=3 + 8, output_len=1)])["results"][3:]
        client = median([(r["stamps"][0] - r["start"]) * 1e3 for r in idle])
        server = median([r["server_ttft"] * 1e3 for r in idle])
        prefill = engine["prefill_ms"]
        # TTFT of one prompt on an idle server = the engine's prefill + the service's own part:
        # gRPC and admission (client − server's arrival-to-first-token), IPC and the core's loop (the rest).
        out["idle_ttft"] = {"client_ms": client, "server_ms": server, "engine_prefill_ms": prefill,
                            "service_ms": client - prefill, "grpc_and_admission_ms": client - server,
                            "ipc_and_core_loop_ms": server - prefill}
        for setting in settings:
            c, n = setting.concurrency, min(processes, setting.concurrency)
            _run_jobs(pool, _jobs(args, setting, n, job))  # warm-up: the timed settings once
            cpu0, wall0 = _server_cpu(server_pid), time.monotonic()
            runs = [summarize(_run_jobs(pool, _jobs(args, setting, n, job))) for _ in range(args.repeats)]
            cpu1, wall = _server_cpu(server_pid), time.monotonic() - wall0
            tokens = sum(r["tokens"] for r in runs)
            # a closed loop of c streams runs batches of c; Poisson arrivals run whatever has come
            step_ms = None if setting.rate else engine["step_ms"][setting.name]
            step_tok_s = step_ms and c * 1e3 / step_ms
            workload_tok_s = engine["workload"][setting.name]["tok_s_median"]
            served = median([r["tok_s"] for r in runs])
            steady = None if setting.rate else [r["steady_tok_s"] for r in runs]
            steady = steady if steady and None not in steady else None
            out["settings"][setting.name] = {
                      "concurrency": c, "output_len": setting.output_len, "rate": setting.rate, "runs": runs,
                      "tok_s_min": min(r["tok_s"] for r in runs), "tok_s_median": served,
                      "steady_tok_s_min": steady and min(steady), "steady_tok_s_median": steady and median(steady),
                      "engine_step_ms": step_ms, "engine_step_tok_s": step_tok_s,
                      "of_step_steady": steady and median(steady) / step_tok_s,
                      "of_step_steady_min": steady and min(steady) / step_tok_s,
                      "of_step": step_tok_s and served / step_tok_s,
                      "engine_workload_tok_s": workload_tok_s, "of_engine": served / workload_tok_s,
                      "of_engine_min": min(r["tok_s"] for r in runs) / workload_tok_s,
                      "tpot_over_step": step_ms and median([r["tpot_ms"]["p50"] for r in runs]) / step_ms,
                      "client_cpu": max(r["client_cpu"] for r in runs),
                      "frontend_cpu": (cpu1[0] - cpu0[0]) / wall, "core_cpu": (cpu1[1] - cpu0[1]) / wall,
                      "frontend_cpu_us_per_token": (cpu1[0] - cpu0[0]) * 1e6 / tokens}
            _progress("served %s: %.0f tok/s (steady %s), %.0f%% of the engine on it" % (
                setting.name, served, steady and round(median(steady)), 100 * served / workload_tok_s))
    return out


def _jobs(args, setting, processes, job) -> list[dict]:
    """The run's streams (or Poisson arrivals) spread over the client processes."""
    if setting.rate:
        arrivals = _arrivals(args, setting)
        return [job(arrivals=arrivals[i::processes], output_len=setting.output_len) for i in range(processes)]
    c = setting.concurrency
    return [job(streams=c // processes + (i < c % processes), output_len=setting.output_len)
            for i in range(processes)]


def _run_jobs(pool, jobs) -> dict:
    """Every job at one start time, each in its own client process; their results merged."""
    start = time.monotonic() + 0.2
    done = pool.map(_client, [dict(j, start_at=start) for j in jobs], chunksize=1)
    results = [r for d in done for r in d["results"]]
    return {"start": start, "results": results, "client_cpu": max(d["cpu"] / d["wall"] for d in done)}


def summarize(run) -> dict:
    """A timed run's latencies and tok/s: whole run, and steady state (closed loop: while every
    stream decodes, from the last stream's first token to the first stream's last)."""
    results = run["results"]
    ttft = [(r["stamps"][0] - r["start"]) * 1e3 for r in results]
    itl = [(b - a) * 1e3 for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) * 1e3 / (sum(r["counts"]) - 1)
            for r in results if sum(r["counts"]) > 1]
    tokens = sum(sum(r["counts"]) for r in results)
    wall = max(r["stamps"][-1] for r in results) - run["start"]
    streams: dict = {}
    for r in results:
        if r["stream"] is not None:
            first, last = streams.get(r["stream"], (r["stamps"][0], r["stamps"][-1]))
            streams[r["stream"]] = (min(first, r["stamps"][0]), max(last, r["stamps"][-1]))
    steady = None
    if streams:
        begin, end = max(f for f, _ in streams.values()), min(last for _, last in streams.values())
        if end > begin:
            steady = sum(n for r in results for t, n in zip(r["stamps"], r["counts"]) if begin < t <= end) / (
                end - begin)

    def pcts(values):
        return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}

    return {"tok_s": tokens / wall, "steady_tok_s": steady, "ttft_ms": pcts(ttft), "itl_ms": pcts(itl),
            "tpot_ms": pcts(tpot), "requests": len(results), "tokens": tokens,
            "messages": sum(len(r["stamps"]) for r in results),
            "client_cpu": run["client_cpu"]}


def _server_cpu(pid) -> tuple[float, float]:
    """CPU-seconds used so far by the server's own process (the front end) and by its children
    (the engine core), from /proc."""
    def cpu(p):
        fields = open(f"/proc/{p}/stat").read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        children += open(f"/proc/{pid}/task/{task}/children").read().split()
    return cpu(pid), sum(cpu(c) for c in children)


def _client_ready(_):
    """Each client process up, grpc imported, before any timed run."""
    import grpc  # noqa: F401

    from jetserve.v1 import inference_pb2_grpc  # noqa: F401


def _client(job) -> dict:
    """One client process's share of a run: its streams (or arrivals), from `start_at` on."""
    import asyncio

    return asyncio.run(_client_run(job))


async def _client_run(job) -> dict:
    import asyncio
    import random

    import grpc

    from jetserve.v1 import inference_pb2 as pb
    from jetserve.v1 import inference_pb2_grpc as pb_grpc

    rng = random.Random(job["seed"])
    results = []
    async with grpc.aio.insecure_channel(job["target"]) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        await channel.channel_ready()

        async def one(output_len, stream=None):
            ids = [rng.randrange(job["vocab"]) for _ in range(job["prompt_len"])]  # fresh: no prefix-cache hit
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingOptions(
                temperature=0, max_tokens=output_len, ignore_eos=True))
            start, stamps, counts, server_ttft = time.monotonic(), [], [], None
            async for reply in stub.Generate(request):
                if reply.token_ids:
                    stamps.append(time.monotonic())
                    counts.append(len(reply.token_ids))
                if reply.HasField("timing"):
                    server_ttft = reply.timing.time_to_first_token_s
            results.append({"stream": stream, "start": start, "stamps": stamps, "counts": counts,
                            "server_ttft": server_ttft})

        async def stream(number):
            for _ in range(job["rounds"]):
                await one(job["output_len"], (job["seed"], number))

        await asyncio.sleep(max(0.0, job["start_at"] - time.monotonic()))
        cpu, wall = time.process_time(), time.monotonic()
        if job["sequential"]:
            for _ in range(job["sequential"]):
                await one(job["output_len"])
        elif job["arrivals"] is not None:
            tasks = []
            for offset in job["arrivals"]:
                await asyncio.sleep(max(0.0, job["start_at"] + offset - time.monotonic()))
                tasks.append(asyncio.create_task(one(job["output_len"])))
            await asyncio.gather(*tasks)
        else:
            await asyncio.gather(*(stream(i) for i in range(job["streams"])))
        return {"results": results, "cpu": time.process_time() - cpu, "wall": time.monotonic() - wall}


def _vocab(target) -> int:
    import grpc

    from jetserve.v1 import inference_pb2 as pb
    from jetserve.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        return pb_grpc.InferenceServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest()).vocab_size


def _env(engine) -> dict:
    import torch

    from jetserve.bench.common import environment
    return {**environment(torch.device(engine["device"])), "cpus": len(os.sched_getaffinity(0)),
            "load_average": os.getloadavg()}


def _print_table(result):
    print("\n| server | setting | engine step ms | served tok/s, whole run (median, min) | steady | of step: steady "
          "(median, min) | whole run | of engine (median, min) | TPOT p50 / step | ITL p50/p99 ms | "
          "TTFT p50/p99 ms | client CPU | front-end CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def pct(x):
        return "%.0f%%" % (100 * x) if x else "–"

    for name, runs in result["servers"].items():
        for setting, r in runs["settings"].items():
            best = min(r["runs"], key=lambda x: x["tpot_ms"]["p50"])
            print("| %s | %s | %s | %.0f, %.0f | %s | %s, %s | %s | %s, %s | %s | %.2f / %.2f | %.1f / %.1f | "
                  "%.2f | %.2f (%.0f µs/token) |" % (
                      name, setting, "%.3f" % r["engine_step_ms"] if r["engine_step_ms"] else "–",
                      r["tok_s_median"], r["tok_s_min"],
                      "%.0f" % r["steady_tok_s_median"] if r["steady_tok_s_median"] else "–",
                      pct(r["of_step_steady"]), pct(r["of_step_steady_min"]), pct(r["of_step"]),
                      pct(r["of_engine"]), pct(r["of_engine_min"]),
                      "%.3f" % r["tpot_over_step"] if r["tpot_over_step"] else "–",
                      best["itl_ms"]["p50"], best["itl_ms"]["p99"], best["ttft_ms"]["p50"], best["ttft_ms"]["p99"],
                      r["client_cpu"], r["frontend_cpu"], r["frontend_cpu_us_per_token"]))
        t = runs["idle_ttft"]
        print("%s: idle TTFT %.2f ms = engine prefill %.2f ms + service %.2f ms (gRPC and admission %.2f, "
              "IPC and core loop %.2f)" % (name, t["client_ms"], t["engine_prefill_ms"], t["service_ms"],
                                          t["grpc_and_admission_ms"], t["ipc_and_core_loop_ms"]))


def _plot(result):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    engine = result["engine"]
    labels, bars = [], {"of the engine's step, steady state": [], "of the engine's step, whole run": [],
                        "of the engine on the same workload": []}
    for output_len in result["output_lens"]:
        closed = {name: s for name, s in next(iter(result["servers"].values()))["settings"].items()
                  if not s["rate"] and s["output_len"] == output_len}
        c = [s["concurrency"] for s in closed.values()]
        left.plot(c, [s["engine_step_tok_s"] for s in closed.values()], "k--o", alpha=0.4 + 0.6 * (output_len ==
                  result["output_lens"][-1]), label=f"engine decode at that batch, output {output_len}")
        left.plot(c, [engine["workload"][n]["tok_s_median"] for n in closed], "k:s",
                  label=f"engine alone, same workload, output {output_len}")
    for name, runs in result["servers"].items():
        for output_len in result["output_lens"]:
            closed = [s for s in runs["settings"].values() if not s["rate"] and s["output_len"] == output_len]
            left.plot([s["concurrency"] for s in closed], [s["steady_tok_s_median"] or 0 for s in closed], "-o",
                      label=f"{name} (gRPC), steady, output {output_len}")
            left.plot([s["concurrency"] for s in closed], [s["tok_s_median"] for s in closed], "-^",
                      label=f"{name} (gRPC), whole run, output {output_len}")
        for setting, s in runs["settings"].items():
            labels.append(f"{name}\n{setting}" if len(result["servers"]) > 1 else setting)
            bars["of the engine's step, steady state"].append((s["of_step_steady"] or 0) * 100)
            bars["of the engine's step, whole run"].append((s["of_step"] or 0) * 100)
            bars["of the engine on the same workload"].append(s["of_engine"] * 100)
    x = range(len(labels))
    for i, (label, values) in enumerate(bars.items()):
        right.bar([j + (i - 1) * 0.27 for j in x], values, 0.27, label=label)
    right.set_xticks(list(x), labels, fontsize=7)
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrent streams")
    left.set_ylabel("tokens/s")
    left.legend(fontsize=6)
    right.axhline(90, color="k", ls="--", lw=1)
    right.set_ylabel("served tok/s, % of the engine's")
    right.legend(fontsize=7, loc="lower left")
    fig.suptitle("jetserve bench serve: %s, prompt %d, output %s (%s)" % (
        result["model"], result["prompt_len"], "/".join(map(str, result["output_lens"])),
        result["env"].get("gpu", "CPU")))
    return fig
