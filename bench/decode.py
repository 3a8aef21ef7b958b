"""Decode latency: time per output token (TPOT) by batch size.

Ours with CUDA graphs, ours eager (fused Triton kernels, and plain torch with them off), and
transformers (eager `generate`, and static cache + torch.compile) on the same weights in the
same run, against the memory-bandwidth roofline (every weight and the batch's KV read once a
step). On a CPU: ours compiled (engine/cpu_graphs.py), ours eager and transformers eager,
interleaved batch size by batch size in each of `--repeats` rounds with fresh prompts (a
shared machine's load moves within minutes; each round sees the same load for all three),
reported as the median and the min over rounds, with the load average of each round. Random
weights in real Qwen3 shapes (timing only), or a checkpoint (--model). Our TPOT is the wall
time of one engine step (scheduling, sampling and the host sync included); "graph
replay" is the GPU time of the captured step alone (forward, vocab projection and greedy argmax),
and "step overhead" what the engine step adds to it (host work and anything launched around it).
"""

DEFAULT_SHAPES = ["qwen3-0.6b", "qwen3-4b"]
PROGRAM_RANGE = "compiled CPU decode step"  # the profile's name for a compiled step's program
# CPU profile (--profile): profiler op names → where a step's time goes; the first match wins.
PROFILE_FAMILIES = (
    ("products (MKL / oneDNN; ours compiled: the batch program's vocab projection, the rest run inside the programs)",
     ("mkl::_mkl_linear", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm")),
    ("attention (SDPA)", ("scaled_dot_product",)),
    ("compiled program (AOTInductor): the layers' products and C++ loops (norms, RoPE, attention, SiLU)",
     (PROGRAM_RANGE,)),
)


def add_arguments(p):
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="random-weight Qwen3 shapes to time")
    p.add_argument("--model", help="time this checkpoint instead (e.g. demo: the bundled demo model)")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size (ours)")
    p.add_argument("--hf-steps", type=int, default=8, help="tokens timed per batch size (transformers)")
    p.add_argument("--hf-batch-sizes", help="default: --batch-sizes")
    p.add_argument("--hf-compile-batch-sizes", default="1",
                   help="static cache + compile recompiles per batch size (~35 s for 0.6B): keep it short")
    p.add_argument("--hf-compile-shapes", nargs="*", default=["qwen3-0.6b"], help="'' to skip")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--only", nargs="+", metavar="CONFIG", help="time only these of ours (e.g. ours_graphs "
                   "ours_graphs_async)")
    p.add_argument("--repeats", type=int, default=3, help="CPU: rounds over every batch size and config")
    p.add_argument("--quantization", help="ours with weight-only int8 or int4 (on the fly)")
    p.add_argument("--tiles", nargs="+", default=["shipped"], choices=("shipped", "tuned"),
                   help="GPU: ours with the shipped tile table, and/or with tuned tiles (the tile cache `jetserve "
                        "tune` kept, any shape it lacks timed at the engine's start), tuned first")
    p.add_argument("--threads", type=int, help="CPU: torch threads (default: torch's, one a core)")
    p.add_argument("--profile", action="store_true",
                   help="CPU: after the rounds, where a step's time goes (torch.profiler), ours and transformers")


def _checkpoint_dir(model: str) -> str:
    """A checkpoint directory, or the bundled demo model's for "demo" (as `LLM(model="demo")`)."""
    from pathlib import Path

    from jetserve import DEMO_MODEL, demo_model_dir

    return str(demo_model_dir()) if model == DEMO_MODEL and not Path(model).is_dir() else model


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def run(args) -> dict:
    import tempfile
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from jetserve.bench.common import environment, load_hf, random_checkpoint, read_bandwidth, write_results

    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = _ints(args.batch_sizes)
    result = {"env": environment(device), "dtype": str(dtype).replace("torch.", ""), "prompt_len": args.prompt_len,
              "batch_sizes": batches, "models": {}}
    if device.type == "cuda":
        result["read_bandwidth_GBps"] = round(read_bandwidth(device) / 1e9, 1)
    targets = [("model", args.model)] if args.model else [(s, None) for s in args.shapes]
    for name, model_dir in targets:
        with tempfile.TemporaryDirectory() as tmp:
            if model_dir:
                model_dir = _checkpoint_dir(model_dir)
                hf = None if args.no_hf else load_hf(model_dir, dtype, device)
                name = Path(model_dir).name
            else:
                tqdm.write(f"[decode] building a random {name} checkpoint")
                hf = random_checkpoint(name, Path(tmp), dtype, device)
                model_dir = tmp
            result["models"][name] = _time_model(args, name, model_dir, hf, device, dtype, batches,
                                                 result.get("read_bandwidth_GBps"))
            del hf
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_results(args.out, result, {"decode": _plot(result)})  # after each model: partial results survive
    return result


def _time_model(args, name, model_dir, hf, device, dtype, batches, bandwidth_gbps) -> dict:
    import torch

    from jetserve.bench.common import peak_memory, reset_peak

    if device.type != "cuda":
        return _time_cpu(args, model_dir, hf, batches)
    out = {"configs": {}, "peak_memory_MiB": {}}
    configs = [("ours_graphs", dict(enforce_eager=False)),
               ("ours_graphs_async", dict(enforce_eager=False, async_scheduling=True)),
               ("ours_eager", dict(enforce_eager=True)), ("ours_eager_plain_torch", dict(enforce_eager=True, plain=True))]
    configs = [(name, kwargs) for name, kwargs in configs if not args.only or name in args.only]
    if "tuned" in args.tiles:  # the same engines with every tile timed at their start, timed first
        configs = [(f"{name}_tuned", dict(kwargs, tune_tiles=True)) for name, kwargs in configs
                   if not kwargs["enforce_eager"]] + ([] if "shipped" not in args.tiles else configs)
    out["configs"] = _time_engines(args, model_dir, device, batches, configs, out["peak_memory_MiB"])
    if hf is not None and not args.no_hf:
        hf_batches = _ints(args.hf_batch_sizes) if args.hf_batch_sizes else batches
        reset_peak(device)
        out["configs"]["hf_eager"] = {b: _time_hf(hf, b, args.prompt_len, args.hf_steps, False) for b in hf_batches}
        out["peak_memory_MiB"]["hf_eager"] = _mib(peak_memory(device))
        if device.type == "cuda" and name in args.hf_compile_shapes:
            reset_peak(device)
            out["configs"]["hf_static_compile"] = {
                b: _time_hf(hf, b, args.prompt_len, args.hf_steps, True) for b in _ints(args.hf_compile_batch_sizes)}
            out["peak_memory_MiB"]["hf_static_compile"] = _mib(peak_memory(device))
    if hf is not None:
        weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in hf.parameters()}.values())
        cfg = hf.config
        kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
        out["weights_bytes"] = weights
        if bandwidth_gbps:
            context = args.prompt_len + args.steps // 2
            out["configs"]["roofline"] = {b: round((weights + b * context * kv_per_token) / (bandwidth_gbps * 1e9) * 1e3,
                                                   4) for b in batches}
    ours = out["configs"]
    if {"ours_graphs", "ours_eager", "ours_eager_plain_torch"} <= set(ours):
        one = min(batches)
        out["speedup_graphs_vs_eager_batch1"] = round(ours["ours_eager"][one] / ours["ours_graphs"][one], 2)
        out["speedup_graphs_vs_plain_eager_batch1"] = round(
            ours["ours_eager_plain_torch"][one] / ours["ours_graphs"][one], 2)
    return out


def _mib(n):
    return None if n is None else round(n / 2**20)


def _config(model_dir, device, batches, args, **kwargs):
    from jetserve.engine.config import EngineArgs

    max_batch, length = max(batches), args.prompt_len + args.steps + 16
    return EngineArgs(
        model=model_dir, device=str(device), max_num_seqs=max_batch, max_model_len=length,
        num_kv_blocks=max_batch * -(-length // 16) + 1, max_num_batched_tokens=max(2048, max_batch),
        **kwargs).resolve()


def _engine_tpot(engine, batch, prompt_len, steps, rng) -> float:
    """Median engine step (ms) of `batch` sequences decoding, after their (fresh, random) prompts."""
    import time

    import torch

    from jetserve.bench.common import median
    from jetserve.engine.sampling_params import SamplingParams

    vocab = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(0, vocab, (prompt_len,), generator=rng).tolist()
        engine.add_request(f"{batch}-{i}", {"prompt_token_ids": ids}, params)
    started = set()
    while len(started) < batch:  # prefill (chunked) until every sequence decodes
        started.update(o.request_id for o in engine.step())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return round(median(times) * 1e3, 4)


def _engine(args, model_dir, device, batches, enforce_eager, plain=False, async_scheduling=False, tune_tiles=False):
    import dataclasses

    from jetserve.engine.llm_engine import LLMEngine

    config = _config(model_dir, device, batches, args, enforce_eager=enforce_eager,
                     async_scheduling=async_scheduling, quantization=args.quantization, tune_tiles=tune_tiles,
                     # tuned: the tile cache `jetserve tune` left (a shape it lacks is timed now); else the
                     # shipped table alone
                     tile_cache_dir=None if tune_tiles else "none")
    if plain:  # the plain torch path on the GPU: what the step costs without the fused kernels
        config = dataclasses.replace(config, fused_kernels=False, cuda_graphs=None)
    return LLMEngine(config)


def _time_engines(args, model_dir, device, batches, configs, peak_mib: dict) -> dict:
    """TPOT (median engine step, ms) of each config for each batch size, and with graphs the
    graph replay alone: every engine built first (each one's own peak memory noted), then
    `--repeats` rounds, each timing every batch size on every engine in turn with fresh prompts,
    so a host that slows down during the run slows every config alike. Medians over the rounds,
    with their min."""
    import torch
    from tqdm import tqdm

    from jetserve.bench.common import median, peak_memory, reset_peak

    engines = {}
    for name, kwargs in configs:
        reset_peak(device)
        before = torch.cuda.memory_allocated(device)
        engines[name] = _engine(args, model_dir, device, batches, **kwargs)
        peak_mib[name] = _mib(peak_memory(device) - before)
    rng = torch.Generator().manual_seed(0)
    tpot = {name: {b: [] for b in batches} for name in engines}
    replay = {name: {b: [] for b in batches} for name in engines}
    for _ in tqdm(range(max(1, args.repeats)), desc="[decode] ours, rounds over " + ", ".join(engines), unit="round"):
        for batch in batches:
            for name, engine in engines.items():
                tpot[name][batch].append(_engine_tpot(engine, batch, args.prompt_len, args.steps, rng))
                if engine.runner.graphs:
                    replay[name][batch].append(replay_ms(engine.runner.graphs, batch))
    out = {}
    for name in engines:
        out[name] = {b: median(runs) for b, runs in tpot[name].items()}
        out[name]["min_ms"] = {b: min(runs) for b, runs in tpot[name].items()}
        out[name]["runs_ms"] = tpot[name]
        replays = {b: median(runs) for b, runs in replay[name].items() if runs and None not in runs}
        if replays:
            out[name]["graph_replay_ms"] = replays
            out[name]["step_overhead_ms"] = {b: round(out[name][b] - ms, 4) for b, ms in replays.items()}
    engines.clear()
    return out


def _time_cpu(args, model_dir, hf, batches) -> dict:
    """Ours compiled, ours eager and transformers eager, interleaved: in each round, each batch
    size, every config with fresh prompts. Medians and mins over the rounds. Ours compiled starts
    twice: into an empty program cache, then from it."""
    import dataclasses
    import os
    import shutil
    import tempfile
    import time

    import torch
    from tqdm import tqdm

    from jetserve.bench.common import median
    from jetserve.engine.llm_engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    out = {"threads": torch.get_num_threads(), "repeats": args.repeats, "startup_s": {}}
    engines = {}
    for name, eager in (("ours_compiled", False), ("ours_eager", True)):
        if args.only and name not in args.only:
            continue
        # compiled: a bucket for each batch size timed, so no step is padded
        config = _config(model_dir, "cpu", batches, args, enforce_eager=eager, cudagraph_capture_sizes=batches)
        if eager:
            start = time.perf_counter()
            engines[name] = LLMEngine(config)
            out["startup_s"][name] = round(time.perf_counter() - start, 1)
            continue
        # The first start into an empty cache (it compiles), the second from it (it loads).
        cache = tempfile.mkdtemp(prefix="jetserve-bench-cache-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "torchinductor")  # inductor's kernels too
        config = dataclasses.replace(config, cpu_compile=dataclasses.replace(config.cpu_compile, cache_dir=cache))
        for start_name in ("first", "second"):
            engines.pop(name, None)
            start = time.perf_counter()
            engines[name] = LLMEngine(config)
            graphs = engines[name].runner.graphs
            graphs.wait()  # a first start serves eagerly while it compiles: the timed step is the compiled one
            out["startup_s"][f"{name}_{start_name}"] = round(time.perf_counter() - start, 1)
            out[f"programs_{start_name}_start"] = {"compiled_s": graphs.compile_seconds,
                                                   "loaded_s": graphs.load_seconds}
        shutil.rmtree(cache, ignore_errors=True)
    rng = torch.Generator().manual_seed(0)
    for batch in batches:  # warm every shape (prefill and decode) of ours; _time_hf warms its own
        for engine in engines.values():
            _engine_tpot(engine, batch, args.prompt_len, 4, rng)
    runs = {name: {b: [] for b in batches} for name in [*engines, *(["hf_eager"] if hf is not None else [])]}
    load = []
    for _ in tqdm(range(args.repeats), desc="[decode] rounds (ours compiled, ours eager, transformers)"):
        load.append(round(os.getloadavg()[0], 2))
        for batch in batches:
            for name, engine in engines.items():
                runs[name][batch].append(_engine_tpot(engine, batch, args.prompt_len, args.steps, rng))
            if hf is not None:
                runs["hf_eager"][batch].append(_time_hf(hf, batch, args.prompt_len, args.hf_steps, False, rng))
    load.append(round(os.getloadavg()[0], 2))
    out["load_average_1min"] = load
    out["configs"] = {name: {b: median(v) for b, v in per.items()} for name, per in runs.items()}
    out["min"] = {name: {b: min(v) for b, v in per.items()} for name, per in runs.items()}
    out["runs"] = runs
    if args.profile:
        out["profile_ms"] = {name: {b: _profile_engine(engine, b, args.prompt_len, rng) for b in batches}
                             for name, engine in engines.items()}
        if hf is not None:
            out["profile_ms"]["hf_eager"] = {b: _profile_hf(hf, b, args.prompt_len, rng) for b in batches}
    if hf is not None:
        hf_median = out["configs"]["hf_eager"]
        out["speedup_vs_hf_eager"] = {name: {b: round(hf_median[b] / out["configs"][name][b], 2) for b in batches}
                                      for name in engines}
    return out


def _families(profile, steps: int, wall_s: float) -> dict:
    """ms a step of each PROFILE_FAMILIES family (self times), and the rest of the wall time."""
    out = {name: 0.0 for name, _ in PROFILE_FAMILIES}
    for event in profile.key_averages():
        family = next((name for name, keys in PROFILE_FAMILIES if any(k in event.key for k in keys)), None)
        if family:
            out[family] += event.self_cpu_time_total / 1e3 / steps
    out["rest: Python and small ops (ours: scheduling, inputs, sampling)"] = wall_s * 1e3 / steps - sum(out.values())
    out["profiled step"] = wall_s * 1e3 / steps
    return {name: round(ms, 3) for name, ms in out.items() if ms}


def _profile_engine(engine, batch, prompt_len, rng, steps=16) -> dict:
    """Where `steps` decode steps of `batch` fresh sequences spend their time (torch.profiler)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from jetserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(0, engine.config.model_config.vocab_size, (prompt_len,), generator=rng).tolist()
        engine.add_request(f"profile-{batch}-{i}", {"prompt_token_ids": ids}, params)
    started = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step())
    graphs = engine.runner.graphs
    programs = dict(graphs.graphs) if graphs else {}
    for key, program in programs.items():  # named in the profile (a record_function range costs host time: never in the engine)
        graphs.graphs[key] = lambda n, program=program: _in_range(program, n)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    if graphs:
        graphs.graphs.update(programs)
    while engine.has_unfinished_requests():
        engine.step()
    return _families(prof, steps, wall)


def _in_range(program, n):
    import torch

    with torch.profiler.record_function(PROGRAM_RANGE):
        return program(n)


def _profile_hf(model, batch, prompt_len, rng, steps=64) -> dict:
    """The same for transformers' `generate`: a run of steps + 1 tokens less a run of 1 (the
    prefill; long enough a run that the prefill's own variation stays small)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=rng)
    runs = []
    for tokens in (steps + 1, 1):
        kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            model.generate(ids, **kwargs)
            wall = time.perf_counter() - start
        runs.append(_families(prof, steps, wall))
    return {name: round(ms - runs[1].get(name, 0), 3) for name, ms in runs[0].items()}


def replay_ms(graphs, batch) -> float | None:
    """GPU time of one replay of the decode graph of this batch's bucket (forward, vocab
    projection and argmax), over the inputs the last step left."""
    import torch

    bucket = next((s for s in graphs.sizes if s >= batch), None)
    graph = graphs.graphs.get((None, 1, bucket))
    if graph is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / 50, 4)


class _TokenClock:
    """A transformers streamer that only notes when each new token arrives."""

    def __init__(self):
        import time

        self.clock, self.times = time.perf_counter, []

    def put(self, value):
        self.times.append(self.clock())

    def end(self):
        pass


def _time_hf(model, batch, prompt_len, steps, static, rng=None) -> float:
    """Median gap between tokens of one transformers `generate` (after a warm-up call); prompts
    drawn from `rng` (default: seeded by the batch size)."""
    import torch

    from jetserve.bench.common import median

    rng = rng or torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=rng).to(model.device)
    kwargs = dict(max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    if static:
        kwargs["cache_implementation"] = "static"  # transformers compiles the decode step itself
    with torch.inference_mode():
        model.generate(ids, **kwargs)  # warm-up (and, static, the compile)
        clock = _TokenClock()
        model.generate(ids, streamer=clock, **kwargs)
    gaps = [b - a for a, b in zip(clock.times[2:], clock.times[3:])]  # [0]: the prompt, [1]: first token
    return round(median(gaps) * 1e3, 4)


LABELS = {
    "ours_graphs": ("ours, CUDA graphs", "o-"), "ours_graphs_async": ("ours, CUDA graphs + async scheduling", "o-."),
    "ours_graphs_replay": ("ours, graph replay (GPU only)", "o:"),
    "ours_compiled": ("ours, compiled (CPU)", "o-"),
    "ours_eager": ("ours, eager (fused kernels on CUDA)", "s-"), "ours_eager_plain_torch": ("ours, eager (plain torch)", "s--"),
    "hf_eager": ("transformers eager", "^-"), "hf_static_compile": ("transformers static cache + compile", "D"),
    "roofline": ("bandwidth roofline", "k--"),
}


def _plot(result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, (name, data) in zip(axes[0], models.items()):
        configs = dict(data["configs"])
        if "ours_graphs" in configs:
            configs["ours_graphs_replay"] = configs["ours_graphs"].get("graph_replay_ms", {})
        for key, (label, style) in LABELS.items():
            series = {int(b): v for b, v in configs.get(key, {}).items() if str(b).isdigit() and v}
            if series:
                ax.plot(list(series), list(series.values()), style, label=label, markersize=5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (sequences decoding)")
        ax.set_ylabel("time per output token, ms")
        ax.set_title(f"{name}, {result['dtype']}, {result['env'].get('gpu', result['env']['device'])}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return fig
