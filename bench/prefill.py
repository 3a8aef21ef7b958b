"""Chunked prefill: what a long prompt does to the streams already decoding.

N requests stream tokens; once they are in steady state a long prompt (8k tokens) arrives.
Without chunking its whole prefill is one step, and every stream stalls for it; with a token
budget per step it is split into chunks that ride along with the decodes. Reported per
configuration: the streams' inter-token latency (ITL) p50/p99/max in steady state and while the
long prompt is processed (its arrival to its first token), the long prompt's TTFT (and its ratio
to chunking off), the TTFT of a short prompt on the idle engine (the service's first token is
this prefill step plus the gRPC path), peak memory; and the recommended budget: the shortest
TTFT among those that keep the streams' ITL p99 under a bar (8 ms by default) in every run.
The same for step latency targets (`--targets`: chunks sized by predicted step time under the
`--target-budget` cap), with the chunks the long prompt was cut into and the step cost model's
fit. Each configuration runs `--repeats` times with fresh prompts: the median of each number,
the fastest TTFT and the worst p99 are reported, with every run.
"""

# A run's numbers that are summarized over the repeats (median), and kept per run.
RUN_NUMBERS = ("long_ttft_ms", "steady_itl_p50_ms", "steady_itl_p99_ms", "during_itl_p50_ms", "during_itl_p99_ms",
               "during_itl_max_ms", "during_itl_samples")


def add_arguments(p):
    p.add_argument("--shape", default="qwen3-0.6b", help="random-weight Qwen3 shape")
    p.add_argument("--model", help="use this checkpoint instead")
    p.add_argument("--device", default="auto")
    p.add_argument("--streams", type=int, default=8, help="requests decoding when the long prompt arrives")
    p.add_argument("--stream-prompt-len", type=int, default=256)
    p.add_argument("--long-prompt-len", type=int, default=8192)
    p.add_argument("--budgets", default="128,256,512,1024,2048",
                   help="max_num_batched_tokens with chunking, the latency target off")
    p.add_argument("--targets", default="7,7.5,8", help="max_step_latency_ms values (chunks sized by predicted time)")
    p.add_argument("--target-budget", type=int, default=None,
                   help="max_num_batched_tokens (the hard cap) with a latency target; default: the engine's")
    p.add_argument("--repeats", type=int, default=2, help="runs of each configuration, each with fresh prompts")
    p.add_argument("--steady-steps", type=int, default=24, help="stream steps before and after the long prompt")
    p.add_argument("--jitter", type=float, default=1.5, help="the bar: ITL p99 <= jitter * p50 during the prefill")
    p.add_argument("--short-prompt-len", type=int, default=128, help="the idle engine's TTFT prompt")
    p.add_argument("--cudagraph-mode", default="full", choices=["full", "full_decode_only"],
                   help="full_decode_only: steps with prefill chunks run eagerly (the path before graphed mixed steps)")
    p.add_argument("--itl-p99-ms", type=float, default=8.0,
                   help="the streams' bar: ITL p99 while the long prompt runs; the recommended budget is the one "
                        "with the shortest TTFT of those under it")


def run(args) -> dict:
    import tempfile
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from jetserve.bench.common import environment, peak_memory, random_checkpoint, reset_peak, write_results

    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budgets = [int(b) for b in args.budgets.split(",") if b]
    targets = [float(t) for t in args.targets.split(",") if t]
    result = {"env": environment(device), "shape": args.model or args.shape, "streams": args.streams,
              "cudagraph_mode": args.cudagraph_mode,
              "stream_prompt_len": args.stream_prompt_len, "long_prompt_len": args.long_prompt_len, "configs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if not model_dir:
            hf = random_checkpoint(args.shape, Path(tmp), dtype, device)
            del hf
            model_dir = tmp
        configs = [(None, None), *[(t, None) for t in targets], *[(None, b) for b in budgets]]
        for target, budget in tqdm(configs, desc="[prefill] configurations", unit="config"):
            name = f"target-{target:g}ms" if target else f"chunked-{budget}" if budget else "no-chunking"
            reset_peak(device)
            engine = _engine(args, model_dir, device, budget, target)
            # Warm-up in the same engine: kernel compiles and cuBLAS heuristics for new shapes; with a
            # target, the whole prompt, so the step cost model has seen every depth (as it would in service).
            _measure(args, engine, args.long_prompt_len if target else min(args.long_prompt_len, 2 * (budget or 1024)),
                     seed=1000)
            result["configs"][name] = _repeated(args, [_measure(args, engine, args.long_prompt_len, seed=r)
                                                       for r in range(args.repeats)])
            result["configs"][name].update(_idle_ttft(args, engine))
            result["configs"][name]["peak_memory_MiB"] = (peak_memory(device) or 0) // 2**20 or None
            if target:
                result["configs"][name].update(_fit(engine.scheduler.step_cost))
            del engine
            _summarize(args, result, budgets, targets)
            write_results(args.out, result, {"prefill": _plot(result)})  # partial results survive
    return result


def _repeated(args, runs: list[dict]) -> dict:
    """A configuration's runs as one: the median of each number, the fastest TTFT, the worst ITL
    p99, each run's numbers, and the first run's trace."""
    from jetserve.bench.common import median

    out = dict(runs[0])
    for key in RUN_NUMBERS:
        out[key] = round(median([run[key] for run in runs]), 3)
    out["long_ttft_min_ms"] = min(run["long_ttft_ms"] for run in runs)
    out["during_itl_p99_worst_ms"] = max(run["during_itl_p99_ms"] for run in runs)
    out["during_p99_over_p50"] = round(out["during_itl_p99_ms"] / out["during_itl_p50_ms"], 3)
    out["max_over_steady_p50"] = round(out["during_itl_max_ms"] / out["steady_itl_p50_ms"], 1)
    out["meets_jitter_bar"] = out["during_p99_over_p50"] <= args.jitter
    out["runs"] = [{key: run[key] for key in RUN_NUMBERS} for run in runs]
    return out


def _summarize(args, result, budgets, targets) -> None:
    """TTFT against chunking off, and the recommended budget and target: the shortest TTFT among
    those whose streams' ITL p99 stays under the bar while the long prompt runs, in every run."""
    configs = result["configs"]
    unchunked = configs["no-chunking"]["long_ttft_ms"]
    for data in configs.values():
        data["ttft_over_unchunked"] = round(data["long_ttft_ms"] / unchunked, 2)
    result["itl_p99_bar_ms"] = args.itl_p99_ms
    for key, names in (("recommended_budget", {b: f"chunked-{b}" for b in budgets}),
                       ("recommended_target_ms", {t: f"target-{t:g}ms" for t in targets})):
        ok = [v for v, name in names.items()
              if name in configs and configs[name]["during_itl_p99_worst_ms"] <= args.itl_p99_ms]
        result[key] = min(ok, key=lambda v: configs[names[v]]["long_ttft_ms"]) if ok else None


def _fit(cost) -> dict:
    """The step cost model after the runs: its coefficients and how well they predict the steps
    in its window (median and 90th percentile of |predicted / observed - 1|)."""
    import numpy as np

    n = min(cost.num_observed, len(cost.y))
    errors = np.abs(cost.x[:n] @ cost.coef / cost.y[:n] - 1)
    a, b, c = cost.coef
    return {"cost_model": {"fixed_ms": round(a, 4), "per_token_us": round(b * 1e3, 4),
                           "per_tile_key_ns": round(c * 1e6, 4), "steps_observed": cost.num_observed, "window": n,
                           "error_median": round(float(np.median(errors)), 4) if n else None,
                           "error_p90": round(float(np.percentile(errors, 90)), 4) if n else None}}


def _engine(args, model_dir, device, budget, target):
    """The engine for one budget, or one latency target (under --target-budget), or neither
    (chunking off); graphs for the streams' batch only."""
    from jetserve.engine.config import EngineArgs
    from jetserve.engine.llm_engine import LLMEngine

    length = args.long_prompt_len + 512
    chunked = bool(budget or target)
    return LLMEngine(EngineArgs(
        model=model_dir, device=str(device), max_model_len=length, max_num_seqs=args.streams + 1,
        enable_chunked_prefill=chunked, max_step_latency_ms=target or 0,
        max_num_batched_tokens=(args.target_budget if target else budget) if chunked else length,
        num_kv_blocks=(args.streams + 1) * -(-length // 16) + 1, cudagraph_capture_sizes=[max(1, args.streams)],
        cudagraph_mode=args.cudagraph_mode).resolve())


def _idle_ttft(args, engine, repeats=8) -> dict:
    """A fresh `short_prompt_len`-token prompt alone on the engine, one token: its TTFT, min and
    median of `repeats` (after one warm-up), i.e. one prefill step and its sampling."""
    import time

    import torch

    from jetserve.bench.common import median
    from jetserve.engine.sampling_params import SamplingParams

    rng = torch.Generator().manual_seed(7)
    vocab = engine.config.model_config.vocab_size
    times = []
    for i in range(repeats + 1):
        ids = torch.randint(0, vocab, (args.short_prompt_len,), generator=rng).tolist()
        start = time.perf_counter()
        engine.add_request(f"idle{i}", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    times = times[1:]
    return {"idle_ttft_prompt_len": args.short_prompt_len, "idle_ttft_min_ms": round(min(times) * 1e3, 3),
            "idle_ttft_median_ms": round(median(times) * 1e3, 3)}


def _measure(args, engine, long_len, seed) -> dict:
    """One run: fresh streams in steady state, then a fresh `long_len`-token prompt."""
    import time

    import torch

    from jetserve.bench.common import median, percentile
    from jetserve.engine.sampling_params import SamplingParams

    rng = torch.Generator().manual_seed(seed)
    vocab = engine.config.model_config.vocab_size
    stream = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"s{i}", {"prompt_token_ids": torch.randint(0, vocab, (args.stream_prompt_len,),
                                                                       generator=rng).tolist()}, stream)
    times: dict[str, list[float]] = {}
    arrival = first = None
    steps_after = 0
    warm = 0
    computed = [0]  # the long prompt's computed tokens after each step: its chunks
    while steps_after < args.steady_steps:
        outputs = engine.step()
        now = time.perf_counter()
        if "long" in engine.requests and first is None:
            computed.append(engine.requests["long"].seq.num_computed_tokens)
        for o in outputs:
            times.setdefault(o.request_id, []).append(now)
            if o.request_id == "long":
                first = now
        if arrival is None and len(times) == args.streams:
            warm += 1
            if warm == args.steady_steps:  # steady state reached: the long prompt arrives
                long_ids = torch.randint(0, vocab, (long_len,), generator=rng).tolist()
                engine.add_request("long", {"prompt_token_ids": long_ids},
                                   SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                arrival = time.perf_counter()
        steps_after += first is not None
    for rid in list(engine.requests):
        engine.abort(rid)
    steady, during = [], []
    for rid, stamps in times.items():
        if rid == "long":
            continue
        for a, b in zip(stamps, stamps[1:]):
            if b <= arrival:
                steady.append(b - a)
            elif b <= first:
                during.append(b - a)

    def ms(values, q):
        return round(percentile(values, q) * 1e3, 3)
    out = {"budget": engine.config.max_num_batched_tokens if engine.config.enable_chunked_prefill else None,
           "max_step_latency_ms": engine.config.max_step_latency_ms,
           "long_chunks": [b - a for a, b in zip(computed, [*computed[1:], long_len]) if b > a],
           "long_ttft_ms": round((first - arrival) * 1e3, 2),
           "steady_itl_p50_ms": round(median(steady) * 1e3, 3), "steady_itl_p99_ms": ms(steady, 99),
           "during_itl_p50_ms": ms(during, 50), "during_itl_p99_ms": ms(during, 99),
           "during_itl_max_ms": round(max(during) * 1e3, 3), "during_itl_samples": len(during)}
    out["during_p99_over_p50"] = round(out["during_itl_p99_ms"] / out["during_itl_p50_ms"], 3)
    out["max_over_steady_p50"] = round(out["during_itl_max_ms"] / out["steady_itl_p50_ms"], 1)
    out["meets_jitter_bar"] = out["during_p99_over_p50"] <= args.jitter
    out["itl_trace_ms"] = [round(b * 1e3, 3) for b in _one_stream_gaps(times["s0"])]
    out["arrival_index"] = sum(1 for t in times["s0"] if t <= arrival) - 1
    return out


def _one_stream_gaps(stamps):
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _plot(result):
    from itertools import accumulate

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (trace, bars, trade, chunks) = plt.subplots(1, 4, figsize=(25, 4.8))
    for name, data in result["configs"].items():
        gaps = data["itl_trace_ms"]
        start = data["arrival_index"]
        trace.plot(range(-start, len(gaps) - start), gaps, label=f"{name} (TTFT {data['long_ttft_ms']:.0f} ms)")
    trace.set_yscale("log")
    trace.set_xlabel("stream token index (0: the long prompt arrives)")
    trace.set_ylabel("inter-token latency of one stream, ms")
    trace.set_title(f"{result['streams']} streams + one {result['long_prompt_len']}-token prompt, "
                    f"{result['shape']}, {result['env'].get('gpu', result['env']['device'])}")
    trace.grid(True, which="both", alpha=0.3)
    trace.legend(fontsize=8)
    names = list(result["configs"])
    x = range(len(names))
    for offset, key, label in ((-0.2, "during_itl_p50_ms", "ITL p50"), (0.0, "during_itl_p99_ms", "ITL p99"),
                               (0.2, "during_itl_max_ms", "ITL max")):
        bars.bar([i + offset for i in x], [result["configs"][n][key] for n in names], width=0.2, label=label)
    bars.set_xticks(list(x), names, rotation=20)
    bars.set_yscale("log")
    bars.set_ylabel("ms, while the long prompt is processed")
    bars.grid(True, axis="y", which="both", alpha=0.3)
    bars.legend(fontsize=8)
    by_ttft = sorted(names, key=lambda n: result["configs"][n]["long_ttft_ms"])  # each group as a curve
    budgets = [n for n in by_ttft if not n.startswith("target-")]
    targets = [n for n in by_ttft if n.startswith("target-")]
    for group, style, label in ((budgets, "-", "by max_num_batched_tokens"), (targets, "--", "by step latency target")):
        if not group:
            continue
        for key, marker in (("during_itl_p50_ms", "o"), ("during_itl_p99_ms", "s")):
            trade.plot([result["configs"][n]["long_ttft_ms"] for n in group],
                       [result["configs"][n][key] for n in group], marker + style,
                       label=key.replace("during_itl_", "streams' ITL ").replace("_ms", "") + ", " + label)
        for n in group:
            data = result["configs"][n]
            trade.annotate(n.replace("chunked-", "").replace("target-", ""),
                           (data["long_ttft_ms"], data["during_itl_p99_ms"]), fontsize=8)
    trade.axhline(result["itl_p99_bar_ms"], color="k", ls=":", label="ITL p99 bar")
    trade.set_xlabel("long prompt's TTFT, ms")
    trade.set_ylabel("streams' ITL while it runs, ms")
    trade.set_yscale("log")
    trade.set_title("the trade-off: token budget or step latency target")
    trade.grid(True, which="both", alpha=0.3)
    trade.legend(fontsize=8)
    for name, data in result["configs"].items():
        if data["budget"] and data["long_chunks"]:
            starts = [0, *accumulate(data["long_chunks"][:-1])]
            chunks.step(starts, data["long_chunks"], where="post", marker=".", label=name)
    chunks.set_xlabel("chunk's start in the long prompt (its context)")
    chunks.set_ylabel("prompt tokens in the step")
    chunks.set_title("the long prompt's chunks (first run)")
    chunks.grid(True, alpha=0.3)
    chunks.legend(fontsize=8)
    return fig
