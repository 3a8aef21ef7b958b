"""CUDA graphs for decode-shaped steps: plain decode and whole speculative steps.

A decode step of a small model is a few hundred short kernels; launched one by one from Python,
the CPU sets the pace (7.4 µs a launch against 1.0 µs inside a graph on the H200). So each step
shape is captured once — (model part, tokens per sequence, batch bucket) — and replayed:

- a batch is padded up to the next capture size; its inputs go into the static buffers the
  graphs were captured on, all views of one int32 tensor, so that a main-model step built on
  the host crosses in one copy (`stage`); padded tokens write their KV into the scratch block
  and attend to one key, so they touch no real sequence;
- decode steps also run the vocab projection and the greedy argmax inside the graph, into a
  static fp32 logits buffer: the lm_head GEMV is the step's biggest, and launched eagerly it
  and the argmax cost host time every step;
- a speculative step (verify k+1 rows a sequence, accept, MTP pass, k drafting steps: the
  whole of `spec_decode.speculative_step`) is one graph for greedy batches, its drafting
  steps' slots computed on the device from the static block tables; it returns one small
  int tensor (tokens, accepted counts, next drafts), the only thing the host reads back;
- graphs are captured largest first into one shared memory pool, each after warm-up runs
  (Triton compiles, cuBLAS handles, allocator state);
- steps with prefill chunks, batches above the largest bucket and buckets whose capture failed
  run eagerly. Sampling other than greedy stays outside the graphs (a sampled speculative
  step runs the same function eagerly over the same static inputs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from jetserve.engine.config import CUDAGraphConfig
from jetserve.engine.model.attention import AttentionMetadata, slot_mapping
from jetserve.engine.spec_decode import ChainInputs, device_chain_inputs, speculative_step

log = logging.getLogger(__name__)


def _name(num_drafts: int | None, q_len: int) -> str:
    if num_drafts is None:
        return "decode"
    return f"speculative step ({q_len} token{'s' * (q_len > 1)} verified, {num_drafts} drafted)"


class CUDAGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, config: CUDAGraphConfig, max_model_len: int, block_size: int,
                 scratch_block: int):
        self.model, self.kv_cache = model, kv_cache
        self.sizes, self.shapes, self.num_warmup = config.capture_sizes, config.step_shapes, config.num_warmup
        self.block_size, self.scratch_block = block_size, scratch_block
        self.scratch_slot = scratch_block * block_size
        max_q = max(q for _, q in self.shapes)
        self.max_rows, self.max_batch = max(self.sizes) * max_q, max(self.sizes)
        # Wide enough for max_model_len plus the KV slots reserved for drafts.
        self.width = -(-(max_model_len + max_q) // block_size)
        size = 3 * self.max_rows + self.max_batch * (1 + self.width)
        # Two pinned staging buffers: with async scheduling the host writes step N+1's inputs
        # while step N's copy may still wait in the stream. An event per buffer, recorded after
        # its copy, tells when the host may write that buffer again.
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        for staging in self._staging:
            _, _, slots, context_lens, block_tables = self._split(staging)
            slots.fill_(self.scratch_slot)
            context_lens.fill_(1)
            block_tables.fill_(scratch_block)
        self._host = [self._split(staging.numpy()) for staging in self._staging]
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0
        # Static inputs, shared by every graph (one step runs at a time).
        self.inputs = self._staging[0].to(kv_cache.device)
        self.ids, self.positions, self.slots, self.context_lens, self.block_tables = self._split(self.inputs)
        # Outside the pool and shared by the main-model graphs: one graph's own output would pin
        # its logits in the pool, one such copy per captured graph.
        self.logits = torch.zeros(self.max_rows, model.config.vocab_size, dtype=torch.float32, device=kv_cache.device)
        self.graphs: dict[tuple[int | None, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int | None, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _split(self, flat):
        """Views of one buffer, laid out [ids n | positions n | slots n | context_lens b | block_tables b×W]
        (n: rows of the largest step, b: the largest bucket, W: the table width)."""
        n, b = self.max_rows, self.max_batch
        return (flat[:n], flat[n:2 * n], flat[2 * n:3 * n], flat[3 * n:3 * n + b],
                flat[3 * n + b:].reshape(b, self.width))

    def key(self, num_drafts: int | None, q_len: int, batch: int, width: int) -> tuple[int | None, int, int] | None:
        """The captured graph for `batch` sequences of `q_len` tokens with block tables `width`
        wide, proposing `num_drafts` (None: a plain decode): (num_drafts, q_len, bucket); None:
        the step runs eagerly."""
        bucket = next((s for s in self.sizes if s >= batch), None)
        key = (num_drafts, q_len, bucket)
        return key if key in self.graphs and width <= self.width else None

    def meta(self, q_len: int, batch: int) -> AttentionMetadata:
        """Attention metadata over the static inputs of `batch` sequences of `q_len` tokens."""
        return AttentionMetadata(slot_mapping=self.slots[:batch * q_len], block_tables=self.block_tables[:batch],
                                 context_lens=self.context_lens[:batch], q_len=q_len, block_size=self.block_size)

    def chain_inputs(self, q_len: int, batch: int) -> ChainInputs:
        """The drafting steps' inputs of a speculative step over the static inputs of `batch`
        sequences (padded rows: context length 1 < q_len)."""
        return device_chain_inputs(self.block_tables[:batch], self.block_size, self.context_lens[:batch] < q_len,
                                   self.scratch_slot)

    def _step(self, num_drafts: int | None, q_len: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The captured work: hidden states, and for the main model the greedy tokens of the fp32
        logits it writes into `self.logits`; a greedy speculative step's packed result."""
        n = bucket * q_len
        meta = self.meta(q_len, bucket)
        if num_drafts is not None:
            return speculative_step(self.model, self.kv_cache, self.ids[:n], self.positions[:n], meta, q_len, num_drafts,
                                    lambda logits: logits.argmax(dim=-1), self.chain_inputs(q_len, bucket)), None
        hidden = self.model(self.ids[:n], self.positions[:n], self.kv_cache, meta)
        logits = self.logits[:n]
        logits.copy_(self.model.compute_logits(hidden))  # the cast to fp32 rides on the copy
        return hidden, logits.argmax(-1)

    @torch.inference_mode()
    def capture(self, progress: Callable[[str], None] | None = None) -> None:
        todo = sorted(((d, q, b) for d, q in self.shapes for b in self.sizes), key=lambda k: -k[1] * k[2])
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

    def stage(self, key: tuple[None, int, int], ids: list[int], positions: list[int], ctx_lens: list[int],
              tables: list[list[int]]) -> None:
        """Write a main-model step, given as the host lists the runner builds (per token: id and
        position; per sequence: context length after the step and block table), into the static
        inputs: through pinned staging, in one copy of the part this bucket reads."""
        _, q_len, bucket = key
        n, batch, bs = len(ids), len(ctx_lens), self.block_size
        turn, self._turn = self._turn, 1 - self._turn
        self._copied[turn].synchronize()  # this buffer's previous copy has left it
        host_ids, host_positions, slots, context_lens, block_tables = self._host[turn]
        host_ids[:n] = ids
        host_positions[:n] = positions
        slots[:n] = slot_mapping(tables, ctx_lens, [q_len] * batch, bs)
        slots[n:bucket * q_len] = self.scratch_slot
        context_lens[:batch] = ctx_lens
        context_lens[batch:bucket] = 1
        # Entries past a sequence's context stay stale: the paged kernel reads positions < its length only.
        for row, table in zip(block_tables, tables):
            row[:len(table)] = table
        block_tables[batch:bucket, 0] = self.scratch_block
        end = self.inputs.shape[0] - (self.max_batch - bucket) * self.width
        self.inputs[:end].copy_(self._staging[turn][:end], non_blocking=True)
        self._copied[turn].record()

    def replay(self, key: tuple[int | None, int, int], n: int
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Replay a captured step over the static inputs. Returns the first n rows of its hidden
        states, fp32 logits and greedy tokens; for a speculative step, the first n sequences'
        packed result, then None, None.

        Views, not copies: every reader enqueues its reads before the next replay of any graph,
        and the stream keeps that order (the runner samples, and in sync mode waits for the
        tokens; async scheduling scatters them into the next step's ids before that step
        replays; the drafting chain gathers rows and takes logits before its next step). Nothing
        else writes there: each graph's outputs stay allocated in the shared pool, and the logits
        buffer lies outside it."""
        self.graphs[key].replay()
        hidden, greedy = self.outputs[key]
        if greedy is None:
            return hidden[:n], None, None
        return hidden[:n], self.logits[:n], greedy[:n]
