"""MTP speculative decoding: draft with the checkpoint's MTP layers, verify losslessly.

A step with speculation, per decoding sequence whose last token is x_t and drafts d_1..d_k:

1. The main model computes x_t, d_1..d_k in one forward (batched with everything else).
2. Each of the k+1 rows samples its token as if no drafts existed: the argmax for greedy
   requests, the exponential race (argmax p/E) with the counter-based noise of that position
   for sampled ones (sampler.py). The drafts are accepted while they equal those tokens, and
   the first token that differs (or the bonus after the last draft) is emitted too. For a
   one-hot draft x this *is* rejection sampling: the race picks x with probability p(x), and
   when it picks another token that token follows p with x removed and renormalized. So the
   output has the model's distribution, and because the noise of a position depends only on
   the seed and the position, a seeded request gives the same tokens for any k or none.
3. The MTP pass runs MTP layer 0 over the same rows, fed the main hidden state at position p
   and the token at p+1: the tokens now known, i.e. the prompt, accepted drafts and the new
   token. Prefill chunks go through it too, so the MTP layer's KV cache holds the whole context
   (vLLM's "shifted by one"). Rows past the last accepted token are garbage and get rewritten
   next step, like the main model's rejected entries (rollback = `num_computed_tokens`).
4. Drafting chains from the last accepted row: step j runs MTP layer j % n on the previous
   draft and the previous MTP hidden state, one token per sequence; drafts are argmax. A step
   that ends a prompt stops after step 3: the next step verifies nothing and drafts k (a
   speculative step of q = 1, graphed like the others), so the first token is not delayed.

When every sequence of a step decodes with the same k drafts, steps 1-4 are one function of
device tensors (`speculative_step`), which the runner replays as one CUDA graph: the host
stages the inputs once and reads back the tokens, accepted counts and next drafts once.
Other steps (prefill chunks in the batch, ragged draft counts) take the general path
(`verify`, `MTPProposer`). `draft_policy.py` picks k from acceptance and measured step costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from jetserve.engine.model.attention import AttentionMetadata
from jetserve.engine.model.qwen3 import runs_triton
from jetserve.engine.sampler import sample
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.sequence import Sequence


def accepted_counts(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B, k] drafts against the [B, k+1] tokens the model samples at their rows → [B] drafts
    accepted (the leading run that matches)."""
    return (drafts == target[:, :drafts.shape[1]]).long().cumprod(1).sum(1)


def verify(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           seeds: torch.Tensor, positions: torch.Tensor) -> list[list[int]]:
    """Accept a prefix of each sequence's one-hot drafts and add one token; lossless (step 2).

    logits: [sum(len(d) + 1), V] fp32, the rows of each sequence in order (its drafts' positions,
    then the bonus position); seeds and positions: per row, the request's seed and the position
    of the token the row samples.
    """
    rows = [p for p, d in zip(params, drafts) for _ in range(len(d) + 1)]
    target = sample(logits, rows, seeds, positions).tolist()
    out, row = [], 0
    for draft_ids in drafts:
        n = 0
        while n < len(draft_ids) and draft_ids[n] == target[row + n]:
            n += 1
        out.append(draft_ids[:n] + [target[row + n]])
        row += len(draft_ids) + 1
    return out


def chained_inputs(packed: torch.Tensor, context_lens: torch.Tensor, prev_q: int, q: int, block_tables: torch.Tensor,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of a speculative step that verifies what the step before it proposed, from
    that step's result on the device, before the host reads it (async scheduling): per
    sequence, the token after its accepted drafts and its q - 1 new drafts, at the positions
    after the accepted ones. packed [B, prev_q + q]: the previous step's sampled tokens,
    accepted count and drafts; context_lens [B]: the previous step's. Returns ids, positions,
    slots [B*q] and context_lens [B], int32. The graphs run the same as one kernel
    (spec_kernels.chain_inputs)."""
    accepted = packed[:, prev_q]
    ids = torch.cat([packed.gather(1, accepted[:, None]), packed[:, prev_q + 1:]], 1)
    start = context_lens.long() - prev_q + accepted + 1
    positions = start[:, None] + torch.arange(q, device=packed.device)
    blocks = block_tables.long().gather(1, positions // block_size)
    slots = blocks * block_size + positions % block_size
    return tuple(t.flatten().to(torch.int32) for t in (ids, positions, slots, start + q))

Acceptance = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor],
                      tuple[torch.Tensor, torch.Tensor, list[tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]]]]


def speculative_step(model, kv_cache: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata, q: int, num_drafts: int, sample_rows: Callable[[torch.Tensor], torch.Tensor],
                     accept: Acceptance, packed: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-4 for B sequences of q rows each (last token, q-1 drafts), proposing
    `num_drafts` each, on device tensors with fixed shapes and no host read, so it can be
    captured in a CUDA graph.

    `sample_rows(logits)` gives each row's token (step 2); `accept(ids, target, positions, x,
    residual, n, packed)` writes the sampled tokens and accepted counts into `packed` and gives
    the MTP pass's output (x, residual) at each sequence's last verified row and the inputs
    (RoPE, attention metadata) of n one-token drafting steps after it (the caller knows where
    the KV slots are). Returns [B, q + 1 + num_drafts] int64 (into `packed` when given): the q
    sampled tokens, the accepted count n, then the next drafts; the sequence gains the first n+1
    tokens.

    Launches are what a small model's step costs, so the MTP pass shares the verify's RoPE, each
    MTP layer's input is one kernel (`Qwen3ForCausalLM.draft_input`: the embedding, both norms,
    and in the chain the previous draft's argmax and final norm), and a draft head is its final
    norm fused into the projection of the draft vocabulary."""
    rope = model.rotary(positions, model.dtype)
    hidden = model(ids, positions, kv_cache, meta, rope)
    target = sample_rows(model.compute_logits(hidden)).view(-1, q)
    # Row j's successor is target[j] for every row up to the first rejection: the shifted ids.
    x, residual = model.mtp_layer(0, model.draft_input(0, target.flatten(), hidden), rope, kv_cache, meta)
    if packed is None:
        packed = torch.empty(target.shape[0], q + 1 + num_drafts, dtype=torch.int64, device=target.device)
    x, residual, chain = accept(ids, target, positions, x, residual, max(num_drafts - 1, 0), packed)
    for step in range(num_drafts):
        logits, total = model.draft_logits(step, x, residual)
        column = packed[:, q + 1 + step]
        if step == num_drafts - 1:
            if model.lm_head.skinny(total) and runs_triton(total):
                from jetserve.engine.model.spec_kernels import argmax_into  # needs Triton

                argmax_into(logits, column, model.draft_ids)
            else:
                column.copy_(model.draft_token_ids(logits.argmax(dim=-1)))
            break
        step_rope, step_meta = chain[step]
        inputs = model.draft_input(step + 1, logits, total, model.mtp[step % len(model.mtp)].norm, column)
        x, residual = model.mtp_layer(step + 1, inputs, step_rope, kv_cache, step_meta)
    return packed


def device_acceptance(meta: AttentionMetadata, q: int, rotary, scratch_slot: int = 0) -> Acceptance:
    """Acceptance and drafting inputs computed on the device from a uniform step's metadata, in
    one kernel (model/spec_kernels.py): no host read, so they can live in a CUDA graph. A graph's
    padded sequences (context length 1) draft into `scratch_slot`. `rotary`: the model's
    RotaryEmbedding."""
    from jetserve.engine.model.spec_kernels import accept_and_chain  # needs Triton

    def accept(ids, target, positions, x, residual, steps, packed):
        x, residual, slots, context_lens, cos, sin = accept_and_chain(
            ids, target, positions, meta.block_tables, meta.context_lens, meta.block_size, q, steps, x, residual,
            *rotary.tables(x.dtype), packed, scratch_slot)
        return x, residual, [
            ((cos[s][:, None], sin[s][:, None]),
             AttentionMetadata(slot_mapping=slots[s], block_tables=meta.block_tables, context_lens=context_lens[s],
                               q_len=1, block_size=meta.block_size))
            for s in range(steps)]
    return accept


def host_acceptance(block_tables: list[list[int]], block_size: int, device: torch.device, rotary) -> Acceptance:
    """Acceptance in torch, drafting inputs built on the host (the general attention path, e.g.
    on a CPU, where reading the positions costs nothing)."""
    def accept(ids, target, positions, x, residual, steps, packed):
        batch, q = target.shape
        accepted = accepted_counts(ids.view(batch, q)[:, 1:], target)
        packed[:, :q], packed[:, q] = target, accepted
        last = torch.arange(batch, device=ids.device) * q + accepted
        last_positions = positions[last].long()
        ends = last_positions.tolist()
        return x[last], residual[last], [
            (rotary(last_positions + s, x.dtype),
             AttentionMetadata.build([1] * batch, [p + s + 1 for p in ends], block_tables, block_size, device))
            for s in range(1, steps + 1)]
    return accept


def next_tokens(seqs: list[Sequence], num_tokens: list[int], emitted: list[list[int] | None]) -> list[int]:
    """What the MTP pass feeds each row of a step beside its hidden state: the token after it
    (the next prompt token, the next draft, or the token this step emitted; 0 past what is known:
    rows of rejected drafts, rewritten next step)."""
    shifted = []
    for seq, n, new in zip(seqs, num_tokens, emitted):
        start = seq.num_computed_tokens
        known = seq.token_ids[start + 1:start + n + 1].tolist() + (new or [])
        shifted.extend(known[:n] + [0] * (n - len(known)))
    return shifted


class MTPProposer:
    """The MTP pass and the drafting chain of one step (steps 3 and 4 above)."""

    def __init__(self, max_model_len: int, block_size: int, device: torch.device, fused: bool):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.fused = fused  # the model runs the Triton kernels: uniform steps take the paged kernel

    def num_drafts(self, seq: Sequence, emitted: list[int], k: int) -> int:
        """Drafts worth making: none past max_model_len or past the request's max_tokens."""
        left = self.max_model_len - seq.num_tokens - len(emitted)
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens - len(emitted) - 1)
        return max(0, min(k, left))

    def propose(self, draft_forward, draft_tokens, seqs: list[Sequence], num_tokens: list[int],
                hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                emitted: list[list[int] | None], k: int) -> list[list[int]]:
        """Run the MTP pass over this step's rows, then chain drafts; returns drafts per sequence."""
        last_rows, row = [], 0
        for seq, n, new in zip(seqs, num_tokens, emitted):
            # The last verified row: its successor is the token just emitted.
            last_rows.append(row + n - 1 - len(seq.spec_token_ids) + len(new) - 1 if new else -1)
            row += n
        shifted = next_tokens(seqs, num_tokens, emitted)
        mtp_hidden = draft_forward(0, torch.tensor(shifted, device=self.device), positions, hidden, meta)
        # A step that finished a prompt drafts nothing: its first drafts come from the next step,
        # a graphed speculative step that verifies none (q = 1) and proposes k, instead of an
        # eager drafting chain here that would delay the first token by a launch-bound chain on a GPU.
        counts = [self.num_drafts(s, new, k) if new and s.num_computed_tokens >= s.num_prompt_tokens else 0
                  for s, new in zip(seqs, emitted)]
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [i for i, c in enumerate(counts) if c > 0]
        if not active:
            return drafts
        h = mtp_hidden[[last_rows[i] for i in active]]
        # Position of the last verified token; draft j (1-based) is guessed at position last + j + 1.
        last = [seqs[i].num_tokens + len(emitted[i]) - 2 for i in active]
        for step in range(max(counts[i] for i in active)):
            if step:
                ids = torch.tensor([drafts[i][-1] for i in active], device=self.device)
                pos = [p + step for p in last]
                step_meta = AttentionMetadata.build([1] * len(active), [p + 1 for p in pos],
                                                    [seqs[i].block_table for i in active], self.block_size,
                                                    self.device, self.fused)
                h = draft_forward(step, ids, torch.tensor(pos, device=self.device), h, step_meta)
            tokens = draft_tokens(h).tolist()
            for i, t in zip(active, tokens):
                drafts[i].append(t)
            keep = [m for m, i in enumerate(active) if counts[i] > step + 1]
            active, last, h = [active[m] for m in keep], [last[m] for m in keep], h[keep]
            if not active:
                break
        return drafts


@dataclass
class SpecCounters:
    """Totals since start, for EngineStats (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verifications with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j+1

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted step emits on average: accepted drafts plus the one verified token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
