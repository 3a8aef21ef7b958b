"""Weight-only quantization's decode speed: bf16 vs INT8 vs INT4 at batch 1, CUDA graphs on,
random weights in real Qwen3 shapes (timing only), and what it projects for the Jetsons.

A batch-1 decode step reads every weight it multiplies by once, so its floor is bytes read /
bandwidth. Two tables:
- kernels: each projection of a layer (qkv with the norm, o, gate·up with add + norm, down with
  SiLU·up) alone, every candidate tile timed in a CUDA graph over weights cold in L2 as the
  engine's start-up does; the fastest tile's time and the GB/s it reads the weights at (packed
  integers, scales and zero points);
- engine: per shape and method the TPOT (median step over fresh prompts, each repeat, min and
  median over repeats) and the graph replay alone, the bytes read a token (from the memory
  plan's meta model), this GPU's roofline (its measured read bandwidth) and the measured share of
  it, and for each Jetson board the bandwidth floor and that floor scaled by the measured ratio (a
  board reaching the same share of its bandwidth).
Every kernel variant is compiled first by a pool of processes (Triton's on-disk cache then
serves the timing process): compiled one after another they take minutes.
"""

DEFAULT_SHAPES = ["qwen3-0.6b", "qwen3-4b"]
METHODS = ["bf16", "int8", "int4"]


def add_arguments(p):
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=48, help="decode steps timed a repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats a method, each with fresh prompts")
    p.add_argument("--skip-engine", action="store_true", help="the kernel table only")


def shape_projections(shape: str) -> dict:
    """name → (prologue, out features, in features) of one decoder layer of `shape`: the
    prologues every layer but the first runs (its q·k·v adds the residual before the norm; the
    first layer's has none yet to add, `kernels.NORM`)."""
    from jetserve.bench.common import SHAPES
    from jetserve.engine.model import kernels

    c = SHAPES[shape]
    h, q, kv = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return {"qkv": (kernels.ADD_NORM, q + 2 * kv, h), "o": (kernels.PLAIN, h, q),
            "gate_up": (kernels.ADD_NORM, 2 * c["intermediate_size"], h),
            "down": (kernels.SILU_MUL, h, c["intermediate_size"]), "lm_head": (kernels.PLAIN, c["vocab_size"], h)}


def _methods(name: str, methods: list[str]) -> list[str]:
    """The vocab projection: in the model dtype (as AWQ and GPTQ exports keep it) and in the
    format either on-the-fly method gives it (QuantizationConfig.vocab)."""
    from jetserve.engine.config import ON_THE_FLY, VOCAB_QUANTIZATION

    if name != "lm_head":
        return methods
    return ["bf16"] + ([VOCAB_QUANTIZATION] if any(m in ON_THE_FLY for m in methods) else [])


def operands(prologue: int, n: int, k: int, method: str, device, rows: int = 1):
    """(x, weight, residual, norm weight) of one product of `rows` rows, random."""
    import torch

    from jetserve.engine.config import ON_THE_FLY
    from jetserve.engine.model import kernels, quant

    torch.manual_seed(n + k)
    dense = torch.randn(n, k, device=device) / k**0.5
    weight = dense.to(torch.bfloat16) if method == "bf16" else quant.quantize(dense, *ON_THE_FLY[method])
    del dense
    x = torch.randn(rows, 2 * k if prologue == kernels.SILU_MUL else k, device=device, dtype=torch.bfloat16)
    residual = torch.randn(rows, k, device=device, dtype=torch.bfloat16) if prologue == kernels.ADD_NORM else None
    norm = torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5 if prologue in (kernels.NORM,
                                                                                   kernels.ADD_NORM) else None
    return x, weight, residual, norm


def _tiles(method: str, prologue: int, k: int, rows: int) -> list:
    """Every tile the start-up tuning times for this product (K = k) on a GPU with PDL: asked of a
    weight on the meta device, which is offered what a GPU would be (the MMA kernel's tiles too)."""
    import torch

    from jetserve.engine.config import ON_THE_FLY
    from jetserve.engine.model import kernels, quant
    from jetserve.engine.model.quant_kernels import fitting_tiles

    if method == "bf16":
        return kernels.candidate_tiles(rows, prologue, pdl=True)[1:]
    weight = quant.quantize(torch.zeros(16, k, device="meta"), *ON_THE_FLY[method])
    return fitting_tiles(rows, weight, prologue, pdl=True)


def projection_variants(shapes, methods, rows: int) -> list[tuple]:
    """(method, prologue, k, rows, tile) of every kernel a run compiles. N is a launch argument
    (all real ones multiples of 16, as Triton specializes them), K and the tile are compiled in."""
    seen = []
    for shape in shapes:
        for name, (prologue, _, k) in shape_projections(shape).items():
            for method in _methods(name, methods):
                seen += [v for v in ((method, prologue, k, rows, t) for t in _tiles(method, prologue, k, rows))
                         if v not in seen]
    return seen


def main_choice(times: dict) -> tuple[float, object]:
    """(ms, tile) of the fastest of what main could choose before this round: any candidate but
    the one-row quantized kernel's (`Tile.one_row`)."""
    mains = {t: ms for t, ms in times.items() if t is None or not t.one_row}
    best = min(mains, key=mains.get)
    return mains[best], best


def _runner(method: str):
    from jetserve.engine.model import kernels
    from jetserve.engine.model.quant_kernels import quant_matmul

    return kernels._run if method == "bf16" else quant_matmul


def _compile(variant) -> str | None:
    """Compile (and run once) one variant; what went wrong, if anything (that tile is then
    skipped by the tuning too)."""
    import torch

    method, prologue, k, rows, tile = variant
    x, weight, residual, norm = operands(prologue, 128, k, method, torch.device("cuda"), rows)
    try:
        _runner(method)(tile, prologue, x, weight, residual, norm, 1e-6)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on
        return f"{variant}: {type(exc).__name__}: {exc}"[:300]
    return None


def precompile(variants, desc: str) -> None:
    """Every kernel variant compiled first by a pool of processes (Triton's on-disk cache then
    serves the timing process): compiled one after another they take minutes."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    workers = max(1, min(len(variants), (os.cpu_count() or 2) - 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = [e for e in tqdm(pool.map(_compile, variants), total=len(variants), desc=desc) if e]
    for error in errors:
        tqdm.write(f"[quant] failed: {error}")


def _weight_bytes(weight) -> int:
    import torch

    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return sum(t.numel() * t.element_size() for t in weight if isinstance(t, torch.Tensor))


def _relative_error(product, prologue, x, weight, residual, norm) -> float:
    """||out - ref|| / ||ref|| of `product` (called as a skinny matmul) against the same product
    in fp32 (dequantized weights): bf16 activations and outputs put it near 3e-3; a wrong kernel,
    near 1."""
    import torch
    import torch.nn.functional as F

    from jetserve.engine.model import kernels, quant

    eps = 1e-6
    dense = weight.float() if isinstance(weight, torch.Tensor) else quant.dequantize(weight, torch.float32)
    h = x.float()
    if prologue == kernels.SILU_MUL:
        h = F.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:]
    if residual is not None:
        h = h + residual.float()
    if norm is not None:
        h = norm.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    want = F.linear(h, dense)
    got = product(prologue, x, weight, residual, norm, eps)
    got = (got[0] if isinstance(got, tuple) else got).float()
    return round(((got - want).norm() / want.norm()).item(), 5)


def kernel_table(shapes, methods, bandwidth: float) -> dict:
    """Per shape, projection and method: the start-up tile tuning's fastest tile, GB/s and
    weights a second, beside the fastest of what main could choose, timed in the same tuning
    (`bandwidth` the tensor-sum read rate, GB/s)."""
    import torch

    from jetserve.engine.model import int4pack
    from jetserve.engine.model.quant_kernels import QuantFusedKernels, quant_matmul

    device = torch.device("cuda")
    table = {}
    for shape in shapes:
        rows = table[shape] = {}
        for name, (prologue, n, k) in shape_projections(shape).items():
            for method in _methods(name, methods):
                x, weight, residual, norm = operands(prologue, n, k, method, device)
                if method == "int4" and int4pack.applies(4, weight.group_size, n, k, x.dtype, device):
                    row = rows[f"{name} {method}"] = _tinygemm_row(prologue, x, weight, residual, norm, bandwidth)
                    row["jetson_us"] = jetson_projection(name, n, k, row["weight_bytes"], method, True,
                                                         row["share_of_read_bandwidth"])
                    print(f"[quant] kernel {shape} {name} {method}: {row}", flush=True)
                    continue
                fused = QuantFusedKernels(tile_timing=True)
                fused.skinny_matmul(prologue, x, weight, residual, norm, 1e-6)
                (key, tile), = fused.chosen.items()
                times = fused.tuning_times[key]
                ms = min(times.values())
                main_ms, main_tile = main_choice(times)
                size = _weight_bytes(weight)
                error = _relative_error(fused.skinny_matmul, prologue, x, weight, residual, norm)
                gemv = {t: ms for t, ms in times.items() if t is not None and t.one_row}
                gemv_tile = min(gemv, key=gemv.get) if gemv else None
                gemv_error = gemv_tile and _relative_error(lambda *a, t=gemv_tile: quant_matmul(t, *a), prologue, x,
                                                           weight, residual, norm)
                rows[f"{name} {method}"] = {
                    "shape_nk": [n, k], "weight_bytes": size, "us": round(ms * 1e3, 2),
                    "GBps": round(size / ms / 1e6, 1), "Gweights_per_s": round(n * k / ms / 1e6), "share_of_read_bandwidth": round(size / ms / 1e6 / bandwidth, 3),
                    "tile": "cuBLAS" if tile is None else str(tile), "relative_error": error,
                    "main_us": round(main_ms * 1e3, 2), "main_GBps": round(size / main_ms / 1e6, 1),
                    "main_tile": "cuBLAS" if main_tile is None else str(main_tile),
                    "gemv_us": gemv_tile and round(gemv[gemv_tile] * 1e3, 2), "gemv_tile": gemv_tile and str(gemv_tile),
                    "gemv_relative_error": gemv_error,
                    "cuBLAS_us": round(times[None] * 1e3, 2) if None in times else None,
                    "tiles_us": {str(t): round(v * 1e3, 2) for t, v in times.items()}}
                row = rows[f"{name} {method}"]
                row["jetson_us"] = jetson_projection(name, n, k, size, method, False, row["share_of_read_bandwidth"])
                print(f"[quant] kernel {shape} {name} {method}: {row['us']} us {row['GBps']} GB/s tile {tile} "
                      f"error {row['relative_error']}; main {row['main_us']} us {row['main_GBps']} GB/s "
                      f"{row['main_tile']}; one-row kernel {row['gemv_us']} us error {row['gemv_relative_error']}",
                      flush=True)
                del x, weight, residual, norm, fused
    return table


def jetson_projection(name: str, n: int, k: int, size: int, method: str, tinygemm: bool, share: float) -> dict:
    """Each Jetson board's time for one product (µs), as `jetserve plan` projects it
    (plan.product_times: its bytes over the board's bandwidth, its kernel's SASS instructions a
    weight over cores x clock, and the bound it hits), and that time where the board's memory
    reaches the share of its bandwidth this kernel reached here (`share`, measured)."""
    from jetserve.engine.plan import BOARDS, Product, product_times

    product = Product(name, 1, n * k, size, method, tinygemm)
    boards = {}
    for board_name, board in BOARDS.items():
        (t,) = product_times(board, (product,))
        boards[board_name] = {"kernel": t.kernel, "memory_us": round(t.memory_ms * 1e3, 2),
                              "instructions_us": round(t.issue_ms * 1e3, 2), "bound": t.bound,
                              "at_measured_share_us": round(max(t.memory_ms / max(share, 1e-3), t.issue_ms) * 1e3, 2)}
    return boards


def _tinygemm_row(prologue, x, weight, residual, norm, bandwidth: float) -> dict:
    """A kernel-table row for an INT4 product the engine runs through torch's W4A16 kernel
    (model/int4pack.py), its prologue apart, timed as the tiles are (a CUDA graph over cold copies)."""
    from jetserve.engine.model import int4pack, quant
    from jetserve.engine.model.kernels import cold_copies, graph_time
    from jetserve.engine.model.quant_kernels import QuantFusedKernels

    packed = int4pack.pack(quant.integers(weight), quant.zero_points(weight), weight.scales, weight.group_size)
    fused = QuantFusedKernels()
    ms = graph_time([lambda w=packed._replace(packed=c): fused.skinny_matmul(prologue, x, w, residual, norm, 1e-6)
                     for c in cold_copies(packed.packed)])
    size = _weight_bytes(packed)
    error = _relative_error(lambda p, a, _w, r, nw, eps: fused.skinny_matmul(p, a, packed, r, nw, eps), prologue, x,
                            weight, residual, norm)
    n, k = weight.shape
    return {"shape_nk": [n, k], "weight_bytes": size, "us": round(ms * 1e3, 2), "GBps": round(size / ms / 1e6, 1),
            "Gweights_per_s": round(n * k / ms / 1e6), "share_of_read_bandwidth": round(size / ms / 1e6 / bandwidth, 3),
            "tile": "tinygemm", "relative_error": error}


def _time_decode(engine, args, rng) -> tuple[float, float | None]:
    """One repeat: fresh random prompt, prefill, then the median of `steps` decode steps (ms),
    and the decode graph's replay alone."""
    import time

    import torch

    from jetserve.bench.common import median
    from jetserve.bench.decode import replay_ms
    from jetserve.engine.sampling_params import SamplingParams

    vocab = engine.config.model_config.vocab_size
    ids = torch.randint(0, vocab, (args.prompt_len,), generator=rng).tolist()
    engine.add_request(f"r{rng.initial_seed()}-{time.monotonic_ns()}", {"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True))
    while not engine.step():  # prefill until the sequence decodes
        pass
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return median(times) * 1e3, replay_ms(engine.runner.graphs, 1) if engine.runner.graphs else None


def run(args) -> dict:
    import tempfile
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from jetserve.bench.common import environment, median, random_checkpoint, read_bandwidth, write_results
    from jetserve.engine.config import EngineArgs
    from jetserve.engine.llm_engine import LLMEngine
    from jetserve.engine.plan import BOARDS, memory_plan

    device = torch.device("cuda")
    # the table's, then the engines' start-up tuning's (16-64 rows: the mixed-step buckets)
    from jetserve.engine.model import int4pack

    # INT4 takes torch's W4A16 kernel where it runs (model/int4pack.py): no Triton INT4 tiles to compile
    tinygemm = int4pack.applies(4, 128, 8, 128, torch.bfloat16, device)
    variants = projection_variants(args.shapes, [m for m in args.methods if not (m == "int4" and tinygemm)], 1)
    for rows in ([] if args.skip_engine else [16, 32, 64]):
        variants += projection_variants(args.shapes, ["bf16"], rows)
    precompile(variants, "[quant] compiling kernel variants")
    bandwidth = read_bandwidth(device)
    result = {"env": environment(device), "read_bandwidth_GBps": round(bandwidth / 1e9, 1), "batch": 1,
              "activations": "bfloat16", "kernels": {}, "shapes": {}}
    result["kernels"] = kernel_table(args.shapes, args.methods, bandwidth / 1e9)
    write_results(args.out, result, {"kernels": plot_kernels(result)})
    if args.skip_engine:
        return result
    rng = torch.Generator().manual_seed(0)
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
                config = EngineArgs(model=tmp, device="cuda", quantization=quantization, max_num_seqs=1,
                                    max_model_len=length, num_kv_blocks=-(-length // 16) + 1).resolve()
                read = memory_plan(config, "orin-nano-8gb").bytes_per_token
                engine = LLMEngine(config)
                _time_decode(engine, args, rng)  # warm: every shape compiled, tuned and captured
                tpots, replays = zip(*(_time_decode(engine, args, rng) for _ in range(args.repeats)))
                tiles = {str(k): v for k, v in engine.runner.model.layers[0].mlp.down_proj.kernels.chosen.items()}
                del engine
                torch.cuda.empty_cache()
                roofline = read / bandwidth * 1e3
                ratio = min(replays) / roofline
                out[method] = {
                    "tpot_ms": {"min": round(min(tpots), 4), "median": round(median(tpots), 4)},
                    "graph_replay_ms": {"min": round(min(replays), 4), "median": round(median(replays), 4)},
                    "bytes_read_per_token": read, "roofline_ms": round(roofline, 4),
                    "measured_over_roofline": round(ratio, 2), "tiles": tiles,
                    "jetson_ms_per_token": {name: {"bandwidth_floor": round(read / b.bandwidth * 1e3, 2),
                                                   "at_measured_ratio": round(read / b.bandwidth * 1e3 * ratio, 2)}
                                            for name, b in BOARDS.items()}}
                tqdm.write(f"[quant] {shape} {method}: {out[method]['tpot_ms']} ms/token, replay "
                           f"{out[method]['graph_replay_ms']}")
                write_results(args.out, result, {"quant": _plot(result), "kernels": plot_kernels(result)})
    return result


def _gpu(result) -> str:
    return result["env"].get("gpu", result["env"].get("device", "?"))


def _figure(shapes, width):
    """One plot a shape, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(shapes)), figsize=(width * max(1, len(shapes)), 4), squeeze=False)
    return fig, axes[0]


def _plot(result):
    shapes = list(result["shapes"])
    fig, axes = _figure(shapes, 5)
    for ax, shape in zip(axes, shapes):
        methods = result["shapes"][shape]
        names = list(methods)
        ax.bar(names, [methods[m]["tpot_ms"]["min"] for m in names], label="TPOT (engine step)")
        ax.plot(names, [methods[m]["roofline_ms"] for m in names], "k_", markersize=30, label="bandwidth floor")
        ax.set_title(f"{shape}, {_gpu(result)}, batch 1")
        ax.set_ylabel("ms / token")
        ax.legend()
    return fig


def plot_kernels(result):
    """GB/s each projection's kernel reads its weights at, per method, against the read bandwidth."""
    shapes = list(result["kernels"])
    fig, axes = _figure(shapes, 6)
    for ax, shape in zip(axes, shapes):
        rows = result["kernels"][shape]
        projections = list(dict.fromkeys(name.split()[0] for name in rows))
        for i, method in enumerate(METHODS):
            xs = [j + 0.27 * (i - 1) for j, p in enumerate(projections) if f"{p} {method}" in rows]
            ys = [rows[f"{p} {method}"]["GBps"] for p in projections if f"{p} {method}" in rows]
            ax.bar(xs, ys, width=0.27, label=method)
        ax.axhline(result["read_bandwidth_GBps"], color="k", linestyle="--", label="read bandwidth")
        ax.set_xticks(range(len(projections)), projections)
        ax.set_title(f"{shape} kernels alone, {_gpu(result)}, batch 1")
        ax.set_ylabel("GB/s of weights read")
        ax.legend()
    return fig
