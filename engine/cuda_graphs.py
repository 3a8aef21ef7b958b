"""CUDA graphs for decode-shaped steps: decode, MTP verify and MTP draft steps.

A decode step of a small model is a few hundred short kernels; launched one by one from Python,
the CPU sets the pace (7.4 µs a launch against 1.0 µs inside a graph on the H200). So each step
shape is captured once — (model part, tokens per sequence, batch bucket) — and replayed:

- a batch is padded up to the next capture size; its inputs are copied into the static buffers
  the graphs were captured on; padded tokens write their KV into the scratch block and attend
  to one key, so they touch no real sequence;
- graphs are captured largest first into one shared memory pool, each after warm-up runs
  (Triton compiles, cuBLAS handles, allocator state);
- steps with prefill chunks, batches above the largest bucket and buckets whose capture failed
  run eagerly. Sampling and draft acceptance stay outside the graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from jetserve.engine.attention import AttentionMetadata

log = logging.getLogger(__name__)


def capture_sizes(sizes: list[int] | None, max_size: int | None, max_num_seqs: int) -> list[int]:
    """Batch buckets: the given sizes, or 1, 2, 4, 8 and every 8 after up to the max (vLLM's
    default), all capped by max_num_seqs."""
    limit = min(max_size or max_num_seqs, max_num_seqs)
    sizes = sizes or [1, 2, 4, *range(8, limit + 1, 8), limit]
    return sorted({s for s in sizes if 1 <= s <= limit})


def step_shapes(num_speculative_tokens: int, num_mtp_layers: int) -> list[tuple[int | None, int]]:
    """(MTP layer, or None for the main model; tokens per sequence) of each step to capture.
    With k drafts a step verifies 1..k+1 tokens a sequence (the draft length adapts), the MTP
    pass runs layer 0 over the same rows, and drafting chains 1-token steps through the layers."""
    k = num_speculative_tokens
    if not k:
        return [(None, 1)]
    shapes = {(None, q) for q in range(1, k + 2)} | {(0, q) for q in range(1, k + 2)}
    return sorted(shapes | {(j % num_mtp_layers, 1) for j in range(1, k)}, key=lambda s: (s[0] is not None, s))


def _name(layer: int | None, q_len: int) -> str:
    part = "decode" if layer is None and q_len == 1 else "verify" if layer is None else f"MTP layer {layer}"
    return f"{part} ({q_len} token{'s' * (q_len > 1)} a sequence)"


class CUDAGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, sizes: list[int], shapes: list[tuple[int | None, int]],
                 max_model_len: int, block_size: int, scratch_block: int, num_warmup: int):
        self.model, self.kv_cache = model, kv_cache
        self.sizes, self.shapes, self.num_warmup = sizes, shapes, num_warmup
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        device, n, b = kv_cache.device, max(sizes) * max(q for _, q in shapes), max(sizes)
        # Static inputs, shared by every graph (one step runs at a time).
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=kv_cache.dtype, device=device)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(b, dtype=torch.int32, device=device)
        # Wide enough for max_model_len plus the KV slots reserved for drafts.
        width = -(-(max_model_len + max(q for _, q in shapes)) // block_size)
        self.block_tables = torch.full((b, width), scratch_block, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int | None, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int | None, int, int], torch.Tensor] = {}

    @property
    def max_tokens(self) -> int:
        return self.ids.shape[0]

    def _step(self, layer: int | None, q_len: int, bucket: int) -> torch.Tensor:
        n = bucket * q_len
        meta = AttentionMetadata(slot_mapping=self.slots[:n], block_tables=self.block_tables[:bucket],
                                 context_lens=self.context_lens[:bucket], q_len=q_len, block_size=self.block_size)
        if layer is None:
            return self.model(self.ids[:n], self.positions[:n], self.kv_cache, meta)
        return self.model.mtp_forward(layer, self.ids[:n], self.positions[:n], self.hidden[:n], self.kv_cache, meta)

    @torch.inference_mode()
    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        todo = sorted(((layer, q, b) for layer, q in self.shapes for b in self.sizes), key=lambda k: -k[1] * k[2])
        pool = torch.cuda.graph_pool_handle()
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        for i, key in enumerate(tqdm(todo, desc="capturing CUDA graphs", unit="graph", leave=False)):
            if progress:
                progress(f"capturing CUDA graphs {i + 1}/{len(todo)}")
            try:
                for _ in range(self.num_warmup):
                    self._step(*key)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._step(*key)
            except Exception as exc:  # whatever broke, this bucket runs eagerly and the engine still starts
                log.warning("CUDA graph capture failed for %s at batch size %d (%s: %s); that bucket runs eagerly",
                            _name(*key[:2]), key[2], type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                continue
            self.graphs[key], self.outputs[key] = graph, out
        torch.cuda.synchronize()
        log.info("CUDA graphs: %d of %d captured in %.1f s (batch sizes %s; %s), %.0f MiB", len(self.graphs), len(todo),
                 time.perf_counter() - start, ",".join(map(str, self.sizes)),
                 ", ".join(_name(*s) for s in self.shapes), (torch.cuda.memory_reserved() - reserved) / 2**20)

    def run(self, layer: int | None, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """Replay the graph of this step's shape and return its output; None: run it eagerly."""
        if meta.block_tables is None:
            return None
        batch = meta.context_lens.shape[0]
        bucket = next((s for s in self.sizes if s >= batch), None)
        key = (layer, meta.q_len, bucket)
        graph = self.graphs.get(key)
        if graph is None or meta.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        n = ids.shape[0]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:bucket * meta.q_len].fill_(self.scratch_slot)
        self.context_lens[:batch].copy_(meta.context_lens)
        self.context_lens[batch:bucket].fill_(1)
        self.block_tables[:batch, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if hidden is not None:
            self.hidden[:n].copy_(hidden)
        graph.replay()
        return self.outputs[key][:n].clone()  # the next replay overwrites the static output
