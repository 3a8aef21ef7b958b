"""Compiled decode steps on the CPU: the CPU's counterpart of cuda_graphs.py.

An eager CPU decode step of a small model is a few hundred aten calls from Python, and on a
2-core board that interpreter work, not the arithmetic, sets the pace. So, as on CUDA, each
decode batch bucket is made once into one fixed-shape program and then only run: the whole
forward, the vocab projection and the greedy argmax go through `torch.compile` (inductor's C++
backend, `dynamic=False`), which fuses the norms, RoPE and SiLU·up into a handful of C++ loops
around the matrix products. What stays opaque to the compiler is the attention over the paged
KV cache (`cpu_decode_attention`): the context it reads grows every step, and a shape that
changes would recompile. Its static inputs are the CUDA graphs' (token ids, positions, slots,
context lengths), plus each context position's cache slot in place of block tables, all
written in place by the host (`stage`); the attention reads only the batch's longest context.

Compiled code lives in inductor's on-disk caches (FX graph and AOTAutograd caches under
`cache_dir`), so a restart loads the buckets' kernels instead of compiling them again; the
first start on a machine compiles each bucket once (progress bar). Steps with prefill chunks,
batches above the largest bucket and buckets whose compile failed run eagerly; so does every
step with `--enforce-eager`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from jetserve.engine.config import CPUCompileConfig
from jetserve.engine.model.attention import AttentionMetadata, slot_mapping
from jetserve.engine.model.qwen3 import apply_rope

log = logging.getLogger(__name__)

# Realize every pointwise chain of more than three ops (a norm, SiLU·up, RoPE) into its own small
# buffer: inlined into a product's reduction, inductor recomputes it for every output column and
# can no longer vectorize along the weight row (a batch-8 step took 60 ms, not 3). The product's
# own multiply (two loads and a mul) stays inlined, so no [N, M, K] tensor is ever made.
INDUCTOR_OPTIONS = {"realize_opcount_threshold": 3}


@torch.library.custom_op("jetserve::cpu_kv_store", mutates_args=("k_cache", "v_cache"))
def cpu_kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Write a step's keys and values into their cache slots."""
    index = slots.long()
    k_cache.index_copy_(0, index, k)
    v_cache.index_copy_(0, index, v)


@cpu_kv_store.register_fake
def _(k, v, k_cache, v_cache, slots) -> None:
    return None


@torch.library.custom_op("jetserve::cpu_decode_attention", mutates_args=())
def cpu_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_slots: torch.Tensor,
                         context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query a sequence over its context in the paged cache: q [B, H, D], caches [slots, KVH,
    D], context_slots [B, W] the cache slot of each context position (a block table of one-token
    blocks, written by the host), context_lens [B] (after this step's token). Reads the batch's
    longest context only, not the table's whole width."""
    longest = int(context_lens.max())
    slots = context_slots[:, :longest]
    keys, values = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)  # [B, KVH, C, D]
    visible = (torch.arange(longest) < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, C]
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=visible, scale=scale,
                                         enable_gqa=q.shape[1] != keys.shape[1])
    return out[:, :, 0].contiguous()


@cpu_decode_attention.register_fake
def _(q, k_cache, v_cache, context_slots, context_lens, scale):
    return q.new_empty(q.shape)  # contiguous, as the real one returns


class CPUKernels:
    """The model's kernel interface (model/kernels.py's `FusedKernels`) in plain torch, for the
    compiled step. Under `torch.compile` a product of a few rows becomes one reduction loop
    that streams each weight row once for all the rows, `(W[:, None, :] * x).sum(-1)`: inductor
    vectorizes it, where the BLAS call (M ≤ 16, K = hidden) reads the weights at a fraction of
    the memory bandwidth (bench/results/decode-cpu-compiled). Eagerly (prefill steps, buckets
    that did not compile) every method is the model's own plain-torch computation."""

    SKINNY_MAX_ROWS = 16  # more rows: the BLAS product, which is compute-bound by then

    @staticmethod
    def runs_on(x: torch.Tensor) -> bool:
        return x.device.type == "cpu"

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return F.linear(x, weight)
        return (weight[:, None, :] * x[None]).sum(-1).t().contiguous()

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual), as model/qwen3.RMSNorm."""
        if residual is not None:
            x = x + residual
        y = _rms_norm(x, weight, eps)
        return y if residual is None else (y, x)

    @classmethod
    def norm_linear(cls, x, residual, norm_weight, eps: float, weight):
        if residual is None:
            return cls.linear(_rms_norm(x, norm_weight, eps), weight), x
        y, residual = cls.rms_norm(x, norm_weight, eps, residual)
        return cls.linear(y, weight), residual

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @classmethod
    def silu_linear(cls, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return cls.linear(cls.silu_mul(gate_up), weight)

    @staticmethod
    def qk_norm_rope_store(qkv, q_weight, k_weight, cos, sin, slot_mapping, k_cache, v_cache, eps: float,
                           num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """Per-head RMSNorm and RoPE of q and k, k and v written into their cache slots; returns
        q [T, H, D]."""
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = apply_rope(_rms_norm(q.view(-1, num_heads, head_dim), q_weight, eps), cos, sin)
        k = apply_rope(_rms_norm(k.view(-1, num_kv_heads, head_dim), k_weight, eps), cos, sin)
        torch.ops.jetserve.cpu_kv_store(k, v.view(-1, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping)
        return q

    @staticmethod
    def paged_attention(q, k_cache, v_cache, block_tables, context_lens, q_len: int, block_size: int,
                        scale: float) -> torch.Tensor:
        """The compiled step's tables are per token (block_size 1): see `CPUGraphs.meta`."""
        return torch.ops.jetserve.cpu_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm numerics: in fp32, then cast."""
    y = x.float()
    return weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class CPUGraphs:
    """The compiled decode step of each batch bucket over one set of static inputs; the same
    interface the runner uses for CUDA graphs (key, stage, replay, meta)."""

    def __init__(self, model, kv_cache: torch.Tensor, config: CPUCompileConfig, max_model_len: int, block_size: int,
                 scratch_block: int):
        self.model, self.kv_cache, self.config = model, kv_cache, config
        self.sizes = config.capture_sizes
        self.block_size, self.scratch_block = block_size, scratch_block
        self.scratch_slot = scratch_block * block_size
        self.max_batch = max(self.sizes)
        self.width = -(-(max_model_len + 1) // block_size)  # blocks of a sequence's table
        b = self.max_batch
        self.inputs = torch.zeros(4 * b, dtype=torch.int32)
        self.ids, self.positions, self.slots, self.context_lens = self.inputs.view(4, b)
        # The attention reads each context position's slot from here (a table of one-token blocks:
        # no division in the step); padded rows see the scratch slot only.
        self.context_slots = torch.full((b, self.width * block_size), self.scratch_slot, dtype=torch.int64)
        self._host = [t.numpy() for t in (self.ids, self.positions, self.slots, self.context_lens,
                                          self.context_slots)]
        self._offsets = np.arange(block_size)
        self.slots.fill_(self.scratch_slot)
        self.context_lens.fill_(1)
        self.graphs: dict[tuple[None, int, int], Callable] = {}
        self.outputs: dict[tuple[None, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.compile_seconds: dict[int, float] = {}

    def key(self, num_drafts: int | None, q_len: int, batch: int, width: int) -> tuple[None, int, int] | None:
        """The compiled step for `batch` single-token decodes (num_drafts None, q_len 1) with block
        tables `width` wide: (None, 1, bucket); None: the step runs eagerly."""
        bucket = next((s for s in self.sizes if s >= batch), None)
        key = (num_drafts, q_len, bucket)
        return key if key in self.graphs and width <= self.width else None

    def meta(self, q_len: int, batch: int) -> AttentionMetadata:
        """Attention metadata over the static inputs of `batch` decodes (tables per token: block size 1)."""
        return AttentionMetadata(slot_mapping=self.slots[:batch], block_tables=self.context_slots[:batch],
                                 context_lens=self.context_lens[:batch], q_len=q_len, block_size=1)

    def _step(self, ids, positions, meta):
        hidden = self.model(ids, positions, self.kv_cache, meta)
        logits = self.model.compute_logits(hidden).float()
        return hidden, logits, logits.argmax(-1)

    @torch.inference_mode()
    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile each bucket (or load it from the on-disk caches) and run it once."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.config.cache_dir  # inductor reads it at each lookup
        self.model.use_kernels(CPUKernels())
        compiled = torch.compile(self._step, dynamic=False, fullgraph=True, options=INDUCTOR_OPTIONS)
        start = time.perf_counter()
        for i, bucket in enumerate(tqdm(self.sizes, desc="compiling CPU decode steps", unit="step", leave=False)):
            if progress:
                progress(f"compiling CPU decode steps {i + 1}/{len(self.sizes)}")
            began = time.perf_counter()
            step = lambda b=bucket: compiled(self.ids[:b], self.positions[:b], self.meta(1, b))  # noqa: E731
            try:
                step()
            except Exception as exc:  # that bucket runs eagerly; the engine still starts
                log.warning("compiling the CPU decode step at batch size %d failed (%s: %s); it runs eagerly", bucket,
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                continue
            self.graphs[(None, 1, bucket)] = step
            self.compile_seconds[bucket] = round(time.perf_counter() - began, 2)
        log.info("CPU decode steps: %d of %d compiled in %.1f s (batch sizes %s; cache %s)", len(self.graphs),
                 len(self.sizes), time.perf_counter() - start, ",".join(map(str, self.sizes)),
                 self.config.cache_dir)

    def stage(self, key: tuple[None, int, int], ids: list[int], positions: list[int], ctx_lens: list[int],
              tables: list[list[int]]) -> None:
        """Write a decode step (host lists, as the runner builds them) into the static inputs."""
        _, q_len, bucket = key
        n = len(ids)
        host_ids, host_positions, slots, context_lens, context_slots = self._host
        host_ids[:n] = ids
        host_positions[:n] = positions
        slots[:n] = slot_mapping(tables, ctx_lens, [q_len] * n, self.block_size)
        slots[n:bucket] = self.scratch_slot
        context_lens[:n] = ctx_lens
        context_lens[n:bucket] = 1
        # Entries past a sequence's context stay stale: the attention masks positions >= its length.
        for row, table in zip(context_slots, tables):
            row[:len(table) * self.block_size] = (np.asarray(table)[:, None] * self.block_size + self._offsets).ravel()
        context_slots[n:bucket, 0] = self.scratch_slot

    def replay(self, key: tuple[None, int, int], n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run a compiled step over the static inputs: the first n rows of its hidden states, fp32
        logits and greedy tokens."""
        hidden, logits, greedy = self.graphs[key]()
        return hidden[:n], logits[:n], greedy[:n]

