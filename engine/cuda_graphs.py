"""CUDA graphs for every step shape: plain decode, whole speculative steps, and mixed steps.

A decode step of a small model is a few hundred short kernels; launched one by one from Python,
the CPU sets the pace: a launch from Python costs several times one inside a graph
(bench/results/kernels-h200). So each step
shape is captured once — (model part, tokens per sequence, batch bucket) — and replayed:

- a batch is padded up to the next capture size; its inputs go into the static buffers the
  graphs were captured on, all views of one int32 tensor, so that a main-model step built on
  the host crosses in one copy (`stage`); padded tokens write their KV into the scratch block
  and attend to one key, so they touch no real sequence;
- decode steps also run the vocab projection and the draw inside the graph, into a
  static fp32 logits buffer: the lm_head GEMV is the step's biggest, and launched eagerly it
  and the argmax cost host time every step;
- a speculative step (verify k+1 rows a sequence, accept, MTP pass, k drafting steps: the
  whole of `spec_decode.speculative_step`) is one graph, its drafting
  steps' slots computed on the device from the static block tables; it returns one small
  int tensor (tokens, accepted counts, next drafts), the only thing the host reads back;
- with async scheduling, consecutive speculative steps of the same sequences chain on the
  device: a step's graph starts with one kernel that, where the host flags it, writes its ids,
  positions, slots and context lengths from the previous step's result (which the host has not
  read yet), so the host sends only block tables and flags (`stage_chained`) and reads step N's
  tokens while step N+1 runs;
- graphs are captured largest first into one shared memory pool, each after warm-up runs
  (Triton compiles, cuBLAS handles, allocator state);
- the draw is inside the decode and speculative graphs too (`draw`: sampler.race's kernel,
  temperature, min_p and seed per sequence as static inputs, 0 = greedy), so greedy and
  sampled batches alike replay one graph; top-k/top-p (a sort) and the logits processors take
  the graph's logits and draw eagerly (a speculative step with them runs eagerly);
- any other step — prefill chunks, alone or beside decodes (vLLM's full-graph mode) — replays
  a graph bucketed by its token count (`MixedStepGraphs`): its varlen attention metadata
  (query starts, the flash kernel's work list, context lengths, block tables) are static inputs
  sized for max_num_seqs sequences, padded tokens write the scratch slot, padded work items of
  the flash kernel point at an empty sequence; the graph ends in the vocab projection of the
  sampled rows and their argmax;
- batches above the largest bucket, steps above the largest token bucket, steps with prefill
  chunks when speculating, and buckets whose capture failed run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from itertools import accumulate

import numpy as np
import torch
from tqdm import tqdm

from jetserve.engine.config import CUDAGraphConfig
from jetserve.engine.model.attention import (PREFILL_BLOCK_M, AttentionMetadata, PrefillWork, aligned_bounds,
                                             prefill_plan, slot_mapping, to_device, token_rows)
from jetserve.engine.spec_decode import Acceptance, device_acceptance, speculative_step

log = logging.getLogger(__name__)


def _name(num_drafts: int | None, q_len: int) -> str:
    if num_drafts is None:
        return "decode"
    return f"speculative step ({q_len} token{'s' * (q_len > 1)} verified, {num_drafts} drafted)"


class StagedInputs:
    """A graph family's static inputs: one int32 device tensor, written on the host into one of
    two pinned buffers and sent in one copy. Two, because with async scheduling the host writes
    step N+1's inputs while step N's copy may still wait in the stream; an event per buffer,
    recorded after its copy, tells when the host may write that buffer again."""

    def __init__(self, size: int, device: torch.device, split: Callable, init: Callable[..., None]):
        pinned = device.type == "cuda"
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self._host = [split(staging.numpy()) for staging in self._staging]
        for views in self._host:
            init(*views)
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if pinned else None
        self._stream = torch.cuda.current_stream(device) if pinned else None  # looked up once: see ResultCopies
        self._turn = 0
        self.device = self._staging[0].to(device)
        self.views = split(self.device)

    def host(self) -> tuple:
        """Views of the staging buffer to write next (once its previous copy has left it)."""
        if self._copied is not None:
            self._copied[self._turn].synchronize()
        return self._host[self._turn]

    def send(self, end: int, start: int = 0) -> None:
        """Copy entries [start, end) of the buffer just written to the device."""
        turn, self._turn = self._turn, 1 - self._turn
        self.device[start:end].copy_(self._staging[turn][start:end], non_blocking=True)
        if self._copied is not None:
            self._copied[turn].record(self._stream)


def _dry_run(keys: list, step: Callable) -> None:
    """`step(*key)` once for each key, as a dry pass before the captures. A key whose step fails
    is passed over: its capture fails the same way, says so and leaves that bucket eager."""
    for key in keys:
        try:
            step(*key)
        except Exception:  # reported by the capture
            continue


def _capture(todo: list, step: Callable, num_warmup: int, pool, describe: Callable[[tuple], str],
             progress: Callable[[str], None] | None, before: Callable | None = None) -> dict:
    """Capture `step(*key)` for each key (largest first) into the shared pool, each after
    `before(*key)` and `num_warmup` eager runs. A key whose capture fails is left out (its steps
    run eagerly) and the engine still starts. Returns {key: (graph, step's output)}."""
    captured = {}
    # With `progress` (the service's log records) no bar beside them; without, a terminal's bar.
    for i, key in enumerate(tqdm(todo, desc="capturing CUDA graphs", unit="graph", leave=False,
                                 disable=True if progress else None)):
        if progress:
            progress(f"capturing CUDA graphs {i + 1}/{len(todo)}")
        try:
            if before is not None:
                before(*key)
            for _ in range(num_warmup):
                step(*key)
            torch.cuda.empty_cache()  # the warm-ups' memory, for the graph's private pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = step(*key)
        except Exception as exc:  # whatever broke, this bucket runs eagerly and the engine still starts
            log.warning("CUDA graph capture failed for %s (%s: %s); that bucket runs eagerly", describe(key),
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            continue
        captured[key] = graph, out
    return captured


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
        n, b = self.max_rows, self.max_batch
        # [ids n | positions n | slots n | context_lens b | chain b | temperature b | min_p b |
        # seeds 2b | block_tables b×W], each part 16-byte aligned (aligned_bounds); chain: per
        # sequence the flag of `chain_inputs`; seeds as (lo, hi) pairs. The tables come last, so a
        # step of a smaller bucket sends a prefix.
        self._bounds = aligned_bounds((n, n, n, b, b, b, b, 2 * b, b * self.width))
        self.staged = StagedInputs(self._bounds[-1][1], kv_cache.device, self._split, self._pad)
        self.ids, self.positions, self.slots, self.context_lens, self.chain, self.block_tables, draw = \
            self.staged.views
        self.chained_from = self._bounds[4][0]  # where what a chained step sends begins
        # Per sequence, what the draw reads (sampler.race): temperature and min_p (float32 bits), seed (lo, hi).
        self.temperature, self.min_p = draw[0].view(torch.float32), draw[1].view(torch.float32)
        self.seeds = draw[2]
        # Outside the pool and shared by the main-model graphs: one graph's own output would pin
        # its logits in the pool, one such copy per captured graph.
        self.logits = torch.zeros(self.max_rows, model.config.vocab_size, dtype=torch.float32, device=kv_cache.device)
        # Every speculative graph's packed result, flat (a step's rows q + 1 + k wide): where the
        # next chained step reads it, whichever graph wrote it.
        max_drafts = max((d for d, _ in self.shapes if d is not None), default=0)
        self.packed = torch.zeros(self.max_batch * (max_q + 1 + max_drafts), dtype=torch.int64,
                                  device=kv_cache.device)
        self.graphs: dict[tuple[int | None, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int | None, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _pad(self, ids, positions, slots, context_lens, chain, block_tables, draw) -> None:
        """Padding that touches no real sequence: the scratch slot, a context of one key, a greedy draw."""
        slots.fill(self.scratch_slot)
        context_lens.fill(1)
        block_tables.fill(self.scratch_block)

    def _split(self, flat):
        """Views of one buffer, laid out as `_bounds` says: ids, positions, slots, context_lens,
        chain, block_tables [b, W], and the draw's (temperature, min_p, seeds)."""
        ids, positions, slots, context_lens, chain, temperature, min_p, seeds, tables = (
            flat[lo:hi] for lo, hi in self._bounds)
        return ids, positions, slots, context_lens, chain, tables.reshape(self.max_batch, self.width), \
            (temperature, min_p, seeds)

    def _sent(self, bucket: int) -> int:
        """Where a step of `bucket` sequences' inputs end: its rows of the block tables."""
        return self._bounds[-1][0] + bucket * self.width

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

    def acceptance(self, q_len: int, batch: int) -> Acceptance:
        """A speculative step's acceptance and drafting inputs over the static inputs of `batch`
        sequences (padded ones draft into the scratch slot)."""
        return device_acceptance(self.meta(q_len, batch), q_len, self.model.rotary, self.scratch_slot)

    def draw(self, logits: torch.Tensor, q_len: int, bucket: int) -> torch.Tensor:
        """Each row's token from its logits, with its sequence's parameters and seed and its
        token's position (the row's + 1): sampler.race, inside the graph."""
        from jetserve.engine.model.sampling_kernels import race

        return race(logits, self.temperature[:bucket], self.min_p[:bucket], None, self.seeds[:2 * bucket],
                    self.positions[:bucket * q_len], position_offset=1, rows_per_param=q_len)

    def packed_result(self, q_len: int, num_drafts: int, bucket: int) -> torch.Tensor:
        """A speculative step's packed result [bucket, q + 1 + k], in the shared buffer."""
        return self.packed[:bucket * (q_len + 1 + num_drafts)].view(bucket, q_len + 1 + num_drafts)

    def _step(self, num_drafts: int | None, q_len: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The captured work: hidden states, and for the main model the tokens drawn from the
        fp32 logits it writes into `self.logits`; a speculative step's packed result, its inputs
        first chained from the previous step's where the host flagged it."""
        n = bucket * q_len
        meta = self.meta(q_len, bucket)
        if num_drafts is not None:
            from jetserve.engine.model.spec_kernels import chain_inputs  # needs Triton

            chain_inputs(self.chain[:bucket], self.packed, self.ids[:n], self.positions[:n], self.slots[:n],
                         self.context_lens[:bucket], self.block_tables[:bucket], self.block_size, q_len,
                         self.scratch_slot)
            return speculative_step(self.model, self.kv_cache, self.ids[:n], self.positions[:n], meta, q_len, num_drafts,
                                    lambda logits: self.draw(logits, q_len, bucket), self.acceptance(q_len, bucket),
                                    self.packed_result(q_len, num_drafts, bucket)), None
        hidden = self.model(self.ids[:n], self.positions[:n], self.kv_cache, meta)
        logits = self.logits[:n]
        logits.copy_(self.model.compute_logits(hidden))  # the cast to fp32 rides on the copy
        return hidden, self.draw(logits, q_len, bucket)

    @torch.inference_mode()
    def dry_run(self) -> None:
        """Every plain step's launches once, for `parallel_compile.compile_only()` to queue their
        kernels (batch sizes specialise some) side by side before the captures need them one by
        one. Speculative steps stay out: their inputs come from kernels a dry pass does not run."""
        _dry_run([(d, q, b) for d, q in self.shapes if d is None for b in self.sizes], self._step)

    @torch.inference_mode()
    def capture(self, pool, progress: Callable[[str], None] | None = None) -> None:
        todo = sorted(((d, q, b) for d, q in self.shapes for b in self.sizes), key=lambda k: -k[1] * k[2])
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        captured = _capture(todo, self._step, self.num_warmup, pool,
                            lambda key: f"{_name(*key[:2])} at batch size {key[2]}", progress)
        for key, (graph, out) in captured.items():
            self.graphs[key], self.outputs[key] = graph, out
        torch.cuda.synchronize()
        log.info("CUDA graphs: %d of %d captured in %.1f s (batch sizes %s; %s), %.0f MiB", len(self.graphs), len(todo),
                 time.perf_counter() - start, ",".join(map(str, self.sizes)),
                 ", ".join(_name(*s) for s in self.shapes), (torch.cuda.memory_reserved() - reserved) / 2**20)

    def stage(self, key: tuple[None, int, int], ids: list[int], positions: list[int], ctx_lens: list[int],
              tables: list[list[int]], draw: list[tuple[float, float, int]]) -> None:
        """Write a main-model step, given as the host lists the runner builds (per token: id and
        position; per sequence: context length after the step, block table, and its draw's
        temperature (0: greedy), min_p and seed), into the static inputs: through pinned staging,
        in one copy."""
        _, q_len, bucket = key
        n, batch, bs = len(ids), len(ctx_lens), self.block_size
        host_ids, host_positions, slots, context_lens, chain, block_tables, host_draw = self.staged.host()
        chain[:bucket] = 0
        self._stage_draws(host_draw, draw, bucket)
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
        self.staged.send(self._sent(bucket))

    def stage_chained(self, key: tuple[int, int, int], prev_q: int, tables: list[list[int]],
                      draw: list[tuple[float, float, int]]) -> None:
        """Stage a speculative step that verifies what the step before it (of the same
        sequences, in the same order, `prev_q` tokens a sequence) proposed: its ids, positions,
        slots and context lengths come from that step's result on the device (`chain_inputs`,
        the graph's first kernel); the host sends the flags, the draws and the block tables,
        which must already reach the positions the previous step may have advanced to."""
        _, q_len, bucket = key
        batch = len(tables)
        _, _, _, _, chain, block_tables, host_draw = self.staged.host()
        chain[:batch] = prev_q
        chain[batch:bucket] = -1
        self._stage_draws(host_draw, draw, bucket)
        for row, table in zip(block_tables, tables):
            row[:len(table)] = table
        block_tables[batch:bucket, 0] = self.scratch_block
        self.staged.send(self._sent(bucket), self.chained_from)

    def _stage_draws(self, host_draw, draw: list[tuple[float, float, int]], bucket: int) -> None:
        """Each sequence's temperature (padding: greedy), min_p and seed, into the staging buffer."""
        batch = len(draw)
        temperature, min_p, seeds = host_draw[0].view(np.float32), host_draw[1].view(np.float32), \
            host_draw[2].view(np.uint32)
        temperature[:batch] = [t for t, _, _ in draw]
        temperature[batch:bucket] = 0.0
        min_p[:batch] = [m for _, m, _ in draw]
        seeds[0:2 * batch:2] = [seed & 0xFFFFFFFF for _, _, seed in draw]
        seeds[1:2 * batch:2] = [seed >> 32 for _, _, seed in draw]

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


def _fill_columns(flat, width: int, columns: list[list[int]], pads: tuple[int, ...]) -> None:
    """Write columns of ints as the rows of a [len(columns), width] view of `flat`, each padded."""
    for r, (column, pad) in enumerate(zip(columns, pads)):
        flat[r * width:r * width + len(column)] = column
        flat[r * width + len(column):(r + 1) * width] = pad


class MixedStepGraphs:
    """Whole steps of any shape — prefill chunks, alone or beside decodes — as CUDA graphs
    bucketed by token count. A step of n tokens over b sequences replays the graph of the
    smallest bucket T >= n: its varlen attention metadata live in static buffers sized for
    `max_seqs` sequences plus one empty one, index `max_seqs`, that padding points at — padded
    tokens are no sequence's (their KV goes to the scratch slot, their rows are never read),
    padded work items and merges of the flash kernel belong to the empty sequence and return at
    once, and so do the padded decode rows (one a sequence at most) of the paged decode kernel; the
    flash kernel's plan cuts a step's keys into `split_items` pieces (attention.prefill_plan),
    so its work list and partial results have static bounds. The graph ends in the
    vocab projection of the step's sampled rows (one a sequence at most; padded: row 0) and their
    argmax, into a logits buffer outside the pool. Only those leave the graph, so the graphs'
    activations share one pool whatever their number: it grows to the largest step's.

    `mtp_pass` (MTP drafting): each bucket has a second graph, the MTP pass over the step's rows
    (MTP layer 0 fed each row's final hidden state, kept outside the pool, and the token after
    it), which fills the MTP layer's KV cache; it is replayed once the step's tokens are sampled,
    since the last row of a sequence is fed the token sampled there."""

    def __init__(self, model, kv_cache: torch.Tensor, sizes: tuple[int, ...], max_seqs: int, width: int,
                 block_size: int, scratch_block: int, num_warmup: int, split_items: int = 1,
                 mtp_pass: bool = False, first_up_to: int | None = None):
        self.model, self.kv_cache, self.sizes, self.num_warmup = model, kv_cache, sorted(sizes), num_warmup
        self.split_items = split_items
        self.max_seqs, self.width, self.block_size = max_seqs, width, block_size
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        self.max_tokens = max(self.sizes)
        n, b = self.max_tokens, max_seqs
        self._bounds = aligned_bounds((n, n, n, b + 1, b + 2, b, 5 * self.max_items(n), 4 * split_items, 3 * b,
                                       (b + 1) * width))
        self.staged = StagedInputs(self._bounds[-1][1], kv_cache.device, self._split, self._pad)
        self.ids, self.positions, self.slots, self.context_lens, self.starts, self.sample_rows, self.items, \
            self.merges, self.decodes, self.block_tables = self.staged.views
        self.logits = torch.zeros(max_seqs, model.config.vocab_size, dtype=torch.float32, device=kv_cache.device)
        # The MTP pass's inputs, outside the pool: every row's final hidden state and the token after it.
        self.hidden = torch.zeros(self.max_tokens, model.config.hidden_size, dtype=model.dtype,
                                  device=kv_cache.device) if mtp_pass else None
        self.shifted = torch.zeros(self.max_tokens, dtype=torch.int32, device=kv_cache.device) if mtp_pass else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.greedy: dict[int, torch.Tensor] = {}
        self.mtp_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Buckets not yet captured, in capture order: largest first (a chunked prompt's steps fill the
        # largest), those up to `first_up_to` tokens before the others (the token budget's, which a
        # step latency target's schedule uses while the others are pending: ModelRunner.chunk_cap).
        self.pending = self.capture_order(self.sizes, first_up_to)
        self._captured_s = self._captured_mib = 0.0

    def max_items(self, tokens: int) -> int:
        """Flash-kernel work items a step of `tokens` tokens over up to max_seqs sequences may
        have: its query tiles, plus one per piece its keys are cut into (prefill_plan's bound)."""
        return tokens // PREFILL_BLOCK_M + self.max_seqs + self.split_items

    def _split(self, flat):
        """Views of one buffer: [ids n | positions n | slots n | context_lens b+1 | query starts b+2 |
        sampled rows b | work items 5×K | merges 4×M | decodes b×3 | block_tables (b+1)×W] (n: the
        largest bucket, b: max_seqs, K: its most work items, M: split_items; the empty sequence is
        row b), each 16-byte aligned (aligned_bounds)."""
        *views, tables = (flat[lo:hi] for lo, hi in self._bounds)
        return (*views, tables.reshape(self.max_seqs + 1, self.width))

    def _pad(self, ids, positions, slots, context_lens, starts, sample_rows, items, merges, decodes,
             block_tables) -> None:
        slots.fill(self.scratch_slot)
        block_tables.fill(self.scratch_block)  # the empty sequence's context length stays 0

    def bucket(self, num_tokens: int, num_seqs: int, width: int) -> int | None:
        """The captured bucket for a step of `num_tokens` tokens over `num_seqs` sequences whose
        block tables are `width` wide; None: the step runs eagerly."""
        bucket = next((s for s in self.sizes if s >= num_tokens), None)
        ok = bucket in self.graphs and num_seqs <= self.max_seqs and width <= self.width
        return bucket if ok else None

    @staticmethod
    def capture_order(sizes, first_up_to: int | None) -> list[int]:
        """Largest first, those up to `first_up_to` tokens (None: all) before the others."""
        first = [s for s in sizes if first_up_to is None or s <= first_up_to]
        return sorted(first, reverse=True) + sorted(set(sizes) - set(first), reverse=True)

    def awaits(self, num_tokens: int) -> bool:
        """Whether the bucket of a step of `num_tokens` tokens is one still to be captured."""
        return next((s for s in self.sizes if s >= num_tokens), None) in self.pending

    def meta(self, tokens: int) -> AttentionMetadata:
        """Varlen attention metadata over the static inputs, for the bucket of `tokens` tokens."""
        k, m = self.max_items(tokens), self.split_items
        work = PrefillWork(items=self.items[:5 * k].view(5, k), merges=self.merges.view(4, m), num_parts=2 * m)
        return AttentionMetadata(slot_mapping=self.slots[:tokens], context_lens=self.context_lens,
                                 query_start_loc=self.starts, prefill=work, block_tables=self.block_tables,
                                 block_size=self.block_size, token_rows=self.decodes.view(self.max_seqs, 3))

    def step(self, tokens: int) -> torch.Tensor:
        """The captured work of a bucket: the forward (its hidden states into `self.hidden`
        with an MTP pass), the sampled rows' fp32 logits (into `self.logits`) and their argmax.
        Eager on the same static inputs where graphs are unavailable (the CPU tests)."""
        hidden = self.model(self.ids[:tokens], self.positions[:tokens], self.kv_cache, self.meta(tokens))
        if self.hidden is not None:
            self.hidden[:tokens].copy_(hidden)
        self.logits.copy_(self.model.compute_logits(hidden.index_select(0, self.sample_rows)))
        return self.logits.argmax(-1)

    def mtp_step(self, tokens: int) -> None:
        """The captured MTP pass of a bucket, over the static inputs and the kept hidden states:
        only its KV writes matter (a step with prefill drafts nothing; see MTPProposer)."""
        self.model.mtp_forward(0, self.shifted[:tokens], self.positions[:tokens], self.hidden[:tokens], self.kv_cache,
                               self.meta(tokens))

    @torch.inference_mode()
    def dry_run(self) -> None:
        """Each bucket's launches once, as `CUDAGraphs.dry_run` (every input here is staged)."""
        def both(tokens):
            self.step(tokens)
            if self.hidden is not None:
                self.mtp_step(tokens)
        _dry_run([(tokens,) for tokens in self.sizes], both)

    @torch.inference_mode()
    def capture(self, pool, progress: Callable[[str], None] | None = None, count: int | None = None) -> bool:
        """Capture the next `count` buckets not yet captured (all by default), each with its
        MTP pass; True while some remain. Each bucket's static inputs are an empty step of its
        size first, so the runs of a capture made while serving write the scratch slot, not a
        live sequence's KV from the last step staged."""
        todo = self.pending[:count] if count is not None else self.pending
        self.pending = self.pending[len(todo):]
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        captured = _capture([(tokens,) for tokens in todo], self.step, self.num_warmup, pool,
                            lambda key: f"a mixed step of {key[0]} tokens", progress, before=self._stage_empty)
        for (tokens,), (graph, greedy) in captured.items():
            self.graphs[tokens], self.greedy[tokens] = graph, greedy
        if self.hidden is not None:  # a bucket without its MTP pass graph runs eagerly
            mtp = _capture([key for key in captured], self.mtp_step, self.num_warmup, pool,
                           lambda key: f"the MTP pass of a mixed step of {key[0]} tokens", progress,
                           before=self._stage_empty)
            for (tokens,), (graph, _) in mtp.items():
                self.mtp_graphs[tokens] = graph
            for (tokens,) in set(captured) - set(mtp):
                del self.graphs[tokens]
        torch.cuda.synchronize()
        self._captured_s += time.perf_counter() - start
        self._captured_mib += (torch.cuda.memory_reserved() - reserved) / 2**20
        if not self.pending:
            log.info("CUDA graphs of mixed steps: %d of %d captured in %.1f s (tokens %s), %.0f MiB", len(self.graphs),
                     len(self.sizes), self._captured_s, ",".join(map(str, self.sizes)), self._captured_mib)
        return bool(self.pending)

    def _stage_empty(self, bucket: int) -> None:
        self.stage(bucket, [], [], [], [], [], [])

    def stage(self, bucket: int, ids: list[int], positions: list[int], q_lens: list[int], ctx_lens: list[int],
              tables: list[list[int]], sample_at: list[int]) -> None:
        """Write a step, as the host lists the runner builds (per token: id and position; per
        sequence: new tokens, context length after the step, block table; the rows to sample, one
        a sequence at most), into the static inputs, padded to `bucket` tokens: one copy."""
        n, b = len(ids), len(q_lens)
        host_ids, host_positions, slots, context_lens, starts, sample_rows, items, merges, decodes, block_tables = \
            self.staged.host()
        host_ids[:n] = ids
        host_positions[:n] = positions
        slots[:n] = slot_mapping(tables, ctx_lens, q_lens, self.block_size)
        slots[n:bucket] = self.scratch_slot
        context_lens[:b] = ctx_lens
        starts[0] = 0
        starts[1:b + 1] = list(accumulate(q_lens))
        starts[b + 1:] = n  # every sequence after the real ones, the empty one included, has no tokens
        sample_rows[:len(sample_at)] = sample_at
        sample_rows[len(sample_at):] = 0
        item_columns, merge_columns = prefill_plan(q_lens, ctx_lens, self.split_items)
        # Padding: the empty sequence's, with no keys and no partial slot (items), no pieces (merges).
        _fill_columns(items, self.max_items(bucket), item_columns, (self.max_seqs, 0, 0, 0, -1))
        _fill_columns(merges, self.split_items, merge_columns, (self.max_seqs, 0, 0, 0))
        # The decodes (paged decode kernel), padded with rows of the empty sequence that write nothing.
        rows = token_rows(q_lens, ctx_lens, decodes_only=True)
        decodes[:len(rows)] = rows
        decodes[len(rows):] = [-1, self.max_seqs, 0] * (self.max_seqs - len(rows) // 3)
        for row, table in zip(block_tables, tables):
            row[:len(table)] = table
        self.staged.send(self.staged.device.shape[0])

    def replay(self, bucket: int, num_sampled: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay a bucket over the static inputs: the sampled rows' fp32 logits and greedy tokens
        (views, read before the next replay as the decode graphs' are)."""
        self.graphs[bucket].replay()
        return self.logits[:num_sampled], self.greedy[bucket][:num_sampled]

    def replay_mtp_pass(self, bucket: int, shifted: list[int]) -> None:
        """Replay a bucket's MTP pass, given per row the token after it (`spec_decode.next_tokens`)."""
        self.shifted[:len(shifted)].copy_(to_device(torch.tensor(shifted, dtype=torch.int32), self.shifted.device))
        self.mtp_graphs[bucket].replay()
