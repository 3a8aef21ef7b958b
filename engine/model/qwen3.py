"""Qwen3 dense decoder with its MTP (multi-token prediction) layers, over a paged KV cache.

Numerics follow transformers' Qwen3 exactly where it decides logits: RMSNorm in fp32 then
cast, q/k RMSNorm per head before RoPE, NeoX RoPE with cos/sin computed in fp32, head_dim from
the config. Projections are fused (q|k|v, gate|up) so a step launches fewer kernels; the loader
concatenates the checkpoint's separate tensors into them. On CUDA the elementwise chains run as
Triton kernels (model/kernels.py, handed in by the runner as `FusedKernels`), and a step of a few
rows (decode, verify) is five kernels a layer: residual add + RMSNorm + qkv projection; q/k norm
+ RoPE + KV store + paged attention (then a kernel combining its context splits, where it splits
them); o projection; residual add + RMSNorm + gate|up projection; SiLU·up + down projection. The
CPU path is plain torch and exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jetserve.engine.config import INVARIANT_ROWS, TRITON_INTERPRET, ModelConfig
from jetserve.engine.model.attention import AttentionMetadata, FreshQKV, causal_attention, paged_attention


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a speculative step's own Triton kernels (spec_kernels.py) take x: CUDA tensors, or
    CPU ones under Triton's interpreter (tests); not the compiled CPU steps' kernels."""
    return x.is_cuda or TRITON_INTERPRET


class KernelUser(nn.Module):
    """A module that takes the fused kernels when the model was given them (`use_kernels`)."""

    kernels = None  # FusedKernels, or None: plain torch

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether x takes the Triton kernels: on CUDA, and not training (they have no backward)."""
        return self.kernels is not None and self.kernels.runs_on(x) and not torch.is_grad_enabled()

    def skinny(self, x: torch.Tensor) -> bool:
        """Whether x is a few rows (a decode or verify step), where each product streams its
        weight once through a fused Triton kernel."""
        return self._fused(x) and x.dim() == 2 and x.shape[0] <= self.kernels.SKINNY_MAX_ROWS


class RMSNorm(KernelUser):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual): the add fused in."""
        if self._fused(x):
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dtype)
        return y if residual is None else (y, x)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with a row's bits independent of the other rows and of their count. torch's
    CPU matmul picks its kernel by the row count (on AMX CPUs a one-row bf16 product rounds
    differently from the same row among many), so every call here is one block of
    INVARIANT_ROWS rows, the last padded with zeros: each row meets the same kernel."""
    rows = x.reshape(-1, x.shape[-1])
    pad = -rows.shape[0] % INVARIANT_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.cat([F.linear(block, weight) for block in rows.split(INVARIANT_ROWS)])
    return out[:out.shape[0] - pad].reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear, KernelUser):
    """nn.Linear without bias; a few rows on CUDA take the skinny Triton matmul."""

    invariant = False  # batch-invariant mode on the torch path (Qwen3ForCausalLM.set_batch_invariant)

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight) if self.skinny(x) else self.product(x, self.weight)

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T on the torch path (the weight, or rows of it: a draft vocabulary)."""
        return invariant_linear(x, weight) if self.invariant else F.linear(x, weight)


def norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None):
    """(linear(norm(x + residual)), x + residual); no residual: (linear(norm(x)), x). One kernel
    for a few rows on CUDA."""
    if linear.skinny(x):
        return linear.kernels.norm_linear(x, residual, norm.weight, norm.eps, linear.weight)
    if residual is None:
        return linear(norm(x)), x
    y, residual = norm(x, residual)
    return linear(y), residual


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in fp32 like transformers does per call."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        if torch.get_default_device().type == "meta":
            # The memory plan's model: tables of the right size, no arithmetic (torch's meta
            # kernels for it import its whole compiler stack, the longest wait of a start).
            emb = torch.empty(max_positions, head_dim)
            self.register_buffer("cos", emb, persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        else:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)
        self._cast: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        cos, sin = self.tables(dtype)
        return cos[positions][:, None, :], sin[positions][:, None, :]

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables cast to `dtype` once (the rows transformers casts per call, rounded alike):
        a step gathers its rows in two launches, not four."""
        if self._cast is None or self._cast[0].dtype != dtype or self._cast[0].device != self.cos.device:
            self._cast = self.cos.to(dtype), self.sin.to(dtype)
        return self._cast


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


class Attention(KernelUser):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.invariant = False  # batch-invariant attention on the CPU path (Qwen3ForCausalLM.set_batch_invariant)

    def forward(self, qkv, rope, kv_cache, meta: AttentionMetadata):
        """From the qkv projection of the normed input (the layer makes it, so that the norm fuses
        into the projection)."""
        if meta is not None and meta.block_tables is not None:  # CUDA: fused kernels
            kernels = self.kernels
            fresh = FreshQKV(qkv, self.q_norm.weight, self.k_norm.weight, *rope, meta.slot_mapping, self.q_norm.eps)
            if meta.prefill is None and meta.token_rows is None and kernels.attention_from_qkv:  # decode, verify
                out = kernels.paged_attention(None, kv_cache[0], kv_cache[1], meta.block_tables, meta.context_lens,
                                              meta.q_len, meta.block_size, self.scale, fresh=fresh)
                return self.o_proj(out.flatten(1))
            q = kernels.qk_norm_rope_store(*fresh[:-1], kv_cache[0], kv_cache[1], fresh.eps, self.num_heads,
                                           self.num_kv_heads, self.head_dim)
            out = None
            if meta.prefill is not None:  # prefill chunks, alone or with decodes (those are token_rows)
                out = kernels.prefill_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.query_start_loc,
                                                meta.context_lens, meta.prefill, self.scale, meta.block_size)
            if meta.prefill is None or meta.token_rows is not None:
                out = kernels.paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.context_lens,
                                              meta.q_len, meta.block_size, self.scale, token_rows=meta.token_rows,
                                              out=out)
            return self.o_proj(out.flatten(1))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if meta is None:  # training: x is [B, L, hidden], whole rows, no cache
            rows = qkv.shape[:-1]
            out = causal_attention(q.unflatten(0, rows), k.unflatten(0, rows), v.unflatten(0, rows), self.scale)
        else:
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.invariant)
        return self.o_proj(out.flatten(-2))


class MLP(KernelUser):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, gate_up):
        """From the gate|up projection of the normed input (made by the layer, like qkv)."""
        if self.skinny(gate_up):
            return self.kernels.silu_linear(gate_up, self.down_proj.weight)
        if self._fused(gate_up):
            return self.down_proj(self.kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, rope, kv_cache, meta):
        """Returns (this layer's MLP output, the residual stream before it): the next norm adds
        them, so each residual add rides along with a norm (and with the projection after it)."""
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        x = self.self_attn(qkv, rope, kv_cache, meta)
        gate_up, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, x, residual)
        return self.mlp(gate_up), residual


class MTPLayer(nn.Module):
    """One multi-token-prediction layer: from the hidden state at t and the embedding of token
    t+1 it predicts token t+2. DeepSeek checkpoints name these enorm/hnorm/eh_proj/shared_head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_fc_norm_embedding = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.block = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds, hidden, rope, kv_cache, meta):
        return self.norm(*self.layer(self.inputs(embeds, hidden), rope, kv_cache, meta))[0]

    def inputs(self, embeds, hidden):
        """The fc's input: the normed embedding beside the normed hidden state."""
        return torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)

    def layer(self, inputs, rope, kv_cache, meta):
        """(x, residual) from the fc's input, before the final norm (the draft head fuses it)."""
        return self.block(self.fc(inputs), None, rope, kv_cache, meta)


def _tensors(weight) -> list[torch.Tensor]:
    """A weight's tensors, each with a row an output row: a float weight itself, or a quantized
    one's (quant.QuantizedWeight, int8pack.Int8PackedWeight)."""
    if isinstance(weight, torch.Tensor):
        return [weight]
    return [t for t in weight if isinstance(t, torch.Tensor)]


def _map_rows(weight, fn):
    """`fn` applied to each of a weight's tensors (see _tensors), the same kind of weight back."""
    if isinstance(weight, torch.Tensor):
        return fn(weight)
    return weight._replace(**{name: fn(t) for name, t in zip(weight._fields, weight) if isinstance(t, torch.Tensor)})


class Qwen3ForCausalLM(nn.Module):
    """`forward` returns final-normed hidden states for every new token; `compute_logits` turns
    only the rows that need sampling into logits (the vocab projection is the biggest GEMM)."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        # No random init: the weights come from the checkpoint (or a trainer's own init), and
        # normal_ on the meta device (the memory plan's model) imports torch's compiler stack.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.num_mtp_layers))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions)
        # The draft vocabulary (see draft_tokens): its rows of the vocab projection, gathered, and
        # the token id of each; None: the whole vocabulary, the projection itself.
        self._draft_rows: torch.Tensor | None = None
        self.draft_ids: torch.Tensor | None = None

    def use_kernels(self, kernels) -> None:
        """Run on these fused kernels (a `FusedKernels`), or on plain torch (None)."""
        for module in self.modules():
            if isinstance(module, KernelUser):
                module.kernels = kernels

    def set_batch_invariant(self, on: bool) -> None:
        """Batch-invariant mode on the plain torch path: attention row by row (attention.py's
        `invariant_attention`), products in fixed blocks of rows (`invariant_linear`); the norms
        reduce each row alone. The fused kernels take the mode from `FusedKernels`."""
        for module in self.modules():
            if isinstance(module, (Attention, Linear)):
                module.invariant = on

    def use_draft_vocabulary(self, size: int) -> None:
        """Draft heads over `size` rows of the vocabulary projection, gathered into a buffer of
        their own (graphs keep its address): the first `size` ids until `rank_draft_vocabulary`
        names others. The whole vocabulary: the projection itself."""
        if size >= self.config.vocab_size:
            self._draft_rows = self.draft_ids = None
            return
        weight = self.lm_head.weight
        self.draft_ids = torch.arange(size, device=_tensors(weight)[0].device)
        self._draft_rows = _map_rows(weight, lambda t: t[:size].detach().clone())

    @property
    def draft_head(self) -> torch.Tensor:
        """The weight the draft heads project with: [draft vocabulary, hidden]."""
        return self.lm_head.weight if self._draft_rows is None else self._draft_rows

    def rank_draft_vocabulary(self, ids: torch.Tensor) -> None:
        """Make `ids` (as many as the draft vocabulary holds, ascending) the draft heads' rows:
        written in place, in stream order, so a step in flight drafts from the old rows or the new."""
        with torch.no_grad():
            self.draft_ids.copy_(ids, non_blocking=True)
            for source, rows in zip(_tensors(self.lm_head.weight), _tensors(self._draft_rows)):
                torch.index_select(source, 0, self.draft_ids, out=rows)

    def draft_token_ids(self, argmax: torch.Tensor) -> torch.Tensor:
        """Token ids of draft-head rows (their logits' argmax)."""
        return argmax if self.draft_ids is None else self.draft_ids[argmax]

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the model's, whatever its projections are stored in)."""
        return self.norm.weight.dtype

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep a KV cache: the main stack, then one per MTP layer."""
        return len(self.layers) + len(self.mtp)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, rope=None):
        """`rope`: the positions' (cos, sin), when the caller already has them (a speculative step
        shares them with its MTP pass)."""
        x = self.embed_tokens(input_ids)
        rope = rope or self.rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.norm(x, residual)[0]

    def mtp_forward(self, step: int, input_ids, positions, hidden, kv_caches, meta: AttentionMetadata):
        """Draft step `step`: MTP layer step % n, fed token t+1 and the hidden state at t."""
        index = step % len(self.mtp)
        embeds = self.embed_tokens(input_ids)
        rope = self.rotary(positions, embeds.dtype)
        return self.mtp[index](embeds, hidden, rope, kv_caches[len(self.layers) + index], meta)

    def draft_input(self, step: int, tokens, hidden, hidden_norm: RMSNorm | None = None, tokens_out=None):
        """MTP layer step % n's fc input [rows, 2H] for a speculative step: its normed embedding of
        the tokens beside its normed hidden state. `tokens`: ids [rows], or draft logits
        [rows, draft vocab] whose argmax is the token (then also written into `tokens_out`);
        `hidden_norm`: `hidden` is the previous MTP layer's output before its final norm (x +
        residual), normed here. One kernel on CUDA (spec_kernels.draft_input)."""
        layer = self.mtp[step % len(self.mtp)]
        table = self.embed_tokens.weight  # float, or quant.py's layout: the kernel reads both (not a CPU's INT8 one)
        if layer.fc.skinny(hidden) and runs_triton(hidden) and (isinstance(table, torch.Tensor) or hasattr(table, "qweight")):
            from jetserve.engine.model.spec_kernels import draft_input  # needs Triton

            return draft_input(tokens, hidden, table, layer.pre_fc_norm_embedding,
                               layer.pre_fc_norm_hidden, hidden_norm, tokens_out, self.draft_ids)
        if tokens.is_floating_point():
            tokens = self.draft_token_ids(tokens.argmax(dim=-1))
            tokens_out.copy_(tokens)
        return layer.inputs(self.embed_tokens(tokens), hidden if hidden_norm is None else hidden_norm(hidden))

    def mtp_layer(self, step: int, inputs, rope, kv_caches, meta: AttentionMetadata):
        """MTP layer step % n (its own KV cache) on its fc input: (x, residual) before its final norm."""
        index = step % len(self.mtp)
        return self.mtp[index].layer(inputs, rope, kv_caches[len(self.layers) + index], meta)

    def draft_logits(self, step: int, x, residual):
        """(logits over the draft vocabulary's rows, x + residual) from MTP layer step % n's
        output: its final norm fused into the draft head's projection (see draft_tokens)."""
        norm, weight = self.mtp[step % len(self.mtp)].norm, self.draft_head
        if self.lm_head.skinny(x):
            return self.lm_head.kernels.norm_linear(x, residual, norm.weight, norm.eps, weight)
        h, total = norm(x, residual)
        return self.lm_head.product(h, weight), total

    def compute_logits(self, hidden):
        return self.lm_head(hidden)

    def draft_tokens(self, hidden):
        """Greedy drafts from MTP hidden states: the argmax over the draft vocabulary's rows
        (speculative_config's draft_vocab_size; engine/draft_vocab.py ranks which ids they are).
        A draft needs only its argmax, and with a big vocabulary the vocab projection is most of
        a drafting step's weight reads, while a few thousand ids hold most of what a workload
        emits (FR-Spec's frequency-ranked drafting). Verification still uses every id: lossless."""
        weight = self.draft_head
        logits = (self.lm_head.kernels.linear(hidden, weight) if self.lm_head.skinny(hidden)
                  else self.lm_head.product(hidden, weight))
        return self.draft_token_ids(logits.argmax(dim=-1))
