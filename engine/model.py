"""Qwen3 dense decoder with its MTP (multi-token prediction) layers, over a paged KV cache.

Numerics follow transformers' Qwen3 exactly where it decides logits: RMSNorm in fp32 then
cast, q/k RMSNorm per head before RoPE, NeoX RoPE with cos/sin computed in fp32, head_dim from
the config. Projections are fused (q|k|v, gate|up) so a step launches fewer kernels; the loader
concatenates the checkpoint's separate tensors into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jetserve.engine.attention import AttentionMetadata, paged_attention
from jetserve.engine.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in fp32 like transformers does per call."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(nn.Module):
    """One multi-token-prediction layer: from the hidden state at t and the embedding of token
    t+1 it predicts token t+2. DeepSeek checkpoints name these enorm/hnorm/eh_proj/shared_head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_fc_norm_embedding = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds, hidden, rope, kv_cache, meta):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.block(x, rope, kv_cache, meta))


class Qwen3ForCausalLM(nn.Module):
    """`forward` returns final-normed hidden states for every new token; `compute_logits` turns
    only the rows that need sampling into logits (the vocab projection is the biggest GEMM)."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.num_mtp_layers))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions)

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep a KV cache: the main stack, then one per MTP layer."""
        return len(self.layers) + len(self.mtp)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)

    def mtp_forward(self, step: int, input_ids, positions, hidden, kv_caches, meta: AttentionMetadata):
        """Draft step `step`: MTP layer step % n, fed token t+1 and the hidden state at t."""
        index = step % len(self.mtp)
        embeds = self.embed_tokens(input_ids)
        rope = self.rotary(positions, embeds.dtype)
        return self.mtp[index](embeds, hidden, rope, kv_caches[len(self.layers) + index], meta)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)
