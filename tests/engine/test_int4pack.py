"""torch's W4A16 kernel (model/int4pack.py): where it applies, and the arithmetic of our
conversion. Its table of scales and offsets is the same on the CPU and on CUDA (only the
packing of the integers differs), so torch's CPU build of the kernel checks in CI that every
INT4 format's zero points become the right offsets; on a GPU, a projection in tinygemm's layout
against its dequantized weight at 1 to 300 rows (the prologues run apart), and an INT4 engine's
prompt logprobs against the same checkpoint through the Triton INT4 kernels. On the CPU the
kernel's own CPU build: a projection and the demo engine."""

import pytest
import torch

from jetserve.engine.model import int4pack, quant

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("group,sym", [(32, True), (64, False), (128, False), (256, True)])
def test_scales_and_offsets_reproduce_the_dequantized_weight(group, sym):
    """(q - 8) * s + (8 - z) * s is (q - z) * s: the CPU kernel over our integers and table
    gives the fp32 product of the dequantized weight, to bf16's rounding; a zero point off by
    one does not."""
    torch.manual_seed(group)
    n, k = 48, 512  # the CPU kernel's N: a multiple of 16
    w = quant.quantize(torch.randn(n, k), 4, group, sym)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(quant.integers(w), 2)
    x = torch.randn(3, k).to(torch.bfloat16)
    want = x.float() @ quant.dequantize(w, torch.float32).t()
    zeros = quant.zero_points(w)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, int4pack.scales_zeros(zeros, w.scales))
    assert _relative(got, want) < 6e-3
    off = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, int4pack.scales_zeros(zeros + 1, w.scales))
    assert _relative(off, want) > 5e-2


def _cuda_layout(q: torch.Tensor, inner: int) -> torch.Tensor:
    """torch's CUDA packing (matrix_to_m16n8k16_Bint4_layout) in torch ops: nibble 4 low + i of
    word j of lane t in tile (tn, tk) holds q[8 tn + t // 4, 16 inner tk + 32 j + 8 i + 2 (t % 4) + low]."""
    n, k = q.shape
    v = q.view(n // 8, 8, k // (16 * inner), inner // 2, 4, 4, 2)  # [tn, t // 4, tk, j, i, t % 4, low]
    v = v.permute(0, 2, 1, 5, 3, 6, 4).reshape(n // 8, k // (16 * inner), 32, inner // 2, 8)  # [..., 4 low + i]
    words = (v.to(torch.int64) << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("inner,group", [(8, 128), (4, 32), (2, 64)])
def test_prefill_dequantizes_the_tinygemm_layout(inner, group):
    """Many rows take cuBLAS over the weight dequantized from tinygemm's layout (a Triton kernel:
    its interpreter without a GPU, on the layout torch's CUDA packing makes, written out above;
    with one, on that packing itself) into (q - 8) * s + (8 - z) * s from the bf16 table, each
    weight rounded once."""
    pytest.importorskip("triton")
    from jetserve.engine.model.quant_kernels import dequantize_int4pack

    device = "cuda" if GPU else "cpu"
    torch.manual_seed(inner)
    n, k = 40, 384
    w = quant.quantize(torch.randn(n, k, device=device), 4, group, sym=False)
    q, zeros = quant.integers(w), quant.zero_points(w)
    if GPU:
        words = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), inner)
    else:
        words = _cuda_layout(q, inner)
    packed = int4pack.Int4PackedWeight(words, int4pack.scales_zeros(zeros, w.scales), group)
    sz = packed.scales_zeros.float().repeat_interleave(group, dim=0)  # [K, N, 2]
    want = (q.float() - 8) * sz[..., 0].t() + sz[..., 1].t()
    got = dequantize_int4pack(packed, torch.bfloat16).float()
    # within one bf16 step of each weight (the interpreter rounds toward zero, a GPU to nearest)
    assert ((got - want).abs() <= want.abs() * 2**-7 + 1e-6).all()


def test_where_it_applies():
    """INT4 in groups the kernel takes, K a multiple of 32, bf16 activations: on the CPU, N a
    multiple of 16 and any size (the CPU has no fused kernels to keep); on a CUDA sm80+ GPU, N a
    multiple of 8, projections of MIN_WEIGHTS or more, and only where the span layout's MMA
    kernel does not take the shape (a group of 64, N not a multiple of 16)."""
    cpu = torch.device("cpu")
    assert int4pack.applies(4, 128, 48, 256, torch.bfloat16, cpu)
    for bits, group, n, k, dtype in [(8, 128, 48, 256, torch.bfloat16), (4, 96, 48, 384, torch.bfloat16),
                                     (4, 128, 40, 256, torch.bfloat16), (4, 128, 48, 256, torch.float32)]:
        assert not int4pack.applies(bits, group, n, k, dtype, cpu), (bits, group, n, k, dtype)
    assert [int4pack.inner_k_tiles(k) for k in (256, 192, 96, 48)] == [8, 4, 2, None]
    big = int4pack.MIN_WEIGHTS // 256
    # what the memory plan asks of a board, no GPU needed
    assert int4pack.takes(4, 128, big, 256, torch.bfloat16, "cpu")
    assert not int4pack.takes(4, 128, big, 256, torch.bfloat16, "cuda")  # the MMA kernel's
    assert int4pack.takes(4, 64, big, 256, torch.bfloat16, "cuda")  # a group the MMA kernel does not take
    assert int4pack.takes(4, 128, big + 8, 256, torch.bfloat16, "cuda")  # N not a multiple of 16
    if not GPU:
        return
    cuda = torch.device("cuda")
    assert int4pack.applies(4, 64, big, 256, torch.bfloat16, cuda)
    for bits, group, n, k, dtype in [(8, 64, big, 256, torch.bfloat16), (4, 96, big, 384, torch.bfloat16),
                                     (4, 64, big - 4, 256, torch.bfloat16), (4, 64, big, 256, torch.float16),
                                     (4, 64, big, 256, torch.float32), (4, 64, big // 2, 256, torch.bfloat16),
                                     (4, 128, big, 256, torch.bfloat16)]:
        assert not int4pack.applies(bits, group, n, k, dtype, cuda), (bits, group, n, k, dtype)


def test_a_cpu_projection_in_tinygemm_layout_is_its_dequantized_weight():
    """On the CPU every INT4 projection of a bf16 engine takes torch's CPU kernel, at any row count."""
    torch.manual_seed(0)
    n, k = 96, 512
    w = quant.quantize(torch.randn(n, k) / k**0.5, 4, 128, sym=False)
    layer = quant.QuantLinear(k, n, 4, 128, has_zeros=True, tinygemm="cpu")
    layer.load(w)
    assert layer.weight.shape == (n, k) and layer.packed.dtype == torch.uint8
    dense = quant.dequantize(w, torch.float32)
    for m in (1, 5, 70):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        assert _relative(layer(x), x.float() @ dense.t()) < 6e-3, m


def _prompt_scores(llm, prompts) -> list[float]:
    from jetserve.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [lp[t].logprob for o, p in zip(outs, prompts) for lp, t in zip(o.prompt_logprobs[1:], p[1:])]


def test_an_int4_cpu_engine_runs_bf16_through_the_kernel(monkeypatch):
    """--quantization int4 on the CPU: bf16 by default (the kernel's dtype), every projection in
    the CPU kernel's layout, scoring the demo's prompts as the same weights dequantized do."""
    import jetserve
    from jetserve.engine import LLM

    demo = str(__import__("pathlib").Path(jetserve.__file__).parent / "models" / "demo")
    prompts = [list(range(300, 340)), [5, 17, 2, 99, 31, 8, 64, 3, 1000, 77]]
    args = dict(device="cpu", max_num_seqs=2, max_model_len=128, quantization="int4", enforce_eager=True)
    llm = LLM(demo, **args)
    assert llm.engine.config.dtype == "bfloat16"
    layers = llm.engine.runner.model.layers
    assert all(m.tinygemm == "cpu" for layer in layers for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
    ours = _prompt_scores(llm, prompts)
    del llm
    monkeypatch.setattr(int4pack, "applies", lambda *args: False)  # quant.py's layout: dequantize, then multiply
    llm = LLM(demo, **args)
    assert not llm.engine.runner.model.layers[0].mlp.down_proj.tinygemm
    theirs = _prompt_scores(llm, prompts)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 0.1


@pytest.mark.skipif(not GPU, reason="tinygemm's CUDA kernel needs an sm80+ GPU")
@pytest.mark.parametrize("m", [1, 3, 8, 64, 300])
def test_a_projection_in_tinygemm_layout_is_its_dequantized_weight(m):
    from jetserve.engine.model import kernels
    from jetserve.engine.model.quant_kernels import QuantFusedKernels

    torch.manual_seed(m)
    n, k = 384, 1024
    w = quant.quantize(torch.randn(n, k, device="cuda") / k**0.5, 4, 128, sym=False)
    layer = quant.QuantLinear(k, n, 4, 128, has_zeros=True, tinygemm="cuda").cuda()
    layer.load(w)
    layer.kernels = QuantFusedKernels()  # more than MAX_ROWS rows: cuBLAS over the dequantized weight
    assert layer.weight.shape == (n, k)
    dense = quant.dequantize(w, torch.float32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert _relative(layer(x), x.float() @ dense.t()) < 6e-3
    # a few rows through the engine's kernels: RMSNorm of x + residual, then the product
    res = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    out, total = QuantFusedKernels().skinny_matmul(kernels.ADD_NORM, x, layer.weight, res, norm_w, 1e-6)
    h = (x.float() + res.float())
    h = norm_w.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert _relative(out, h @ dense.t()) < 1e-2
    torch.testing.assert_close(total, x + res)


@pytest.mark.skipif(not GPU, reason="tinygemm's CUDA kernel needs an sm80+ GPU")
def test_an_int4_engine_scores_prompts_as_the_triton_kernels_do(tmp_path, monkeypatch):
    """Prompt logprobs (prefill: the dequantized weight) and the first token (decode: tinygemm)
    of an INT4 engine in tinygemm's layout against the same checkpoint in quant.py's."""
    from jetserve.engine import LLM

    from tests.engine.builders import build_qwen3

    build_qwen3(tmp_path, seed=7, vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    prompts = [[5, 17, 2, 99, 31, 8, 64, 3], list(range(40, 90))]

    with monkeypatch.context() as patch:
        patch.setattr(int4pack, "MIN_WEIGHTS", 0)  # this model's projections are small
        from jetserve.engine.model import mma_kernels

        patch.setattr(mma_kernels, "takes", lambda *shape: False)  # and the MMA kernel would take them
        llm = LLM(str(tmp_path), dtype="bfloat16", quantization="int4", max_num_seqs=2, max_model_len=128)
    assert llm.engine.runner.model.layers[0].mlp.down_proj.tinygemm
    ours = _prompt_scores(llm, prompts)
    del llm
    llm = LLM(str(tmp_path), dtype="bfloat16", quantization="int4", max_num_seqs=2, max_model_len=128)
    assert not llm.engine.runner.model.layers[0].mlp.down_proj.tinygemm
    theirs = _prompt_scores(llm, prompts)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 0.1
