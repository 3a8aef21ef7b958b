"""Compiled decode steps on the CPU: the CPU's counterpart of cuda_graphs.py.

An eager CPU decode step of a small model is a few hundred aten calls from Python, and on a
2-core board that interpreter work, not the arithmetic, sets the pace. So a decode step is made
once into one program and then only run: the forward over the paged KV cache (`DecodeStep`) is
exported (`torch.export`) and compiled ahead of time by AOTInductor, whose C++ loops fuse the
norms, q/k norm + RoPE, the attention and SiLU·up between the matrix products, and whose C++
wrapper is called straight from the runner: no guards, no Python wrapper, no per-op dispatch.
The weights are constants of the program.

Two programs serve every batch bucket: batch 1, and one whose batch size is symbolic; in both
the block tables' width (the context read, a multiple of the block size) and the cache's size are
symbolic too, so a step never reads the whole cache nor recompiles as contexts grow, and one
program serves any `max_model_len`, `max_num_seqs` or cache size. At batch 1 every product, the
vocab projection included, is a C++ reduction over the weight in the narrowest dtype that holds
its values exactly (`streamed_linear`, `narrowest`: a bf16 checkpoint served in fp32 is read as
bf16), with fp32 sums: faster than MKL's and oneDNN's packed fp32 products at one row on a core,
since half the bytes fit the cache (bench/results/decode-cpu-r9). Past one row a reduction reads each
weight once a row, so the batch program keeps fp32 weights packed for oneDNN by inductor's
freezing, and its vocab projection and argmax run after it (`VocabHead`, on weights packed when
the engine starts: oneDNN's packed product cannot be saved in a package).
A step's new keys and values leave the program as outputs and are stored with one index_copy
after it: stored inside, into the cache (an input), they make inductor copy the whole cache.

Programs are cached on disk (compile_cache.py: keyed by the weights, the traced source, torch,
the CPU's ISA and the thread count), so only the first start compiles and later ones load. The
first start serves at once: a process of its own (`BackgroundCompile`) compiles what the cache
lacks while decode steps run eagerly, and the programs are swapped in between steps once they
are there (`poll`). Every program, compiled or loaded, is checked against the
eager step on a probe before use: a cache entry that does not load or disagrees is removed and
compiled again. A program's weights are copies: each holds the model's weights once more.
Steps with prefill chunks, speculative steps (a drafting engine's plain decode steps, drafting
off, run compiled: off costs nothing on a CPU either), batches above the largest bucket and
programs that failed to compile run eagerly; so does every step with `--enforce-eager`.
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from jetserve import atomic
from jetserve.engine import compile_cache
from jetserve.engine.config import CPUCompileConfig
from jetserve.engine.model import attention, qwen3
from jetserve.engine.model.attention import AttentionMetadata, slot_mapping
from jetserve.engine.model.qwen3 import apply_rope

log = logging.getLogger(__name__)

# Greatest difference from the eager step a program may show on the probe, relative to the
# largest value: fp32 (reordered sums differ by ~1e-6), half precision (rounds at ~4e-3).
PROBE_TOLERANCE, HALF_PROBE_TOLERANCE = 1e-3, 3e-2


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
    (`decode_attention`). Eagerly (prefill steps, buckets that did not compile) the same methods
    run as plain torch ops."""

    # Rows the model hands to these methods rather than to its plain torch path (the same ops on a
    # CPU): the most rows a compiled batch program takes (export turns this test into its bound).
    SKINNY_MAX_ROWS = 1024
    attention_from_qkv = False  # q made apart (qk_norm_rope_store), then `paged_attention`

    def __init__(self):
        # While `tracing` (a DecodeStep being exported or checked): each layer's new key and value,
        # which the step returns for one store after the program (a store into the cache, an input
        # of the program, makes inductor copy the whole cache); the layer's attention reads its
        # own from here.
        self.tracing = False
        self.fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.streamed = False  # products as `streamed_linear` (while the batch-1 program is exported)

    @staticmethod
    def runs_on(x: torch.Tensor) -> bool:
        return x.device.type == "cpu"

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return streamed_linear(x, weight) if self.streamed else F.linear(x, weight)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual), as model/qwen3.RMSNorm."""
        if residual is not None:
            x = x + residual
        y = _rms_norm(x, weight, eps)
        return y if residual is None else (y, x)

    def norm_linear(self, x, residual, norm_weight, eps: float, weight):
        if residual is None:
            return self.linear(_rms_norm(x, norm_weight, eps), weight), x
        y, residual = self.rms_norm(x, norm_weight, eps, residual)
        return self.linear(y, weight), residual

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.linear(self.silu_mul(gate_up), weight)

    def qk_norm_rope_store(self, qkv, q_weight, k_weight, cos, sin, slot_mapping, k_cache, v_cache, eps: float,
                           num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """Per-head RMSNorm and RoPE of q and k, k and v written into their cache slots; returns
        q [T, H, D]."""
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = apply_rope(_rms_norm(q.view(-1, num_heads, head_dim), q_weight, eps), cos, sin)
        k = apply_rope(_rms_norm(k.view(-1, num_kv_heads, head_dim), k_weight, eps), cos, sin)
        v = v.view(-1, num_kv_heads, head_dim)
        if self.tracing:
            self.fresh.append((k, v))
        else:
            index = slot_mapping.long()
            k_cache.index_copy_(0, index, k)
            v_cache.index_copy_(0, index, v)
        return q

    def paged_attention(self, q, k_cache, v_cache, block_tables, context_lens, q_len: int, block_size: int,
                        scale: float, token_rows=None, out=None) -> torch.Tensor:
        """A decode step's attention (q_len 1) through block tables: each block's slots are
        block * block_size + 0..block_size-1 (a broadcast, no division). The steps compiled here
        are uniform decodes: no token rows (a mixed step's decodes), no output given to write into."""
        if token_rows is not None or out is not None:
            raise ValueError("the CPU programs compile uniform decode steps only")
        batch, blocks = block_tables.shape
        offsets = torch.arange(block_size, device=block_tables.device)
        context_slots = (block_tables.long()[:, :, None] * block_size + offsets).view(batch, blocks * block_size)
        if self.tracing:
            return decode_attention(q, k_cache, v_cache, context_slots, context_lens - 1, scale, self.fresh[-1])
        return decode_attention(q, k_cache, v_cache, context_slots, context_lens, scale)


def streamed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as a sum inductor fuses with the weight's upcast: one pass over the weight in
    the dtype it is stored in, fp32 accumulation. At one row on a core it beats MKL's and oneDNN's
    packed fp32 products (bench/results/decode-cpu-r9); at more rows it reads the weight
    once a row, so the batch program keeps the packed products."""
    return (x.float()[:, None, :] * weight.float()[None]).sum(-1).to(x.dtype)


def narrowest(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the narrowest float dtype that holds every value exactly (fp32 weights upcast
    from a bf16 or fp16 checkpoint: half the bytes a step reads, the same products), else as is."""
    for dtype in (torch.bfloat16, torch.float16):
        if dtype.itemsize < weight.dtype.itemsize:
            narrow = weight.to(dtype)
            if torch.equal(narrow.to(weight.dtype), weight):
                return narrow
    return weight


@contextmanager
def narrowed_weights(model: nn.Module):
    """The model's products' weights (its `Linear`s but the vocab head) swapped for `narrowest`
    copies while the batch-1 program is exported (the program keeps them as its constants)."""
    linears = [m for name, m in model.named_modules() if isinstance(m, qwen3.Linear) and name != "lm_head"]
    weights = [m.weight for m in linears]
    try:
        for m, w in zip(linears, weights):
            m.weight = nn.Parameter(narrowest(w.detach()), requires_grad=False)
        yield
    finally:
        for m, w in zip(linears, weights):
            m.weight = w


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm numerics: in fp32, then cast."""
    y = x.float()
    return weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class DecodeStep(nn.Module):
    """What a program computes: the model over one new token a sequence, attention through
    `block_tables` [B, blocks]; returns the final-normed hidden states [B, hidden], each layer's
    new key and value [layers, 2, B, KVH, D] (stored by the caller) and, given the vocab `head`
    (`narrowest` weights), fp32 logits [B, vocab]."""

    def __init__(self, model: nn.Module, kernels: CPUKernels, block_size: int, head: torch.Tensor | None = None):
        super().__init__()
        self.model, self.kernels, self.block_size = model, kernels, block_size
        self.head = head

    def forward(self, kv_cache, ids, positions, block_tables, context_lens):
        meta = AttentionMetadata(slot_mapping=None, block_tables=block_tables, context_lens=context_lens, q_len=1,
                                 block_size=self.block_size)
        self.kernels.tracing, self.kernels.fresh = True, []
        try:
            hidden = self.model(ids, positions, kv_cache, meta)
            fresh = torch.stack([torch.stack(kv) for kv in self.kernels.fresh])
        finally:
            self.kernels.tracing, self.kernels.fresh = False, []
        if self.head is None:
            return hidden, fresh
        return hidden, fresh, streamed_linear(hidden.float(), self.head)


class VocabHead:
    """The vocab projection after a program, fp32 logits: MKL's packed product at one row, oneDNN's
    at more (each faster than the plain product on a vocab projection), both packed once here."""

    def __init__(self, weight: torch.Tensor, rows: int):
        self.weight = weight
        fp32 = weight.dtype == torch.float32
        self.mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1) if fp32 and torch._C.has_mkl else None
        self.onednn = (torch.ops.mkldnn._reorder_linear_weight(weight, rows)
                       if rows > 1 and torch.backends.mkldnn.is_available() else None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if rows == 1 and self.mkl is not None:
            logits = torch.ops.mkl._mkl_linear(hidden, self.mkl, self.weight, None, 1)
        elif rows > 1 and self.onednn is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden, self.onednn, None, "none", [], "")
        else:
            logits = F.linear(hidden, self.weight)
        return logits.float()


class CPUGraphs:
    """The compiled decode step of each batch bucket over one set of static inputs; the same
    interface the runner uses for CUDA graphs (key, stage, replay, meta)."""

    def __init__(self, model, kv_cache: torch.Tensor, config: CPUCompileConfig, max_model_len: int, block_size: int,
                 scratch_block: int, model_dir: str | None = None):
        self.model, self.kv_cache, self.config = model, kv_cache, config
        self.model_dir, self.max_model_len = model_dir, max_model_len  # what a background compiler loads again
        self.sizes = config.capture_sizes
        self.block_size, self.scratch_block = block_size, scratch_block
        self.scratch_slot = scratch_block * block_size
        self.max_batch = max(self.sizes)
        self.width = -(-(max_model_len + 1) // block_size)  # blocks of a sequence's table
        b = self.max_batch
        self.inputs = torch.zeros(3 * b, dtype=torch.int32)
        self.ids, self.positions, self.context_lens = self.inputs.view(3, b)
        self.context_lens.fill_(1)
        self.slots = torch.full((b,), self.scratch_slot, dtype=torch.int64)  # where each new key and value go
        # Block tables, seen as [bucket, blocks] (contiguous: a program reads its inputs as laid
        # out when exported). Holds block ids only, so stale entries past a table are in bounds.
        self.tables = torch.full((b * self.width,), scratch_block, dtype=torch.int32)
        self.blocks = 2  # table columns the next step reads (set by `stage`; a program takes 2 or more)
        self._host = [t.numpy() for t in (self.ids, self.positions, self.context_lens, self.slots, self.tables)]
        self.graphs: dict[tuple[None, int, int], Callable] = {}
        self.compile_seconds: dict[int, float] = {}  # per program (1: batch 1, 2: batch 2 or more)
        self.load_seconds: dict[int, float] = {}  # per program taken from the on-disk cache
        self.entries: dict[int, Path] = {}  # per program in use, its cache entry
        self.compiler: BackgroundCompile | None = None  # compiling the programs the cache lacked
        self._pending: dict[int, str] = {}  # program -> its cache key, while the compiler runs
        self.on_loaded: Callable[[], None] | None = None  # called once programs compiled in the background are in use

    def key(self, num_drafts: int | None, q_len: int, batch: int, width: int) -> tuple[None, int, int] | None:
        """The compiled step for `batch` single-token decodes (num_drafts None, q_len 1) with block
        tables `width` wide: (None, 1, bucket); None: the step runs eagerly."""
        if self.compiler is not None:
            self.poll()
        bucket = next((s for s in self.sizes if s >= batch), None)
        key = (num_drafts, q_len, bucket)
        return key if key in self.graphs and width <= self.width else None

    def _tables(self, batch: int) -> torch.Tensor:
        return self.tables[:batch * self.blocks].view(batch, self.blocks)

    def meta(self, q_len: int, batch: int) -> AttentionMetadata:
        """Attention metadata over the static inputs of `batch` decodes."""
        return AttentionMetadata(slot_mapping=self.slots[:batch], block_tables=self._tables(batch),
                                 context_lens=self.context_lens[:batch], q_len=q_len, block_size=self.block_size)

    def _inputs(self, batch: int) -> list[torch.Tensor]:
        return [self.kv_cache, self.ids[:batch], self.positions[:batch], self._tables(batch),
                self.context_lens[:batch]]

    def _run(self, program, bucket: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, fresh, *logits = program(self._inputs(bucket))  # the batch-1 program's own logits
        self.kv_cache[:fresh.shape[0]].index_copy_(2, self.slots[:bucket], fresh)
        logits = logits[0][:n] if logits else self.head(hidden[:n])
        return hidden[:n], logits, logits.argmax(-1)

    @torch.inference_mode()
    def capture(self, progress: Callable[[str], None] | None = None, background: bool = True,
                keys: dict[int, str] | None = None) -> None:
        """Load the programs from the on-disk cache, checking each against the eager step and
        running each bucket once. A program the cache lacks is compiled (and cached) by a process
        of its own while the engine serves, eagerly meanwhile (`background`, where the model's
        directory is known: the compiler loads the same weights again), else here and now.
        `keys`: the background compiler's, the entries the engine that started it will look for
        (a key it worked out itself could differ, and the engine would never find the program;
        what the entry holds is checked against the engine's eager step when it loads)."""
        root = Path(self.config.cache_dir)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "torchinductor"))  # inductor's build files
        self.kernels = CPUKernels()
        self.model.use_kernels(self.kernels)
        self.head = VocabHead(self.model.lm_head.weight, self.max_batch)
        self.cache = compile_cache.ProgramCache(root / "cpu-steps")
        c = self.kv_cache
        described = dict(
            weights=compile_cache.weights_digest([*self.model.named_parameters(), *self.model.named_buffers()]),
            source=compile_cache.source_digest([__file__, inspect.getfile(qwen3), inspect.getfile(attention)]),
            cache=[c.shape[0], c.shape[1], c.shape[3], c.shape[4], str(c.dtype)], block_size=self.block_size)
        missing = {}
        for program in sorted(keys or {min(s, 2) for s in self.sizes}):  # 1: batch 1; 2: batch 2 or more
            key = keys[program] if keys else compile_cache.program_key(program=program, **described)
            if not self._load(program, key):
                missing[program] = key
        if missing and background and self.model_dir:
            self._pending = missing
            self.compiler = BackgroundCompile(self, sorted(missing))
            log.info("CPU decode steps: compiling %s in the background (once per model and torch; decode steps run "
                     "eagerly until then, several minutes on a slow board)", _names(missing))
            return
        for i, (program, key) in enumerate(missing.items()):
            if progress:
                progress(f"compiling the CPU decode step {i + 1}/{len(missing)} (once)")
            self._compile_and_store(program, key)
        log.info("CPU decode steps: %s loaded, %s compiled (batch sizes %s; cache %s)", _names(self.load_seconds),
                 _names(self.compile_seconds), ",".join(map(str, self.sizes)), self.cache.directory)

    def _load(self, program: int, key: str) -> bool:
        began = time.perf_counter()
        if self.cache.load(key, self._loader(program)) is None:
            return False
        self.load_seconds[program] = round(time.perf_counter() - began, 2)
        self.entries[program] = self.cache.path(key)
        return True

    def _compile_and_store(self, program: int, key: str) -> None:
        began = time.perf_counter()
        try:  # loaded and checked before it is renamed into place: no other engine can remove it first
            path = self.cache.store(key, lambda tmp: (self._compile(program, tmp), self._loader(program)(tmp)))
        except Exception as exc:  # those buckets run eagerly (nothing cached); the engine still starts
            if atomic.no_space(exc):
                log.warning("CPU decode step for %s not cached: no space left on %s; it runs eagerly, and the "
                            "next start compiles it again", _names([program]), self.cache.directory)
                return
            log.warning("compiling the CPU decode step for %s failed (%s: %s); it runs eagerly", _names([program]),
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return
        self.entries[program] = path
        self.compile_seconds[program] = round(time.perf_counter() - began, 2)

    @property
    def ready(self) -> bool:
        """Every program in use: no compile is pending."""
        return self.compiler is None and not self._pending

    def wait(self) -> None:
        """Block until the background compile has ended and its programs are in use (benchmarks
        and tests that time or check the compiled step)."""
        if self.compiler is not None:
            self.compiler.process.wait()
            self.poll()

    def poll(self) -> None:
        """Between steps: once the background compiler has ended, load what it cached (checked as
        at start-up); what it could not compile keeps running eagerly."""
        if self.compiler is None or self.compiler.running():
            return
        compiler, self.compiler = self.compiler, None
        with torch.inference_mode():
            loaded = [program for program, key in self._pending.items() if self._load(program, key)]
        for program in loaded:  # compiled, not found: its load is part of its compile
            self.compile_seconds[program] = compiler.seconds
            self.load_seconds.pop(program)
        failed = sorted(set(self._pending) - set(loaded))
        self._pending = {}
        if loaded:
            log.info("CPU decode steps: %s compiled in the background in %.0f s; decode steps now run compiled",
                     _names(loaded), compiler.seconds)
            if self.on_loaded is not None:
                with torch.inference_mode():
                    self.on_loaded()
        if failed:
            log.warning("CPU decode steps: the background compile of %s failed (exit %s%s); they run eagerly",
                        _names(failed), compiler.returncode, f": {compiler.error}" if compiler.error else "")

    def _step(self, program: int) -> DecodeStep:
        """The step a program computes: batch 1 with its products streamed (`streamed_linear`) and
        the vocab head inside; batch 2 or more on packed products, the head after it (`VocabHead`)."""
        head = narrowest(self.model.lm_head.weight.detach()) if program == 1 else None
        return DecodeStep(self.model, self.kernels, self.block_size, head)

    def _loader(self, program: int) -> Callable[[str], Callable]:
        """Loads a package, checks it on the probe, runs its buckets once and puts them in
        `graphs` (raises when the check fails: `ProgramCache.load` then removes the entry)."""

        def load(path: str) -> Callable:
            run = torch._inductor.aoti_load_package(path).loader.run  # the C++ runner: no pytree round trip
            self._check(run, program)
            for bucket in self.sizes:
                if min(bucket, 2) == program and bucket <= CPUKernels.SKINNY_MAX_ROWS:
                    self._run(run, bucket, bucket)  # rows past a batch store into the scratch slot
                    self.graphs[(None, 1, bucket)] = lambda n, b=bucket: self._run(run, b, n)
            return run

        return load

    def _compile(self, program: int, path: str) -> None:
        """Export the step at a batch of `program` rows and compile it into the package `path`."""
        # Example sizes apart from each other and from every fixed size (export would take equal
        # sizes for the same symbol).
        batch, blocks = (1 if program == 1 else 5), 3
        rows = torch.export.Dim("batch", min=2, max=CPUKernels.SKINNY_MAX_ROWS) if batch > 1 else None
        width, slots = torch.export.Dim("blocks", min=2), torch.export.Dim("slots", min=2)
        dynamic = ({2: slots}, {0: rows} if rows else None, {0: rows} if rows else None,
                   {0: rows, 1: width} if rows else {1: width}, {0: rows} if rows else None)
        streamed = program == 1
        with torch.inference_mode(False), torch.no_grad():
            example = (self.kv_cache, torch.zeros(batch, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32),
                       torch.full((batch, blocks), self.scratch_block, dtype=torch.int32),
                       torch.ones(batch, dtype=torch.int32))
            with narrowed_weights(self.model) if streamed else nullcontext():
                self.kernels.streamed = streamed
                try:
                    exported = torch.export.export(self._step(program), example, dynamic_shapes=dynamic, strict=False)
                finally:
                    self.kernels.streamed = False
            # Freezing packs the batch program's weights for oneDNN; it would also fold the streamed
            # products' upcasts into fp32 copies of their weights.
            torch._inductor.aoti_compile_and_package(exported, package_path=path,
                                                     inductor_configs={"freezing": not streamed})

    @torch.no_grad()
    def _check(self, run: Callable, program: int) -> None:
        """Raise unless the program computes what the eager step computes on a probe: a small
        random cache, three sequences (one for batch 1) of different context lengths."""
        rng = torch.Generator().manual_seed(0)
        batch, bs, blocks = 1 if program == 1 else 3, self.block_size, 3
        c = self.kv_cache
        slots = (batch * blocks + 1) * bs
        cache = torch.randn((c.shape[0], c.shape[1], slots, *c.shape[3:]), generator=rng).to(c.dtype)
        tables = torch.randperm(batch * blocks, generator=rng).view(batch, blocks).to(torch.int32)
        lens = torch.randint(2, blocks * bs + 1, (batch,), generator=rng, dtype=torch.int32)
        inputs = [cache, torch.randint(0, self.model.config.vocab_size, (batch,), generator=rng, dtype=torch.int32),
                  lens - 1, tables, lens]
        want = self._step(program)(*inputs)
        got = run(inputs)
        tolerance = PROBE_TOLERANCE if c.dtype == torch.float32 else HALF_PROBE_TOLERANCE
        if len(want) != len(got):
            raise ValueError(f"it returns {len(got)} outputs, the step {len(want)}")
        for name, w, g in zip(("hidden states", "new keys and values", "logits"), want, got):
            error = (w.float() - g.float()).abs().max().item() if w.shape == g.shape else float("inf")
            if not error <= tolerance * w.float().abs().max().item():
                raise ValueError(f"its {name} differ from the eager step's by {error:.3g}")

    def stage(self, key: tuple[None, int, int], ids: list[int], positions: list[int], ctx_lens: list[int],
              tables: list[list[int]]) -> None:
        """Write a decode step (host lists, as the runner builds them) into the static inputs."""
        _, q_len, bucket = key
        n = len(ids)
        host_ids, host_positions, context_lens, slots, host_tables = self._host
        host_ids[:n] = ids
        host_positions[:n] = positions
        context_lens[:n] = ctx_lens
        context_lens[n:bucket] = 1  # padding rows read nothing from the cache
        slots[:n] = slot_mapping(tables, ctx_lens, [q_len] * n, self.block_size)
        slots[n:bucket] = self.scratch_slot
        self.blocks = max(2, *map(len, tables))
        view = host_tables[:bucket * self.blocks].reshape(bucket, self.blocks)
        for row, table in zip(view, tables):  # entries past a table stay stale: masked by its length
            row[:len(table)] = table

    def replay(self, key: tuple[None, int, int], n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run a compiled step over the static inputs: the first n rows of its hidden states, fp32
        logits and greedy tokens."""
        return self.graphs[key](n)


def _names(programs) -> str:
    names = {1: "batch 1", 2: "batch 2+"}
    return ", ".join(names[p] for p in sorted(programs)) or "none"


class BackgroundCompile:
    """A process that compiles CPU programs into the program cache (`python -m
    jetserve.engine.cpu_graphs`): it loads the model again from its directory, so the engine's
    process keeps serving (an in-process compile would hold the interpreter for the whole trace),
    and a compiler crash costs nothing but the speed-up. It ends itself when its parent dies."""

    def __init__(self, graphs: CPUGraphs, programs: list[int]):
        import json
        import subprocess
        import sys

        c = graphs.kv_cache
        spec = {"model": graphs.model_dir, "dtype": str(c.dtype).removeprefix("torch."),
                "max_model_len": graphs.max_model_len, "block_size": graphs.block_size,
                "sizes": list(graphs.sizes), "cache_dir": graphs.config.cache_dir, "programs": programs,
                "threads": torch.get_num_threads(), "parent": os.getpid(),
                "keys": {str(program): graphs._pending[program] for program in programs}}
        self.began = time.perf_counter()
        self.error = ""
        self.log = tempfile.TemporaryFile()  # the compiler's stderr: a pipe nobody drains could stall it
        self.process = subprocess.Popen([sys.executable, "-m", "jetserve.engine.cpu_graphs", json.dumps(spec)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
                                        env={**os.environ, "TQDM_DISABLE": "1"})
        self.seconds = 0.0

    def running(self) -> bool:
        if self.process.poll() is None:
            return True
        self.seconds = round(time.perf_counter() - self.began, 1)
        if self.process.returncode:
            self.log.seek(max(0, self.log.seek(0, os.SEEK_END) - 4096))
            lines = self.log.read().decode(errors="replace").strip().splitlines()
            self.error = lines[-1][:300] if lines else ""
        self.log.close()
        return False

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _compile_main(spec: dict) -> int:
    """The background compiler: the engine's model and cache layout, its programs compiled into the cache."""
    import threading

    from jetserve.engine.config import CPUCompileConfig
    from jetserve.engine.model.loader import load_model, torch_dtype

    parent = spec["parent"]

    def orphaned() -> None:  # the engine died: nobody will load what this compiles
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=orphaned, daemon=True).start()
    os.nice(5)  # below the engine it compiles for (and the C++ compilers it starts): serving comes first
    torch.set_num_threads(spec["threads"])  # part of a program's key: the engine's own count
    dtype = torch_dtype(spec["dtype"])
    model = load_model(spec["model"], dtype, torch.device("cpu"), spec["max_model_len"], None, None)
    blocks, c = 2, model.config
    kv = torch.zeros(model.num_kv_layers, 2, (blocks + 1) * spec["block_size"], c.num_key_value_heads, c.head_dim,
                     dtype=dtype)
    graphs = CPUGraphs(model, kv, CPUCompileConfig(tuple(spec["sizes"]), spec["cache_dir"]), spec["max_model_len"],
                       spec["block_size"], scratch_block=blocks)
    with torch.inference_mode():
        graphs.capture(background=False, keys={int(program): key for program, key in spec["keys"].items()})
    return 0 if set(graphs.entries) >= set(spec["programs"]) else 1


if __name__ == "__main__":
    import json
    import sys

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(_compile_main(json.loads(sys.argv[1])))
