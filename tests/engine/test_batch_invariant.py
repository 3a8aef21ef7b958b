"""Batch-invariant mode (docs/engine.md): a row's logits do not depend on how many rows its step
has nor which step computes them. The fused kernels in Triton's interpreter (tests/conftest.py;
compiled on a GPU): a row's product is the same bits for any row count, and so is its attention
in a decode, a verify and a prefill step; the CPU path on the demo model in bf16: greedy with
MTP drafting gives exactly the tokens of greedy without, and a seeded request the same tokens
alone and in a batch of 8."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jetserve import demo_model_dir
from jetserve.engine import LLM, SamplingParams
from jetserve.engine.config import EngineArgs
from jetserve.engine.model.qwen3 import invariant_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 2, 3, 4, 8, 9, 16]
PROMPTS = json.loads((Path(__file__).parents[2] / "bench" / "mtp_prompts.json").read_text())["prompts"]


def _kernels():
    pytest.importorskip("triton")
    from jetserve.engine.model import kernels

    return kernels


def _products(fused, prologue, x, w, res, norm_w):
    """Each row count's output rows (the product, for the prologues that return a pair)."""
    out = {}
    for m in ROWS + [33]:  # 33: three blocks of rows
        got = fused.skinny_matmul(prologue, x[:m], w, None if res is None else res[:m], norm_w, 1e-6)
        out[m] = got[0] if isinstance(got, tuple) else got
    return out


def _operands(kernels, prologue):
    torch.manual_seed(prologue)
    n, k = 512, 256
    width = 2 * k if prologue == kernels.SILU_MUL else k
    x = torch.randn(33, width, device=DEVICE).to(torch.bfloat16)
    res = torch.randn(33, k, device=DEVICE).to(torch.bfloat16) if prologue == kernels.ADD_NORM else None
    norm_w = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(torch.bfloat16)
    w = (0.05 * torch.randn(n, k, device=DEVICE)).to(torch.bfloat16)
    return x, w, res, norm_w


@pytest.mark.parametrize("prologue", [0, 2, 3])  # PLAIN, ADD_NORM, SILU_MUL
def test_a_rows_product_is_the_same_bits_for_any_row_count(prologue):
    """In the mode one tile per (N, K) over blocks of 16 rows: row r of an M-row product equals
    row r of the 33-row one, for M = 1..16."""
    kernels = _kernels()
    x, w, res, norm_w = _operands(kernels, prologue)
    on = _products(kernels.FusedKernels(batch_invariant=True), prologue, x, w, res, norm_w)
    for m in ROWS:
        assert torch.equal(on[m], on[33][:m]), m


def test_without_the_mode_row_counts_round_differently():
    """The premise of the test above, so that its check can fail: without the mode each row
    count takes its own tile (FMA sums for a few rows, tensor-core dots with split K for more)
    and some rows of some product round differently. Which products do depends on the
    machine's tiles, so the premise is over all three prologues."""
    kernels = _kernels()
    differs = []
    for prologue in (kernels.PLAIN, kernels.ADD_NORM, kernels.SILU_MUL):
        x, w, res, norm_w = _operands(kernels, prologue)
        off = _products(kernels.FusedKernels(), prologue, x, w, res, norm_w)
        differs += [not torch.equal(off[m], off[33][:m]) for m in ROWS]
    assert any(differs)


def _attention_inputs(ctx=300, heads=4, kv_heads=2, head_dim=64, block_size=16):
    """fp16: in Triton's interpreter this kernel's bf16 output is wrong already before the mode
    (values ~1e8; the interpreter's bf16 dots), so bf16 is left to a GPU."""
    torch.manual_seed(1)
    blocks = -(-ctx // block_size)
    k_cache = torch.randn((3 * blocks + 1) * block_size, kv_heads, head_dim, device=DEVICE).to(torch.float16)
    v_cache = torch.randn_like(k_cache)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(3)]
    q = torch.randn(ctx, heads, head_dim, device=DEVICE).to(torch.float16)  # the query of each position
    return q, k_cache, v_cache, tables, block_size, head_dim ** -0.5


def _table(tables):
    return torch.tensor(tables, dtype=torch.int32, device=DEVICE)


def test_a_rows_attention_is_the_same_bits_in_decode_verify_and_prefill():
    """The query at position p of sequence 0: a decode of one sequence, a verify of 4 tokens
    beside two other sequences, and a prefill chunk of mixed lengths (the mode's per-token form)
    give the same bits; the split over the context follows the row's length alone. Without the
    mode the split count follows the batch (programs to fill the GPU): a different count rounds
    some rows differently, which is what the mode removes."""
    kernels = _kernels()
    from jetserve.engine.model.attention import AttentionMetadata

    q, k_cache, v_cache, tables, bs, scale = _attention_inputs()
    fused = kernels.FusedKernels(batch_invariant=True)
    p = 250
    decode = fused.paged_attention(q[p:p + 1], k_cache, v_cache, _table(tables[:1]),
                                   torch.tensor([p + 1], dtype=torch.int32, device=DEVICE), 1, bs, scale)
    verify_q = torch.cat([q[p:p + 4]] * 3)  # sequences 0, 1, 2 verify positions p..p+3
    verify = fused.paged_attention(verify_q, k_cache, v_cache, _table(tables),
                                   torch.tensor([p + 4] * 3, dtype=torch.int32, device=DEVICE), 4, bs, scale)
    meta = AttentionMetadata.build([20, 3, 7], [p + 1, 40, 9], tables, bs, torch.device(DEVICE), fused=True,
                                   invariant=True)
    prefill_q = torch.cat([q[p - 19:p + 1], q[:10]])
    prefill = fused.paged_attention(prefill_q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.q_len,
                                    bs, scale, token_rows=meta.token_rows)
    assert torch.equal(verify[0], decode[0]) and torch.equal(prefill[19], decode[0])
    lens = torch.tensor([p + 1], dtype=torch.int32, device=DEVICE)
    few, many = (kernels.paged_attention(q[p:p + 1], k_cache, v_cache, _table(tables[:1]), lens, 1, bs, scale, s)
                 for s in (3, kernels.MAX_SPLITS))
    assert not torch.equal(few, many)


def test_cpu_products_give_a_row_the_same_bits_for_any_row_count():
    """The torch path's products in the mode (`invariant_linear`): a row's bits whatever the row
    count (decode 1, verify k+1, prefill chunks) and wherever it sits among them, on this
    machine's torch and ISA (torch's own matmul does not promise it: on AMX CPUs a one-row bf16
    product differs)."""
    torch.manual_seed(0)
    for n, k in [(768, 256), (8192, 256), (3072, 1024)]:
        w, x = torch.randn(n, k).to(torch.bfloat16), torch.randn(600, k).to(torch.bfloat16)
        full = invariant_linear(x, w)
        assert torch.allclose(full.float(), F.linear(x, w).float(), rtol=0.02, atol=0.5)
        for m in [1, 2, 4, 9, 16, 65, 512]:
            assert torch.equal(invariant_linear(x[:m], w), full[:m]), (n, k, m)
            assert torch.equal(invariant_linear(x[3:3 + m], w), full[3:3 + m]), (n, k, m)


def test_the_mode_is_one_setting():
    """`--batch-invariant`, `LLM(batch_invariant=...)`: resolved once; off by default on a CPU,
    where it costs the compiled decode steps (their reductions have their own order)."""
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["demo", "--batch-invariant"]))
    assert args.batch_invariant is True
    on = args.resolve(device="cpu")
    assert on.batch_invariant and on.cpu_compile is None
    assert EngineArgs(model="demo").resolve(device="cpu").batch_invariant is False
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineArgs(model="demo", batch_invariant="yes").resolve(device="cpu")


COMMON = {"dtype": "bfloat16", "batch_invariant": True, "max_model_len": 256, "max_num_seqs": 16,
          "enable_prefix_caching": False}


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain_greedy():
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return params, _tokens(LLM(demo_model_dir(), **COMMON).generate(PROMPTS[:16], params, use_tqdm=False))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_drafting_is_greedy_without_in_bf16(plain_greedy, k):
    """The demo model in bf16, 16 held-out prompts (bench/mtp_prompts.json) batched: drafting k
    verifies k+1 rows a step where plain decoding computes one, and prefill chunks share steps
    with decodes; in the mode the tokens are exactly plain greedy's. (Without it, these prompts
    diverge within 64 tokens: docs/engine.md.)"""
    params, plain = plain_greedy
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
    llm = LLM(demo_model_dir(), speculative_config=spec, **COMMON)
    assert _tokens(llm.generate(PROMPTS[:16], params, use_tqdm=False)) == plain
    assert llm.engine.stats().num_accepted_tokens > 0


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch_of_8():
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, seed=7 + i)
              for i in range(8)]
    llm = LLM(demo_model_dir(), **COMMON)
    alone = _tokens(llm.generate(PROMPTS[16:17], params[:1], use_tqdm=False))[0]
    batch = _tokens(llm.generate(PROMPTS[16:24], params, use_tqdm=False))
    assert batch[0] == alone
