"""Weight-only quantization's decode speed: bf16 vs INT8 vs INT4 at batch 1, CUDA graphs on,
random weights in real Qwen3 shapes (timing only), and what it projects for the Jetsons.

A batch-1 decode step reads every weight it multiplies by once, so its floor is bytes read /
bandwidth. Per shape and method: the engine's TPOT (median step) and the graph replay alone,
the bytes read a token (from the memory plan's meta model), the H200 roofline and the measured
share of it, and for each Jetson board the bandwidth floor and that floor scaled by the H200's
measured ratio (a board reaching the same share of its bandwidth).
"""

DEFAULT_SHAPES = ["qwen3-4b", "qwen3-0.6b"]
METHODS = ["bf16", "int8", "int4"]


def add_arguments(p):
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=48, help="decode steps timed a method")
    p.add_argument("--repeats", type=int, default=2, help="times each method is timed (min and median kept)")


def run(args) -> dict:
    import tempfile
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from jetserve.bench.common import environment, median, random_checkpoint, read_bandwidth, write_results
    from jetserve.bench.decode import _time_engine
    from jetserve.engine.config import EngineArgs
    from jetserve.engine.plan import BOARDS, memory_plan

    device = torch.device("cuda")
    bandwidth = read_bandwidth(device)
    result = {"env": environment(device), "read_bandwidth_GBps": round(bandwidth / 1e9, 1), "batch": 1,
              "activations": "bfloat16", "shapes": {}}
    args.device = "cuda"
    for shape in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            tqdm.write(f"[quant] building a random {shape} checkpoint")
            del_model = random_checkpoint(shape, Path(tmp), torch.bfloat16, device)
            del del_model
            torch.cuda.empty_cache()
            out = result["shapes"][shape] = {}
            for method in args.methods:
                quantization = None if method == "bf16" else method
                length = args.prompt_len + args.steps + 16
                config = EngineArgs(model=tmp, quantization=quantization, max_num_seqs=1,
                                    max_model_len=length).resolve()
                read = memory_plan(config, "orin-nano-8gb").bytes_per_token
                tpots, replays = [], []
                for _ in range(args.repeats):
                    timed = _time_engine(args, tmp, device, [1], enforce_eager=False, quantization=quantization)
                    tpots.append(timed[1])
                    replays.append(timed["graph_replay_ms"][1])
                roofline = read / bandwidth * 1e3
                ratio = min(replays) / roofline
                out[method] = {
                    "tpot_ms": {"min": min(tpots), "median": round(median(tpots), 4)},
                    "graph_replay_ms": {"min": min(replays), "median": round(median(replays), 4)},
                    "bytes_read_per_token": read, "h200_roofline_ms": round(roofline, 4),
                    "measured_over_roofline": round(ratio, 2),
                    "jetson_ms_per_token": {name: {"bandwidth_floor": round(read / b.bandwidth * 1e3, 2),
                                                   "at_h200_ratio": round(read / b.bandwidth * 1e3 * ratio, 2)}
                                            for name, b in BOARDS.items()}}
                tqdm.write(f"[quant] {shape} {method}: {out[method]['tpot_ms']} ms/token")
                write_results(args.out, result, {"quant": _plot(result)})
    return result


def _plot(result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(result["shapes"])
    fig, axes = plt.subplots(1, max(1, len(shapes)), figsize=(5 * max(1, len(shapes)), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        methods = result["shapes"][shape]
        names = list(methods)
        ax.bar(names, [methods[m]["tpot_ms"]["min"] for m in names], label="TPOT (engine step)")
        ax.plot(names, [methods[m]["h200_roofline_ms"] for m in names], "k_", markersize=30, label="bandwidth floor")
        ax.set_title(f"{shape}, H200, batch 1")
        ax.set_ylabel("ms / token")
        ax.legend()
    return fig
