"""The flash prefill kernel against plain attention over the same paged cache: a mixed step of
chunks and decodes in one launch — odd lengths, chunks starting mid-block, a prefix-cache hit
(blocks shared with another sequence), GQA, head_dim 64 and 128, several tiles a sequence. On a
GPU it runs compiled; without one in Triton's interpreter (tests/conftest.py). End to end on the
GPU: greedy tokens with chunked prefill and prefix caching equal transformers'."""

import pytest
import torch

pytest.importorskip("triton")

from jetserve.engine.model.attention import AttentionMetadata, prefill_tiles  # noqa: E402
from jetserve.engine.model.flash_prefill import prefill_attention  # noqa: E402

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


# bf16 on the GPU only: the interpreter's tl.dot returns garbage for bf16 operands (Triton 3.x).
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4)] + [(torch.bfloat16, 3e-2)] * (DEVICE == "cuda"))
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (2, 1, 128), (3, 3, 24)])
@pytest.mark.parametrize("block_m", [16 if DEVICE == "cpu" else 128])  # small tiles: several a sequence
def test_mixed_step(dtype, tol, heads, kv_heads, head_dim, block_m):
    torch.manual_seed(heads * head_dim + block_m)
    q_lens, ctx_lens = [q for q, _ in STEP], [c for _, c in STEP]
    blocks, tables = iter(range(1, 100)), []
    for q_len, ctx in STEP:
        tables.append([next(blocks) for _ in range(-(-ctx // BLOCK_SIZE))])
    tables[3][:2] = tables[0][:2]  # the prefix-cache hit: 32 tokens in the first sequence's blocks
    slots = 40 * BLOCK_SIZE
    k_cache = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(slots, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    q = torch.randn(sum(q_lens), heads, head_dim, dtype=dtype, device=DEVICE)
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, BLOCK_SIZE, torch.device(DEVICE), fused=True)
    tiles = torch.tensor(prefill_tiles(q_lens, ctx_lens, block_m), dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    got = prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, tiles,
                            scale, BLOCK_SIZE, block_m)
    want = reference(q, k_cache, v_cache, tables, q_lens, ctx_lens, scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_varlen_metadata():
    """The host side: tiles cover every query row once, the longest context first; slots,
    starts and tables are what the SDPA path reads."""
    q_lens, ctx_lens, tables = [5, 40, 1], [5, 50, 20], [[3], [4, 5, 6, 7], [8, 9]]
    seqs, rows = prefill_tiles(q_lens, ctx_lens, 16)
    covered = sorted((b, m0 + i) for b, m0 in zip(seqs, rows) for i in range(min(16, q_lens[b] - m0)))
    assert covered == [(b, r) for b, q in enumerate(q_lens) for r in range(q)]
    assert (seqs[0], rows[0]) == (1, 32)  # the tile whose last row sees 50 keys
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, 16, torch.device("cpu"), fused=True)
    assert meta.query_start_loc.tolist() == [0, 5, 45, 46]
    assert meta.context_lens.tolist() == ctx_lens
    assert meta.block_tables.tolist() == [[3, 0, 0, 0], [4, 5, 6, 7], [8, 9, 0, 0]]
    assert meta.slot_mapping.tolist()[:6] == [48, 49, 50, 51, 52, 4 * 16 + 10]
    assert meta.query_tiles.tolist() == prefill_tiles(q_lens, ctx_lens)


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
