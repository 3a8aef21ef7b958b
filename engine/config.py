"""Engine configuration: `EngineArgs` (what a user sets, vLLM's names) resolved once into `EngineConfig`.

As vLLM hands every part one `VllmConfig`, `EngineArgs.resolve()` reads the checkpoint's
config.json, applies every default and cross-field rule, and returns one frozen `EngineConfig`
that the engine, scheduler, runner and the TensorRT-LLM mapping all receive: no part derives a
budget, a draft length or a graph size from the raw arguments again. Importing this module
imports no torch (`jetserve --help` stays fast); `resolve()` asks torch only about the device.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib.util
import json
import logging
import math
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, fields, replace
from pathlib import Path

from jetserve import DEMO_MODEL, demo_model_dir
from jetserve.config import add_flags, setting
from jetserve.engine.model.checkpoint import (MAX_MODEL_DIM, MAX_POSITIONS, MAX_VOCAB_SIZE, CheckpointError, config_int,
                                               num_hidden_layers, num_mtp_layers, read_json)
from jetserve.engine.prompts import queued_bytes

DEFAULT_MAX_MODEL_LEN = 4096  # when the model allows more: KV for a longer default rarely fits a Jetson
DEFAULT_CHUNK_BUDGET = 512  # tokens a step with chunked prefill computes at most: measured (bench/results/prefill-h200)
# With a step latency target, chunks are sized by predicted time (step_cost.py) under a hard cap of
# DEFAULT_TARGET_BUDGET tokens a step unless max_num_batched_tokens says otherwise. A discrete GPU's
# default target is what `jetserve bench prefill` recommends there: the shortest long-prompt TTFT whose
# streams' ITL p99 stays under 8 ms in every run (bench/results/prefill-h200-targets). A CPU (a step is
# host work) and a Jetson (not measured) keep chunks by budget.
DEFAULT_STEP_LATENCY_MS: float | None = 7.5
DEFAULT_TARGET_BUDGET = 2048
MAX_STEP_LATENCY_MS = 1000.0  # a target beyond a second paces nothing a user would notice
MAX_GRAPH_WARMUP_STEPS = 100  # eager runs before a capture: one or two settle lazy allocations, more delay the start
# Batch-invariant mode (docs/engine.md, "Batch-invariant mode"): on by default where it costs at
# most 5% of decode speed. A GPU's default awaits `jetserve bench mtp --batch-invariant` on it, so
# off until then; on a CPU it costs the compiled decode steps (they reduce in their own order), far
# more than 5%, so off.
DEFAULT_BATCH_INVARIANT_GPU = False
# The mode's products run in blocks of this many rows whatever the row count, on both paths (the
# Triton skinny matmul's program, the CPU's torch call): tl.dot's smallest tile.
INVARIANT_ROWS = 16
FINE_TOKEN_STEP = 128  # mixed-step buckets with a latency target: every flash prefill tile (PREFILL_BLOCK_M)
HAS_TRITON = importlib.util.find_spec("triton") is not None  # the fused CUDA kernels and the graphs need it
# Triton's interpreter runs the kernels on CPU tensors (the tests without a GPU). Read once, at import, as
# Triton itself reads it when it is first imported: a process runs its kernels one way throughout.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclass(frozen=True)
class ModelConfig:
    """The Qwen3 shape; `head_dim` always comes from the config, never hidden/heads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_mtp_layers: int
    dtype: str  # the checkpoint's own dtype name, e.g. "bfloat16"
    architecture: str

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        """Every field checked for its type and range (a config.json may come from anywhere): an
        error names the field, before any shape derived from it is built or allocated."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        if not isinstance(archs, list):
            raise CheckpointError(f"config.json: architectures must be a list of names, got {archs!r}")
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"unknown architecture {archs[0]!r}: jetserve runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise CheckpointError(f"config.json: rope_parameters must be an object, got {rope!r}")
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CheckpointError(f"unsupported RoPE scaling {rope!r}: only default RoPE is implemented")
        if cfg.get("attention_bias"):
            raise CheckpointError("attention_bias=true is not a Qwen3 layout")
        hidden = config_int(cfg, "hidden_size", 1, MAX_MODEL_DIM)
        heads = config_int(cfg, "num_attention_heads", 1, MAX_MODEL_DIM)
        kv_heads = config_int(cfg, "num_key_value_heads", 1, heads, default=heads)
        if heads % kv_heads:
            raise CheckpointError(f"config.json: num_key_value_heads={kv_heads} does not divide "
                                  f"num_attention_heads={heads}")
        if cfg.get("head_dim") is None and hidden % heads:
            raise CheckpointError(f"config.json: no head_dim, and num_attention_heads={heads} does not divide "
                                  f"hidden_size={hidden}")
        tie = cfg.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise CheckpointError(f"config.json: tie_word_embeddings must be true or false, got {tie!r}")
        return cls(
            vocab_size=config_int(cfg, "vocab_size", 1, MAX_VOCAB_SIZE),
            hidden_size=hidden,
            intermediate_size=config_int(cfg, "intermediate_size", 1, MAX_MODEL_DIM),
            num_hidden_layers=num_hidden_layers(cfg),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=config_int(cfg, "head_dim", 1, MAX_MODEL_DIM, default=hidden // heads),
            rms_norm_eps=_config_float(cfg, "rms_norm_eps", 1e-6, 0, 1),
            rope_theta=_config_float(rope if "rope_theta" in rope else cfg, "rope_theta", 1e6, 0, math.inf),
            max_position_embeddings=config_int(cfg, "max_position_embeddings", 1, MAX_POSITIONS, default=32768),
            tie_word_embeddings=tie,
            num_mtp_layers=num_mtp_layers(cfg),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            architecture=archs[0],
        )


def _config_float(cfg: dict, key: str, default: float, low: float, high: float) -> float:
    """config.json's number `key` (`default` when absent or null), finite and in (low, high)."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
        raise CheckpointError(f"config.json: {key} must be a number in ({low:g}, {high:g}), got {value!r}")
    return float(value)


def _json_dict(text):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _int_list(text):
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None


class _IntList(argparse.Action):
    """`--flag 1 2 4` and `--flag 1,2,4` alike (vLLM takes the first form)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [n for value in values for n in value])


def human_int(text) -> int:
    """vLLM's human-readable integers: 4k = 4000, 4K = 4096 (m/M, g/G likewise)."""
    text = str(text).strip()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    try:
        number = float(text[:-1] if scale != 1 else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer like 4096, 4k or 4K, got {text!r}") from None
    if number * scale != int(number * scale):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(number * scale)


# vLLM's dtype names and their torch spellings.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
DTYPES = ("auto", "float32", "float16", "bfloat16", *DTYPE_ALIASES)


MAX_ACCEPTANCE_WINDOW = 2**20
# The default draft vocabulary: the draft vocabulary of EAGLE-3 and FR-Spec for 128k-150k-id
# vocabularies; ranked from the engine's own output it holds nearly all of what a workload emits
# (bench/results/draft-vocab-coverage), at a fifth of a Qwen3 head's reads.
DRAFT_VOCAB_SIZE = 32768


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config` (vLLM's name and keys), plus the draft policy's."""

    method: str = "mtp"
    num_speculative_tokens: int = 1  # the most drafts a step (adaptive), or every step's (not)
    adaptive: bool = True  # each step drafts the k (down to 0) that measured costs favour (draft_policy.py)
    acceptance_window: int = 64  # verifications of a draft position its decayed acceptance estimate spans
    # Draft heads over the N token ids this engine emits most (engine/draft_vocab.py); None: the
    # default, at most DRAFT_VOCAB_SIZE; resolved to an int no larger than the vocabulary.
    draft_vocab_size: int | None = None
    quantization: str = "auto"  # MTP heads: "auto" (as the base), "none" (model dtype) or "int8"

    @classmethod
    def from_dict(cls, config: dict, num_mtp_layers: int, vocab_size: int) -> SpeculativeConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        spec = cls(**config)
        if spec.method != "mtp":
            raise ValueError(f"speculative_config.method must be 'mtp', got {spec.method!r}")
        k = spec.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
        if not isinstance(spec.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {spec.adaptive!r}")
        w = spec.acceptance_window
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= MAX_ACCEPTANCE_WINDOW:
            raise ValueError(f"speculative_config.acceptance_window must be an integer in [1, {MAX_ACCEPTANCE_WINDOW}], "
                             f"got {w!r}")
        n = spec.draft_vocab_size
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"speculative_config.draft_vocab_size must be an integer >= 1 or null, got {n!r}")
        spec = replace(spec, draft_vocab_size=min(n or DRAFT_VOCAB_SIZE, vocab_size))
        if num_mtp_layers == 0:
            raise ValueError("speculative_config: method 'mtp' needs MTP heads, and this checkpoint has none; "
                             "merge shipped heads with `jetserve mtp merge BASE HEADS OUT` or train them with "
                             "`jetserve mtp fit --model BASE --data FILES... --out OUT`")
        return spec


QUANTIZATION_METHODS = ("awq", "gptq", "int8", "int4")  # checkpoint formats, then on-the-fly methods
ON_THE_FLY = {"int8": (8, -1, True), "int4": (4, 128, False)}  # method: bits, group size (-1: per channel), sym
# What a float checkpoint's vocab projection becomes under either method (and a tied embedding with
# it): at batch 1 it is the biggest single read of a small model's step (the 0.6B's INT4 step reads
# more vocab than layers), and 8 bits a channel keep its logits within the other projections'
# rounding, where 4 would not (llama.cpp keeps its output tensor at 6 bits or more for the same reason).
VOCAB_QUANTIZATION = "int8"
DRAFT_QUANTIZATION = ("auto", "none", "int8")  # MTP heads: as the base, kept in the model dtype, or INT8


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight-only quantization, activations stay in the model dtype. A checkpoint's own
    `quantization_config` (AWQ, GPTQ) decides the layout; `quantization="int8"` (vLLM's flag)
    quantizes a float checkpoint's projections per output channel while loading, "int4" per
    group of 128 (round to nearest, with zero points), each with the vocab projection at INT8
    (`vocab`); method "none" quantizes only the MTP heads.
    `draft` says what the MTP heads get."""

    method: str
    bits: int
    group_size: int  # input columns sharing a scale; -1: the whole row (per output channel)
    sym: bool
    zero_offset: int  # added to stored zero points: GPTQ's v1 format stores them minus one
    draft: str = "auto"

    @property
    def on_the_fly(self) -> bool:
        return self.method in ON_THE_FLY

    @property
    def vocab(self) -> str | None:
        """The vocab projection's on-the-fly method, or None: kept in the model dtype (AWQ and GPTQ
        exports keep it so, and method "none" quantizes only the MTP heads)."""
        return VOCAB_QUANTIZATION if self.on_the_fly else None

    @classmethod
    def resolve(cls, checkpoint: dict, requested: str | None, draft: str) -> QuantizationConfig | None:
        """From config.json's `quantization_config` and the user's `quantization`; errors name the field."""
        if draft not in DRAFT_QUANTIZATION:
            raise ValueError(f"speculative_config.quantization must be one of {DRAFT_QUANTIZATION}, got {draft!r}")
        qc = checkpoint.get("quantization_config")
        if requested is not None and requested not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {requested!r}")
        if qc:
            if not isinstance(qc, dict):
                raise CheckpointError(f"config.json: quantization_config must be an object, got {qc!r}")
            method = str(qc.get("quant_method", "")).lower()
            if method not in ("awq", "gptq"):
                raise CheckpointError(f"quantization_config.quant_method {method!r} is not supported "
                                      "(jetserve loads awq and gptq checkpoints)")
            if requested not in (None, method):
                raise ValueError(f"quantization={requested!r}, but the checkpoint is quantized with {method!r}")
            bits, group = qc.get("bits", qc.get("w_bit", 4)), qc.get("group_size", qc.get("q_group_size", 128))
            if isinstance(bits, bool) or not isinstance(bits, int):
                raise CheckpointError(f"quantization_config.bits must be an integer, got {bits!r}")
            whole = isinstance(group, int) and not isinstance(group, bool)
            if not (whole and (group == -1 or 1 <= group <= MAX_MODEL_DIM)):
                raise CheckpointError(f"quantization_config.group_size must be -1 (per channel) or an integer in "
                                      f"[1, {MAX_MODEL_DIM}], got {group!r}")
            if method == "awq":
                version = str(qc.get("version", "gemm")).lower()
                if bits != 4 or version != "gemm":
                    raise CheckpointError(f"AWQ {bits}-bit version {version!r}: jetserve loads 4-bit GEMM-packed AWQ")
                return cls("awq", 4, group, sym=not qc.get("zero_point", True), zero_offset=0, draft=draft)
            if bits not in (4, 8):
                raise CheckpointError(f"GPTQ with {bits} bits: jetserve loads 4 and 8")
            if qc.get("desc_act"):
                raise CheckpointError("GPTQ with desc_act (act-order) is not supported yet: re-export with "
                                      "desc_act=false")
            fmt = str(qc.get("checkpoint_format", "gptq")).lower()  # v1 ("gptq") stores zero points minus one
            return cls("gptq", bits, group, sym=bool(qc.get("sym", True)), zero_offset=int(fmt == "gptq"), draft=draft)
        if requested in ("awq", "gptq"):
            raise ValueError(f"quantization={requested!r}, but config.json has no quantization_config: "
                             "use int8 or int4 to quantize a float checkpoint while loading")
        if requested is None:
            return cls("none", 16, -1, True, 0, draft) if draft == "int8" else None
        bits, group, sym = ON_THE_FLY[requested]
        return cls(requested, bits, group, sym, 0, draft)


@dataclass(frozen=True)
class CUDAGraphConfig:
    """What the runner captures: batch buckets x step shapes, and whole steps of any other shape
    (prefill chunks, alone or beside decodes) bucketed by token count (see cuda_graphs.py)."""

    capture_sizes: tuple[int, ...]
    step_shapes: tuple[tuple[int | None, int], ...]  # (drafts proposed or None: plain decode; tokens a sequence)
    num_warmup: int
    token_sizes: tuple[int, ...] = ()  # mixed-step buckets; empty: those steps run eagerly


CUDAGRAPH_MODES = ("full", "full_decode_only")  # vLLM's cudagraph_mode values that jetserve implements
MAX_QUEUED_BYTES = 64 * 2**30  # half the memory of the largest Jetson (Thor): no queue of one is larger
MAX_GRAPHED_TOKENS = 16384  # bigger steps run eagerly: compute-bound, and their graph would pin much memory


def token_sizes(budget: int, step: int = 512) -> list[int]:
    """Token-count buckets of the mixed-step graphs: powers of two from 16 to 512, then every
    `step`, and the step budget itself, up to MAX_GRAPHED_TOKENS (a step pads up to the next
    bucket: at most 2x below 512 tokens, where a step is launch-bound, and at most `step` tokens
    above). With a latency target the scheduler rounds steps to buckets, so there they are fine
    (FINE_TOKEN_STEP): a coarse bucket would leave a step well under the target."""
    limit = min(budget, MAX_GRAPHED_TOKENS)
    sizes = [16, 32, 64, 128, 256, 512, *range(step, limit, step), limit]
    return sorted({s for s in sizes if s <= limit})


@dataclass(frozen=True)
class CPUCompileConfig:
    """What the runner compiles on a CPU: the decode step of these batch buckets, as two programs
    (batch 1, and any batch of 2 or more: see cpu_graphs.py)."""

    capture_sizes: tuple[int, ...]
    cache_dir: str  # jetserve's cache_root(): programs under cpu-steps/, inductor's build files under torchinductor/


def cpu_capture_sizes(sizes: list[int] | None, max_size: int | None, max_num_seqs: int) -> list[int]:
    """CPU batch buckets: the given sizes, or powers of two up to the max, all capped by
    max_num_seqs. A step is padded to its bucket; buckets cost no compile of their own (one
    program serves every batch of 2 or more)."""
    limit = min(max_size or max_num_seqs, max_num_seqs)
    sizes = sizes or [*(2 ** i for i in range(limit.bit_length())), limit]
    return sorted({s for s in sizes if 1 <= s <= limit})


def capture_sizes(sizes: list[int] | None, max_size: int | None, max_num_seqs: int) -> list[int]:
    """Batch buckets: the given sizes, or 1, 2, 4, 8 and every 8 after up to the max (vLLM's
    default), all capped by max_num_seqs."""
    limit = min(max_size or max_num_seqs, max_num_seqs)
    sizes = sizes or [1, 2, 4, *range(8, limit + 1, 8), limit]
    return sorted({s for s in sizes if 1 <= s <= limit})


def step_shapes(num_speculative_tokens: int) -> list[tuple[int | None, int]]:
    """(drafts proposed, or None for a plain decode; tokens verified a sequence) of each step to
    capture: with k drafts at most, a speculative step verifies q = j+1 tokens (j drafts) and
    proposes any number up to k: the draft policy may choose any k after any other (a probe, the
    argmax moving), and a step not captured runs eagerly, many times a graph's replay, and
    compiles kernels the first time (bench/results/mtp-h200-r8). Verifying and proposing nothing is a
    plain decode; proposing 0 after verifying drafts still runs the MTP pass that keeps the MTP
    KV cache filled."""
    k = num_speculative_tokens
    spec = [(out, j + 1) for j in range(k + 1) for out in range(k + 1) if out + j]
    return [(None, 1)] + (spec if k else [])


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, resolved once (see the module docstring). Built by `EngineArgs.resolve()`."""

    model: str
    served_model_name: str
    model_config: ModelConfig
    backend: str
    device: str  # "cpu", "cuda", "cuda:N": never "auto"
    dtype: str  # torch dtype name, e.g. "bfloat16": never "auto"
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int  # the step budget the scheduler spends and the KV plan reserves for
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    block_size: int
    num_kv_blocks: int | None  # None: sized by the runner from memory
    max_waiting: int
    max_queued_bytes: int  # of prompt token ids in the engine (prompts.queued_bytes); admission refuses past it
    seed: int
    async_scheduling: bool
    speculative: SpeculativeConfig | None
    cuda_graphs: CUDAGraphConfig | None  # None: every step eager
    fused_kernels: bool  # the Triton kernels (CUDA with Triton); else plain torch
    has_tokenizer: bool
    engine_core_process: bool  # AsyncLLM runs the step loop in its own process (else in a thread)
    tile_cache_dir: str | None  # where `jetserve tune` keeps timed tile choices; None: off (CPU, eager, 'none')
    quantization: QuantizationConfig | None = None  # weight-only; None: every weight in `dtype`
    cpu_compile: CPUCompileConfig | None = None  # compiled CPU decode steps; None: every CPU step eager
    max_step_latency_ms: float | None = None  # prefill chunks sized to keep a step under it; None: by budget alone
    tune_tiles: bool = False  # time every tile at start-up into tile_cache_dir (`jetserve tune`; never when serving)
    batch_invariant: bool = False  # a row's logits independent of the step's other rows (see EngineArgs)

    @property
    def step_token_sizes(self) -> list[int]:
        """The step sizes a latency-sized chunk rounds a step to (the mixed-step graphs' buckets)."""
        return token_sizes(self.max_num_batched_tokens, FINE_TOKEN_STEP)

    @property
    def num_speculative_tokens(self) -> int:
        """The most draft tokens a step verifies a sequence (the KV lookahead it reserves)."""
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def max_blocks_per_seq(self) -> int:
        """KV blocks one sequence of max_model_len needs, with its draft slots."""
        return -(-(self.max_model_len + self.num_speculative_tokens) // self.block_size)


@dataclass
class EngineArgs:
    """Everything that shapes an engine; the CLI flags and the `[serve]` TOML keys are these fields
    (vLLM's names, with dashes on the command line: jetserve.config.setting)."""

    model: str | None = setting(None, "checkpoint directory (Hugging Face layout)")
    # The name clients and metrics use (default: model).
    served_model_name: str | None = setting(None, "the name the API reports and metrics carry (default: --model); "
                                                  "with several, the first is used", nargs="+")
    backend: str = setting("torch", "torch runs everywhere; tensorrt-llm where NVIDIA ships it",
                           choices=["torch", "tensorrt-llm"])
    dtype: str = setting("auto", "half = float16, float = float32; auto: the checkpoint's dtype on a GPU, float32 on "
                                 "the CPU (bfloat16 with INT4 weights: torch's INT4 kernel takes it)", choices=DTYPES)
    device: str = setting("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    # Default: the model's max_position_embeddings, capped at DEFAULT_MAX_MODEL_LEN.
    max_model_len: int | None = setting(None, "e.g. 4096, 4k or 4K", type=human_int)
    max_num_seqs: int = setting(16, type=int)
    # Default: DEFAULT_CHUNK_BUDGET with chunking (DEFAULT_TARGET_BUDGET with a latency target), max_model_len without.
    max_num_batched_tokens: int | None = setting(None, type=int)
    enable_chunked_prefill: bool = setting(True, action=argparse.BooleanOptionalAction)
    # None: DEFAULT_STEP_LATENCY_MS on a discrete GPU, else off; 0: off.
    max_step_latency_ms: float | None = setting(
        None, "size each prefill chunk so the step's predicted time (a model fitted to the steps observed) stays "
              "under this, so streams decoding beside a long prompt keep their pace (not a vLLM flag); "
              f"--max-num-batched-tokens stays the hard cap (default {DEFAULT_TARGET_BUDGET} with a target). 0: "
              "off, chunks by the token budget alone; default: "
              f"{DEFAULT_STEP_LATENCY_MS:g} on a discrete GPU, off on a CPU or a Jetson", type=float)
    # Reuse the KV of prompt prefixes seen before.
    enable_prefix_caching: bool = setting(True, action=argparse.BooleanOptionalAction)
    gpu_memory_utilization: float = setting(0.9, type=float)
    enforce_eager: bool = setting(False, "never capture CUDA graphs nor compile CPU decode steps", action="store_true")
    # Launch step N+1 before reading step N's tokens; None: on a GPU.
    async_scheduling: bool | None = setting(
        None, "overlap the host's work on one step with the device's on the next (default: on a GPU, where it "
              "hides the host's share of a step; off on a CPU, which does both). With --speculative-config, and "
              "while a request reads tokens or logits on the host (penalties, bad_words, min_tokens, logprobs), "
              "steps run one at a time", action=argparse.BooleanOptionalAction)
    speculative_config: dict | None = setting(None, 'e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'',
                                              type=_json_dict)
    block_size: int = setting(16, type=int)
    # Override the computed KV pool size (tests, tight devices).
    num_kv_blocks: int | None = setting(None, type=int)
    max_waiting: int = setting(256, "bounded queue of requests not yet running", type=int)
    # None: the worst case of the request limits, (max_num_seqs + max_waiting) prompts of max_model_len.
    max_queued_bytes: int | None = setting(
        None, "memory the prompts of the requests in the engine may hold (their token ids: 4 bytes each in "
              "the server and again in each sequence of the engine core), e.g. 256M; a request past it gets "
              "RESOURCE_EXHAUSTED (HTTP 429). Default: what max_num_seqs + max_waiting prompts of max_model_len "
              f"hold, at most {MAX_QUEUED_BYTES // 2**30} GiB (`jetserve plan` shows it)", type=human_int)
    seed: int = setting(0, type=int)
    cudagraph_capture_sizes: list[int] | None = setting(
        None, "batch sizes to capture (on a CPU: to compile), e.g. 1 2 4 8", type=_int_list, nargs="+",
        action=_IntList, aliases=("--cuda-graph-batch-sizes",))
    max_cudagraph_capture_size: int | None = setting(None, type=int, aliases=("--cuda-graph-max-batch-size",))
    cuda_graph_num_warmup_steps: int = setting(
        2, f"eager runs of each step shape before its CUDA graph is captured (0-{MAX_GRAPH_WARMUP_STEPS})", type=int)
    # vLLM's: "full" graphs every step (mixed ones by token count); "full_decode_only".
    cudagraph_mode: str = setting(
        "full", "FULL: every step replays a CUDA graph (steps with prefill chunks bucketed by token count, "
                "non-speculative); FULL_DECODE_ONLY: decode and verify steps only", type=str.lower,
        choices=CUDAGRAPH_MODES)
    # False: in a thread; a process on CPUs too (bench/results/serve-cpu).
    engine_core_process: bool = setting(True, "run the step loop in its own process (default); "
                                              "--no-engine-core-process: in a thread of the server",
                                        action=argparse.BooleanOptionalAction)
    # Weight-only: int8/int4 on the fly; awq/gptq come from the checkpoint.
    quantization: str | None = setting(
        None, "weight-only: int8 (per channel) or int4 (group 128) quantizes a float checkpoint while loading, "
              "its vocab projection (and a tied embedding) int8; AWQ and GPTQ checkpoints are recognised without it",
        choices=QUANTIZATION_METHODS)
    # None: cache_root()/tiles; "none": the shipped table alone.
    tile_cache_dir: str | None = setting(
        None, "where `jetserve tune` keeps the matmul tiles it timed on this GPU and software, read at every start "
              "before the shipped tile table (default: $JETSERVE_CACHE_DIR/tiles, else $XDG_CACHE_HOME/jetserve/tiles, "
              "else ~/.cache/jetserve/tiles); 'none': the shipped table alone")
    # None: DEFAULT_BATCH_INVARIANT_GPU on a GPU, off on a CPU.
    batch_invariant: bool | None = setting(
        None, "batch-invariant mode (vLLM's name): a row's logits do not depend on how many rows its step has nor "
              "which step computes them (every product, attention and norm reduces in one order whatever the row "
              "count), so greedy decoding with MTP drafting gives exactly the tokens of greedy without, and a seeded "
              "request the same tokens alone or in any batch, in bf16 too (not a vLLM flag). Costs speed: on a CPU "
              "decode steps run eagerly; on a GPU steps with prefill chunks are not captured and every product "
              "takes the fused kernel's tensor-core tiles; quantized products keep their own kernels. Default: "
              "off (a GPU's default awaits its measurement)", action=argparse.BooleanOptionalAction)
    tune_tiles: bool = False  # `jetserve tune` sets it: no serving flag times tiles

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                            help="checkpoint directory (Hugging Face layout); the same as --model")
        add_flags(parser, EngineArgs, "engine (vLLM's flags)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        tag = getattr(args, "model_tag", None)
        if tag:
            if values.get("model") and values["model"] != tag:
                raise ValueError(f"MODEL {tag!r} and --model {values['model']!r} disagree: give one")
            values["model"] = tag
        if isinstance(values.get("served_model_name"), list):
            values["served_model_name"] = values["served_model_name"][0]
        return cls(**values)

    def check(self) -> EngineArgs:
        """The checks that need neither the checkpoint nor torch, so a front end makes them before
        it starts anything (the service before its listeners); errors name the field."""
        if not self.model:
            raise ValueError("model must name a checkpoint directory")
        for name in ("max_num_seqs", "block_size", "max_waiting"):
            _positive(name, getattr(self, name))
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "max_cudagraph_capture_size"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for size in self.cudagraph_capture_sizes or ():  # a 0 would leave no bucket to pad a step to
            _positive("each of cudagraph_capture_sizes", size)
        warmups = self.cuda_graph_num_warmup_steps
        if isinstance(warmups, bool) or not isinstance(warmups, int) or not 0 <= warmups <= MAX_GRAPH_WARMUP_STEPS:
            raise ValueError(f"cuda_graph_num_warmup_steps must be an integer in [0, {MAX_GRAPH_WARMUP_STEPS}], "
                             f"got {warmups!r}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        if self.backend not in ("torch", "tensorrt-llm"):
            raise ValueError(f"backend must be 'torch' or 'tensorrt-llm', got {self.backend!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        return self

    def resolve(self, device: str | None = None) -> EngineConfig:
        """Check every field and apply every default, once; errors name the field. `device`:
        resolve for that device without asking torch (the memory plan of another board)."""
        self.check()
        model = demo_model_dir() if self.model == DEMO_MODEL and not Path(self.model).is_dir() else str(self.model)
        hf_config = read_json(Path(model) / "config.json")
        model_config = ModelConfig.from_dict(hf_config)
        limit = model_config.max_position_embeddings
        if self.max_model_len and self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        max_model_len = self.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        device = device or self._device()
        target = self._step_latency(device)
        budget = self.max_num_batched_tokens or (
            (DEFAULT_TARGET_BUDGET if target else DEFAULT_CHUNK_BUDGET) if self.enable_chunked_prefill
            else max_model_len)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens={budget} is below max_model_len={max_model_len}: "
                             "without chunked prefill a whole prompt must fit in one step")
        queue = self._queued_bytes(max_model_len)
        spec = (SpeculativeConfig.from_dict(self.speculative_config, model_config.num_mtp_layers,
                                            model_config.vocab_size)
                if self.speculative_config else None)
        quantization = QuantizationConfig.resolve(
            hf_config, self.quantization, (self.speculative_config or {}).get("quantization", "auto"))
        fused = self.backend == "torch" and device.startswith("cuda") and HAS_TRITON
        invariant = self._batch_invariant(fused)
        graphs = None
        if not self.enforce_eager and (fused or self.backend == "tensorrt-llm"):
            k = spec.num_speculative_tokens if spec else 0
            # Steps with prefill chunks replay bucketed graphs; with drafting, those whose sequences
            # verify no drafts (their graph keeps every row's hidden state for the MTP pass after it).
            # Batch-invariant: their attention runs per token (kernels.paged_attention), which no graph captures.
            mixed = self.cudagraph_mode == "full" and self.backend == "torch" and not invariant
            graphs = CUDAGraphConfig(
                tuple(capture_sizes(self.cudagraph_capture_sizes, self.max_cudagraph_capture_size, self.max_num_seqs)),
                tuple(step_shapes(k)), self.cuda_graph_num_warmup_steps,
                tuple(token_sizes(budget, FINE_TOKEN_STEP if target else 512)) if mixed else ())
        cpu_compile = None
        # TORCH_COMPILE_DISABLE=1 is torch's own switch for torch.compile (the test suite sets it).
        compile_disabled = os.environ.get("TORCH_COMPILE_DISABLE") == "1"
        if (device == "cpu" and self.backend == "torch" and not self.enforce_eager and not compile_disabled
                and quantization is None and not invariant):  # with drafting, its plain decode steps (drafting off) run compiled
            # (not batch-invariant: a compiled program reduces in its own order, not the eager step's)
            cpu_compile = CPUCompileConfig(
                tuple(cpu_capture_sizes(self.cudagraph_capture_sizes, self.max_cudagraph_capture_size,
                                        self.max_num_seqs)),
                str(private_cache_root()))
        tile_cache_dir = None
        if graphs and fused and (self.tile_cache_dir or "").lower() != "none":
            tile_cache_dir = self.tile_cache_dir or str(private_cache_root() / "tiles")
        return EngineConfig(
            model=model, served_model_name=self.served_model_name or str(self.model),  # as given: "demo", not its path
            model_config=model_config, backend=self.backend, device=device,
            dtype=self._dtype(model_config, device, quantization), max_model_len=max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget, enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching, gpu_memory_utilization=self.gpu_memory_utilization,
            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks, max_waiting=self.max_waiting,
            max_queued_bytes=queue,
            seed=self.seed, speculative=spec, cuda_graphs=graphs,
            async_scheduling=device.startswith("cuda") if self.async_scheduling is None else self.async_scheduling,
            fused_kernels=fused, has_tokenizer=(Path(model) / "tokenizer.json").exists(),
            engine_core_process=self.engine_core_process, tile_cache_dir=tile_cache_dir,
            quantization=quantization, cpu_compile=cpu_compile, max_step_latency_ms=target,
            tune_tiles=self.tune_tiles and graphs is not None and fused, batch_invariant=invariant)

    def _batch_invariant(self, fused: bool) -> bool:
        """The mode, resolved: the torch backend's (TensorRT-LLM's kernels are its own)."""
        value = self.batch_invariant
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"batch_invariant must be true, false or null (default), got {value!r}")
        if value and self.backend != "torch":
            raise ValueError("batch_invariant is the torch backend's mode: TensorRT-LLM's kernels reduce in their "
                             "own order")
        if value is None:
            return self.backend == "torch" and fused and DEFAULT_BATCH_INVARIANT_GPU
        return value

    def _queued_bytes(self, max_model_len: int) -> int:
        """The byte budget of the prompts in the engine: by default what its request limits allow
        at worst (each request one completion of a prompt of max_model_len), so that the memory
        plan, which counts it, holds whatever the queue can hold."""
        if self.max_queued_bytes is None:
            worst = queued_bytes(max_model_len, 1) * (self.max_num_seqs + self.max_waiting)
            return min(worst, MAX_QUEUED_BYTES)
        value = self.max_queued_bytes
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_QUEUED_BYTES:
            raise ValueError(f"max_queued_bytes must be an integer in [1, {MAX_QUEUED_BYTES}] "
                             f"({MAX_QUEUED_BYTES // 2**30} GiB), got {value!r}")
        return value

    def _step_latency(self, device: str) -> float | None:
        """The step latency target, or None: off (0), or by default where it was not measured —
        on a CPU (a step is host work that a bigger chunk does not amortize) and on an integrated
        GPU (a Jetson's decode step alone is near the H200's target)."""
        value = self.max_step_latency_ms
        if value is None:
            on = DEFAULT_STEP_LATENCY_MS and self.enable_chunked_prefill and self.backend == "torch"
            return DEFAULT_STEP_LATENCY_MS if on and _discrete_gpu(device) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_STEP_LATENCY_MS:
            raise ValueError(f"max_step_latency_ms must be a number in [0, {MAX_STEP_LATENCY_MS:g}] (0: off), "
                             f"got {value!r}")
        if value and not (self.enable_chunked_prefill and self.backend == "torch"):
            raise ValueError("max_step_latency_ms sizes prefill chunks in the torch backend's scheduler: "
                             "it needs enable_chunked_prefill and backend 'torch'")
        return float(value) or None

    def _device(self) -> str:
        return "cuda" if self.backend == "tensorrt-llm" else resolve_device(self.device)

    def _dtype(self, model_config: ModelConfig, device: str, quantization: QuantizationConfig | None) -> str:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.dtype != "auto":
            return DTYPE_ALIASES.get(self.dtype, self.dtype)
        # CPUs rarely do half precision fast; GPUs run the checkpoint's own dtype. INT4 and INT8
        # weights on a CPU are the exception: torch's kernels there (model/int4pack.py, int8pack.py)
        # take bf16 activations, and their fp32 paths are many times slower.
        if device == "cpu":
            return "bfloat16" if quantization and (quantization.bits == 4 or quantization.vocab) else "float32"
        return model_config.dtype


def cache_root() -> Path:
    """jetserve's own caches: $JETSERVE_CACHE_DIR, else $XDG_CACHE_HOME/jetserve, else
    ~/.cache/jetserve (the systemd unit points it at its CacheDirectory=)."""
    if os.environ.get("JETSERVE_CACHE_DIR"):
        return Path(os.environ["JETSERVE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jetserve"


def private_cache_root() -> Path:
    """`cache_root()` where it is this user's alone, made (mode 0700) if missing. The caches hold
    native code this process loads and runs (compiled CPU programs, inductor's build files), so
    a directory another user owns or may write (a shared JETSERVE_CACHE_DIR, a planted one under
    /tmp) is not used: a warning names it and why, and this process caches in a private temporary
    directory of its own instead, removed at exit (it compiles again on its next start)."""
    return _private(cache_root())


@functools.cache
def _private(root: Path) -> Path:
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = _not_private(root)
    except OSError as exc:
        why = f"it cannot be made ({exc.strerror or exc})"
    if why is None:
        return root
    own = Path(tempfile.mkdtemp(prefix="jetserve-cache-"))
    atexit.register(shutil.rmtree, own, ignore_errors=True)
    logging.getLogger(__name__).warning("cache directory %s is not used: %s; caching in %s for this run", root,
                                        why, own)
    return own


def _not_private(path: Path) -> str | None:
    """Why another user could put files in `path` (a directory), or None: owned by someone else,
    writable by group or others, or inside a directory others may write that is not sticky."""
    info = path.stat()
    if info.st_uid != os.getuid():
        return f"it is owned by uid {info.st_uid}, not this user ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group or others may write it (mode {stat.S_IMODE(info.st_mode):o})"
    parent = path.resolve().parent.stat()
    if parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not parent.st_mode & stat.S_ISVTX:
        return "others may write the directory it is in, and replace it"
    return None


def resolve_device(name: str) -> str:
    """"auto" → "cuda" when torch sees a GPU, else "cpu"; other names are checked."""
    import torch  # only here: the CLI and the config file need no torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU")
    return str(device)


def _discrete_gpu(device: str) -> bool:
    import torch

    return (device.startswith("cuda") and torch.cuda.is_available()
            and not torch.cuda.get_device_properties(torch.device(device)).is_integrated)


# Every count and size above is bounded: past int32 it would overflow the kernels' indexing, and
# a memory plan for 2^70 sequences reads as nonsense rather than as a refusal.
MAX_SIZE = 2**31 - 1


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
        raise ValueError(f"{name} must be an integer in [1, {MAX_SIZE}], got {value!r}")
