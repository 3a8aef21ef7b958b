"""Where the time of a decode step goes (torch.profiler), graphed and eager.

Per step: the GPU time of each kernel family (GEMMs, paged attention, norms, q/k norm + RoPE +
KV store, SiLU·up, the rest), the GPU busy time against the wall time of the engine step (the
difference is the host: scheduling, metadata, sampling, the sync), and the profiler's tables.
"""

FAMILIES = (  # kernel-name substrings → family; the first match wins
    ("skinny matmul (+ RMSNorm or SiLU·up)", ("_skinny_matmul",)),
    ("quantized product, one row (+ RMSNorm or SiLU·up)", ("_quant_gemv",)),
    ("quantized product, FMA or tensor cores (+ RMSNorm or SiLU·up)", ("_quant_skinny", "_quant_dot")),
    ("INT4 product, tinygemm", ("tinygemm",)),
    ("split-K partial sums", ("_sum_splits",)),
    ("paged attention (+ split combine; decode: q/k norm, RoPE, KV store)", ("_paged_attention", "_combine_splits")),
    ("q/k norm + RoPE + KV store", ("_qk_norm_rope",)),
    ("RMSNorm (+ residual add)", ("_rms_norm",)),
    ("SiLU * up", ("_silu_mul",)),
    ("cuBLAS GEMM", ("gemm", "gemv", "nvjet", "cutlass", "sm90_", "splitk", "cublas")),
)


def add_arguments(p):
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="decode steps profiled")
    p.add_argument("--quantization", choices=("int8", "int4"), help="weights quantized at load (on the fly)")


def run(args) -> dict:
    import tempfile
    from pathlib import Path

    import torch

    from jetserve.bench.common import environment, random_checkpoint, write_results

    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result = {"env": environment(device), "shape": args.shape, "batch": args.batch, "steps": args.steps,
              "quantization": args.quantization, "modes": {}}
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        del_hf = random_checkpoint(args.shape, Path(tmp), dtype, device)
        del del_hf
        for mode, eager in (("graphs", False), ("eager", True)):
            summary, table = _profile(args, tmp, device, eager)
            result["modes"][mode] = summary
            weights = f", {args.quantization}" if args.quantization else ""
            tables.append(f"== {args.shape}{weights}, batch {args.batch}, {mode}: {args.steps} decode steps ==\n{table}\n")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile.txt").write_text("\n".join(tables))
    else:
        print("\n".join(tables))
    write_results(args.out, result, {})
    return result


def _profile(args, model_dir, device, eager):
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from jetserve.engine.config import EngineArgs
    from jetserve.engine.llm_engine import LLMEngine
    from jetserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=model_dir, device=str(device), max_num_seqs=max(args.batch, 1),
                                  max_model_len=512, num_kv_blocks=args.batch * 32 + 1, enforce_eager=eager,
                                  quantization=args.quantization).resolve())
    params = SamplingParams(temperature=0, max_tokens=3 * args.steps + 10, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), {"prompt_token_ids": list(range(1, 129))}, params)
    for _ in range(args.steps):  # prefill and warm-up
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    walls = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    del engine
    events = prof.key_averages()
    per_step, kernels = {}, 0.0
    for e in events:
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if not us or e.device_type.name != "CUDA":
            continue
        family = next((f for f, keys in FAMILIES if any(k in e.key.lower() for k in keys)), "other")
        per_step[family] = per_step.get(family, 0.0) + us / args.steps
        kernels += e.count / args.steps
    busy = sum(per_step.values())
    wall = sorted(walls)[len(walls) // 2] * 1e6
    summary = {"step_wall_us": round(wall), "gpu_kernel_time_us": round(busy),
               "host_and_gaps_us": round(wall - busy), "kernels_per_step": round(kernels),
               "gpu_us_by_family": {k: round(v, 1) for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])}}
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return summary, events.table(sort_by=sort, row_limit=30, max_name_column_width=60)
