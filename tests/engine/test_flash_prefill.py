"""The flash prefill kernel against plain attention over the same paged cache: a mixed step of
chunks and decodes (the chunks' tiles in one launch, the decodes' rows in the paged decode
kernel's per-token form, as the model runs them) — odd lengths, chunks starting mid-block, a prefix-cache hit
(blocks shared with another sequence), GQA, head_dim 64 and 128, several tiles a sequence, and
tiles whose context is cut into pieces (merged by the second kernel). On a GPU it runs
compiled; without one in Triton's interpreter (tests/conftest.py). End to end on the GPU: greedy
tokens with chunked prefill (pieces included) and prefix caching equal transformers'."""

import pytest
import torch

from tests.tools import require_module

require_module("triton")

from jetserve.engine.model import attention  # noqa: E402
from jetserve.engine.model.attention import AttentionMetadata, PrefillWork, prefill_plan  # noqa: E402
from jetserve.engine.model.flash_prefill import prefill_attention  # noqa: E402
from jetserve.engine.model.kernels import MAX_SPLITS, paged_attention  # noqa: E402

from tests.engine.builders import build_qwen3, hf_greedy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16


def reference(q, k_cache, v_cache, tables, q_lens, ctx_lens, scale):
    """Each sequence's new queries over its context, gathered slot by slot, causal."""
    outs, t = [], 0
    group = q.shape[1] // k_cache.shape[1]
    for table, q_len, ctx in zip(tables, q_lens, ctx_lens):
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx)]
        keys = k_cache[slots].float().repeat_interleave(group, 1)  # [ctx, H, D]
        values = v_cache[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("thd,lhd->htl", q[t:t + q_len].float(), keys) * scale
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        scores = scores.masked_fill(torch.arange(ctx, device=q.device)[None, None, :] > q_pos[None, :, None],
                                    float("-inf"))
        outs.append(torch.einsum("htl,lhd->thd", scores.softmax(-1), values))
        t += q_len
    return torch.cat(outs).to(q.dtype)


# (q_len, ctx_len): a fresh 37-token prompt; a second chunk starting mid-block (position 13); a
# decode; a prompt whose first 32 tokens hit the prefix cache (it shares the first sequence's
# blocks); a chunk of 70 after 45 cached tokens (several tiles, none aligned).
STEP = [(37, 37), (21, 34), (1, 50), (9, 41), (70, 115)]


def plan_on_device(q_lens, ctx_lens, split_items, block_m):
    items, merges = prefill_plan(q_lens, ctx_lens, split_items, block_m)

    def as_tensor(columns, rows):
        return torch.tensor(columns, dtype=torch.int32, device=DEVICE).view(rows, -1)

    return PrefillWork(as_tensor(items, 5), as_tensor(merges, 4), sum(merges[3]))


# bf16 on the GPU only: the interpreter's tl.dot returns garbage for bf16 operands (Triton 3.x).
# split_items 1: a program walks a tile's whole context; 8: contexts cut into pieces of 16 keys
# (on the GPU: of 128), some of which hold no key for a tile's first rows.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4)] + [(torch.bfloat16, 3e-2)] * (DEVICE == "cuda"))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (2, 1, 128), (3, 3, 24)])
@pytest.mark.parametrize("split_items", [1, 8])
def test_mixed_step(monkeypatch, dtype, tol, heads, kv_heads, head_dim, split_items):
    block_m = 16 if DEVICE == "cpu" else 128  # small tiles: several a sequence
    monkeypatch.setattr(attention, "PREFILL_MIN_PIECE", 16 if DEVICE == "cpu" else 128)
    # pieces of 128 need longer contexts; the decode stays one token
    steps = STEP if DEVICE == "cpu" else [(q * 8 if q > 1 else 1, c * 8) for q, c in STEP]
    torch.manual_seed(heads * head_dim + split_items)
    q_lens, ctx_lens = [q for q, _ in steps], [c for _, c in steps]
    blocks, tables = iter(range(1, 1000)), []
    for q_len, ctx in steps:
        tables.append([next(blocks) for _ in range(-(-ctx // BLOCK_SIZE))])
    tables[3][:2] = tables[0][:2]  # the prefix-cache hit: 32 tokens in the first sequence's blocks
    slots = (max(max(t) for t in tables) + 1) * BLOCK_SIZE
    k_cache = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    q = torch.randn(sum(q_lens), heads, head_dim, dtype=dtype, device=DEVICE)
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, BLOCK_SIZE, torch.device(DEVICE), fused=True)
    work = plan_on_device(q_lens, ctx_lens, split_items, block_m)
    assert (work.merges.shape[1] > 0) == (split_items > 1)
    scale = head_dim ** -0.5
    got = prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, work,
                            scale, BLOCK_SIZE, block_m)
    decode = sum(q_lens[:2])  # the step's one single-token sequence: no flash tile, a row of the decode kernel
    assert meta.token_rows.tolist() == [[decode, 2, ctx_lens[2]]] and 2 not in work.items[0].tolist()
    got[decode] = float("nan")  # whatever the flash kernel left there, the decode kernel must overwrite
    paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0, BLOCK_SIZE, scale, MAX_SPLITS,
                    meta.token_rows, out=got)
    want = reference(q, k_cache, v_cache, tables, q_lens, ctx_lens, scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("split_items", [1, 3, 17, 64])
def test_plan_covers_every_key_once(monkeypatch, split_items):
    """Every (query row, key it sees) pair of a sequence with more than one new token is in
    exactly one item (a decode is the decode kernel's: in no item), pieces start at multiples of
    the piece size, items go longest first, and the plan stays within the bounds a graph's
    static buffers are sized by; one item a tile when split_items is 1."""
    monkeypatch.setattr(attention, "PREFILL_MIN_PIECE", 16)
    q_lens, ctx_lens, block_m = [5, 40, 1, 70, 33], [5, 50, 20, 400, 233], 16
    items, merges = prefill_plan(q_lens, ctx_lens, split_items, block_m)
    seen = {}
    for b, m0, lo, hi, slot in zip(*items):
        assert lo % 16 == 0 and lo < hi
        for r in range(m0, min(m0 + block_m, q_lens[b])):
            for key in range(lo, min(hi, ctx_lens[b] - q_lens[b] + r + 1)):
                seen[b, r, key] = seen.get((b, r, key), 0) + 1
    assert set(seen.values()) == {1}
    assert len(seen) == sum((c - q + r + 1) for q, c in zip(q_lens, ctx_lens) if q > 1 for r in range(q))
    assert 2 not in items[0]  # the decode
    sizes = [hi - lo for lo, hi in zip(items[2], items[3])]
    assert sizes == sorted(sizes, reverse=True)
    tiles = sum(-(-q // block_m) for q in q_lens if q > 1)
    assert len(items[0]) <= tiles + split_items and len(merges[0]) <= split_items
    assert sum(merges[3]) <= 2 * split_items
    # Each merge names its tile's pieces: consecutive slots, one per item of that tile.
    for b, m0, first, count in zip(*merges):
        assert sorted(s for ib, im, *_, s in zip(*items) if (ib, im) == (b, m0)) == list(range(first, first + count))
    if split_items == 1:
        assert merges == [[]] * 4 and set(items[4]) == {-1} and len(items[0]) == tiles


def test_varlen_metadata():
    """The host side: slots, starts and tables are what the SDPA path reads, and the work list
    is the plan's."""
    q_lens, ctx_lens, tables = [5, 40, 1], [5, 50, 20], [[3], [4, 5, 6, 7], [8, 9]]
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, 16, torch.device("cpu"), fused=True, split_items=4)
    assert meta.query_start_loc.tolist() == [0, 5, 45, 46]
    assert meta.context_lens.tolist() == ctx_lens
    assert meta.block_tables.tolist() == [[3, 0, 0, 0], [4, 5, 6, 7], [8, 9, 0, 0]]
    assert meta.slot_mapping.tolist()[:6] == [48, 49, 50, 51, 52, 4 * 16 + 10]
    items, merges = prefill_plan(q_lens, ctx_lens, 4)
    assert meta.prefill.items.tolist() == items and meta.prefill.merges.tolist() == merges
    assert meta.prefill.num_parts == sum(merges[3])


@pytest.mark.parametrize("q_lens", [[1], [3], [1, 2], [5, 40, 1], [7, 7, 7], [2, 2, 2, 2, 2]])
def test_every_metadata_view_starts_16_bytes_aligned(q_lens):
    """Triton compiles a kernel variant per pointer alignment: were the views of the packed
    metadata at offsets that follow the step's shape, an eager step of a new shape would compile
    attention kernels while serving. Every pointer the kernels read starts 16 bytes aligned,
    whatever the token and sequence counts (uniform and varlen forms)."""
    ctx_lens = [q + 3 * i for i, q in enumerate(q_lens)]
    tables = [[i + 1] * (-(-c // 16) + i % 2) for i, c in enumerate(ctx_lens)]
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, 16, torch.device("cpu"), fused=True, split_items=4)
    views = [meta.slot_mapping, meta.context_lens, meta.block_tables]
    if meta.prefill is not None:
        views += [meta.query_start_loc, meta.prefill.items, meta.prefill.merges]
    else:
        assert len(set(q_lens)) == 1
    assert all(v.data_ptr() % 16 == 0 for v in views), [v.data_ptr() % 16 for v in views]
    assert meta.context_lens.tolist() == ctx_lens


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("budget", [7, 64])
def test_greedy_with_flash_prefill_matches_transformers(tmp_path, budget):
    """fp32 on the GPU, every prompt's prefill through the flash kernel: chunked (budget 7:
    chunks mid-block, beside decodes) and whole, with prefix-cache hits on the repeated prompt."""
    from jetserve.engine import LLM, SamplingParams

    model = build_qwen3(tmp_path, head_dim=64)
    long = list(range(3, 120))
    prompts = [long, [5, 17, 2, 99, 31, 8, 64], long + [9, 9], [200, 3]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [hf_greedy(model, p, 8) for p in prompts]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=budget)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == want
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == want  # again: the long prompts now hit the prefix cache
    assert llm.engine.scheduler.blocks.num_used == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_greedy_with_context_pieces_matches_transformers(tmp_path):
    """fp32 on the GPU: a 1,500-token prompt in chunks of a 256-token budget beside a decoding
    stream, so that from the third chunk on its tiles see more than PREFILL_MIN_PIECE keys and are
    cut into pieces that the second kernel merges, in graphed mixed steps; greedy tokens equal
    transformers'."""
    from jetserve.engine import LLM, SamplingParams
    from jetserve.engine.model.attention import PREFILL_MIN_PIECE, prefill_split_items

    model = build_qwen3(tmp_path, head_dim=64, max_position_embeddings=2048)
    long = torch.randint(3, 320, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [[5, 17, 2, 99], long]
    assert prefill_plan([255, 1], [3 * 255, 9], prefill_split_items(torch.device("cuda"), 4))[1][0]  # cut
    assert 3 * 255 - 255 + 128 > PREFILL_MIN_PIECE
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [hf_greedy(model, p, 8) for p in prompts]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=2, max_num_batched_tokens=256,
              max_model_len=1600)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == want
