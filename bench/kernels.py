"""The decode step's kernels alone: bandwidth of the skinny matmul (each weight of a Qwen3
shape, with the prologue the model fuses into it) against cuBLAS, and paged attention with the
context split over programs against one program per (token, kv head), by context length.

Shows which tile the first-use tuner picks per shape and how close each product gets to the
read bandwidth; the step-level numbers are `jetserve bench decode` and `profile`.
"""

ROWS = [1, 2, 4, 8]
CONTEXTS = [128, 512, 1024, 4096]


def add_arguments(p):
    p.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-4b"])
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="tokens a step (batch x q_len)")


def run(args) -> dict:
    import torch
    import triton
    from tqdm import tqdm

    from jetserve.bench.common import SHAPES, environment, read_bandwidth, write_results
    from jetserve.engine.model import kernels

    device = torch.device("cuda")
    dtype = torch.bfloat16
    rows = [int(r) for r in args.rows.split(",")]
    result = {"env": environment(device), "dtype": "bfloat16", "read_bandwidth_GBps": round(read_bandwidth(device) / 1e9),
              "matmul": {}, "attention": {}}

    tuned = kernels.FusedKernels(tile_timing=True)

    def bench(fn, weight=None):
        """µs a call takes on the GPU, replayed from a graph; with a weight, read cold as in a step."""
        copies = kernels._cold_copies(weight) if weight is not None else [None]
        return kernels.graph_time([lambda w=w: fn(w) for w in copies]) * 1e3

    for shape in args.shapes:
        s = SHAPES[shape]
        h, i, heads, kv, d = (s["hidden_size"], s["intermediate_size"], s["num_attention_heads"],
                              s["num_key_value_heads"], s["head_dim"])
        weights = {"qkv (RMSNorm +)": (kernels.ADD_NORM, (heads + 2 * kv) * d, h), "o": (kernels.PLAIN, h, heads * d),
                   "gate_up (RMSNorm +)": (kernels.ADD_NORM, 2 * i, h), "down (SiLU·up +)": (kernels.SILU_MUL, h, i),
                   "lm_head": (kernels.PLAIN, s["vocab_size"], h)}
        table = result["matmul"][shape] = {}
        for name, (prologue, n, k) in tqdm(weights.items(), desc=f"[kernels] {shape} matmuls"):
            w = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
            norm_w = torch.ones(k, dtype=dtype, device=device)
            for m in rows:
                x = torch.randn(m, 2 * k if prologue == kernels.SILU_MUL else k, dtype=dtype, device=device)
                res = torch.randn(m, k, dtype=dtype, device=device)
                extra = (res if prologue == kernels.ADD_NORM else None, norm_w, 1e-6)
                tuned.skinny_matmul(prologue, x, w, *extra)  # tunes this shape
                key = (prologue, triton.next_power_of_2(m), n, k, dtype)
                tile, tried = tuned.chosen[key], tuned.tuning_times[key]
                best_tile = min((t for t in tried if t), key=tried.get, default=None)
                ours = bench(lambda w_: tuned.skinny_matmul(prologue, x, w_, *extra), w)
                cublas = bench(lambda w_: kernels._run(None, prologue, x, w_, *extra), w)
                gb = w.numel() * w.element_size() / 1e9
                table.setdefault(name, {})[m] = {
                    "tile": list(tile) if tile else "cuBLAS", "us": round(ours, 2), "cublas_us": round(cublas, 2),
                    "best_tile": best_tile and list(best_tile),
                    "best_tile_us": best_tile and round(tried[best_tile] * 1e3, 2),
                    "GBps": round(gb / ours * 1e6), "cublas_GBps": round(gb / cublas * 1e6)}
            del w
        cache_slots = max(CONTEXTS) + 16
        k_cache = torch.randn(cache_slots, kv, d, dtype=dtype, device=device)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(1, heads, d, dtype=dtype, device=device)
        tables = torch.arange(cache_slots // 16, dtype=torch.int32, device=device)[None]
        att = result["attention"][shape] = {}
        for ctx in CONTEXTS:
            lens = torch.tensor([ctx], dtype=torch.int32, device=device)
            split_us = bench(lambda _: kernels.paged_attention(q, k_cache, v_cache, tables, lens, 1, 16, d ** -0.5))
            one_us = bench(lambda _: kernels.paged_attention(q, k_cache, v_cache, tables, lens, 1, 16, d ** -0.5,
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
                f"M={m} {v['us']} µs ({v['GBps']} GB/s, {v['tile']}; best tile {v['best_tile_us']}, cuBLAS "
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
        for offset, (key, label) in enumerate((("GBps", "skinny matmul (fused)"), ("cublas_GBps", "cuBLAS (unfused)"))):
            ax.bar([j + 0.4 * offset for j in range(len(names))], [table[n][min(table[n])][key] for n in names],
                   width=0.4, label=label)
        ax.axhline(result["read_bandwidth_GBps"], color="k", ls="--", label="read bandwidth")
        ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=20, fontsize=8)
        ax.set_ylabel("GB/s of weights read, batch 1")
        ax.set_title(f"{shape}: one decode row")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
