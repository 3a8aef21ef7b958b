"""Where the time of a chunked-prefill step goes, by the depth of its chunk in the prompt.

The streams of `bench prefill` decode while a long prompt is prefilled in chunks of the step
budget; the steps whose chunk starts at each `--depths` position are profiled (torch.profiler:
GPU time per kernel family and per kernel) and, in runs of their own, timed on the host clock
(the step's wall time is what the streams see as their inter-token latency; wall minus GPU
time is the host's: scheduling, input building, sampling, the sync). Engines compared in one
run: mixed steps replayed from CUDA graphs, the same with the flash kernel's contexts never
cut into pieces (the plan before pieces), and mixed steps launched eagerly.
"""

from jetserve.bench.profile import FAMILIES as DECODE_FAMILIES

FAMILIES = (("flash prefill attention (+ piece merge)", ("_prefill_attention", "_merge_pieces")),) + DECODE_FAMILIES
ENGINES = {  # name: (cudagraph_mode, contexts cut into pieces)
    "graphs": ("full", True),
    "graphs-unsplit": ("full", False),
    "eager-steps": ("full_decode_only", True),
}


def add_arguments(p):
    p.add_argument("--shape", default="qwen3-0.6b", help="random-weight Qwen3 shape")
    p.add_argument("--device", default="auto")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (decodes included)")
    p.add_argument("--streams", type=int, default=8, help="requests decoding beside the chunks")
    p.add_argument("--stream-prompt-len", type=int, default=256)
    p.add_argument("--long-prompt-len", type=int, default=8192)
    p.add_argument("--depths", default="0,2048,4096,7680", help="prompt positions whose chunk step is profiled")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills (fresh prompts) after the profiled one")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"of {', '.join(ENGINES)}")


def run(args) -> dict:
    import tempfile
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from jetserve.bench.common import environment, random_checkpoint, write_results

    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    depths = [int(d) for d in args.depths.split(",")]
    result = {"env": environment(device), "shape": args.shape, "budget": args.budget, "streams": args.streams,
              "chunk_tokens": args.budget - args.streams, "long_prompt_len": args.long_prompt_len, "engines": {}}
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        del_hf = random_checkpoint(args.shape, Path(tmp), dtype, device)
        del del_hf
        for name in tqdm(args.engines.split(","), desc="[prefill-profile] engines", unit="engine"):
            summary, table = _profile_engine(args, tmp, device, name, depths)
            result["engines"][name] = summary
            tables.append(table)
    text = "\n".join(tables) + "\n" + _summary_table(result)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile.txt").write_text(text)
    print(_summary_table(result))
    write_results(args.out, result, {})
    return result


def _engine(args, model_dir, device, name):
    from unittest import mock

    from jetserve.engine.config import EngineArgs
    from jetserve.engine.llm_engine import LLMEngine

    mode, pieces = ENGINES[name]
    length = args.long_prompt_len + 512
    engine_args = EngineArgs(model=model_dir, device=str(device), max_model_len=length,
                             max_num_seqs=args.streams + 1, max_num_batched_tokens=args.budget, max_step_latency_ms=0,
                             num_kv_blocks=(args.streams + 1) * -(-length // 16) + 1,
                             cudagraph_capture_sizes=[max(1, args.streams)],  # none: one unused
                             cudagraph_mode=mode)
    if pieces:
        return LLMEngine(engine_args.resolve())
    with mock.patch("jetserve.engine.runner.prefill_split_items", lambda device, heads: 1):  # never cut
        return LLMEngine(engine_args.resolve())


def _profile_engine(args, model_dir, device, name, depths):
    """One engine: a warm-up prefill, a profiled one (the steps at `depths`), then `repeats`
    timed ones. Returns the per-depth summary and the profiler's kernel tables."""
    from jetserve.bench.common import median

    engine = _engine(args, model_dir, device, name)
    chunk = args.budget - args.streams
    at = {d: d // chunk for d in depths}  # the step (from the prompt's arrival) whose chunk holds depth d
    _prefill(args, engine, seed=100)  # warm-up: every bucket and kernel shape once
    _, profiles = _prefill(args, engine, seed=101, profiled=set(at.values()))
    walls: dict[int, list[float]] = {}
    for r in range(args.repeats):
        for step, wall in enumerate(_prefill(args, engine, seed=200 + r)[0]):
            walls.setdefault(step, []).append(wall)
    del engine
    summary, tables = {}, []
    for depth, step in at.items():
        families, kernels, busy, count = _kernel_times(profiles[step])
        wall = median(walls[step]) * 1e3
        summary[str(depth)] = {
            "step_index": step, "context_before_chunk": step * chunk, "wall_ms": round(wall, 3),
            "wall_ms_each": [round(w * 1e3, 3) for w in walls[step]], "gpu_kernel_ms": round(busy, 3),
            "host_and_gaps_ms": round(wall - busy, 3), "kernels": count,
            "gpu_ms_by_family": {k: round(v, 3) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": kernels[:12]}
        lines = [f"== {name}: step {step} (chunk of {chunk} at context {step * chunk}), wall {wall:.2f} ms, "
                 f"GPU {busy:.2f} ms in {count} kernels =="]
        lines += [f"  {ms:8.3f} ms  {calls:5d}x  {kernel}" for kernel, ms, calls in kernels[:15]]
        tables.append("\n".join(lines) + "\n")
    all_steps = sorted(walls)
    summary["prefill_ms"] = round(sum(median(walls[s]) for s in all_steps) * 1e3, 2)
    return summary, "\n".join(tables)


def _prefill(args, engine, seed, profiled=frozenset()) -> tuple[list[float], dict]:
    """Streams in steady state, then a fresh long prompt: the wall time of each step from its
    arrival to its first token, and the profiles of the steps (by index) in `profiled`, run
    under torch.profiler (their wall times are not kept: the profiler's own cost is in them)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from jetserve.bench.common import sync
    from jetserve.engine.sampling_params import SamplingParams

    rng = torch.Generator().manual_seed(seed)
    vocab = engine.config.model_config.vocab_size
    stream = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    for i in range(args.streams):
        ids = torch.randint(0, vocab, (args.stream_prompt_len,), generator=rng).tolist()
        engine.add_request(f"s{i}", {"prompt_token_ids": ids}, stream)
    for _ in range(16):  # the streams' prefill, then decoding
        engine.step()
    long_ids = torch.randint(0, vocab, (args.long_prompt_len,), generator=rng).tolist()
    engine.add_request("long", {"prompt_token_ids": long_ids},
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    device = torch.device(engine.config.device)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    walls, profiles, done = [], {}, False
    while not done:
        step = len(walls)
        if step in profiled:
            sync(device)
            with profile(activities=activities) as prof:
                outputs = engine.step()
                sync(device)
            profiles[step] = prof
            walls.append(float("nan"))
        else:
            start = time.perf_counter()
            outputs = engine.step()
            walls.append(time.perf_counter() - start)
        done = any(o.request_id == "long" for o in outputs)
    for rid in list(engine.requests):
        engine.abort(rid)
    return walls, profiles


def _kernel_times(prof):
    """GPU ms of one profiled step: by family, by kernel (name, ms, launches; longest first),
    in all, and the number of kernels."""
    families, kernels, count = {}, [], 0
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0)
        if not us or e.device_type.name != "CUDA":
            continue
        family = next((f for f, keys in FAMILIES if any(k in e.key.lower() for k in keys)), "other")
        families[family] = families.get(family, 0.0) + us / 1e3
        kernels.append((e.key[:110], round(us / 1e3, 4), e.count))
        count += e.count
    kernels.sort(key=lambda k: -k[1])
    return families, kernels, sum(families.values()), count


def _summary_table(result) -> str:
    rows = [f"chunk step of {result['chunk_tokens']} prompt tokens + {result['streams']} decodes, {result['shape']}, "
            f"{result['env'].get('gpu', result['env']['device'])}",
            f"{'engine':16} {'depth':>6} {'wall ms':>8} {'GPU ms':>7} {'host':>6}  GPU ms by family"]
    for name, data in result["engines"].items():
        for depth, d in data.items():
            if not isinstance(d, dict):
                continue
            fam = ", ".join(f"{k.split(' (')[0]} {v:.2f}" for k, v in d["gpu_ms_by_family"].items() if v >= 0.02)
            rows.append(f"{name:16} {depth:>6} {d['wall_ms']:8.2f} {d['gpu_kernel_ms']:7.2f} "
                        f"{d['host_and_gaps_ms']:6.2f}  {fam}")
        rows.append(f"{name:16} whole {result['long_prompt_len']}-token prefill (sum of step walls): "
                    f"{data['prefill_ms']:.1f} ms")
    return "\n".join(rows)
