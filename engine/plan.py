"""The memory plan: what a configuration needs on a device, before anything is loaded.

Jetsons share one LPDDR5 pool between the OS, the CPU and the GPU, and run out of it by the OOM
killer, not by an error. So `jetserve plan` (and `serve`, before it loads) adds up the weights as
they will be (the loader's own meta model, quantized as configured), the KV cache at
max_model_len × max_num_seqs (the runner's `block_bytes`), the activations of the largest step and
of the largest CUDA graph (the runner's `kv_reserve`, here with a formula for what a dry run
measures there), the runtime and the most the queued prompts may hold (`max_queued_bytes`:
admission refuses past it), and compares them with what the board leaves beside its OS.
Decode at batch 1 reads every weight once a token, so the bytes read over the board's bandwidth
bound its speed from below; so do the instructions its kernels spend a weight (read from their
SASS for the board's GPU family, tiles/sass.json by tools/sass_count.py) over the board's CUDA
cores times its clock. The projection takes the larger of the two product by product, as each
product runs alone, and says which bound each one hits: an Orin Nano's few cores at a low clock
make a kernel of too many instructions a weight the bound before its memory is, while the bf16
vocab projection beside it, two bytes a weight, stays bound by memory. Summing the two bounds over
the whole step instead would hide the first behind the second.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from jetserve.engine.config import EngineConfig
from jetserve.engine.model.checkpoint import Checkpoint
from jetserve.engine.model import int4pack
from jetserve.engine.model.loader import build_meta_model, torch_dtype
from jetserve.engine.model.quant import MAX_DEQUANTIZED, QuantLinear
from jetserve.engine.runner import block_bytes, kv_reserve

GiB = 2**30


@dataclass(frozen=True)
class Board:
    memory: int  # bytes, shared by the OS, the CPU and the GPU on a Jetson
    os_reserve: int  # bytes kept for the OS, its services and the agent
    bandwidth: float  # bytes/s of memory bandwidth
    cuda_cores: int = 0  # FP32 lanes: one instruction each a clock
    gpu_clock: float = 0.0  # Hz, the GPU's top clock in the default power mode
    family: str = "sm87"  # the GPU's compute capability, as the tile tables name it


# Published memory and bandwidth; the OS share is a headless JetPack with the agent running.
BOARDS = {
    "orin-nano-8gb": Board(8 * GiB, int(1.5 * GiB), 68e9, 1024, 625e6),
    "orin-nx-16gb": Board(16 * GiB, 2 * GiB, 102e9, 1024, 918e6),
    "agx-orin-32gb": Board(32 * GiB, 2 * GiB, 205e9, 1792, 930e6),
    "agx-orin-64gb": Board(64 * GiB, 2 * GiB, 205e9, 2048, 1.3e9),
    "thor": Board(128 * GiB, 3 * GiB, 273e9, 2560, 1.575e9, "sm110"),
}
SASS_COUNTS = Path(__file__).parent / "model" / "tiles" / "sass.json"


def instructions_per_weight(family: str, method: str, tinygemm: bool = False) -> tuple[float, str, str]:
    """(instructions a weight, kernel, family counted) of the batch-1 kernel a product of this
    format (bf16 / int8 / int4) takes on a GPU family, from tiles/sass.json: torch's W4A16 kernel
    for the INT4 products that take it (`tinygemm`: model/int4pack.py), else the fastest-issuing
    of ours (a lower bound, as the projection is); a family not counted takes the nearest counted
    one's (by compute capability), as the tile tables do."""
    families = json.loads(SASS_COUNTS.read_text())["families"]
    number = int(family[2:])
    name = family if family in families else min(families, key=lambda f: abs(int(f[2:]) - number))
    counts = families[name].get(method, families[name]["bf16"])
    if isinstance(counts, float):
        return counts, "fma", name
    if tinygemm and "tinygemm" in counts:
        return counts["tinygemm"], "tinygemm", name
    ours = {kernel: n for kernel, n in counts.items() if kernel != "tinygemm"}
    kernel = min(ours, key=ours.get)
    return ours[kernel], kernel, name


@dataclass(frozen=True)
class Product:
    """Projections alike in a batch-1 decode step: one in each decoder layer, or the vocab projection."""
    name: str
    count: int  # a token
    weights: int  # each multiplies by
    bytes: int  # each reads: the weights, or their packed words, scales and zero points
    method: str  # bf16 (any float: the 16-bit kernels' count), int8 or int4
    tinygemm: bool = False  # INT4 that a GPU runs through torch's W4A16 kernel (model/int4pack.py)


# The kernels tiles/sass.json counts, as the docs name them.
KERNEL_NAMES = {"fma": "FMA", "dot": "tensor-core", "mma": "MMA", "tinygemm": "tinygemm"}
# Our names for the projections, as the docs and the tile tables' probes call them.
PRODUCT_NAMES = {"qkv_proj": "q·k·v", "o_proj": "o", "gate_up_proj": "gate·up", "down_proj": "down",
                 "lm_head": "vocab"}


def decode_products(model: torch.nn.Module, dtype: torch.dtype) -> tuple[Product, ...]:
    """What a batch-1 decode step of the (meta) model multiplies by, kind by kind: the decoder
    layers' projections and the vocab projection (the MTP layers draft in steps of their own)."""
    counts: dict[Product, int] = {}
    for name, module in [*model.layers.named_modules(), ("lm_head", model.lm_head)]:
        if isinstance(module, QuantLinear):
            method = f"int{module.bits}"
            tinygemm = int4pack.takes(module.bits, module.group_size, module.out_features, module.in_features,
                                      dtype, "cuda")
        elif isinstance(module, torch.nn.Linear):
            method, tinygemm = "bf16", False
        else:
            continue
        short = name.rsplit(".", 1)[-1]
        kind = Product(PRODUCT_NAMES.get(short, short), 1, module.in_features * module.out_features,
                       _bytes(module), method, tinygemm)
        counts[kind] = counts.get(kind, 0) + 1
    return tuple(replace(kind, count=n) for kind, n in counts.items())


class ProductTime(NamedTuple):
    """A product's share of a board's batch-1 step: all `count` of them, ms."""
    product: Product
    kernel: str
    per_weight: float  # instructions a weight, from the SASS of `family`
    family: str
    memory_ms: float  # its bytes over the bandwidth
    issue_ms: float  # its instructions over cores x clock

    @property
    def ms(self) -> float:
        return max(self.memory_ms, self.issue_ms)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_ms >= self.issue_ms else "instructions"


def product_times(board: Board, products: tuple[Product, ...]) -> list[ProductTime]:
    """Each product's floors on `board`: its bytes over the bandwidth, its instructions over the
    CUDA cores times the clock (one FP32 lane issues one instruction a clock)."""
    rows = []
    for p in products:
        per_weight, kernel, family = instructions_per_weight(board.family, p.method, p.tinygemm)
        rows.append(ProductTime(p, kernel, per_weight, family, p.count * p.bytes / board.bandwidth * 1e3,
                                p.count * p.weights * per_weight / (board.cuda_cores * board.gpu_clock) * 1e3))
    return rows


RUNTIME_BYTES = int(0.6 * GiB)  # CUDA context, torch and the compiled kernels, on a GPU


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    available: int  # bytes left beside the OS (this machine: free now)
    weights: int
    kv_cache: int
    kv_tokens: int
    activations: int
    graphs: int
    runtime: int
    bytes_per_token: int  # read by a batch-1 decode step: the weights it multiplies by
    bandwidth: float | None
    kv_per_seq: int  # bytes of KV one sequence of max_model_len takes
    products: tuple[Product, ...] = ()  # what a batch-1 decode step multiplies by
    board: Board | None = None
    queue: int = 0  # what the prompts of the requests in the engine may hold at most (max_queued_bytes)

    def decode_ms(self) -> tuple[float, list[ProductTime]]:
        """(projected ms a token at batch 1, each product's share): the products each the slower
        of their bytes and their instructions on the board, the rest of the bytes read (norms)
        at its bandwidth. The bandwidth floor alone where the board's cores are not known."""
        if not (self.board and self.board.cuda_cores):
            return self.bytes_per_token / self.bandwidth * 1e3, []
        rows = product_times(self.board, self.products)
        rest = self.bytes_per_token - sum(p.count * p.bytes for p in self.products)
        return sum(row.ms for row in rows) + rest / self.bandwidth * 1e3, rows

    @property
    def need(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.graphs + self.runtime + self.queue

    @property
    def fits(self) -> bool:
        return self.need <= self.available

    def max_num_seqs(self) -> int:
        """Sequences of max_model_len whose KV fits beside everything else."""
        return max(0, (self.available - self.need + self.kv_cache) // self.kv_per_seq)

    def table(self, config: EngineConfig) -> str:
        q = config.quantization
        rows = [
            ("weights", self.weights, q.method if q else config.dtype),
            ("KV cache", self.kv_cache, f"{config.num_kv_blocks} blocks of {config.block_size} tokens (num_kv_blocks), "
                                        f"{config.dtype}" if config.num_kv_blocks else
                                        f"{config.max_model_len} tokens x {config.max_num_seqs} seqs, {config.dtype}"),
            ("activations", self.activations, f"largest step: {config.max_num_batched_tokens} tokens"),
            ("CUDA graphs", self.graphs, "largest captured step" if config.cuda_graphs else "off"),
            ("runtime", self.runtime, "CUDA context, torch, kernels" if self.runtime else "CPU"),
            ("queue", self.queue, f"prompt token ids in the engine (max_queued_bytes; {config.max_num_seqs} "
                                  f"running + {config.max_waiting} waiting requests)"),
            ("total", self.need, ""),
            ("available", self.available, f"{self.device}, beside the OS"),
        ]
        lines = [f"{name:<12}{n / GiB:>8.2f} GiB  {note}" for name, n, note in rows]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"{verdict}: {(self.available - self.need) / GiB:+.2f} GiB to spare")
        if not self.fits and config.num_kv_blocks:
            spare = self.available - self.need + self.kv_cache
            block = self.kv_cache // (config.num_kv_blocks + 1)
            lines.append(f"num_kv_blocks fits at most {max(0, spare // block - 1)}")
        elif not self.fits:
            lines.append(f"at max_model_len={config.max_model_len}, KV fits max_num_seqs={self.max_num_seqs()}"
                         + ("" if q else "; weight-only quantization (--quantization int8 or int4) shrinks the "
                                         "weights 2-4x"))
        if self.bandwidth:
            lines.append(f"decode, batch 1: {self.bytes_per_token / GiB:.2f} GiB read a token -> "
                         f">= {self.bytes_per_token / self.bandwidth * 1e3:.1f} ms/token at "
                         f"{self.bandwidth / 1e9:.0f} GB/s")
            ms, rows = self.decode_ms()
            if rows:
                board = self.board
                lines.append(f"  projected >= {ms:.1f} ms/token: each product the slower of its bytes at "
                             f"{self.bandwidth / 1e9:.0f} GB/s and its instructions over {board.cuda_cores} cores x "
                             f"{board.gpu_clock / 1e9:.2f} GHz\n  (instructions a weight: the {rows[0].family} SASS "
                             "of the kernel it takes; the rest of the bytes, norms, at the bandwidth)")
                lines.append(f"  {'product':<9}{'format':<8}{'kernel':<13}{'a token':>7}{'instr/weight':>14}"
                             f"{'memory ms':>11}{'instr. ms':>11}  bound")
                lines += [f"  {r.product.name:<9}{r.product.method:<8}{KERNEL_NAMES[r.kernel]:<13}"
                          f"{'x%d' % r.product.count:>7}{r.per_weight:>14.2f}{r.memory_ms:>11.2f}{r.issue_ms:>11.2f}"
                          f"  {r.bound}" for r in rows]
        return "\n".join(lines)


def memory_plan(config: EngineConfig, device: str) -> MemoryPlan:
    """The plan of `config` on a board of BOARDS or on "this" machine (its free memory now)."""
    if device == "this":
        available, bandwidth, board = _free_here(config.device), None, None
    elif device in BOARDS:
        board = BOARDS[device]
        available, bandwidth = board.memory - board.os_reserve, board.bandwidth
    else:
        raise ValueError(f"device must be one of {', '.join([*BOARDS, 'this'])}, got {device!r}")
    dtype = torch_dtype(config.dtype)
    model, _, _ = build_meta_model(Checkpoint(config.model), dtype, config.max_model_len, config.quantization)
    weights = _bytes(model)
    spec, c = config.speculative, config.model_config
    if spec and spec.draft_vocab_size < c.vocab_size:  # the draft vocabulary's rows, gathered (the runner's)
        weights += _bytes(model.lm_head) * spec.draft_vocab_size // c.vocab_size
    read = _bytes(model.layers) + _bytes(model.norm) + _bytes(model.lm_head)
    dequantized = max((min(m.in_features * m.out_features, MAX_DEQUANTIZED) * dtype.itemsize for m in model.modules()
                       if isinstance(m, QuantLinear)), default=0)
    measure = _activation_formula(config, dtype.itemsize, dequantized)
    activations = kv_reserve(replace(config, cuda_graphs=None), measure)
    graphs = kv_reserve(config, measure) - activations
    # the pool the runner allocates: num_kv_blocks where given, else one sequence of max_model_len a
    # slot (the runner fills free memory beyond that), + the scratch block
    blocks = (config.num_kv_blocks or config.max_num_seqs * config.max_blocks_per_seq) + 1
    gpu = device != "this" or config.device.startswith("cuda")
    return MemoryPlan(device, available, weights, blocks * block_bytes(config), blocks * config.block_size,
                      activations, graphs, RUNTIME_BYTES if gpu else 0, read, bandwidth,
                      config.max_blocks_per_seq * block_bytes(config), decode_products(model, dtype), board,
                      config.max_queued_bytes)


def _bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}  # tied weights once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _activation_formula(config: EngineConfig, act_bytes: int, dequantized: int):
    """What `ModelRunner._activation_peak` measures by a dry run, on paper: a layer's live
    tensors for n tokens (hidden, residual, normed input, q|k|v, attention output, gate|up and
    SiLU·up), fp32 logits of the sampled rows and, with quantized weights, one projection
    dequantized for a prefill step."""
    c = config.model_config
    per_token = (4 * c.hidden_size + (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                 + 3 * c.intermediate_size) * act_bytes

    def measure(n: int, n_logits: int) -> int:
        return n * per_token + n_logits * c.vocab_size * (4 + act_bytes) + dequantized
    return measure


def _free_here(device: str) -> int:
    """Bytes this machine can still give: the GPU's free memory, or the RAM available (a Jetson's
    GPU memory is its RAM)."""
    if device.startswith("cuda") and not _unified_memory():
        return torch.cuda.mem_get_info(torch.device(device))[0]
    import psutil

    return psutil.virtual_memory().available


def _unified_memory() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.get_device_properties(0).is_integrated)


def refuse_if_it_cannot_fit(config: EngineConfig) -> None:
    """Raise ValueError with the plan when this machine cannot hold the configuration (a served
    engine, before its weights load): on a Jetson the alternative is the OOM killer, later, with
    nothing said. Settings a plan cannot be made of are left to the engine, which names them."""
    if config.backend != "torch":
        return
    try:
        plan = memory_plan(config, "this")
    except (ValueError, OSError):
        return
    if not plan.fits:
        raise ValueError("this configuration does not fit in this machine's free memory:\n" + plan.table(config))


# Common Hugging Face shapes by name (their config.json ships with jetserve, no weights), so a
# board can be planned for before anything is downloaded: `jetserve plan --model qwen3-4b`.
def known_shapes() -> list[str]:
    from jetserve import __file__ as package

    shapes = Path(package).resolve().parent / "models" / "shapes"
    return sorted(p.name for p in shapes.iterdir() if (p / "config.json").is_file()) if shapes.is_dir() else []


def shape_config(name: str) -> dict | None:
    """The shipped config.json of a named shape, or None for a name that is not one."""
    from jetserve import __file__ as package

    path = Path(package).resolve().parent / "models" / "shapes" / name.lower() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def shape_checkpoint(config: dict, directory: str | os.PathLike) -> Path:
    """A checkpoint of `config`'s shape whose tensors are holes: a safetensors header naming every
    tensor the loader expects (bf16) and a sparse file, so the plan reads real metadata while
    nothing is written to disk but the header."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    tensors = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = (config["vocab_size"], h)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}"
        tensors.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                        f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,),
                        f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                        f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
                        f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h),
                        f"{p}.mlp.down_proj.weight": (h, i)})
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + offset)
    (out / "config.json").write_text(json.dumps(config))
    return out
