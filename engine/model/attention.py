"""Attention over the paged KV cache, for any mix of prefill chunks, decodes and verify steps.

The runner describes a step as B sequences, each with `q_len` new tokens (flattened, in
sequence order) at the end of a context of `ctx_len` tokens. New keys and values are written
into the cache slots of their positions first; then each sequence's queries attend to its
context gathered through its block table (only the batch's own blocks are read, never the
whole cache). That is the CPU path (SDPA, exact). On CUDA the Triton kernels read the cache
through block tables instead: a step where every sequence has the same few new tokens (decodes,
MTP verifies and drafts) takes the uniform form, read by a paged decode kernel whose shapes
depend only on (B, q_len), so the step can be replayed from a CUDA graph (engine/cuda_graphs.py);
any other step (prefill chunks, alone or with decodes) the varlen form, read by the flash
prefill kernel in one launch (model/flash_prefill.py), and its single-token sequences (decodes
beside a chunk) by the paged decode kernel in a second: a flash tile is 128 query rows, so a
decode there would walk its context with one row of 128 in use.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The general path on CUDA: the memory-efficient kernel (masks), not cuDNN's, which plans anew
# for every context length (a prefill chunk brings a new one each step), nor the slow math one.
_GENERAL_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
MAX_UNIFORM_Q = 16  # longer uniform steps are prefill chunks: the flash prefill kernel tiles those better
PREFILL_BLOCK_M = 128  # query rows of one flash prefill tile
# Keys of the shortest context piece, and the multiple every piece starts at (a multiple of each
# BLOCK_N the flash kernel tries): a piece's partial result (128 rows x head_dim in fp32, written
# and read back) is a quarter of the K and V that 512 keys bring, so shorter pieces would spend
# more on partials than they gain in parallelism.
PREFILL_MIN_PIECE = 512


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a step's host-built tensor to the device without making the host wait for the device:
    a copy from pageable memory synchronizes, one from pinned memory is queued (async scheduling
    relies on it)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


ALIGN_INT32 = 4  # 16 bytes: what Triton specializes a pointer argument on


def aligned_bounds(lengths) -> list[tuple[int, int]]:
    """(start, end) of consecutive int32 parts of these lengths in one buffer, each start 16 bytes
    aligned. Triton compiles a kernel variant per pointer alignment, so views at offsets that
    follow a step's or a configuration's shape would meet, while serving, variants the start-up
    warm-up never compiled. The buffer is the last end long."""
    bounds, at = [], 0
    for n in lengths:
        bounds.append((at, at + n))
        at += n + (-n % ALIGN_INT32)
    return bounds


def pack_int32(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Lists of ints as int32 views of one buffer, sent in one host-to-device copy, each view
    starting 16 bytes aligned (aligned_bounds)."""
    bounds = aligned_bounds(len(part) for part in parts)
    flat = [0] * bounds[-1][1] if bounds else []
    for (lo, hi), part in zip(bounds, parts):
        flat[lo:hi] = part
    packed = to_device(torch.tensor(flat, dtype=torch.int32), device)
    return [packed[lo:hi] for lo, hi in bounds]


class FreshQKV(NamedTuple):
    """What q and the step's new keys and values are made from (kernels.qk_norm_rope_store's inputs).
    Handed to the paged decode kernel of a uniform step, its programs make their queries and store
    the new keys they read themselves: a launch less a layer."""

    qkv: torch.Tensor  # [T, (H + 2 KVH) * D], the qkv projection
    q_weight: torch.Tensor  # the per-head norms' weights
    k_weight: torch.Tensor
    cos: torch.Tensor  # [T, D] (any shape of T x D elements): each token's RoPE rows
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [T] each token's cache slot
    eps: float


@dataclass
class SdpaGroup:
    """Sequences attended together: queries padded to the group's longest, keys to its longest context."""

    query_index: torch.Tensor  # [b, max_q] index into the T new tokens (padding points at 0)
    valid_index: torch.Tensor  # [n] the real rows of the flattened [b * max_q]
    context_slots: torch.Tensor  # [b, max_ctx] flat cache slot of each context position
    mask: torch.Tensor  # [b, 1, max_q, max_ctx] bool: causal within the sequence's context
    rows: list[tuple[int, int, int]]  # each real row: (token index, sequence in the group, keys it sees)

    @staticmethod
    def build(starts, q_lens, ctx_lens, block_tables, block_size) -> tuple[SdpaGroup, list[int]]:
        """The group's tensors (on the CPU) and the token index of each of its real rows, in order."""
        batch, max_q, max_ctx = len(q_lens), max(q_lens), max(ctx_lens)
        q_lens_t, ctx_lens_t = torch.tensor(q_lens), torch.tensor(ctx_lens)
        offs = torch.arange(max_q)
        query_valid = offs[None, :] < q_lens_t[:, None]
        query_index = torch.where(query_valid, torch.tensor(starts)[:, None] + offs[None, :], 0)
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        pos = torch.arange(max_ctx)
        blocks = torch.gather(tables, 1, (pos // block_size).clamp(max=width - 1)[None, :].expand(batch, -1))
        # Query j of a sequence sits at position ctx_len - q_len + j and sees keys up to it.
        q_pos = (ctx_lens_t - q_lens_t)[:, None] + offs[None, :]
        mask = pos[None, None, :] <= q_pos[:, :, None]
        mask[:, :, 0] = True  # padded queries see one key, so no row is all -inf (no NaN)
        rows = [(s + j, i, c - q + j + 1) for i, (s, q, c) in enumerate(zip(starts, q_lens, ctx_lens)) for j in range(q)]
        group = SdpaGroup(query_index, torch.nonzero(query_valid.flatten()).flatten(),
                          blocks * block_size + pos % block_size, mask[:, None], rows)
        return group, query_index[query_valid].tolist()

    def to(self, device: torch.device) -> SdpaGroup:
        return SdpaGroup(*(to_device(t, device) for t in (self.query_index, self.valid_index, self.context_slots,
                                                          self.mask)), self.rows)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token (padding: the scratch slot)
    # General form (any mix of prefill chunks and decodes): SDPA over the gathered context, in
    # groups, so that short queries are not padded to a chunk's length nor a chunk batched with them.
    groups: list[SdpaGroup] | None = None
    output_index: torch.Tensor | None = None  # [T]: the groups' concatenated rows, back in token order
    # Paged forms (CUDA): block tables and lengths, read by the Triton kernels.
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    context_lens: torch.Tensor | None = None  # [B] int32, after this step's tokens
    q_len: int = 0  # uniform form (every sequence `q_len` new tokens): the paged decode kernel
    block_size: int = 0
    # Varlen form (any other step): the flash prefill kernel (model/flash_prefill.py).
    query_start_loc: torch.Tensor | None = None  # [B + 1] int32: where each sequence's tokens start
    prefill: PrefillWork | None = None  # its work list
    # Tokens the paged decode kernel attends one by one, each as (row, sequence, keys it sees), [n, 3]
    # int32: a varlen step's decodes, or every token of any step but a uniform one in batch-invariant mode.
    token_rows: torch.Tensor | None = None

    @staticmethod
    def build(q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device, fused: bool = False, split_items: int = 1,
              invariant: bool = False) -> AttentionMetadata:
        """Describe a step; `ctx_lens` count the context after this step's tokens are added.
        `fused`: the model runs the Triton kernels, so a uniform step takes the paged decode
        kernel and any other the flash prefill kernel (its work cut into about `split_items`
        items or more: `prefill_plan`), or with `invariant` (batch-invariant mode) the decode
        kernel too, a token a program, so a row's attention is that of a decode row at its
        position; else SDPA in groups."""
        if fused and len(set(q_lens)) == 1 and q_lens[0] <= MAX_UNIFORM_Q:
            return AttentionMetadata._uniform(q_lens[0], ctx_lens, block_tables, block_size, device)
        if fused and invariant:
            meta = AttentionMetadata._uniform(1, ctx_lens, block_tables, block_size, device, q_lens)
            rows = token_rows(q_lens, ctx_lens)
            meta.token_rows = to_device(torch.tensor(rows, dtype=torch.int32).view(-1, 3), device)
            return meta
        if fused:
            return AttentionMetadata._varlen(q_lens, ctx_lens, block_tables, block_size, device, split_items)
        short = [i for i, q in enumerate(q_lens) if q <= MAX_UNIFORM_Q]
        members = ([short] if short else []) + [[i] for i, q in enumerate(q_lens) if q > MAX_UNIFORM_Q]
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        groups, order = [], []
        for group in members:
            g, rows = SdpaGroup.build([starts[i] for i in group], [q_lens[i] for i in group],
                                      [ctx_lens[i] for i in group], [block_tables[i] for i in group], block_size)
            groups.append(g)
            order.extend(rows)
        slots = slot_mapping(block_tables, ctx_lens, q_lens, block_size)
        output_index = torch.empty(len(order), dtype=torch.long)
        output_index[torch.tensor(order)] = torch.arange(len(order))
        return AttentionMetadata(slot_mapping=to_device(torch.tensor(slots), device),
                                 output_index=to_device(output_index, device),
                                 groups=[g.to(device) for g in groups])

    @staticmethod
    def _uniform(q_len: int, ctx_lens: list[int], block_tables: list[list[int]], block_size: int,
                 device: torch.device, q_lens: list[int] | None = None) -> AttentionMetadata:
        width = max(len(t) for t in block_tables)
        slots = slot_mapping(block_tables, ctx_lens, q_lens or [q_len] * len(ctx_lens), block_size)
        tables = [x for t in block_tables for x in t + [0] * (width - len(t))]
        slot_mapping_t, context_lens, tables_t = pack_int32([slots, ctx_lens, tables], device)
        return AttentionMetadata(slot_mapping=slot_mapping_t, context_lens=context_lens,
                                 block_tables=tables_t.view(len(ctx_lens), width), q_len=q_len,
                                 block_size=block_size)

    @staticmethod
    def _varlen(q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], block_size: int,
                device: torch.device, split_items: int) -> AttentionMetadata:
        width = max(len(t) for t in block_tables)
        slots = slot_mapping(block_tables, ctx_lens, q_lens, block_size)
        starts = [0, *accumulate(q_lens)]
        items, merges = prefill_plan(q_lens, ctx_lens, split_items)
        decodes = token_rows(q_lens, ctx_lens, decodes_only=True)
        tables = [x for t in block_tables for x in t + [0] * (width - len(t))]
        slots_t, ctx_t, starts_t, items_t, merges_t, decodes_t, tables_t = pack_int32(
            [slots, ctx_lens, starts, sum(items, []), sum(merges, []), decodes, tables], device)
        work = PrefillWork(items=items_t.view(5, len(items[0])), merges=merges_t.view(4, len(merges[0])),
                           num_parts=sum(merges[3]))
        return AttentionMetadata(slot_mapping=slots_t, context_lens=ctx_t, query_start_loc=starts_t, prefill=work,
                                 block_tables=tables_t.view(len(ctx_lens), width), block_size=block_size,
                                 token_rows=decodes_t.view(-1, 3) if decodes else None)


@dataclass
class PrefillWork:
    """The flash prefill kernel's work list for a step (from `prefill_plan`, on the device)."""

    items: torch.Tensor  # [5, n] int32: sequence, first query row, first key, end key, partial slot (-1: none)
    merges: torch.Tensor  # [4, m] int32: sequence, first query row, first partial slot, pieces
    num_parts: int  # partial slots to allocate: the plan's, or the most any plan may fill (a graph's)


def prefill_plan(q_lens: list[int], ctx_lens: list[int], split_items: int = 1,
                 block_m: int = PREFILL_BLOCK_M) -> tuple[list[list[int]], list[list[int]]]:
    """The flash prefill kernel's work for a step: (items, merges), each as columns of ints.

    The queries are cut into tiles of `block_m` rows of one sequence; a tile attends to the keys
    up to its last row. A single-token sequence (a decode) has no tile: the paged decode kernel
    takes it (`token_rows`). A 512-token chunk is 4 tiles: one program each per head would leave most
    of the GPU idle while they walk a long context, so a tile whose keys pass the piece size is
    cut along its context into pieces (flash-decoding, for prefill): each piece is an item of its
    own that writes a partial result and its log-sum-exp into a slot, and a merge combines a
    tile's pieces. The piece size is what cuts the step's keys into `split_items` pieces (at
    least PREFILL_MIN_PIECE, a multiple of it), so an unchunked prompt (many tiles) is never cut
    and a chunk deep in its context is cut most. Items go longest first: the GPU's last wave is then
    short. An item: (sequence, first row, first key, end key, partial slot or -1 for a tile's
    only piece); a merge: (sequence, first row, first slot, pieces). Bounds (static buffers of
    a graph): items <= tiles + split_items, merges <= split_items, slots <= 2 * split_items."""
    tiles = [(b, m0, ctx - q + min(m0 + block_m, q))  # the keys the tile's last row sees
             for b, (q, ctx) in enumerate(zip(q_lens, ctx_lens)) if q > 1 for m0 in range(0, q, block_m)]
    total = sum(keys for *_, keys in tiles)
    piece = -(-max(PREFILL_MIN_PIECE, -(-total // split_items)) // PREFILL_MIN_PIECE) * PREFILL_MIN_PIECE
    items, merges, slot = [], [], 0
    for b, m0, keys in tiles:
        n = -(-keys // piece)
        if n == 1:
            items.append((b, m0, 0, keys, -1))
            continue
        merges.append((b, m0, slot, n))
        items += [(b, m0, lo, min(lo + piece, keys), slot + j) for j, lo in enumerate(range(0, keys, piece))]
        slot += n
    items.sort(key=lambda item: item[2] - item[3])  # stable: longest first, then in order
    return [list(col) for col in zip(*items)] or [[]] * 5, [list(col) for col in zip(*merges)] or [[]] * 4


def token_rows(q_lens: list[int], ctx_lens: list[int], decodes_only: bool = False) -> list[int]:
    """(row, sequence, keys it sees) of each token of a step, flat, for the paged decode kernel's
    per-token form; `decodes_only`: those of its single-token sequences alone."""
    rows, start = [], 0
    for b, (q, ctx) in enumerate(zip(q_lens, ctx_lens)):
        if q == 1 or not decodes_only:
            rows += [v for j in range(q) for v in (start + j, b, ctx - q + j + 1)]
        start += q
    return rows


def prefill_split_items(device: torch.device, num_heads: int) -> int:
    """How many pieces `prefill_plan` cuts a step's keys into: enough items that with one program
    per item and head every SM of the GPU has two. 1 off CUDA (the kernel's tests pass their own)."""
    if device.type != "cuda":
        return 1
    return -(-2 * torch.cuda.get_device_properties(device).multi_processor_count // num_heads)


def slot_mapping(block_tables: list[list[int]], ctx_lens: list[int], q_lens: list[int], block_size: int) -> list[int]:
    """Flat KV-cache index of each of a step's tokens: the last `q` positions of each sequence's
    context, through its block table."""
    return [table[p // block_size] * block_size + p % block_size
            for table, c, q in zip(block_tables, ctx_lens, q_lens) for p in range(c - q, c)]


def causal_attention(q, k, v, scale: float):
    """Training path (`meta=None`): whole rows, no cache. q: [B, L, H, D]; k, v: [B, L, KVH, D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, invariant: bool = False):
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [slots, KVH, D]. Returns [T, H, D].
    `invariant`: batch-invariant (`invariant_attention`)."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if invariant:
        return invariant_attention(q, k_cache, v_cache, meta, scale)
    outs = []
    for g in meta.groups:
        keys = k_cache[g.context_slots].transpose(1, 2)  # [b, KVH, max_ctx, D]
        values = v_cache[g.context_slots].transpose(1, 2)
        queries = q[g.query_index].transpose(1, 2)  # [b, H, max_q, D]
        if q.is_cuda:  # the memory-efficient kernel takes a mask but not GQA: give it every head
            groups = queries.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
            with sdpa_kernel(_GENERAL_BACKENDS):
                out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, scale=scale)
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask, scale=scale,
                                                 enable_gqa=queries.shape[1] != keys.shape[1])
        outs.append(out.transpose(1, 2).flatten(0, 1)[g.valid_index])  # the group's real rows
    return torch.cat(outs)[meta.output_index]  # [T, H, D]: back to flattened token order


def invariant_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Batch-invariant attention (the CPU's; the cache already holds the step's keys): each query
    row attends by itself to exactly the keys it sees, so every reduction in it has a shape set by
    its position alone, never by its step's other rows (SDPA of a group pads keys to the longest
    context and blocks queries by their count, and both change a row's rounding in bf16). A
    decode row, a verify row and a prefill row at one position give the same bits."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[1]
    for g in meta.groups:
        keys = values = at = None
        for token, seq, n in g.rows:
            if keys is None or seq != at:  # a sequence's context, gathered once: [KVH, max_ctx, D]
                at, slots = seq, g.context_slots[seq]
                keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
            row = F.scaled_dot_product_attention(q[token, :, None], keys[:, :n], values[:, :n], scale=scale,
                                                 enable_gqa=gqa)
            out[token] = row[:, 0]
    return out
