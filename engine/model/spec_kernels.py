"""The bookkeeping of a speculative step as one Triton kernel.

Between the verify forward and the drafting chain a speculative step must know, per sequence,
how many drafts were accepted, which row was the last verified one, and where each drafting
step's token sits (position, KV slot, context length). In torch that is some thirty tiny
kernels (compare, cumprod, sum, gathers, and a dozen index ops per drafting step); on a model
whose decode step is ~50 kernels it was a fifth of a speculative step's cost. Here it is one
launch, one program per sequence. Used on CUDA (tests: Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_chain_kernel(ids_ptr, target_ptr, positions_ptr, tables_ptr, ctx_ptr, accepted_ptr, last_ptr,
                         chain_pos_ptr, chain_slot_ptr, chain_ctx_ptr, batch, width, block_size, scratch_slot,
                         Q: tl.constexpr, Q_PAD: tl.constexpr, STEPS: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, Q_PAD)
    is_draft = j < Q - 1
    # Draft j (the id at row j+1) against the token row j samples; the leading run of matches.
    draft = tl.load(ids_ptr + b * Q + j + 1, mask=is_draft, other=0).to(tl.int64)
    target = tl.load(target_ptr + b * Q + j, mask=is_draft, other=0).to(tl.int64)
    miss = tl.where(is_draft & (draft != target), j, Q - 1)
    accepted = tl.min(miss, axis=0)
    last = b * Q + accepted
    tl.store(accepted_ptr + b, accepted.to(tl.int64))
    tl.store(last_ptr + b, last.to(tl.int64))
    position = tl.load(positions_ptr + last).to(tl.int64)
    # A graph's padded sequence has context length 1 (< q): its drafting steps stay in the scratch slot.
    padded = tl.load(ctx_ptr + b) < Q
    for step in tl.static_range(STEPS):
        p = position + step + 1
        p = tl.where(padded, 0, p)
        block = tl.load(tables_ptr + b * width + p // block_size).to(tl.int64)
        slot = tl.where(padded, scratch_slot, block * block_size + p % block_size)
        tl.store(chain_pos_ptr + step * batch + b, p)
        tl.store(chain_slot_ptr + step * batch + b, slot.to(tl.int32))
        tl.store(chain_ctx_ptr + step * batch + b, (p + 1).to(tl.int32))


def accept_and_chain(ids: torch.Tensor, target: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, q: int, steps: int, scratch_slot: int = 0):
    """ids, positions: [B*q] (last token, then the q-1 drafts, per sequence); target: [B, q] the
    tokens the rows sampled; block_tables [B, W] int32. Returns the accepted draft counts [B]
    int64, the last verified row [B] int64, and per drafting step 1..steps the positions [steps, B]
    int64, KV slots and context lengths [steps, B] int32. context_lens [B]: after the verify rows;
    a graph's padded sequences (context length 1 < q) draft at position 0 into `scratch_slot`."""
    batch = target.shape[0]
    device = target.device
    accepted = torch.empty(batch, dtype=torch.int64, device=device)
    last = torch.empty(batch, dtype=torch.int64, device=device)
    chain_pos = torch.empty(max(steps, 1), batch, dtype=torch.int64, device=device)
    chain_slot = torch.empty(max(steps, 1), batch, dtype=torch.int32, device=device)
    chain_ctx = torch.empty(max(steps, 1), batch, dtype=torch.int32, device=device)
    _accept_chain_kernel[(batch,)](ids, target, positions, block_tables, context_lens, accepted, last, chain_pos,
                                   chain_slot, chain_ctx, batch, block_tables.shape[1], block_size, scratch_slot,
                                   Q=q, Q_PAD=triton.next_power_of_2(max(q, 2)), STEPS=steps)
    return accepted, last, chain_pos[:steps], chain_slot[:steps], chain_ctx[:steps]
