"""Compiled decode steps on the CPU: the CPU's counterpart of cuda_graphs.py.

An eager CPU decode step of a small model is a few hundred aten calls from Python, and on a
2-core board that interpreter work, not the arithmetic, sets the pace. So a decode step is made
once into one program and then only run: the whole forward, the attention over the paged KV
cache, the vocab projection and the greedy argmax go through `torch.compile` (inductor's C++
backend), which fuses the norms, q/k norm + RoPE, the attention and SiLU·up into a few C++
loops between the matrix products. With inductor's freezing the weights are constants of the
program, packed once at compile time for MKL (batch 1) or oneDNN (more rows), which read them
faster than the BLAS call on the plain matrix (bench/results/decode-cpu-compiled).

Two programs serve every batch bucket: batch 1, and one whose batch size is symbolic (so
oneDNN's product, 2-3x MKL's at 8 rows of a wide projection); in both the context read is the
other symbolic size, the batch's longest context rounded up to `CONTEXT_ALIGN`, so a step never
reads the whole block table nor recompiles as contexts grow. The static inputs are the CUDA
graphs' (token ids, positions, slots, context lengths) plus each context position's cache slot
in place of block tables, written in place by the host (`stage`). A step's new keys and values
leave the program as outputs and are stored with one indexed copy after it: stored inside,
into a view of the cache, they make inductor copy the whole cache every step.

Packed weights (oneDNN tensors) cannot be pickled, so inductor's on-disk cache (`cache_dir`)
passes these programs by and each start compiles both (progress bar; 30 s and 47 s on the
2-core box at load 6, whatever the number of buckets). The frozen weights are copies: each
program holds the model's weights once more. Steps with prefill chunks, batches above the
largest bucket and buckets whose compile failed run eagerly; so does every step with
`--enforce-eager`.
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

CONTEXT_ALIGN = 16  # the attention reads the batch's longest context rounded up to this


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_slots: torch.Tensor,
                     cached_lens: torch.Tensor, scale: float,
                     fresh: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query a sequence over its context, as reductions inductor fuses with the gather from
    the paged cache (no copy of the context): q [B, H, D]; caches [slots, KVH, D];
    context_slots [B, C] the cache slot of each context position (a block table of one-token
    blocks); cached_lens [B] the positions read from the cache (those past it are masked, so
    their slots may be stale); `fresh`: this step's own key and value [B, KVH, D], not yet in
    the cache."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    q = q.view(batch, 1, kv_heads, heads // kv_heads, dim).float() * scale
    keys, values = k_cache[context_slots], v_cache[context_slots]  # [B, C, KVH, D]
    scores = (q * keys[:, :, :, None, :].float()).sum(-1)  # [B, C, KVH, G]
    visible = torch.arange(context_slots.shape[1], device=q.device)[None, :] < cached_lens[:, None]
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    if fresh is not None:
        k, v = (t.float()[:, None, :, None, :] for t in fresh)  # [B, 1, KVH, 1, D]
        scores = torch.cat([scores, (q * k).sum(-1)], dim=1)
    probs = torch.softmax(scores, dim=1)
    out = (probs[:, :keys.shape[1], :, :, None] * values[:, :, :, None, :].float()).sum(1)  # [B, KVH, G, D]
    if fresh is not None:
        out = out + probs[:, -1, :, :, None] * v[:, 0]
    return out.reshape(batch, heads, dim).to(k_cache.dtype)


class CPUKernels:
    """The model's kernel interface (model/kernels.py's `FusedKernels`) in plain torch, for the
    compiled step: the model's own computation, with the paged attention of a decode step
    (`decode_attention`). Eagerly (prefill steps, buckets that did not compile, MTP drafts over
    a compiled step's metadata) the same methods run as plain torch ops."""

    SKINNY_MAX_ROWS = 64  # rows the model hands to `linear` (all of them: it is F.linear)

    def __init__(self):
        # Compiling: each layer's new key and value, which the step returns for one store after
        # the program (a store into the cache, a view of a graph input, makes inductor copy the
        # whole cache); the layer's attention reads its own from here.
        self.fresh: list[tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def runs_on(x: torch.Tensor) -> bool:
        return x.device.type == "cpu"

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

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

    def qk_norm_rope_store(self, qkv, q_weight, k_weight, cos, sin, slot_mapping, k_cache, v_cache, eps: float,
                           num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """Per-head RMSNorm and RoPE of q and k, k and v written into their cache slots; returns
        q [T, H, D]."""
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = apply_rope(_rms_norm(q.view(-1, num_heads, head_dim), q_weight, eps), cos, sin)
        k = apply_rope(_rms_norm(k.view(-1, num_kv_heads, head_dim), k_weight, eps), cos, sin)
        v = v.view(-1, num_kv_heads, head_dim)
        if torch.compiler.is_compiling():
            self.fresh.append((k, v))
        else:
            index = slot_mapping.long()
            k_cache.index_copy_(0, index, k)
            v_cache.index_copy_(0, index, v)
        return q

    def paged_attention(self, q, k_cache, v_cache, block_tables, context_lens, q_len: int, block_size: int,
                        scale: float) -> torch.Tensor:
        """The compiled step's tables are per token (block_size 1): see `CPUGraphs.meta`."""
        if torch.compiler.is_compiling():
            return decode_attention(q, k_cache, v_cache, block_tables, context_lens - 1, scale, self.fresh[-1])
        return decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


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
        self.span = CONTEXT_ALIGN  # context positions the next step reads (set by `stage`)
        self.graphs: dict[tuple[None, int, int], Callable] = {}
        self.compile_seconds: dict[int, float] = {}

    def key(self, num_drafts: int | None, q_len: int, batch: int, width: int) -> tuple[None, int, int] | None:
        """The compiled step for `batch` single-token decodes (num_drafts None, q_len 1) with block
        tables `width` wide: (None, 1, bucket); None: the step runs eagerly."""
        bucket = next((s for s in self.sizes if s >= batch), None)
        key = (num_drafts, q_len, bucket)
        return key if key in self.graphs and width <= self.width else None

    def meta(self, q_len: int, batch: int) -> AttentionMetadata:
        """Attention metadata over the static inputs of `batch` decodes (tables per token: block size 1)."""
        return AttentionMetadata(slot_mapping=self.slots[:batch], block_tables=self.context_slots[:batch, :self.span],
                                 context_lens=self.context_lens[:batch], q_len=q_len, block_size=1)

    def _step(self, ids, positions, slots, context_slots, context_lens):
        meta = AttentionMetadata(slot_mapping=slots, block_tables=context_slots, context_lens=context_lens, q_len=1,
                                 block_size=1)
        hidden = self.model(ids, positions, self.kv_cache, meta)
        logits = self.model.compute_logits(hidden).float()
        fresh = torch.stack([torch.stack(kv) for kv in self.kernels.fresh])  # [layers, 2, B, KVH, D]
        self.kernels.fresh = []
        return hidden, logits, logits.argmax(-1), fresh

    def _inputs(self, bucket: int) -> tuple[torch.Tensor, ...]:
        return (self.ids[:bucket], self.positions[:bucket], self.slots[:bucket],
                self.context_slots[:bucket, :self.span], self.context_lens[:bucket])

    def _run(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Only the guards that tell the two programs apart: the others (the model's weights and
        # modules, the cache) cannot change after `capture` (0.2 ms a step otherwise, on this box).
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            hidden, logits, greedy, fresh = self._compiled(*self._inputs(bucket))
        self.kv_cache[:fresh.shape[0], :, self.slots[:bucket].long()] = fresh
        return hidden, logits, greedy

    @torch.inference_mode()
    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile the programs (or load them from the on-disk caches) and run each bucket once."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.config.cache_dir  # inductor reads it at each lookup
        self.kernels = CPUKernels()
        self.model.use_kernels(self.kernels)
        self._compiled = torch.compile(self._step, fullgraph=True)
        start = time.perf_counter()
        for i, bucket in enumerate(tqdm(self.sizes, desc="compiling CPU decode steps", unit="step", leave=False)):
            if progress:
                progress(f"compiling CPU decode steps {i + 1}/{len(self.sizes)}")
            began = time.perf_counter()
            self.kernels.fresh, self.span = [], 2 * CONTEXT_ALIGN
            inputs = self._inputs(bucket)
            torch._dynamo.maybe_mark_dynamic(inputs[3], 1)  # the context read
            if bucket > 1:  # one program for every batch of 2 or more
                for t in inputs:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            try:
                # Freezing is read while dynamo traces, so it is set around the call, not in options.
                with torch._dynamo.config.patch(automatic_dynamic_shapes=False), \
                        torch._inductor.config.patch(freezing=True):
                    *_, fresh = self._compiled(*inputs)
                self.kv_cache[:fresh.shape[0], :, self.slots[:bucket].long()] = fresh
            except Exception as exc:  # that bucket runs eagerly; the engine still starts
                log.warning("compiling the CPU decode step at batch size %d failed (%s: %s); it runs eagerly", bucket,
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                continue
            self.graphs[(None, 1, bucket)] = lambda b=bucket: self._run(b)
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
        self.span = min(-(-max(ctx_lens) // CONTEXT_ALIGN) * CONTEXT_ALIGN, context_slots.shape[1])

    def replay(self, key: tuple[None, int, int], n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run a compiled step over the static inputs: the first n rows of its hidden states, fp32
        logits and greedy tokens."""
        hidden, logits, greedy = self.graphs[key]()
        return hidden[:n], logits[:n], greedy[:n]
