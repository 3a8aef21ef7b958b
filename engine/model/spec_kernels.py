"""A speculative step's own kernels: its bookkeeping and the MTP layers' inputs, one launch each.

Between the verify forward and the drafting chain a step must know, per sequence, how many
drafts were accepted, which row was the last verified one, and where each drafting step's token
sits (KV slot, context length, RoPE rows). In torch that was some thirty tiny kernels plus four for
each drafting step's RoPE; here it is one launch, one program per sequence, which also gathers
the MTP pass's output at the last verified row and writes the step's packed result.

An MTP layer's input (embedding of a token, RMSNorm of it, RMSNorm of the hidden state, the
concatenation, and in the chain the argmax of the previous draft head and that head's final
norm) is another launch instead of five to seven. A model whose layer is a sixth of the model
(the demo) pays for launches, not arithmetic, so the count is what matters. Each rounds to the
activation dtype where the torch code it replaces rounds. Used on CUDA (tests: Triton's
interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetserve.engine.model.sampling_kernels import argmax_splits, best_split, chunk_argmax


# Not specialized on the values of what varies step to step: each (== 1, divisible by 16) class would
# be a compile of its own, first met on a request's path.
@triton.jit(do_not_specialize=["batch", "width"])
def _accept_chain_kernel(ids_ptr, target_ptr, positions_ptr, tables_ptr, ctx_ptr, x_ptr, res_ptr, cos_ptr, sin_ptr,
                         packed_ptr, x_out_ptr, res_out_ptr, chain_slot_ptr, chain_ctx_ptr, chain_cos_ptr,
                         chain_sin_ptr, batch, width, block_size, scratch_slot, packed_width,
                         Q: tl.constexpr, Q_PAD: tl.constexpr, STEPS: tl.constexpr, HIDDEN: tl.constexpr,
                         HIDDEN_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, Q_PAD)
    is_draft = j < Q - 1
    # Draft j (the id at row j+1) against the token row j samples; the leading run of matches.
    draft = tl.load(ids_ptr + b * Q + j + 1, mask=is_draft, other=0).to(tl.int64)
    target = tl.load(target_ptr + b * Q + j, mask=j < Q, other=0).to(tl.int64)
    miss = tl.where(is_draft & (draft != target), j, Q - 1)
    accepted = tl.min(miss, axis=0)
    last = b * Q + accepted
    packed = packed_ptr + b * packed_width
    tl.store(packed + j, target, mask=j < Q)
    tl.store(packed + Q, accepted.to(tl.int64))
    # The MTP pass's output at the last verified row: where the drafting chain starts.
    h = tl.arange(0, HIDDEN_PAD)
    tl.store(x_out_ptr + b * HIDDEN + h, tl.load(x_ptr + last * HIDDEN + h, mask=h < HIDDEN), mask=h < HIDDEN)
    tl.store(res_out_ptr + b * HIDDEN + h, tl.load(res_ptr + last * HIDDEN + h, mask=h < HIDDEN), mask=h < HIDDEN)
    position = tl.load(positions_ptr + last).to(tl.int64)
    # A graph's padded sequence has context length 1 (< q): its drafting steps stay in the scratch slot.
    padded = tl.load(ctx_ptr + b) < Q
    d = tl.arange(0, HEAD_PAD)
    for step in tl.static_range(STEPS):
        p = position + step + 1
        p = tl.where(padded, 0, p)
        block = tl.load(tables_ptr + b * width + p // block_size).to(tl.int64)
        slot = tl.where(padded, scratch_slot, block * block_size + p % block_size)
        tl.store(chain_slot_ptr + step * batch + b, slot.to(tl.int32))
        tl.store(chain_ctx_ptr + step * batch + b, (p + 1).to(tl.int32))
        at = (step * batch + b) * HEAD_DIM + d
        tl.store(chain_cos_ptr + at, tl.load(cos_ptr + p * HEAD_DIM + d, mask=d < HEAD_DIM), mask=d < HEAD_DIM)
        tl.store(chain_sin_ptr + at, tl.load(sin_ptr + p * HEAD_DIM + d, mask=d < HEAD_DIM), mask=d < HEAD_DIM)


def accept_and_chain(ids: torch.Tensor, target: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, q: int, steps: int, x: torch.Tensor,
                     residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: torch.Tensor,
                     scratch_slot: int = 0):
    """ids, positions: [B*q] (last token, then the q-1 drafts, per sequence); target: [B, q] the
    tokens the rows sampled; block_tables [B, W] int32; context_lens [B] (after the verify rows;
    a graph's padded sequences, context length 1 < q, draft at position 0 into `scratch_slot`);
    x, residual [B*q, H]: the MTP pass's output; cos, sin: the RoPE tables [P, head_dim] in x's dtype.

    Writes packed[:, :q] = target and packed[:, q] = the accepted draft counts (int64). Returns
    x and residual at each sequence's last verified row [B, H], and per drafting step 1..steps
    the KV slots and context lengths [steps, B] int32 and RoPE cos, sin [steps, B, head_dim] in
    x's dtype."""
    batch, hidden = target.shape[0], x.shape[1]
    device, head_dim = target.device, cos.shape[1]
    x_out = torch.empty(batch, hidden, dtype=x.dtype, device=device)
    res_out = torch.empty_like(x_out)
    chain_slot = torch.empty(max(steps, 1), batch, dtype=torch.int32, device=device)
    chain_ctx = torch.empty(max(steps, 1), batch, dtype=torch.int32, device=device)
    chain_cos = torch.empty(max(steps, 1), batch, head_dim, dtype=cos.dtype, device=device)
    chain_sin = torch.empty_like(chain_cos)
    _accept_chain_kernel[(batch,)](ids, target, positions, block_tables, context_lens, x, residual, cos, sin, packed,
                                   x_out, res_out, chain_slot, chain_ctx, chain_cos, chain_sin, batch,
                                   block_tables.shape[1], block_size, scratch_slot, packed.stride(0), Q=q,
                                   Q_PAD=triton.next_power_of_2(max(q, 2)), STEPS=steps, HIDDEN=hidden,
                                   HIDDEN_PAD=triton.next_power_of_2(hidden), HEAD_DIM=head_dim,
                                   HEAD_PAD=triton.next_power_of_2(head_dim))
    return x_out, res_out, chain_slot[:steps], chain_ctx[:steps], chain_cos[:steps], chain_sin[:steps]


SCAN_MAX = 16384  # draft logits a row one program scans alone; past it the argmax is split over programs first


@triton.jit
def _draft_token(score_ptr, index_ptr, ids_ptr, r, width, SPLIT: tl.constexpr, MAP: tl.constexpr,
                 S_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Row r's draft, the first argmax of its draft logits, as a token id (MAP: through the draft
    vocabulary's ids): SPLIT, from the (score, index) of the `width` splits of its row
    (sampling_kernels.argmax_splits); else scanned here, score_ptr the logits [rows, width]."""
    if SPLIT:
        index = best_split(score_ptr, index_ptr, r, width, S_BLOCK)
    else:
        index = chunk_argmax(score_ptr + r * width, 0, width, V_BLOCK, CHUNK)[1].to(tl.int64)
    if MAP:
        index = tl.load(ids_ptr + index).to(tl.int64)
    return index


def _argmax_source(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, dict]:
    """What `_draft_token` reads for these draft logits: (score, index, width, constexprs). One
    program scanning a big vocabulary's row alone would stall the step on one SM, so past SCAN_MAX
    ids the argmax is split over programs first (one launch more)."""
    logits = logits.contiguous()
    vocab = logits.shape[1]
    if vocab <= SCAN_MAX:
        v_block = min(4096, triton.next_power_of_2(vocab))
        return logits, logits, vocab, dict(SPLIT=False, S_BLOCK=2, V_BLOCK=v_block,
                                           CHUNK=max(v_block, triton.next_power_of_2(vocab)))
    score, index = argmax_splits(logits)
    return score, index, score.shape[1], dict(SPLIT=True, S_BLOCK=max(2, triton.next_power_of_2(score.shape[1])),
                                              V_BLOCK=16, CHUNK=16)


@triton.jit
def _rms(x, w_ptr, cols, mask, n, eps, dtype: tl.constexpr):
    """RMSNorm of one row held in fp32, rounded as the RMSNorm module rounds."""
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)).to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return (w.to(tl.float32) * y.to(tl.float32)).to(dtype)


@triton.jit
def _draft_input_kernel(tokens_ptr, index_ptr, ids_ptr, hidden_ptr, embed_ptr, es_ptr, ez_ptr, enorm_ptr, hnorm_ptr,
                        prev_norm_ptr, out_ptr, tokens_out_ptr, tokens_out_stride, width, eps_e, eps_h, eps_prev,
                        HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr, FROM_LOGITS: tl.constexpr,
                        NORM_HIDDEN: tl.constexpr, SPLIT: tl.constexpr, MAP: tl.constexpr, S_BLOCK: tl.constexpr,
                        V_BLOCK: tl.constexpr, CHUNK: tl.constexpr, EMBED_BITS: tl.constexpr = 0,
                        EMBED_GROUP: tl.constexpr = 1, EMBED_ZEROS: tl.constexpr = False):
    r = tl.program_id(0).to(tl.int64)
    if FROM_LOGITS:
        token = _draft_token(tokens_ptr, index_ptr, ids_ptr, r, width, SPLIT, MAP, S_BLOCK, V_BLOCK, CHUNK)
        tl.store(tokens_out_ptr + r * tokens_out_stride, token)
    else:
        token = tl.load(tokens_ptr + r).to(tl.int64)
    h = tl.arange(0, HIDDEN_PAD)
    mask = h < HIDDEN
    dtype = out_ptr.dtype.element_ty
    if EMBED_BITS:  # a quantized table (quant.py's span layout): the row dequantized as quant.dequantize does
        SPAN: tl.constexpr = 512 // EMBED_BITS
        words = tl.load(embed_ptr + token * (HIDDEN * EMBED_BITS // 32) + (h // SPAN) * 16 + h % 16, mask=mask,
                        other=0)
        q = (words >> (EMBED_BITS * ((h % SPAN) // 16))) & ((1 << EMBED_BITS) - 1)
        g = token * (HIDDEN // EMBED_GROUP) + h // EMBED_GROUP
        if EMBED_ZEROS:
            zero = tl.load(ez_ptr + g, mask=mask, other=0).to(tl.int32)
        else:
            zero = 1 << (EMBED_BITS - 1)
        embeds = ((q - zero).to(tl.float32) * tl.load(es_ptr + g, mask=mask, other=0.0)).to(dtype).to(tl.float32)
    else:
        embeds = tl.load(embed_ptr + token * HIDDEN + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * 2 * HIDDEN + h, _rms(embeds, enorm_ptr, h, mask, HIDDEN, eps_e, dtype), mask=mask)
    hidden = tl.load(hidden_ptr + r * HIDDEN + h, mask=mask, other=0.0).to(tl.float32)
    if NORM_HIDDEN:
        hidden = _rms(hidden, prev_norm_ptr, h, mask, HIDDEN, eps_prev, dtype).to(tl.float32)
    tl.store(out_ptr + r * 2 * HIDDEN + HIDDEN + h, _rms(hidden, hnorm_ptr, h, mask, HIDDEN, eps_h, dtype), mask=mask)


def draft_input(tokens: torch.Tensor, hidden: torch.Tensor, embed, enorm, hnorm, hidden_norm=None,
                tokens_out: torch.Tensor | None = None, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """An MTP layer's fc input [rows, 2H]: enorm(embed[token]) beside hnorm(hidden); `embed` the
    table, float or a quant.QuantizedWeight (quant.QuantEmbedding's). `tokens`:
    ids [rows], or draft logits [rows, V] whose argmax is the token (written into `tokens_out`,
    a column view; `draft_ids`: the token id of each logit's row, where the draft head projects
    onto a draft vocabulary); `hidden_norm`: hidden is un-normed (the previous MTP layer's x +
    residual) and takes that RMSNorm first. enorm, hnorm, hidden_norm: RMSNorm modules."""
    rows, size = hidden.shape
    out = torch.empty(rows, 2 * size, dtype=hidden.dtype, device=hidden.device)
    from_logits = tokens.is_floating_point()
    prev = hidden_norm if hidden_norm is not None else hnorm
    if from_logits:
        score, index, width, meta = _argmax_source(tokens)
    else:
        score = index = tokens.contiguous()
        width, meta = 0, dict(SPLIT=False, S_BLOCK=2, V_BLOCK=16, CHUNK=16)
    if isinstance(embed, torch.Tensor):
        table, scales, zeros, quantized = embed, embed, embed, {}
    else:
        table, scales = embed.qweight, embed.scales
        zeros = embed.zeros if embed.zeros is not None else scales
        quantized = dict(EMBED_BITS=embed.bits, EMBED_GROUP=embed.group_size, EMBED_ZEROS=embed.zeros is not None)
    _draft_input_kernel[(rows,)](score, index, draft_ids if draft_ids is not None else index, hidden.contiguous(),
                                 table, scales, zeros, enorm.weight, hnorm.weight, prev.weight, out,
                                 tokens_out if from_logits else out, tokens_out.stride(0) if from_logits else 0,
                                 width, enorm.eps, hnorm.eps, prev.eps, HIDDEN=size,
                                 HIDDEN_PAD=triton.next_power_of_2(size), FROM_LOGITS=from_logits,
                                 NORM_HIDDEN=hidden_norm is not None, MAP=from_logits and draft_ids is not None,
                                 **meta, **quantized)
    return out


@triton.jit
def _argmax_into_kernel(score_ptr, index_ptr, ids_ptr, out_ptr, out_stride, width, SPLIT: tl.constexpr,
                        MAP: tl.constexpr, S_BLOCK: tl.constexpr, V_BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    tl.store(out_ptr + r * out_stride,
             _draft_token(score_ptr, index_ptr, ids_ptr, r, width, SPLIT, MAP, S_BLOCK, V_BLOCK, CHUNK))


def argmax_into(logits: torch.Tensor, out: torch.Tensor, draft_ids: torch.Tensor | None = None) -> None:
    """out[r] = argmax of logits row r (the first, as torch.argmax), through `draft_ids` where
    given; out: an int64 column view."""
    score, index, width, meta = _argmax_source(logits)
    _argmax_into_kernel[(logits.shape[0],)](score, index, draft_ids if draft_ids is not None else index, out,
                                            out.stride(0), width, MAP=draft_ids is not None, **meta)


# Not specialized on the values of what varies step to step: each (== 1, divisible by 16) class would
# be a compile of its own, first met on a request's path.
@triton.jit(do_not_specialize=["width"])
def _chain_inputs_kernel(flags_ptr, packed_ptr, ids_ptr, positions_ptr, slots_ptr, ctx_ptr, tables_ptr, width,
                         block_size, scratch_slot, Q: tl.constexpr, Q_PAD: tl.constexpr):
    b = tl.program_id(0)
    prev_q = tl.load(flags_ptr + b)
    j = tl.arange(0, Q_PAD)
    rows = b * Q + j
    if prev_q > 0:
        # The previous step's packed row (width prev_q + 1 + Q - 1): its q sampled tokens, the
        # accepted count n, its Q - 1 drafts. This step verifies [token n, drafts] from the
        # position after the last accepted one. Each program reads only its own context length
        # (not the positions, which the programs rewrite in a new layout).
        row = packed_ptr + b * (prev_q + Q)
        accepted = tl.load(row + prev_q)
        token = tl.load(row + accepted)
        draft = tl.load(row + prev_q + j, mask=(j >= 1) & (j < Q), other=0)
        start = tl.load(ctx_ptr + b) - prev_q + accepted.to(tl.int32) + 1
        position = start + j
        block = tl.load(tables_ptr + b * width + position // block_size, mask=j < Q, other=0)
        tl.store(ids_ptr + rows, tl.where(j == 0, token, draft).to(tl.int32), mask=j < Q)
        tl.store(positions_ptr + rows, position, mask=j < Q)
        tl.store(slots_ptr + rows, block * block_size + position % block_size, mask=j < Q)
        tl.store(ctx_ptr + b, start + Q)
    elif prev_q < 0:  # a padded sequence: its rows touch only the scratch slot
        tl.store(ids_ptr + rows, tl.zeros([Q_PAD], tl.int32), mask=j < Q)
        tl.store(positions_ptr + rows, tl.zeros([Q_PAD], tl.int32), mask=j < Q)
        tl.store(slots_ptr + rows, tl.full([Q_PAD], scratch_slot, tl.int32), mask=j < Q)
        tl.store(ctx_ptr + b, 1)


def chain_inputs(flags: torch.Tensor, packed: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                 q: int, scratch_slot: int) -> None:
    """A speculative step's inputs written on the device from the step before it, which the
    host has not read yet (async scheduling: spec_decode.chained_inputs says how). flags [B]
    int32: the previous step's tokens a sequence (its q), or 0 to keep what the host staged,
    or -1 for a padded sequence; packed: the previous step's result, flat, its rows
    prev_q + q wide; ids, positions, slots [B*q], context_lens [B], block_tables [B, W]: int32,
    rewritten in place."""
    _chain_inputs_kernel[(flags.shape[0],)](flags, packed, ids, positions, slots, context_lens, block_tables,
                                            block_tables.shape[1], block_size, scratch_slot, Q=q,
                                            Q_PAD=triton.next_power_of_2(q))
