"""Runs one scheduled step on the model: inputs in, sampled tokens out.

Owns the weights, the KV cache and the device. The KV cache is one tensor
[kv_layers, 2, slots, kv_heads, head_dim] with one extra block at the end as a scratch area,
where padded tokens of a fixed-shape (graphed) step write without touching real data.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm import tqdm

from jetserve.engine import compile_watch
from jetserve.engine.config import DEFAULT_CHUNK_BUDGET, EngineConfig, cpu_capture_sizes
from jetserve.engine.cpu_graphs import CPUGraphs
from jetserve.engine.cuda_graphs import CUDAGraphs, MixedStepGraphs
from jetserve.engine.model.attention import MAX_UNIFORM_Q, AttentionMetadata, prefill_split_items, to_device
from jetserve.engine.model import parallel_compile
from jetserve.engine.model.loader import load_model, torch_dtype
from jetserve.engine.outputs import LogprobsLists
from jetserve.engine.sampler import History, drawn_in_graph, process_logits, sample, token_logprobs
from jetserve.engine.scheduler import ScheduledBatch
from jetserve.engine.sequence import Sequence
from jetserve.engine.spec_decode import (MTPProposer, chained_inputs, device_acceptance, host_acceptance, next_tokens,
                                         speculative_step, verify)
from jetserve.engine.step_cost import DecodeCosts, time_runs

log = logging.getLogger(__name__)


def kv_reserve(config: EngineConfig, measure: Callable[[int, int], int]) -> int:
    """Bytes the KV cache must leave free: the activations of the largest step the scheduler may
    run (its whole token budget, with logits of up to max_num_seqs rows), plus, with CUDA graphs,
    those of the largest captured decode-shaped step (logits of every row). The mixed-step graphs
    need no more: they share one pool, which grows to their largest step's activations, and with
    them captured (no speculation) the eager path runs no step of that size. `measure(tokens,
    logit_rows)` is a dry run's peak."""
    n = config.max_num_batched_tokens
    reserve = measure(n, min(n, config.max_num_seqs))
    if config.cuda_graphs:
        rows = max(config.cuda_graphs.capture_sizes) * max(q for _, q in config.cuda_graphs.step_shapes)
        reserve += measure(rows, rows)
    return reserve


def skinny_row_counts() -> list[int]:
    """The row counts that key the skinny matmuls' tiles: powers of two up to SKINNY_MAX_ROWS."""
    from jetserve.engine.model.kernels import SKINNY_MAX_ROWS

    return [2 ** i for i in range(SKINNY_MAX_ROWS.bit_length())]


@torch.inference_mode()
def tune_kernels(model, kv_cache: torch.Tensor, block_size: int, scratch_block: int, prefill: int,
                 row_counts: list[int] | None = None, progress: Callable[[str], None] | None = None,
                 split_items: int = 1, label: str = "warming up kernels") -> None:
    """The start-up warm-up (and a tuning engine's timing), so that no request pays for a kernel's
    compile or timing: a dry step of each row count a skinny product may see (`skinny_row_counts`: decode batches, verifies, drafts, small
    mixed steps), with the vocab projection and the MTP layers, then a `prefill`-token mixed step,
    a chunk and a decode (the flash kernel's autotuning, the decode kernel's per-token form). Their KV goes to the scratch block, the prefill's to the
    first blocks (no sequence holds any yet)."""
    device = kv_cache.device
    todo = (row_counts or skinny_row_counts()) + [prefill]
    # One report of progress: with `progress` (the service's log records) no bar; without it a
    # bar, on a terminal only (tqdm's None).
    for i, n in enumerate(tqdm(todo, desc=label, unit="shape", leave=False, disable=True if progress else None)):
        if progress:
            progress(f"{label} {i + 1}/{len(todo)}")
        rows = i < len(todo) - 1  # n sequences of one token each
        if rows:
            meta = AttentionMetadata.build([1] * n, [1] * n, [[scratch_block]] * n, block_size, device, True)
        else:  # a chunk beside a decode, whose row the paged decode kernel takes in its per-token form
            chunk = max(1, n - 1)
            meta = AttentionMetadata.build([chunk, 1], [chunk, 1], [list(range(-(-chunk // block_size))),
                                                                    [scratch_block]], block_size, device, True,
                                           split_items)
        ids = torch.zeros(n, dtype=torch.long, device=device)
        hidden = model(ids, ids, kv_cache, meta)  # position 0 for all: only the shapes matter
        if rows:
            model.compute_logits(hidden)
            if model.mtp:  # a model without MTP layers has no draft head
                model.draft_tokens(hidden)  # a draft vocabulary is its own shape
                model.draft_logits(0, hidden, hidden)  # ... and with the MTP layer's final norm fused in
            for step in range(len(model.mtp)):
                model.mtp_forward(step, ids, ids, hidden, kv_cache, meta)
    if device.type == "cuda":
        torch.cuda.synchronize()


def block_bytes(config: EngineConfig) -> int:
    """Bytes of one KV block: k and v of every layer with a cache (the main stack, then one per
    MTP layer) for block_size tokens."""
    c = config.model_config
    per_token = 2 * (c.num_hidden_layers + c.num_mtp_layers) * c.num_key_value_heads * c.head_dim
    return per_token * config.block_size * torch.finfo(torch_dtype(config.dtype)).bits // 8


_imported = False


def log_import_time(startup_s: dict[str, float] | None = None) -> None:
    """Once a process: seconds from its start to here (interpreter, torch, Triton and jetserve
    imported), as the first start-up phase. The core's process says it before it waits for its
    configuration (core.main); otherwise the first engine does."""
    global _imported
    if _imported:
        return
    _imported = True
    import psutil

    seconds = round(time.time() - psutil.Process().create_time(), 2)
    if startup_s is not None:
        startup_s["import"] = seconds
    log.info("start-up: import in %.1f s", seconds)


class ModelRunner:
    """Start-up is a sequence of named phases (`startup_s`: seconds each, logged as it ends):
    weights, kernels chosen, KV plan, kernels compiled, then graph capture (CUDA) or the CPU
    programs. No phase times a kernel tile: the tiles come from tables (tile_tables.py), unless
    the engine was built to tune them (`jetserve tune`)."""

    def __init__(self, config: EngineConfig, progress: Callable[[str], None] | None = None,
                 defer_capture: bool = False):
        self.config = config
        self.defer_capture = defer_capture
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.block_size
        self.progress = progress
        self.startup_s: dict[str, float] = {}
        self.kernels = None
        self.graphs = self.mixed = None
        self.decode_costs: DecodeCosts | None = None  # the adaptive draft policy's step-cost table
        torch.manual_seed(config.seed)
        if config.fused_kernels:
            compile_watch.install()  # Triton's compiles; a CPU engine imports no Triton
        log_import_time(self.startup_s)
        with compile_watch.starting():
            with self._phase("weights"):
                self.model = load_model(config.model, self.dtype, self.device, config.max_model_len, progress,
                                        config.quantization)
            with self._phase("kernels chosen"):
                self._choose_kernels()
            with self._phase("KV plan"):
                self._plan_kv()
            if config.cuda_graphs:
                with self._phase("kernels compiled"):
                    self._warm_up()
                with self._phase("graph capture"):
                    self._capture_graphs()
            elif config.cpu_compile:  # the same interface: decode steps compiled instead of captured
                with self._phase("CPU programs"):
                    self.graphs = CPUGraphs(self.model, self.kv_cache, config.cpu_compile, config.max_model_len,
                                            self.block_size, scratch_block=self.num_blocks, model_dir=config.model)
                    self.graphs.capture(progress)
            if config.speculative and config.speculative.adaptive:
                with self._phase("step costs"):
                    self.decode_costs = DecodeCosts(self._time_decode_steps(range(config.num_speculative_tokens + 1)))
                log.info("decode step costs: %s", self.decode_costs)
                if isinstance(self.graphs, CPUGraphs):  # its programs may come later (BackgroundCompile)
                    self.graphs.on_loaded = self._retime_plain_steps

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        began, compiles = time.perf_counter(), compile_watch.count()
        yield
        self.startup_s[name] = round(time.perf_counter() - began, 2)
        compiled = compile_watch.count() - compiles
        log.info("start-up: %s in %.1f s%s", name, self.startup_s[name],
                 f" ({compiled} kernels compiled or loaded)" if compiled else "")

    def _choose_kernels(self) -> None:
        """The fused kernels and how their tiles are chosen, made here once and handed down: two
        engines in one process (tests, benchmarks) each keep their own choices."""
        config = self.config
        # The flash prefill kernel's work is cut into this many pieces or more (attention.prefill_plan).
        self.split_items = prefill_split_items(self.device, config.model_config.num_attention_heads)
        if config.fused_kernels:
            from jetserve.engine.model import tile_tables
            from jetserve.engine.model.quant_kernels import QuantFusedKernels  # needs Triton
            from jetserve.engine.model.tile_cache import TileCache

            tile_cache = TileCache.for_device(config.tile_cache_dir, self.device) if config.tile_cache_dir else None
            self.kernels = QuantFusedKernels(tile_timing=config.tune_tiles and config.cuda_graphs is not None,
                                             tile_cache=tile_cache, table=tile_tables.for_device(self.device),
                                             batch_invariant=config.batch_invariant)
            self.model.use_kernels(self.kernels)
        self.model.set_batch_invariant(config.batch_invariant)
        if config.speculative:  # before the KV plan: the draft vocabulary's rows are memory too
            self.model.use_draft_vocabulary(config.speculative.draft_vocab_size)

    def rank_draft_vocabulary(self, ids) -> None:
        """The draft heads' rows from now on: token ids (ascending, numpy), from DraftVocabulary.rank."""
        self.model.rank_draft_vocabulary(torch.from_numpy(ids).to(self.device))

    def _plan_kv(self) -> None:
        """Size the KV cache (on a GPU, from a dry run of the largest step, its kernels compiled
        side by side first) and allocate it."""
        config = self.config
        if not config.num_kv_blocks and config.fused_kernels and not config.tune_tiles:
            with parallel_compile.compile_only():
                kv_reserve(config, self._activation_peak)
        self.num_blocks = config.num_kv_blocks or self._fit_num_blocks()
        if self.num_blocks < config.max_blocks_per_seq:
            raise ValueError(f"num_kv_blocks={self.num_blocks} of {config.block_size} tokens cannot hold one "
                             f"sequence of max_model_len={config.max_model_len}"
                             + (f" plus {config.num_speculative_tokens} draft slots"
                                if config.num_speculative_tokens else ""))
        slots = (self.num_blocks + 1) * self.block_size
        mc = config.model_config
        self.kv_cache = torch.zeros(self.model.num_kv_layers, 2, slots, mc.num_key_value_heads,
                                    mc.head_dim, dtype=self.dtype, device=self.device)
        self.proposer = (MTPProposer(config.max_model_len, self.block_size, self.device, config.fused_kernels)
                         if config.speculative else None)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s, %s", self.num_blocks, self.block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20, self.device, self.dtype)
        self._last_sampled: tuple[torch.Tensor, dict[Sequence, int]] | None = None  # see launch()
        # The largest result a launch sends back: a speculative step's rows, q + 1 + k wide.
        self.copies = ResultCopies(self.device, config.max_num_seqs * (2 * config.num_speculative_tokens + 2))

    def _warm_up(self) -> None:
        """Compile every kernel of every row count a step may bring, and the flash prefill kernel:
        first a dry pass that queues them all for the compiler threads, then a real one (a tuning
        engine compiles each shape's candidates in parallel as it times them)."""
        prefill = min(self.config.max_num_batched_tokens, 1024, self.num_blocks * self.block_size)
        steps = functools.partial(tune_kernels, self.model, self.kv_cache, self.block_size, self.num_blocks, prefill,
                                  self._row_counts(), split_items=self.split_items)
        if not self.kernels.tile_timing:
            with parallel_compile.compile_only():
                steps(progress=self.progress, label="compiling kernels")
        steps(progress=self.progress, label="tuning kernel tiles" if self.kernels.tile_timing else "warming up kernels")
        log.info("kernel tiles: %s", self.kernels.tuning_summary())

    def _capture_graphs(self) -> None:
        config = self.config
        self.graphs = CUDAGraphs(self.model, self.kv_cache, config.cuda_graphs, config.max_model_len,
                                 self.block_size, scratch_block=self.num_blocks)
        pool = torch.cuda.graph_pool_handle()  # one for all: captured largest first, the mixed steps'
        if config.cuda_graphs.token_sizes:
            self.mixed = MixedStepGraphs(self.model, self.kv_cache, config.cuda_graphs.token_sizes,
                                         config.max_num_seqs, self.graphs.width, self.block_size,
                                         scratch_block=self.num_blocks, num_warmup=config.cuda_graphs.num_warmup,
                                         split_items=self.split_items, mtp_pass=self.proposer is not None,
                                         first_up_to=DEFAULT_CHUNK_BUDGET)
        if self.kernels is not None and not self.kernels.tile_timing and self.device.type == "cuda":
            # What only the captured steps launch, compiled side by side first (a tuning engine's
            # compiles came with its timing).
            with parallel_compile.compile_only():
                for graphs in (self.mixed, self.graphs):
                    if graphs is not None:
                        graphs.dry_run()
        self._pool = pool
        if self.mixed is not None and not (self.defer_capture and not self.kernels.tile_timing):  # tuning: now
            self.mixed.capture(pool, self.progress)
        elif self.mixed is not None:
            log.info("CUDA graphs of mixed steps: %d buckets left for after start-up (captured while idle; "
                     "until then such steps run eagerly)", len(self.mixed.pending))
        self.graphs.capture(pool, self.progress)
        self.kernels.freeze()

    @property
    def deferred(self) -> bool:
        """Start-up work left for after the engine serves (`defer_capture`)."""
        return self.mixed is not None and bool(self.mixed.pending)

    def capture_deferred(self) -> bool:
        """One piece of the work `defer_capture` left: the next mixed-step graph not yet
        captured, with its MTP pass; True while more remain. A served engine calls it in its idle
        moments, and under load now and then with no step in flight (core.BUSY_CAPTURE_EVERY_S),
        so a capture delays the requests by its own length at most. Why defer: those graphs only
        make prefill steps cheaper, and capturing them is the longest part of a warm start; every
        kernel they launch was compiled before SERVING (the dry pass), so a capture here compiles
        nothing."""
        with torch.inference_mode():
            return self.mixed.capture(self._pool, lambda _: None, count=1)

    @property
    def chunk_cap(self) -> int | None:
        """DEFAULT_CHUNK_BUDGET while mixed-step graphs above it are still deferred (they come
        after the budget's own): the most tokens a step with a timed chunk may bring until they
        exist, so it replays a graph; None once they are all captured, or where none wait."""
        waiting = self.deferred and any(size > DEFAULT_CHUNK_BUDGET for size in self.mixed.pending)
        return DEFAULT_CHUNK_BUDGET if waiting else None

    def _row_counts(self) -> list[int]:
        """The skinny-matmul row counts (powers of two) this engine's steps bring: with every
        step graphed, those of the decode buckets (rows and their logits), of the small mixed-step
        buckets and of their sampled rows (max_num_seqs); with speculation, where some steps run
        eagerly (drafting beside prefill chunks), every count."""
        graphs = self.config.cuda_graphs
        if not graphs.token_sizes:
            return skinny_row_counts()
        rows = {b * q for b in graphs.capture_sizes for _, q in graphs.step_shapes}
        rows |= {*graphs.token_sizes, self.config.max_num_seqs}
        return [n for n in skinny_row_counts() if any(n // 2 < r <= n for r in rows)]

    # Timed runs of each step for the step-cost table (the fastest counts): few, as a step is steady.
    COST_RUNS = {"cuda": 3, "cpu": 2}

    @torch.inference_mode()
    def _time_decode_steps(self, ks) -> dict[tuple[int, int], float]:
        """Seconds of a decode step drafting k (0: plain) for every k in `ks` and every batch
        bucket (DecodeCosts): a captured graph's replay, a compiled CPU step, or else the eager
        step as the runner would run it, over padded inputs on the scratch block. Drafting steps
        are timed from the smallest bucket up to the first where no k can pay even with every
        draft accepted (a step drafting k costs more than k + 1 plain ones): a larger batch
        gains less from drafting, and on a CPU each eager drafting step timed costs the start-up
        many plain ones. Within a bucket, k rises until one cannot pay while its last draft cost
        a whole plain step more: drafts do not get cheaper with k, so no longer one pays either.
        Those left out stay unmeasured (never chosen)."""
        graphs = self.graphs  # CUDA graphs or CPU programs: their buckets; eager: a CPU's buckets
        buckets = graphs.sizes if graphs is not None else cpu_capture_sizes(None, None, self.config.max_num_seqs)
        runs = self.COST_RUNS.get(self.device.type, 2)
        table, timed = {}, list(ks)
        for b in buckets:
            previous = table[0, b] = time_runs(self._cost_run(0, b), runs, self.device)
            for k in (k for k in timed if k):
                table[k, b] = time_runs(self._cost_run(k, b), runs, self.device)
                if table[k, b] >= (k + 1) * table[0, b] and table[k, b] - previous >= table[0, b]:
                    break  # k cannot pay, and a draft more costs a plain step more: no longer one can
                previous = table[k, b]
            if not any((k + 1) * table[0, b] > table[k, b] for k in timed if (k, b) in table and k):
                timed = [0]
        return table

    def _cost_run(self, k: int, batch: int) -> Callable[[], object]:
        """One decode step of `batch` padded sequences drafting k, as a call."""
        graphs, scratch, device = self.graphs, self.num_blocks, self.device
        key = (None, 1, batch) if k == 0 else (k, k + 1, batch)
        if isinstance(graphs, CUDAGraphs) and key in graphs.graphs:
            return graphs.graphs[key].replay  # over the padding capture left in the static inputs
        if isinstance(graphs, CPUGraphs) and key in graphs.graphs:
            graphs.stage(key, [0] * batch, [0] * batch, [1] * batch, [[scratch]] * batch)
            return lambda: graphs.replay(key, batch)
        q, fused = k + 1, self.config.fused_kernels
        tables = [[scratch] * -(-(2 * q + 1) // self.block_size)] * batch  # room for the drafting chain
        ids = torch.zeros(batch * q, dtype=torch.long, device=device)
        positions = torch.arange(q, device=device).repeat(batch)
        if k == 0:
            def plain():
                meta = AttentionMetadata.build([1] * batch, [1] * batch, tables, self.block_size, device, fused)
                return self.model.compute_logits(self.model(ids, positions, self.kv_cache, meta)).argmax(-1)
            return plain

        def speculative():
            meta = AttentionMetadata.build([q] * batch, [q] * batch, tables, self.block_size, device, fused)
            accept = (device_acceptance(meta, q, self.model.rotary) if meta.block_tables is not None
                      else host_acceptance(tables, self.block_size, device, self.model.rotary))
            return speculative_step(self.model, self.kv_cache, ids, positions, meta, q, k,
                                    lambda logits: logits.argmax(dim=-1), accept)
        return speculative

    def _retime_plain_steps(self) -> None:
        """The CPU's compiled programs came in use: plain decoding got cheaper, drafting did not."""
        self.decode_costs.update(self._time_decode_steps([0]))
        log.info("decode step costs, decode steps compiled: %s", self.decode_costs)

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.config)

    def _fit_num_blocks(self) -> int:
        """Enough for every sequence at full length (with its draft slots); on a GPU no more
        than memory allows, after the activations of the largest step the scheduler may run
        (its token budget: max_model_len when chunking is off) and of the CUDA graphs' largest
        step (measured by dry runs)."""
        config = self.config
        wanted = config.max_num_seqs * config.max_blocks_per_seq
        if self.device.type != "cuda":
            return wanted
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = kv_reserve(config, self._activation_peak)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - reserve
        fits = budget // self.block_bytes - 1  # the scratch block
        if fits < config.max_blocks_per_seq:
            raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization} leaves room for {fits} KV "
                             f"blocks, fewer than one sequence of max_model_len={config.max_model_len} needs")
        return min(wanted, fits)

    def _activation_peak(self, n: int, n_logits: int) -> int:
        """Bytes a step of n tokens, with fp32 logits of n_logits of them, needs beyond the weights
        (one dry run)."""
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        c = self.config.model_config
        cache = torch.zeros(self.model.num_kv_layers, 2, n + self.block_size, c.num_key_value_heads,
                            c.head_dim, dtype=self.dtype, device=self.device)
        table = list(range(-(-n // self.block_size)))
        meta = AttentionMetadata.build([n], [n], [table], self.block_size, self.device, self.config.fused_kernels,
                                       self.split_items, self.config.batch_invariant)
        if meta.prefill is not None:  # the partial results a graphed step allocates, whatever its plan
            meta.prefill.num_parts = 2 * self.split_items
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            positions = torch.arange(n, device=self.device) % self.model.rotary.cos.shape[0]  # n may pass max_model_len
            hidden = self.model(ids, positions, cache, meta)
            if n_logits:
                self.model.compute_logits(hidden[-n_logits:]).float()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del cache, hidden
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, num_drafts: int = 0, skip_prompts: bool = False) -> tuple[
            list[list[int] | None], list[list[int]], list[LogprobsLists | None], list[LogprobsLists | None]]:
        """Compute the scheduled tokens (a sequence's pending drafts included); for each sequence
        whose tokens are now all computed, the tokens it gains (accepted drafts + one), None for
        one still part-way through its prompt; the drafts (up to `num_drafts`) each one
        proposes for the next step; for those that asked, the gained tokens' logprobs; and the
        logprobs of the prompt tokens this step's rows predict (prompt_logprobs).
        `skip_prompts`: prefill chunks skip the MTP pass too (see plain_step)."""
        plain = self.plain_step(batch, num_drafts, skip_prompts)
        if (self.proposer is not None and not plain
                and self.speculative_shape(batch, num_drafts) is not None
                and not any(seq.params.logprobs is not None for seq in batch.seqs)):
            none = [None] * len(batch)  # no logprobs asked, no prompt rows
            return *self.speculative_result(self.launch_speculative(batch, num_drafts)), none, none
        step = self._run(batch)
        prompt_logprobs = self._prompt_logprobs(batch, step)
        sampled = [seq for seq, d in zip(batch.seqs, step.sampled) if d]
        tokens, logprobs = self._sample(step, sampled) if sampled else ([], [])
        tokens, logprobs = iter(tokens), iter(logprobs)
        emitted = [next(tokens) if d else None for d in step.sampled]
        emitted_logprobs = [next(logprobs) if d else None for d in step.sampled]
        if self.proposer is None or plain:
            return emitted, [[] for _ in batch.seqs], emitted_logprobs, prompt_logprobs
        if step.mixed_bucket is not None:  # its MTP pass is a graph too, and such a step drafts nothing
            self.mixed.replay_mtp_pass(step.mixed_bucket, next_tokens(batch.seqs, batch.num_tokens, emitted))
            return emitted, [[] for _ in batch.seqs], emitted_logprobs, prompt_logprobs
        drafts = self.proposer.propose(self._draft_forward, self.model.draft_tokens, batch.seqs,
                                       batch.num_tokens, step.hidden, step.positions, step.meta, emitted, num_drafts)
        return emitted, drafts, emitted_logprobs, prompt_logprobs

    def _prompt_logprobs(self, batch: ScheduledBatch, step: _Step) -> list[LogprobsLists | None]:
        """Per sequence that asked for prompt_logprobs, those of the prompt tokens its rows in
        this step predict (the row at position p predicts the token at p + 1), so a prompt split
        over chunks gets each chunk's. The vocabulary projection runs max_num_seqs rows at a
        time: no more logits than a step samples (what `kv_reserve` leaves room for)."""
        rows, targets, spans, row = [], [], [], 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            end = min(start + n, seq.num_prompt_tokens - 1)
            if seq.params.prompt_logprobs is not None and start < end:
                spans.append((len(rows), len(rows) + end - start))
                rows += range(row, row + end - start)
                targets += seq.token_ids[start + 1:end + 1]
            else:
                spans.append(None)
            row += n
        if not rows:
            return [None] * len(batch)
        most = max(seq.params.prompt_logprobs for seq, span in zip(batch.seqs, spans) if span)
        lists, size = LogprobsLists([], [], []), self.config.max_num_seqs
        for i in range(0, len(rows), size):
            logits = self.model.compute_logits(step.hidden[to_device(torch.tensor(rows[i:i + size]), self.device)])
            lists.extend(token_logprobs(logits, to_device(torch.tensor(targets[i:i + size]), self.device), most))
        return [lists[span[0]:span[1]].top(seq.params.prompt_logprobs) if span else None
                for seq, span in zip(batch.seqs, spans)]

    @staticmethod
    def plain_step(batch: ScheduledBatch, num_drafts: int, skip_prompts: bool = False) -> bool:
        """A step that verifies and proposes nothing and skips the MTP pass: a decode step (so
        drafting that is off costs nothing; the MTP KV cache misses these positions, see
        draft_policy.py), and with `skip_prompts` any such step, prefill chunks too."""
        return num_drafts == 0 and all((n == 1 or skip_prompts) and not seq.spec_token_ids
                                       for seq, n in zip(batch.seqs, batch.num_tokens))

    def speculative_shape(self, batch: ScheduledBatch, num_drafts: int) -> int | None:
        """The drafts every sequence verifies when all decode with the same number and have room
        for `num_drafts` more past them before max_model_len (then the step is one
        `speculative_step`, one graph where captured); None: the general path runs it."""
        q = batch.num_tokens[0]
        if q > MAX_UNIFORM_Q or not all(
                n == q and len(seq.spec_token_ids) == q - 1 and seq.num_uncomputed_tokens == 1
                and seq.num_tokens + q + num_drafts - 2 <= self.config.max_model_len  # the last draft's position
                for seq, n in zip(batch.seqs, batch.num_tokens)):
            return None
        return q - 1

    @torch.inference_mode()
    def launch_speculative(self, batch: ScheduledBatch, num_drafts: int,
                           after: SpeculativeLaunch | None = None) -> SpeculativeLaunch | None:
        """A uniform decode step (`speculative_shape`) as one `speculative_step`, launched without
        waiting for its result: staged in one copy and replayed as one graph where one is
        captured and every draw runs inside it, else eagerly. `after`: the step before it, of the
        same sequences in the same order, still in flight; this step verifies that step's drafts
        and takes its inputs from that step's result on the device (async scheduling). None:
        `after` cannot be chained here (an eager step on a GPU would wait for its result)."""
        seqs, q = batch.seqs, batch.num_tokens[0]
        tables = [seq.block_table for seq in seqs]
        graphs = self.graphs if isinstance(self.graphs, CUDAGraphs) else None
        key = graphs.key(num_drafts, q, len(seqs), max(map(len, tables))) if graphs else None
        if key is not None and all(drawn_in_graph(seq.params) for seq in seqs):
            if after is None:
                graphs.stage(key, *self._uniform_inputs(seqs, q), tables, _draws(seqs))
            else:
                graphs.stage_chained(key, after.q, tables, _draws(seqs))
            return SpeculativeLaunch(batch, num_drafts, *self.copies(graphs.replay(key, len(seqs))[0]))
        if after is None:
            ids, positions, ctx_lens = self._uniform_inputs(seqs, q)
            ids_t, positions_t = (to_device(torch.tensor(x), self.device) for x in (ids, positions))
        elif self.device.type == "cpu":
            width = max(map(len, tables))
            table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            ids_t, positions_t, _, ctx_t = chained_inputs(after.packed, after.context_lens, after.q, q, table_t,
                                                          self.block_size)
            ctx_lens = ctx_t.tolist()
        else:
            return None
        meta = AttentionMetadata.build([q] * len(seqs), ctx_lens, tables, self.block_size, self.device,
                                       self.config.fused_kernels)
        accept = (device_acceptance(meta, q, self.model.rotary) if meta.block_tables is not None
                  else host_acceptance(tables, self.block_size, self.device, self.model.rotary))
        packed = speculative_step(self.model, self.kv_cache, ids_t, positions_t, meta, q, num_drafts,
                                  self._sample_rows(seqs, q, positions_t), accept)
        return SpeculativeLaunch(batch, num_drafts, *self.copies(packed), context_lens=torch.tensor(ctx_lens))

    @staticmethod
    def _uniform_inputs(seqs: list[Sequence], q: int) -> tuple[list[int], list[int], list[int]]:
        """ids, positions (per token: the last token then the drafts) and context lengths of a
        uniform decode step of q tokens a sequence."""
        ids, positions, ctx_lens = [], [], []
        for seq in seqs:
            start = seq.num_computed_tokens
            ids += [seq.token_ids[start], *seq.spec_token_ids]
            positions += range(start, start + q)
            ctx_lens.append(start + q)
        return ids, positions, ctx_lens

    def speculative_result(self, launch: SpeculativeLaunch) -> tuple[list[list[int]], list[list[int]]]:
        """Wait for a speculative step: per sequence the tokens it gains (accepted drafts + one)
        and its next drafts (as many as `MTPProposer.num_drafts` lets it keep)."""
        rows, q = launch.rows(), launch.q
        emitted = [row[:row[q] + 1] for row in rows]
        drafts = [row[q + 1:q + 1 + self.proposer.num_drafts(seq, new, launch.num_drafts)]
                  for seq, row, new in zip(launch.batch.seqs, rows, emitted)]
        return emitted, drafts

    def _sample_rows(self, seqs: list[Sequence], q: int, positions: torch.Tensor):
        """The token of each of a speculative step's rows (q a sequence): the argmax for greedy
        requests, the seeded race of the token's position for sampled ones."""
        if all(seq.params.greedy and not seq.params.processes_logits for seq in seqs):
            return lambda logits: logits.argmax(dim=-1)
        params = [seq.params for seq in seqs for _ in range(q)]
        seeds = to_device(torch.tensor([seq.seed for seq in seqs for _ in range(q)]), self.device)
        return lambda logits: sample(logits.float(), params, seeds, positions.long() + 1, _histories(seqs))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> Launch:
        """Async scheduling: enqueue the step and its sampling without waiting for them. The
        sampled tokens stay on the device, where the next step reads its inputs, and reach the
        host later through `Launch.tokens()`, while the device computes that next step."""
        step = self._run(batch)
        sampled = [seq for seq, d in zip(batch.seqs, step.sampled) if d]
        if not sampled:
            return Launch(sampled, None, None)
        tokens = self._sample_tensor(step, sampled)
        self._last_sampled = tokens, {seq: row for row, seq in enumerate(sampled)}
        return Launch(sampled, *self.copies(tokens))

    def _run(self, batch: ScheduledBatch) -> _Step:
        """The forward of a step: a graph replay fed by one copy when a captured graph fits the
        step, else eager."""
        ids, positions, q_lens, ctx_lens, tables, sample_at, sampled = [], [], [], [], [], [], []
        pending = []  # (index in ids, sequence): a token the last launch left on the device
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            new = seq.token_ids[start:start + n].tolist()
            if len(new) < n and seq.num_pending:
                pending.append((len(ids) + len(new), seq))
                new.append(0)
            ids.extend(new + seq.spec_token_ids[:n - len(new)])
            positions.extend(range(start, start + n))
            q_lens.append(n)
            ctx_lens.append(start + n)
            tables.append(seq.block_table)
            sampled.append(seq.sampled_after(n))
            if sampled[-1]:
                sample_at.extend(range(len(ids) - 1 - len(seq.spec_token_ids), len(ids)))
        key = self._graph_key(q_lens, tables)
        # Any other step of a captured token count replays a mixed-step graph (one sampled row a
        # sequence: no drafts to verify), unless prompt_logprobs need every row's logits.
        bucket = self.mixed.bucket(len(ids), len(q_lens), max(map(len, tables))) if (
            key is None and self.mixed is not None and not any(seq.spec_token_ids for seq in batch.seqs)
            and not any(seq.params.prompt_logprobs is not None for seq in batch.seqs)) else None
        batch.graph_pending = bucket is None and key is None and self.mixed is not None and self.mixed.awaits(len(ids))
        if bucket is not None:
            self.mixed.stage(bucket, ids, positions, q_lens, ctx_lens, tables, sample_at)
            if pending:
                self._fill_pending(self.mixed.ids, pending)
            logits, greedy = self.mixed.replay(bucket, len(sample_at))
            return _Step(None, self.mixed.positions[:len(ids)], None, sample_at, sampled, logits, greedy,
                         mixed_bucket=bucket)
        if key is not None:
            graphs = self.graphs
            drawn = isinstance(graphs, CUDAGraphs)  # the draw is in the graph (compiled CPU steps: the argmax)
            graphs.stage(key, ids, positions, ctx_lens, tables, *([_draws(batch.seqs)] if drawn else []))
            if pending:  # after the copy into the static ids, before the replay: stream order
                self._fill_pending(graphs.ids, pending)
            hidden, logits, tokens = graphs.replay(key, len(ids))
            step = _Step(hidden, graphs.positions[:len(ids)], graphs.meta(key[1], len(q_lens)), sample_at, sampled)
            if sample_at == list(range(len(ids))):  # every row sampled: the graph's logits are the sampled ones
                step.logits, step.greedy = logits, tokens
                step.drawn = drawn
            return step
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, self.block_size, self.device,
                                       self.config.fused_kernels, self.split_items, self.config.batch_invariant)
        ids_t = to_device(torch.tensor(ids), self.device)
        if pending:
            self._fill_pending(ids_t, pending)
        positions_t = to_device(torch.tensor(positions), self.device)
        return _Step(self.model(ids_t, positions_t, self.kv_cache, meta), positions_t, meta, sample_at, sampled)

    def _graph_key(self, q_lens: list[int], tables: list[list[int]]) -> tuple[None, int, int] | None:
        """The main-model graph that fits a step (every sequence the same few tokens, a captured
        bucket, tables not too wide), decided before any metadata is built; None: eager."""
        if self.graphs is None or q_lens.count(q_lens[0]) != len(q_lens) or q_lens[0] > MAX_UNIFORM_Q:
            return None
        return self.graphs.key(None, q_lens[0], len(q_lens), max(len(t) for t in tables))

    def _fill_pending(self, ids: torch.Tensor, pending: list[tuple[int, Sequence]]) -> None:
        """Put the tokens the last launch sampled on the device into this step's ids."""
        tokens, rows = self._last_sampled
        where, source = [i for i, _ in pending], [rows[seq] for _, seq in pending]
        if where == source == list(range(len(pending))):  # steady decoding: same sequences, same order
            ids[:len(pending)].copy_(tokens[:len(pending)])
            return
        index = to_device(torch.tensor(where + source), self.device)  # one copy for both
        ids[index[:len(pending)]] = tokens[index[len(pending):]].to(ids.dtype)

    def _draft_forward(self, step: int, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """MTP draft step `step` (layer step % n, its own KV cache), eagerly: steps with prefill."""
        return self.model.mtp_forward(step, ids, positions, hidden, self.kv_cache, meta)

    def _sample(self, step: _Step, seqs: list[Sequence]) -> tuple[list[list[int]], list[LogprobsLists | None]]:
        """Tokens each sequence gains (one sampled token, or accepted drafts + one with MTP), and
        their logprobs for the sequences that asked."""
        wants_logprobs = any(s.params.logprobs is not None for s in seqs)
        if not any(s.spec_token_ids for s in seqs) and not wants_logprobs:
            return [[t] for t in self._sample_tensor(step, seqs).tolist()], [None] * len(seqs)
        logits, drafts, params, seeds, positions = self._logits(step, seqs, [len(s.spec_token_ids) + 1 for s in seqs])
        tokens = verify(process_logits(logits, params, _histories(seqs)), drafts, [s.params for s in seqs],
                        seeds, positions)
        return tokens, self._logprobs(logits, seqs, tokens) if wants_logprobs else [None] * len(seqs)

    @staticmethod
    def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[list[int]]) -> list[LogprobsLists | None]:
        """Per sequence that asked, its gained tokens' logprobs with its top N. A sequence's rows
        are its draft positions then the bonus one, in order."""
        rows, taken, row = [], [], 0
        for seq, new in zip(seqs, tokens):
            if seq.params.logprobs is not None:
                rows += range(row, row + len(new))
                taken += new
            row += len(seq.spec_token_ids) + 1
        most = max(s.params.logprobs for s in seqs if s.params.logprobs is not None)
        lists = token_logprobs(logits[rows], torch.tensor(taken, device=logits.device), most)
        out, start = [], 0
        for seq, new in zip(seqs, tokens):
            if seq.params.logprobs is None:
                out.append(None)
                continue
            out.append(lists[start:start + len(new)].top(seq.params.logprobs))
            start += len(new)
        return out

    def _sample_tensor(self, step: _Step, seqs: list[Sequence]) -> torch.Tensor:
        """One token per sequence, left on the device: the graph's when it drew them all (or all
        are greedy and it took the argmax)."""
        if step.greedy is not None and all(drawn_in_graph(s.params) if step.drawn
                                           else s.params.greedy and not s.params.processes_logits for s in seqs):
            return step.greedy
        logits, _, params, seeds, positions = self._logits(step, seqs, [1] * len(seqs))
        return sample(logits, params, seeds, positions, _histories(seqs))

    def _logits(self, step: _Step, seqs: list[Sequence], rows_per_seq: list[int]):
        """What sampling reads: fp32 logits of the sampled rows (the graph's, or the vocab
        projection of those rows), each sequence's drafts, and per row the sampling parameters,
        the seed and the position of the token it samples."""
        rows = to_device(torch.tensor(step.sample_at, dtype=torch.long), self.device)
        logits = step.logits
        if logits is None:
            logits = self.model.compute_logits(step.hidden[rows]).float()
        params = [s.params for s, n in zip(seqs, rows_per_seq) for _ in range(n)]
        seeds = to_device(torch.tensor([s.seed for s, n in zip(seqs, rows_per_seq) for _ in range(n)]), self.device)
        return logits, [s.spec_token_ids for s in seqs], params, seeds, step.positions[rows].long() + 1


def _draws(seqs: list[Sequence]) -> list[tuple[float, float, int]]:
    """Per sequence, what a graph's draw reads: temperature (0: greedy), min_p, seed."""
    return [(0.0, 0.0, seq.seed) if seq.params.greedy else (seq.params.temperature, seq.params.min_p, seq.seed)
            for seq in seqs]


def _histories(seqs: list[Sequence]) -> list[History]:
    """Per sampled row, the tokens its token follows: a sequence's rows are its draft positions
    then the bonus one, row j after the output so far and the first j drafts."""
    return [History(s.prompt_token_ids, s.token_ids[s.num_prompt_tokens:].tolist() + s.spec_token_ids[:j])
            for s in seqs for j in range(len(s.spec_token_ids) + 1)]


class ResultCopies:
    """Small step results on their way to the host: one non-blocking copy each into a ring of
    pinned buffers, with an event each that says the copy arrived (not a pageable copy's
    implicit sync of everything). Buffers, events and the stream are made once: a pinned
    allocation, an event and the current stream's lookup each cost the host as much as a graph's
    launch, or more. Three, because async scheduling leaves at most two results unread (the step in
    flight and the one launched after it); a result larger than a buffer gets its own. On a CPU
    the tensor itself, already there."""

    def __init__(self, device: torch.device, size: int, depth: int = 3):
        self.cuda = device.type == "cuda"
        self.turn = 0
        if self.cuda:
            self.stream = torch.cuda.current_stream(device)
            self.buffers = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(depth)]
            self.events = [torch.cuda.Event() for _ in range(depth)]

    def __call__(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if not self.cuda:
            return tensor, None
        turn, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
        if tensor.dtype == torch.int64 and tensor.numel() <= self.buffers[turn].numel():
            host, ready = self.buffers[turn][:tensor.numel()].view(tensor.shape), self.events[turn]
        else:
            host, ready = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True), torch.cuda.Event()
        host.copy_(tensor, non_blocking=True)
        ready.record(self.stream)
        return host, ready


@dataclass
class _Step:
    """A step's forward, as sampling and drafting read it."""

    hidden: torch.Tensor | None  # [tokens, hidden] final-normed; None from a mixed-step graph (logits given)
    positions: torch.Tensor
    meta: AttentionMetadata | None
    sample_at: list[int]  # the rows to sample
    sampled: list[bool]  # per sequence: whether this step samples it
    logits: torch.Tensor | None = None  # [len(sample_at), vocab] fp32, when the graph computed them
    greedy: torch.Tensor | None = None  # their argmax, or with `drawn` the graph's draw (sampler.race)
    drawn: bool = False
    mixed_bucket: int | None = None  # the mixed-step graph that ran the step (its MTP pass replays apart)


@dataclass
class Launch:
    """A step in flight (async scheduling): the sequences it samples and their tokens to come."""

    seqs: list[Sequence]
    tokens_on_host: torch.Tensor | None  # pinned, filled by a non-blocking copy (CPU: the tokens)
    ready: torch.cuda.Event | None

    def wait(self) -> None:
        """Until the step's tokens are on the host."""
        if self.ready is not None and self.seqs:
            self.ready.synchronize()

    def tokens(self) -> list[tuple[Sequence, int]]:
        """Wait for the step's tokens: (sequence, token) for each sequence it sampled."""
        if not self.seqs:
            return []
        self.wait()
        return list(zip(self.seqs, self.tokens_on_host.tolist()))


@dataclass
class SpeculativeLaunch:
    """A speculative step in flight: its packed result [B, q + 1 + k] (the q sampled tokens,
    the accepted count, the next drafts) reaches the host through one copy."""

    batch: ScheduledBatch
    num_drafts: int
    packed: torch.Tensor  # pinned, filled by a non-blocking copy (CPU: the result)
    ready: torch.cuda.Event | None
    context_lens: torch.Tensor | None = None  # eager steps: what a step chained after this one starts from

    @property
    def q(self) -> int:
        """Tokens verified a sequence."""
        return self.batch.num_tokens[0]

    def wait(self) -> None:
        """Until the result is on the host."""
        if self.ready is not None:
            self.ready.synchronize()

    def rows(self) -> list[list[int]]:
        """Wait for the result: a row a sequence."""
        self.wait()
        return self.packed.tolist()
