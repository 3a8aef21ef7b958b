"""Load a Qwen3 (+MTP) checkpoint into `Qwen3ForCausalLM`, checking every tensor.

The checkpoint's names map onto our fused parameters: q|k|v → qkv_proj, gate|up → gate_up_proj;
`mtp.*` (Qwen3-Next) or `model.layers.{N+j}.{enorm,hnorm,eh_proj,shared_head.norm}` (DeepSeek)
→ `mtp[j]`. A tensor that is missing or has the wrong shape is an error that names it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from jetserve.engine.model.checkpoint import Checkpoint, CheckpointError
from jetserve.engine.config import ModelConfig
from jetserve.engine.model.qwen3 import Qwen3ForCausalLM, RotaryEmbedding

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.replace("torch.", "")]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} (or auto), got {name!r}") from None


def _block_sources(prefix: str) -> dict[str, list[str]]:
    """Our decoder-block parameter → the checkpoint tensors it is made of (concatenated)."""
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
    return {
        "input_layernorm.weight": [f"{prefix}.input_layernorm.weight"],
        "post_attention_layernorm.weight": [f"{prefix}.post_attention_layernorm.weight"],
        "self_attn.qkv_proj.weight": [f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"],
        "self_attn.o_proj.weight": [f"{attn}.o_proj.weight"],
        "self_attn.q_norm.weight": [f"{attn}.q_norm.weight"],
        "self_attn.k_norm.weight": [f"{attn}.k_norm.weight"],
        "mlp.gate_up_proj.weight": [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
        "mlp.down_proj.weight": [f"{mlp}.down_proj.weight"],
    }


def _mtp_sources(ckpt: Checkpoint, cfg: ModelConfig, j: int) -> dict[str, list[str]]:
    deepseek = f"model.layers.{cfg.num_hidden_layers + j}"
    if f"{deepseek}.eh_proj.weight" in ckpt:
        head = {"fc.weight": "eh_proj", "pre_fc_norm_embedding.weight": "enorm",
                "pre_fc_norm_hidden.weight": "hnorm", "norm.weight": "shared_head.norm"}
        sources = {ours: [f"{deepseek}.{theirs}.weight"] for ours, theirs in head.items()}
        block = deepseek
    else:
        # Qwen3-Next: one fc and norm pair shared by every MTP layer.
        sources = {name: [f"mtp.{name}"] for name in
                   ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")}
        block = f"mtp.layers.{j}"
    sources.update({f"block.{k}": v for k, v in _block_sources(block).items()})
    return sources


def parameter_sources(ckpt: Checkpoint, cfg: ModelConfig) -> dict[str, list[str]]:
    sources = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        sources.update({f"layers.{i}.{k}": v for k, v in _block_sources(f"model.layers.{i}").items()})
    for j in range(cfg.num_mtp_layers):
        sources.update({f"mtp.{j}.{k}": v for k, v in _mtp_sources(ckpt, cfg, j).items()})
    return sources


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, max_positions: int,
               progress: Callable[[str], None] | None = None) -> Qwen3ForCausalLM:
    ckpt = Checkpoint(model_dir)
    cfg = ModelConfig.from_dict(ckpt.config)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, max_positions).to(dtype)
    sources = parameter_sources(ckpt, cfg)
    _check(ckpt, cfg, dict(model.named_parameters()), sources)

    model = model.to_empty(device=device)
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions).to(device)  # fp32 tables
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, (name, names) in enumerate(tqdm(sources.items(), desc="loading weights", unit="tensor",
                                               leave=False, disable=progress is None)):
            tensor = torch.cat([ckpt.get(s) for s in names]) if len(names) > 1 else ckpt.get(names[0])
            params[name].copy_(tensor)
            if progress and n % 16 == 0:
                progress(f"loading weights {n + 1}/{len(sources)}")
    return model.eval()


def _check(ckpt: Checkpoint, cfg: ModelConfig, params: dict, sources: dict[str, list[str]]) -> None:
    """Every parameter is covered, by tensors of the right shapes; say which one is not."""
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, names in sources.items():
        shape = tuple(params[name].shape)
        if name.endswith("qkv_proj.weight"):
            expected = [(q_rows, shape[1]), (kv_rows, shape[1]), (kv_rows, shape[1])]
        elif name.endswith("gate_up_proj.weight"):
            expected = [(shape[0] // 2, shape[1])] * 2
        else:
            expected = [shape]
        for source, want in zip(names, expected):
            if source not in ckpt:
                raise CheckpointError(f"{ckpt.dir}: tensor {source!r} is missing")
            found = ckpt.shape(source)
            if found != want:
                raise CheckpointError(f"{ckpt.dir}: tensor {source!r} has shape {list(found)}, "
                                      f"expected {list(want)}")
    missing = set(params) - set(sources)
    if missing:
        raise CheckpointError(f"no checkpoint tensor maps to {sorted(missing)}")
