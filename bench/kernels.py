"""The decode step's kernels alone: bandwidth of the skinny matmul (each weight of a Qwen3
shape, with the prologue the model fuses into it) against cuBLAS, and paged attention with the
context split over programs against one program per (token, kv head), by context length.

Shows which tile the start-up tuner picks per shape, how close each product gets to the read
bandwidth, and beside it the fastest of what main could choose (cuBLAS, or a tile without PDL, K
whole, the prologue fused), timed in the same tuning; the step-level numbers are `jetserve bench
decode` and `profile`.
"""

ROWS = [1, 2, 4, 8]
CONTEXTS = [128, 512, 1024, 4096]


def add_arguments(p):
    p.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-4b"])
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="tokens a step (batch x q_len)")


def run(args) -> dict:
    import torch
    from tqdm import tqdm

    from jetserve.bench.common import SHAPES, environment, read_bandwidth, write_results
    from jetserve.bench.quant import main_choice, operands, precompile, projection_variants, shape_projections
    from jetserve.engine.model import kernels

    device = torch.device("cuda")
    dtype = torch.bfloat16
    rows = [int(r) for r in args.rows.split(",")]
    result = {"env": environment(device), "dtype": "bfloat16", "read_bandwidth_GBps": round(read_bandwidth(device) / 1e9),
              "matmul": {}, "attention": {}}

    def bench(fn):
        """µs a call takes on the GPU, replayed from a graph."""
        return kernels.graph_time([fn]) * 1e3

    for m in rows:
        precompile(projection_variants(args.shapes, ["bf16"], m), f"[kernels] compiling {m}-row variants")
    for shape in args.shapes:
        s = SHAPES[shape]
        heads, kv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
        table = result["matmul"][shape] = {}
        for name, (prologue, n, k) in tqdm(shape_projections(shape).items(), desc=f"[kernels] {shape} matmuls"):
            for m in rows:
                x, w, res, norm_w = operands(prologue, n, k, "bf16", device, m)
                tuned = kernels.FusedKernels(tile_timing=True)
                tuned.skinny_matmul(prologue, x, w, res, norm_w, 1e-6)  # tunes this shape
                tile, tried = next(iter(tuned.chosen.values())), next(iter(tuned.tuning_times.values()))
                main_ms, main_tile = main_choice(tried)
                gb = w.numel() * w.element_size() / 1e9
                ours, cublas, main = tried[tile] * 1e3, tried[None] * 1e3, main_ms * 1e3
                table.setdefault(name, {})[m] = {
                    "tile": str(tile) if tile else "cuBLAS", "us": round(ours, 2), "cublas_us": round(cublas, 2),
                    "main_us": round(main, 2), "main_tile": str(main_tile) if main_tile else "cuBLAS",
                    "tiles_us": {str(t): round(v * 1e3, 2) for t, v in tried.items()},
                    "GBps": round(gb / ours * 1e6), "main_GBps": round(gb / main * 1e6),
                    "Gweights_per_s": round(n * k / ours / 1e3),
                    "cublas_GBps": round(gb / cublas * 1e6)}
                del x, w, res, norm_w, tuned
        cache_slots = max(CONTEXTS) + 16
        k_cache = torch.randn(cache_slots, kv, d, dtype=dtype, device=device)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(1, heads, d, dtype=dtype, device=device)
        tables = torch.arange(cache_slots // 16, dtype=torch.int32, device=device)[None]
        att = result["attention"][shape] = {}
        for ctx in CONTEXTS:
            lens = torch.tensor([ctx], dtype=torch.int32, device=device)
            split_us = bench(lambda: kernels.paged_attention(q, k_cache, v_cache, tables, lens, 1, 16, d ** -0.5))
            one_us = bench(lambda: kernels.paged_attention(q, k_cache, v_cache, tables, lens, 1, 16, d ** -0.5,
                                                           num_splits=1))
            att[ctx] = {"splits": kernels._num_splits(kv, device), "us": round(split_us, 2), "one_split_us": round(one_us, 2)}
    print_summary(result)
    write_results(args.out, result, {"kernels": _plot(result)})
    return result


def print_summary(result):
    from tqdm import tqdm

    for shape, table in result["matmul"].items():
        for name, by_m in table.items():
            tqdm.write(f"[kernels] {shape} {name}: " + "; ".join(
                f"M={m} {v['us']} µs ({v['GBps']} GB/s, {v['tile']}; main {v['main_us']} µs {v['main_tile']}, cuBLAS "
                f"{v['cublas_us']})" for m, v in by_m.items()))
        for ctx, v in result["attention"][shape].items():
            tqdm.write(f"[kernels] {shape} attention, context {ctx}: {v['us']} µs in {v['splits']} splits, "
                       f"{v['one_split_us']} µs in one")


def _plot(result):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(result["matmul"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        table = result["matmul"][shape]
        names = list(table)
        m = min(table[names[0]])
        series = (("GBps", "tuned (PDL, split K, prologue apart)"), ("main_GBps", "main's choices (no PDL)"),
                  ("cublas_GBps", "cuBLAS (unfused)"))
        for offset, (key, label) in enumerate(series):
            ax.bar([j + 0.27 * offset for j in range(len(names))], [table[n][m][key] for n in names],
                   width=0.27, label=label)
        ax.axhline(result["read_bandwidth_GBps"], color="k", ls="--", label="read bandwidth")
        ax.set_xticks([j + 0.27 for j in range(len(names))], names, rotation=20, fontsize=8)
        ax.set_ylabel(f"GB/s of weights read, {m} rows")
        ax.set_title(f"{shape}: {m} decode rows")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
