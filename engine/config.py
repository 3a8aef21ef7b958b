"""Engine configuration: the model's shape (from config.json) and the engine's knobs (vLLM's names)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields

from jetserve.engine.model.checkpoint import CheckpointError, num_mtp_layers

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
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"unknown architecture {archs[0]!r}: jetserve runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CheckpointError(f"unsupported RoPE scaling {rope!r}: only default RoPE is implemented")
        if cfg.get("attention_bias"):
            raise CheckpointError("attention_bias=true is not a Qwen3 layout")
        try:
            heads = cfg["num_attention_heads"]
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1e6)),
                max_position_embeddings=cfg.get("max_position_embeddings", 32768),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                num_mtp_layers=num_mtp_layers(cfg),
                dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
                architecture=archs[0],
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks {exc.args[0]!r}") from None


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


@dataclass
class EngineArgs:
    """Everything that shapes an engine; the CLI flags are these fields with dashes (vLLM's names)."""

    model: str | None = None
    backend: str = "torch"  # or "tensorrt-llm", where TensorRT-LLM is installed
    dtype: str = "auto"  # auto: the checkpoint's dtype on a GPU, float32 on the CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # default: 512 with chunking, max_model_len without
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # reuse the KV of prompt prefixes seen before
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    async_scheduling: bool = False  # launch step N+1 before reading step N's tokens
    speculative_config: dict | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # override the computed KV pool size (tests, tight devices)
    max_waiting: int = 256  # bounded queue of not-yet-running requests
    seed: int = 0
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    cuda_graph_num_warmup_steps: int = 2  # eager runs of each step shape before it is captured

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        g = parser.add_argument_group("engine (vLLM's flags)")
        g.add_argument("--model", default=d.model, help="checkpoint directory (Hugging Face layout)")
        g.add_argument("--backend", default=d.backend, choices=["torch", "tensorrt-llm"],
                       help="torch runs everywhere; tensorrt-llm where NVIDIA ships it")
        g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"])
        g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
        g.add_argument("--max-model-len", type=int, default=d.max_model_len)
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=d.enable_chunked_prefill)
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching)
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                       help="never capture CUDA graphs")
        g.add_argument("--async-scheduling", action="store_true", default=d.async_scheduling,
                       help="overlap the host's work on one step with the device's on the next "
                            "(not with --speculative-config)")
        g.add_argument("--speculative-config", type=_json_dict, default=d.speculative_config,
                       help='e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'')
        g.add_argument("--block-size", type=int, default=d.block_size)
        g.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
        g.add_argument("--max-waiting", type=int, default=d.max_waiting)
        g.add_argument("--seed", type=int, default=d.seed)
        g.add_argument("--cudagraph-capture-sizes", "--cuda-graph-batch-sizes", type=_int_list,
                       default=d.cudagraph_capture_sizes, dest="cudagraph_capture_sizes")
        g.add_argument("--max-cudagraph-capture-size", "--cuda-graph-max-batch-size", type=int,
                       default=d.max_cudagraph_capture_size, dest="max_cudagraph_capture_size")
        g.add_argument("--cuda-graph-num-warmup-steps", type=int, default=d.cuda_graph_num_warmup_steps,
                       help="eager runs of each step shape before its CUDA graph is captured")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
