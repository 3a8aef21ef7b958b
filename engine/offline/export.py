"""Our fused modules → Hugging Face tensor names: the loader's mapping, run backwards.

`mtp fit` writes trained heads (Qwen3-Next `mtp.*` naming) and the demo script writes its base
model through here, so every checkpoint jetserve writes loads in transformers and in jetserve.
"""

from __future__ import annotations

import torch
from torch import nn

from jetserve.engine.model.loader import block_sources


def _block_tensors(block: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    params = dict(block.named_parameters())
    attn = block.self_attn
    splits = {"self_attn.qkv_proj.weight": [attn.q_size, attn.kv_size, attn.kv_size],
              "mlp.gate_up_proj.weight": None}
    out = {}
    for ours, theirs in block_sources(prefix).items():
        tensor = params[ours].detach()
        if len(theirs) == 1:
            out[theirs[0]] = tensor
            continue
        parts = tensor.split(splits[ours]) if splits[ours] else tensor.chunk(len(theirs))
        out.update(zip(theirs, parts))
    return out


def mtp_tensors(layers: nn.ModuleList) -> dict[str, torch.Tensor]:
    """MTP layers in Qwen3-Next naming (one fc and norm set, shared: taken from layer 0)."""
    first = layers[0]
    out = {f"mtp.{name}": getattr(first, name.split(".")[0]).weight.detach()
           for name in ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")}
    for j, layer in enumerate(layers):
        out.update(_block_tensors(layer.block, f"mtp.layers.{j}"))
    return out


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A whole Qwen3ForCausalLM (its MTP layers included) in Hugging Face naming."""
    out = {"model.embed_tokens.weight": model.embed_tokens.weight.detach(),
           "model.norm.weight": model.norm.weight.detach()}
    if not model.config.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight.detach()
    for i, layer in enumerate(model.layers):
        out.update(_block_tensors(layer, f"model.layers.{i}"))
    if len(model.mtp):
        out.update(mtp_tensors(model.mtp))
    return {name: t.contiguous() for name, t in out.items()}
