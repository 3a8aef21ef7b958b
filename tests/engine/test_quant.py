"""Weight-only quantization: AWQ and GPTQ checkpoints packed by AutoAWQ (the library's own
quantizer formula and packing code, not ours) load, dequantize bit-exactly to AutoAWQ's
reference and generate transformers' greedy tokens for their dequantized twin; INT8/INT4 on
the fly; the W8A16/W4A16 kernels against torch (Triton's interpreter without a GPU); the memory
plan on the Jetson boards."""

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.model import int8pack, quant
from jetserve.engine.model.checkpoint import Checkpoint, CheckpointError
from jetserve.engine.config import QuantizationConfig

from tests.engine.builders import build_qwen3, hf_greedy
from tests.tools import compile_for_gpus, require_module


# Every input dim a multiple of the group size 128.
SHAPE = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
PROMPTS = [[5, 17, 2, 99, 31, 8, 64], list(range(40, 63))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _awq_pack(weight: torch.Tensor):
    """AutoAWQ's round-to-nearest quantizer (zero points, group 128) and its GEMM packer."""
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer

    quantizer = AwqQuantizer.__new__(AwqQuantizer)  # its formula needs only these three settings
    quantizer.w_bit, quantizer.group_size, quantizer.zero_point = 4, 128, True
    fake, scales, zeros = quantizer.pseudo_quantize_tensor(weight.detach().clone())
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = fake
    packed = WQLinear_GEMM.from_linear(linear, 4, 128, False, scales.t().contiguous(), zeros.t().contiguous())
    return packed.qweight, packed.qzeros, packed.scales


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(AWQ dir, GPTQ dir, transformers twin with AutoAWQ's dequantized weights, its greedy tokens)."""
    require_module("awq")  # the test extra installs it where CI runs (x86-64 Linux)
    from awq.utils.packing_utils import dequantize_gemm, unpack_reorder_pack

    root = tmp_path_factory.mktemp("quant")
    base = root / "base"
    model = build_qwen3(base, seed=3, **SHAPE)
    state = load_file(base / "model.safetensors")
    awq, gptq = dict(state), dict(state)
    twin = model.state_dict()
    for i in range(SHAPE["num_hidden_layers"]):
        for proj in PROJECTIONS:
            name = f"model.layers.{i}.{proj}"
            qweight, qzeros, scales = _awq_pack(awq.pop(f"{name}.weight"))
            awq.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales})
            g_qweight, g_qzeros = unpack_reorder_pack(qweight, qzeros, 4)  # AutoAWQ's AWQ -> GPTQ (v1) layout
            del gptq[f"{name}.weight"]
            gptq.update({f"{name}.qweight": g_qweight, f"{name}.qzeros": g_qzeros, f"{name}.scales": scales,
                         f"{name}.g_idx": torch.arange(qweight.shape[0], dtype=torch.int32) // 128})
            twin[f"{name}.weight"] = dequantize_gemm(qweight, qzeros, scales.float(), 4, 128).t()  # in fp32
    config = json.loads((base / "config.json").read_text())
    dirs = []
    for fmt, tensors, qc in [
        ("awq", awq, {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}),
        ("gptq", gptq, {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": False}),
    ]:
        path = root / fmt
        path.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        dirs.append(path)
    model.load_state_dict(twin)
    return *dirs, model, [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_dequantizes_bit_exactly_to_autoawq(quantized, fmt):
    from awq.utils.packing_utils import dequantize_gemm

    path = quantized[0] if fmt == "awq" else quantized[1]
    ckpt = Checkpoint(path)
    config = QuantizationConfig.resolve(ckpt.config, None, "auto")
    reference = Checkpoint(quantized[0])
    for proj in PROJECTIONS:
        name = f"model.layers.1.{proj}"
        ours = quant.dequantize(quant.read_quantized(ckpt, [name], config), torch.float16)
        theirs = dequantize_gemm(*(reference.get(f"{name}.{t}") for t in ("qweight", "qzeros", "scales")), 4, 128)
        assert torch.equal(ours, theirs.t()), proj


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_greedy_tokens_equal_the_dequantized_twin(quantized, fmt):
    path = quantized[0] if fmt == "awq" else quantized[1]
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=4)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj, quant.QuantLinear)
    assert model.layers[0].self_attn.qkv_proj.weight.bits == 4
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == quantized[3]


def test_gptq_v2_and_act_order(quantized, tmp_path):
    """checkpoint_format gptq_v2 stores true zero points; act-order is refused by name."""
    config = json.loads((quantized[1] / "config.json").read_text())
    v2 = QuantizationConfig.resolve({**config, "quantization_config": {**config["quantization_config"],
                                                                      "checkpoint_format": "gptq_v2"}}, None, "auto")
    assert v2.zero_offset == 0 and QuantizationConfig.resolve(config, None, "auto").zero_offset == 1
    with pytest.raises(CheckpointError, match="desc_act"):
        QuantizationConfig.resolve({"quantization_config": {"quant_method": "gptq", "desc_act": True}}, None, "auto")
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        QuantizationConfig.resolve(config, "int8", "auto")


def test_gptq_8bit_layout():
    """8-bit GPTQ: four bytes a word along the input dim, natural order (packed here by formula)."""
    torch.manual_seed(0)
    n, k, group = 16, 256, 128
    q = torch.randint(0, 256, (k, n), dtype=torch.int64)
    z = torch.randint(1, 255, (k // group, n), dtype=torch.int64)
    scales = torch.rand(k // group, n, dtype=torch.float16) / 100
    shifts = torch.arange(0, 32, 8)
    qweight = (q.view(k // 4, 4, n) << shifts[None, :, None]).sum(1).to(torch.int32)  # wraps like int32 packing
    qzeros = ((z - 1).view(k // group, n // 4, 4) << shifts).sum(-1).to(torch.int32)  # v1: zero - 1
    w = quant.from_gptq(qweight, qzeros, scales, 8, group, zero_offset=1)
    expected = ((q - z.repeat_interleave(group, 0)).to(torch.float16) * scales.repeat_interleave(group, 0)).t()
    assert torch.equal(quant.dequantize(w, torch.float16), expected)


@pytest.mark.parametrize("bits", [4, 8])
def test_span_layout(bits):
    """Field i of word j of a span holds input column span * c + 16 i + j: 16 words' field i is a
    run of 16 columns (what the kernels load activations for)."""
    fields = 32 // bits
    q = torch.randint(0, 2**bits, (3, 2 * 16 * fields))
    words = quant.pack(q, bits)
    assert words.shape == (3, 2 * 16) and words.dtype == torch.int32
    for c, i, j in [(0, 0, 0), (0, fields - 1, 15), (1, 2, 7), (1, fields - 1, 0)]:
        field = (words[:, 16 * c + j] >> (i * bits)) & (2**bits - 1)
        assert torch.equal(field, q[:, 16 * fields * c + 16 * i + j].to(torch.int32))
    assert torch.equal(quant.integers(quant.QuantizedWeight(words, torch.ones(3, 1), None, bits, q.shape[1])), q)
    with pytest.raises(ValueError, match="multiple of"):
        quant.pack(q[:, :-16], bits)


@pytest.mark.parametrize("bits,group,sym", [(8, -1, True), (4, 128, False)])
def test_on_the_fly_round_trip(bits, group, sym):
    """Each weight comes back within half a step; quantizing what came back gives the same integers."""
    torch.manual_seed(bits)
    weight = torch.randn(64, 256) * 0.05
    w = quant.quantize(weight, bits, group, sym)
    back = quant.dequantize(w, torch.float32)
    step = w.scales.repeat_interleave(w.group_size, dim=1)
    assert ((back - weight).abs() <= step / 2 + 1e-7).all()
    again = quant.quantize(back, bits, group, sym)
    assert torch.equal(quant.integers(again), quant.integers(w))
    assert w.qweight.numel() * w.qweight.element_size() == weight.numel() * bits // 8


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_on_the_fly_engine_equals_its_dequantized_twin(tmp_path, method):
    """--quantization int8 / int4: every projection quantized, the vocab projection INT8 per
    channel and the tied embedding read from it (no float table left); the MTP-less model
    generates the tokens transformers generates with the same dequantized weights."""
    model = build_qwen3(tmp_path, seed=5, **SHAPE)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_seqs=4, quantization=method)
    ours = llm.engine.runner.model
    assert isinstance(ours.lm_head, quant.QuantLinear) and ours.lm_head.bits == 8 and ours.lm_head.int8mm  # a CPU's
    assert isinstance(ours.embed_tokens, quant.QuantEmbedding) and ours.embed_tokens.head[0] is ours.lm_head
    assert not any("embed" in name for name, _ in ours.named_parameters())
    twin = model.state_dict()
    twin["model.embed_tokens.weight"] = _float(ours.lm_head)  # tied: the head too
    bits = int(method[-1])
    for i, layer in enumerate(ours.layers):
        qkv = _float(layer.self_attn.qkv_proj)
        q_rows, kv_rows = 4 * 32, 2 * 32
        for name, part in zip(("q_proj", "k_proj", "v_proj"), qkv.split([q_rows, kv_rows, kv_rows])):
            twin[f"model.layers.{i}.self_attn.{name}.weight"] = part
        gate, up = _float(layer.mlp.gate_up_proj).chunk(2)
        twin[f"model.layers.{i}.mlp.gate_proj.weight"], twin[f"model.layers.{i}.mlp.up_proj.weight"] = gate, up
        twin[f"model.layers.{i}.self_attn.o_proj.weight"] = _float(layer.self_attn.o_proj)
        twin[f"model.layers.{i}.mlp.down_proj.weight"] = _float(layer.mlp.down_proj)
        assert layer.mlp.down_proj.bits == bits and layer.mlp.down_proj.int8mm == (bits == 8)  # INT8: a CPU's kernel
    model.load_state_dict(twin)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]


def _float(linear: quant.QuantLinear) -> torch.Tensor:
    """The weight a projection's products see, fp32 (fp32 activations: no tinygemm layout)."""
    assert not linear.tinygemm
    if linear.int8mm:
        return int8pack.dequantize(linear.weight, torch.float32)
    return quant.dequantize(linear.weight, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_on_a_cpu_takes_torchs_kernel(dtype):
    """INT8 per channel on a CPU loads into torch's `_weight_int8pack_mm` layout (a block of rows
    at a time, as the loader's): its products and a tied embedding's rows are those of the
    dequantized weight (bf16: its scales in bf16, the kernel's rounding)."""
    assert int8pack.applies(8, -1, 256, False, "cpu") and not int8pack.applies(8, -1, 256, False, "cuda")
    assert not int8pack.applies(8, 128, 256, False, "cpu") and not int8pack.applies(4, -1, 256, False, "cpu")
    torch.manual_seed(7)
    w = quant.quantize(torch.randn(40, 256), 8, -1, True)
    head = quant.QuantLinear(256, 40, 8, -1, has_zeros=False, int8pack_dtype=dtype)
    assert head.int8mm and "int8pack" in repr(head)
    for lo in (0, 24):
        head.load(quant.quant_rows(w, slice(lo, lo + 24)), row=lo)
    dense = quant.dequantize(w, torch.float32)
    x = torch.randn(3, 256).to(dtype)
    tight = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(head(x).float(), F.linear(x.float(), dense), **tight)
    assert head(x).dtype == dtype
    ids = torch.tensor([[39, 0], [7, 7]])
    want = dense[ids] if dtype == torch.float32 else int8pack.dequantize(head.weight, torch.float32)[ids]
    torch.testing.assert_close(quant.QuantEmbedding(head, torch.float32)(ids), want, rtol=0, atol=0)


def test_big_projections_load_and_multiply_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """Past MAX_DEQUANTIZED weights (a vocab projection) a float tensor is read and quantized a
    block of rows at a time, and a product off the fused kernels dequantizes a block at a time:
    the same integers, scales and logits as at once."""
    build_qwen3(tmp_path, seed=6, **SHAPE)
    whole = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_seqs=2, quantization="int8")
    head = whole.engine.runner.model.lm_head.weight
    monkeypatch.setattr(quant, "MAX_DEQUANTIZED", 200 * SHAPE["hidden_size"])  # the vocab's 320 rows: 200 + 120
    calls = []
    real = quant.quantize
    monkeypatch.setattr(quant, "quantize", lambda w, *a: calls.append(w.shape[0]) or real(w, *a))
    blocked = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_seqs=2, quantization="int8")
    rows = blocked.engine.runner.model.lm_head.weight
    assert 200 in calls and 120 in calls and 320 not in calls  # the vocab in blocks; the layers' projections whole
    assert all(torch.equal(a, b) for a, b in zip(head, rows))
    w = real(torch.randn(SHAPE["vocab_size"], SHAPE["hidden_size"]), 8, -1, True)  # quant.py's layout, as a GPU's
    x = torch.randn(3, SHAPE["hidden_size"])
    torch.testing.assert_close(quant.float_product(x, w), F.linear(x, quant.dequantize(w, torch.float32)),
                               rtol=1e-6, atol=1e-6)


def test_an_awq_checkpoints_mtp_heads_requantize_to_int8(tmp_path):
    """The demo packed by AutoAWQ, MTP layer included: speculative_config's `"quantization":
    "int8"` requantizes the packed MTP projections (no float tensor of theirs exists), the base
    stays AWQ's INT4, and the vocab projection stays the checkpoint's bf16."""
    require_module("awq")
    import shutil

    import jetserve

    demo = __import__("pathlib").Path(jetserve.__file__).parent / "models" / "demo"
    path = tmp_path / "awq"
    shutil.copytree(demo, path)
    shard = next(path.glob("model-*.safetensors"))
    tensors = load_file(shard)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:  # every layer's, the MTP layer's too
        qweight, qzeros, scales = _awq_pack(tensors.pop(name).float())
        prefix = name.removesuffix(".weight")
        tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
    save_file({k: v.contiguous() for k, v in tensors.items()}, shard)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: shard.name for name in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "gemm"}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), device="cpu", max_num_seqs=1, max_model_len=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1, "quantization": "int8"})
    model = llm.engine.runner.model
    assert model.mtp[0].block.mlp.down_proj.bits == 8 and model.layers[0].mlp.down_proj.bits == 4
    assert not isinstance(model.lm_head, quant.QuantLinear) and not isinstance(model.embed_tokens, quant.QuantEmbedding)
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 10


def test_mtp_heads_follow_the_base_or_the_speculative_config():
    """The demo's MTP layer: quantized with the base by default, kept in the model dtype or made INT8
    by speculative_config's `quantization`."""
    import jetserve

    demo = str(__import__("pathlib").Path(jetserve.__file__).parent / "models" / "demo")
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    cases = [("int4", "auto", 4), ("int4", "none", None), ("int4", "int8", 8), (None, "int8", 8)]
    for method, draft, bits in cases:
        llm = LLM(demo, device="cpu", max_num_seqs=1, max_model_len=64, quantization=method,
                  speculative_config={**spec, "quantization": draft})
        fc = llm.engine.runner.model.mtp[0].block.mlp.down_proj
        assert (fc.bits if isinstance(fc, quant.QuantLinear) else None) == bits, (method, draft)


# --- kernels ---------------------------------------------------------------------------------------------------

# INT8 on the fly (one group a row), AWQ/INT4 (a word's fields in one group), GPTQ 8-bit, symmetric
# INT4, groups smaller than a span of words (scales and zero points a weight)
FORMATS = [(8, -1, True), (4, 128, False), (8, 128, False), (4, 128, True), (4, 32, True)]


@pytest.mark.parametrize("bits,group,sym", FORMATS)
@pytest.mark.parametrize("m", [1, 3])
def test_quant_kernel_prologues(bits, group, sym, m):
    """Against dequantize + torch: N not a tile multiple, K in several tiles of words (the next
    one in flight) and in one partly masked tile; K split over programs (a partial last split),
    the prologue in its own kernel."""
    require_module("triton")
    from jetserve.engine.model import kernels
    from jetserve.engine.model.kernels import Tile
    from jetserve.engine.model.quant_kernels import quant_matmul

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(m + bits)
    eps = 1e-6
    split_and_apart = [(384, Tile(8, 16, 4, 3, True)), (640, Tile(4, 16, 4, 3))] if m == 1 else []
    for k, tile in [(384, Tile(8, 16, 4)), (256, Tile(4, 64, 4))] + split_and_apart:
        n = 37
        w = quant.quantize(torch.randn(n, k) / 8, bits, group, sym)
        w = quant.QuantizedWeight(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in w))
        cases, h = prologue_cases(m, k, quant.dequantize(w, torch.float32), device, eps)
        for prologue, ((inp, residual, nw), want) in cases.items():
            got = quant_matmul(tile, prologue, inp, w, residual, nw, eps)
            if prologue == kernels.ADD_NORM:
                torch.testing.assert_close(got[1], h, rtol=0, atol=0)
            got = got[0] if isinstance(got, tuple) else got
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{prologue} k={k} {tile}")


def prologue_cases(m: int, k: int, dense: torch.Tensor, device: str, eps: float):
    """Inputs of each fused prologue over m rows and their dequantize + torch reference:
    {prologue: ((input, residual, norm weight), expected)}, and x + residual (ADD_NORM's second output)."""
    from jetserve.engine.model import kernels

    x, res = torch.randn(m, k, device=device), torch.randn(m, k, device=device)
    gate_up, norm_w = torch.randn(m, 2 * k, device=device), torch.rand(k, device=device) + 0.5
    h = x + res
    rms = lambda v: norm_w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731
    return {kernels.PLAIN: ((x, None, None), F.linear(x, dense)),
            kernels.NORM: ((x, None, norm_w), F.linear(rms(x), dense)),
            kernels.ADD_NORM: ((x, res, norm_w), F.linear(rms(h), dense)),
            kernels.SILU_MUL: ((gate_up, None, None), F.linear(F.silu(gate_up[:, :k]) * gate_up[:, k:], dense))}, h


@pytest.mark.parametrize("bits,group,sym", FORMATS)
def test_quant_gemv_kernel(bits, group, sym):
    """The one-row kernel against dequantize + torch, every prologue: N not a multiple of the
    tile's rows (the rows past it read the last one, unstored), K in several steps (the next in
    flight, or pipelined: Tile.stages), K split over programs with a partial last split, the
    prologue apart, a step over two groups (a scale and zero point a word); groups smaller than a
    span of words take none of its tiles."""
    require_module("triton")
    from jetserve.engine.model import kernels
    from jetserve.engine.model.kernels import Tile
    from jetserve.engine.model.quant_kernels import fitting_tiles, quant_matmul

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(bits + group)
    eps, n, k = 1e-6, 37, 512 if group == -1 else 640  # with groups, the last of two splits is partial
    w = quant.quantize(torch.randn(n, k) / 8, bits, group, sym)
    w = quant.QuantizedWeight(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in w))
    step = 32 if group == -1 else group * bits // 32  # words a step: a group's, or any that divides K
    tiles = {Tile(16, step, 1, one_row=True): (kernels.PLAIN, kernels.NORM, kernels.ADD_NORM, kernels.SILU_MUL),
             Tile(8, step, 1, 2, one_row=True): (kernels.NORM, kernels.ADD_NORM),
             Tile(16, step, 1, apart=True, one_row=True): (kernels.SILU_MUL,),
             Tile(8, step, 1, 2, one_row=True, stages=3): (kernels.PLAIN, kernels.ADD_NORM)}  # tile: prologues
    wide = quant.quantize(torch.randn(n, 1024) / 8, bits, group, sym)  # K of a whole number of the candidates' steps
    wide = quant.QuantizedWeight(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in wide))
    fitting = [t for t in fitting_tiles(1, wide, kernels.NORM) if t.one_row]
    if group % quant.span(bits) and group != -1:
        assert not fitting
        return
    assert fitting and not [t for t in fitting_tiles(2, wide) if t.one_row]
    cases, h = prologue_cases(1, k, quant.dequantize(w, torch.float32), device, eps)
    runs = [(tile, p, w, cases) for tile, prologues in tiles.items() for p in prologues]
    if group != -1:  # a step over two groups, two splits
        wide_cases, _ = prologue_cases(1, 1024, quant.dequantize(wide, torch.float32), device, eps)
        runs += [(Tile(8, 2 * step, 1, 2, one_row=True), p, wide, wide_cases) for p in (kernels.PLAIN, kernels.SILU_MUL)]
    for tile, prologue, weight, inputs in runs:
        (inp, residual, nw), want = inputs[prologue]
        got = quant_matmul(tile, prologue, inp, weight, residual, nw, eps)
        if prologue == kernels.ADD_NORM:
            torch.testing.assert_close(got[1], h, rtol=0, atol=0)
        got = got[0] if isinstance(got, tuple) else got
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{prologue} {tile}")


DOT_FORMATS = [(8, -1, True), (8, -1, False), (4, 128, False), (8, 128, False), (4, 128, True), (4, 256, False)]


@pytest.mark.parametrize("bits,group,sym", DOT_FORMATS)
@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (3, torch.float16), (11, torch.bfloat16)])
def test_quant_dot_kernel(bits, group, sym, m, dtype, monkeypatch):
    """The tensor-core kernel against the same product in fp32 (the dequantized weights, the
    prologue's output as the kernel rounds it), every prologue: N not a multiple of the tile's
    rows, several steps, K split with a partial last split, the prologue apart, rows repeated up
    to the dot's 16 (1, 3) or padded to it (11), the words held a step ahead or pipelined
    (Tile.stages); outputs poisoned with NaN first. Groups smaller than a
    step, fp32 inputs and more than 16 rows take none of its tiles."""
    require_module("triton")
    from jetserve.engine.model import kernels
    from jetserve.engine.model.kernels import Tile
    from jetserve.engine.model.quant_kernels import fitting_tiles, quant_matmul

    device = "cuda" if torch.cuda.is_available() else "cpu"
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(math.nan)
                        if kw.get("dtype", torch.get_default_dtype()).is_floating_point else empty(*a, **kw))
    torch.manual_seed(bits + group + m)
    eps, n, k = 1e-6, 37, 448 if group == -1 else 640 if group == 128 else 3 * group  # 5 to 12 steps, split 3 ways
    w = quant.quantize(torch.randn(n, k) / 8, bits, group, sym)
    w = quant.QuantizedWeight(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in w))
    dense = quant.dequantize(w, torch.float32)
    assert [t for t in fitting_tiles(m, w, kernels.NORM, dtype=dtype) if t.dot]
    assert not [t for t in fitting_tiles(m, w, kernels.NORM, dtype=torch.float32) if t.dot]
    assert not [t for t in fitting_tiles(17, w, kernels.NORM, dtype=dtype) if t.dot]
    (x, res, gate_up, norm_w) = (torch.randn(m, k, device=device, dtype=dtype), torch.randn(m, k, device=device,
                                 dtype=dtype), torch.randn(m, 2 * k, device=device, dtype=dtype),
                                 (torch.rand(k, device=device) + 0.5).to(dtype))
    inputs = {kernels.PLAIN: ((x, None, None), x), kernels.NORM: ((x, None, norm_w), None),
              kernels.ADD_NORM: ((x, res, norm_w), None), kernels.SILU_MUL: ((gate_up, None, None), None)}
    tiles = [Tile(16, 16, 4, dot=True), Tile(32, 16, 4, 3, dot=True), Tile(16, 16, 4, 3, dot=True, stages=3),
             Tile(16, 16, 4, apart=True, dot=True)]
    for prologue, ((inp, residual, nw), _) in inputs.items():
        # what the product multiplies: the prologue as the float path rounds it (kernels' own kernels)
        apart = kernels.run_apart(lambda y: y, prologue, inp, residual, nw, eps, False) if prologue else inp
        a = apart[0] if isinstance(apart, tuple) else apart
        want = F.linear(a.float(), dense)
        for tile in tiles if prologue else tiles[:3]:
            got = quant_matmul(tile, prologue, inp, w, residual, nw, eps)
            if prologue == kernels.ADD_NORM:
                torch.testing.assert_close(got[1], apart[1], rtol=0, atol=0)  # x + residual, as rms_norm's
            got = (got[0] if isinstance(got, tuple) else got).float()
            assert not got.isnan().any(), (prologue, tile)
            # 16-bit roundings (the output's, the fused prologue's where its reduction order flips one):
            # some 3e-3 in bf16, as the FMA kernels; a wrong kernel is off by ~1
            error = ((got - want).norm() / want.norm()).item()
            assert error < (8e-3 if dtype == torch.bfloat16 else 1e-3), (prologue, tile, error)


def test_the_tile_cache_keeps_which_kernel_a_one_row_choice_runs(tmp_path):
    """A one-row tile read back from the tile cache still runs the one-row kernel: the kernel is
    a field of the tile, not its class (a stored tile is its fields)."""
    from jetserve.engine.model.kernels import Tile
    from jetserve.engine.model.tile_cache import TileCache, fingerprint

    fp = fingerprint(torch.device("cpu"))
    key = ("quant", 0, 1, 6144, 2560, 8, 2560, torch.float32, torch.bfloat16)
    tiles = [Tile(32, 64, 4), Tile(32, 64, 4, one_row=True)]
    TileCache(tmp_path, fp).store(key, tiles, [0.02, 0.01], tiles[1])
    entry = TileCache(tmp_path, fp).lookup(key, tiles)
    assert entry.tile == tiles[1] and entry.tile.one_row and entry.candidates == tuple(tiles)


def test_quant_gemv_kernel_compiles_for_hopper():
    """Triton's compiler and ptxas (no GPU needed) take the one-row kernel's variants for sm_90:
    the interpreter the kernel tests run in is more lenient."""
    compile_for_gpus("quant")


def test_quant_dot_kernel_compiles_for_hopper_and_orin():
    """Triton's compiler and ptxas take the tensor-core kernel's variants for sm_90 and sm_87 (no
    GPU needed), and its INT4 loop spends fewer instructions a weight than the FMA kernel's on
    both, within a few percent of what tiles/sass.json (the plan's projection) says it does."""
    done = compile_for_gpus("quant_dot", timeout=600)
    counted = json.loads(plan_sass_path().read_text())["families"]
    for line in done.stdout.splitlines():
        if line.startswith("sass "):
            _, arch, bits, per_weight = line.split()
            family = counted["sm" + arch[3:]][f"int{bits}"]
            if bits == "4":
                assert float(per_weight) < family["fma"], line
            assert abs(float(per_weight) - family["dot"]) < 0.15 * family["dot"], (line, family)


def plan_sass_path():
    from jetserve.engine import plan

    return plan.SASS_COUNTS


@pytest.mark.parametrize("bits,group,sym", FORMATS)
def test_prefill_dequantizes_in_one_pass(bits, group, sym):
    """Products of many rows take cuBLAS over the weight dequantized by one Triton pass (its
    interpreter without a GPU): the same bits as quant.dequantize, odd row counts included
    (on a GPU in bf16 too; the interpreter rounds bf16 toward zero)."""
    require_module("triton")
    from jetserve.engine.model.quant_kernels import dequantized

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(bits + group)
    w = quant.quantize(torch.randn(37, 512, device=device), bits, group, sym)
    ids = torch.tensor([36, 0, 5, 5, 17], device=device)  # a quantized embedding's lookups: any rows, repeats
    for dtype in [torch.float32] + [torch.bfloat16] * (device == "cuda"):
        assert torch.equal(dequantized(w, dtype), quant.dequantize(w, dtype)), dtype
        assert torch.equal(dequantized(w, dtype, ids), quant.dequantize(w, dtype)[ids]), dtype
    assert dequantized(w, torch.float32, ids[:0]).shape == (0, 512)


def test_a_tied_embedding_reads_the_quantized_vocab_projection():
    """QuantEmbedding: a step's rows of the quantized table, as the projection sees them, on the
    plain path and through the fused kernel (Triton's interpreter without a GPU), any id shape."""
    require_module("triton")
    from jetserve.engine.model.kernels import FusedKernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    head = quant.QuantLinear(256, 40, 8, -1, has_zeros=False).to(device)
    head.load(quant.quantize(torch.randn(40, 256, device=device), 8, -1, True))
    embed = quant.QuantEmbedding(head, torch.float32)
    ids = torch.tensor([[3, 39], [0, 3]], device=device)
    want = quant.dequantize(head.weight, torch.float32)[ids]
    with torch.no_grad():
        assert torch.equal(embed(ids), want)
        embed.kernels = FusedKernels()
        assert torch.equal(embed(ids), want)


def test_fused_kernels_route_quantized_weights():
    """The engine's kernels object takes a `QuantizedWeight` where a float weight would be, any
    group size; scales not in fp32 (not the loader's) fall back to dequantize + torch."""
    require_module("triton")
    from jetserve.engine.model.quant_kernels import QuantFusedKernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = QuantFusedKernels(tile_timing=False)
    x = torch.randn(2, 384, device=device)
    for group, scales in [(128, torch.float32), (96, torch.float32), (128, torch.float16)]:
        w = quant.quantize(torch.randn(16, 384, device=device), 4, group, sym=False)
        w = w._replace(scales=w.scales.to(scales))
        torch.testing.assert_close(kernels.linear(x, w), F.linear(x, quant.dequantize(w, torch.float32)),
                                   rtol=1e-4, atol=1e-4)
    assert [tile is None for key, tile in kernels.chosen.items()] == [False, False, True]
    dense = torch.randn(16, 384, device=device)
    torch.testing.assert_close(kernels.linear(x, dense), F.linear(x, dense), rtol=1e-4, atol=1e-4)


def test_a_vocab_sized_weight_never_dequantizes_whole(monkeypatch):
    """Past MAX_DEQUANTIZED weights (a vocab projection), rows past 16 (17-64: batches, verifies)
    take the tensor-core tiles in one pass, prologues included, not the float path; a weight no
    tile takes (fp16 scales) takes the float path a block of its rows at a time: each as the
    dequantized product, in Triton's interpreter without a GPU."""
    require_module("triton")
    from jetserve.engine.model import quant_kernels
    from jetserve.engine.model.quant_kernels import QuantFusedKernels

    monkeypatch.setattr(quant_kernels, "MAX_DEQUANTIZED", 32 * 128)  # the 48 x 128 weight is "big"
    monkeypatch.setattr(quant, "MAX_DEQUANTIZED", 32 * 128)  # float_product's blocks: 32 rows
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = QuantFusedKernels(tile_timing=False)
    w = quant.quantize(torch.randn(48, 128, device=device) / 128**0.5, 8, -1, True)  # outputs about 1
    dense = quant.dequantize(w, torch.float32)
    # bf16 inputs, as the engine's: the tensor-core tiles take 16-bit ones
    x, residual = (torch.randn(40, 128, device=device).to(torch.bfloat16) for _ in range(2))
    norm = (torch.rand(128, device=device) + 0.5).to(torch.bfloat16)
    torch.testing.assert_close(kernels.linear(x, w).float(), F.linear(x.float(), dense), rtol=2e-2, atol=2e-2)
    out, total = kernels.norm_linear(x, residual, norm, 1e-6, w)
    torch.testing.assert_close(total, x + residual)
    normed = F.rms_norm(x + residual, (128,), norm, 1e-6).float()
    torch.testing.assert_close(out.float(), F.linear(normed, dense), rtol=3e-2, atol=3e-2)
    assert {key[2] for key in kernels.chosen} == {64} and all(tile.dot for tile in kernels.chosen.values())
    monkeypatch.setattr(quant_kernels, "MAX_DEQUANTIZED", 10**9)  # not big: past 16 rows the float path only
    assert quant_kernels.candidates(40, w) == []
    untiled = w._replace(scales=w.scales.half())
    y = torch.randn(3, 128, device=device)
    torch.testing.assert_close(kernels.linear(y, untiled), F.linear(y, quant.dequantize(untiled, torch.float32)),
                               rtol=1e-4, atol=1e-4)
    assert [tile for key, tile in kernels.chosen.items() if torch.float16 in key] == [None]


# --- the memory plan -------------------------------------------------------------------------------------------

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6, architectures=["Qwen3ForCausalLM"],
                model_type="qwen3", dtype="bfloat16")


def _sparse_checkpoint(path, tensors: dict, config: dict):
    """A safetensors file with these (dtype, shape) tensors whose data is a hole: a real
    checkpoint's metadata at no disk cost (the plan reads only metadata)."""
    sizes = {"BF16": 2, "F16": 2, "I32": 4}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.mkdir()
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + offset)
    (path / "config.json").write_text(json.dumps(config))


def _qwen3_4b_tensors(awq: bool) -> dict:
    c = QWEN3_4B
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    tensors = {"model.embed_tokens.weight": ("BF16", (c["vocab_size"], h)), "model.norm.weight": ("BF16", (h,))}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}"
        tensors.update({f"{p}.input_layernorm.weight": ("BF16", (h,)),
                        f"{p}.post_attention_layernorm.weight": ("BF16", (h,)),
                        f"{p}.self_attn.q_norm.weight": ("BF16", (d,)), f"{p}.self_attn.k_norm.weight": ("BF16", (d,))})
        for name, (out, inp) in {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
                                 "mlp.down_proj": (h, i)}.items():
            if awq:
                tensors.update({f"{p}.{name}.qweight": ("I32", (inp, out // 8)),
                                f"{p}.{name}.qzeros": ("I32", (inp // 128, out // 8)),
                                f"{p}.{name}.scales": ("F16", (inp // 128, out))})
            else:
                tensors[f"{p}.{name}.weight"] = ("BF16", (out, inp))
    return tensors


def test_plan_qwen3_4b_on_an_orin_nano(tmp_path, capsys):
    """4B in bf16 cannot fit an 8 GB Orin Nano, the plan says so (exit 1); 4B INT4, on the fly or
    as AWQ, fits with two sequences of 4096 tokens. On the fly, the tied vocab projection is INT8
    (one table for it and the embedding): fewer weights and fewer bytes a token than AWQ's bf16."""
    from jetserve.cli import main

    _sparse_checkpoint(tmp_path / "bf16", _qwen3_4b_tensors(awq=False), QWEN3_4B)
    awq_config = {**QWEN3_4B, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                      "zero_point": True, "version": "gemm"}}
    _sparse_checkpoint(tmp_path / "awq", _qwen3_4b_tensors(awq=True), awq_config)
    common = ["--device", "orin-nano-8gb", "--max-model-len", "4096", "--max-num-seqs", "2"]
    assert main(["plan", "--model", str(tmp_path / "bf16"), *common]) == 1
    refused = capsys.readouterr().out
    assert "DOES NOT FIT" in refused and "weights" in refused and "KV cache" in refused
    weights = float(refused.split("weights")[1].split("GiB")[0])
    assert 7.4 < weights < 7.6  # 4.02B parameters in bf16 (tied embedding once)
    projections, layers = [], []
    # (vocab format, weights GiB): 4-bit layers beside the INT8 vocab table, or beside AWQ's bf16 one
    for model, extra, vocab, (low, high) in [("bf16", ["--quantization", "int4"], "int8", (2.1, 2.3)),
                                             ("awq", [], "bf16", (2.4, 2.8))]:
        assert main(["plan", "--model", str(tmp_path / model), *common, *extra]) == 0
        accepted = capsys.readouterr().out
        assert accepted.count("fits") == 1 and "ms/token at 68 GB/s" in accepted
        assert low < float(accepted.split("weights")[1].split("GiB")[0]) < high
        projected = accepted.split("projected >= ")[1]
        projections.append(float(projected.split(" ms/token")[0]))
        assert "1024 cores x 0.62 GHz" in projected and "sm87 SASS" in projected
        rows = [line.split() for line in projected.splitlines() if line.startswith("  ")]
        assert [r[1] for r in rows if r[0] == "vocab"] == [vocab]
        layers.append([r for r in rows if r[0] != "vocab"])
    assert layers[0] == layers[1]  # AWQ's layers run what INT4 on the fly runs
    assert projections[0] < projections[1] * 0.9  # the vocab's bytes halved


def test_the_projection_takes_each_product_at_its_slower_bound():
    """A board's batch-1 projection takes each product at the slower of its bytes over the
    bandwidth and its instructions over cores x clock, and the rest of the bytes at the bandwidth:
    an instruction-bound product beside a memory-bound one costs both their bounds, where the
    whole step's two sums would hide the first behind the second."""
    from jetserve.engine import plan

    board = plan.BOARDS["orin-nano-8gb"]
    ms_of_bytes = int(board.bandwidth / 1000)  # 1 ms at the bandwidth
    one_ms_of_issue = board.cuda_cores * int(board.gpu_clock) // 1000  # instructions the cores issue in 1 ms
    packed = plan.Product("gate·up", 2, one_ms_of_issue // 2, ms_of_bytes // 2, "int4", tinygemm=True)  # 1 ms of bytes
    vocab = plan.Product("vocab", 1, 1000, 10 * ms_of_bytes, "bf16")  # 10 ms of bytes
    per_weight = plan.instructions_per_weight("sm87", "int4", tinygemm=True)[0]
    assert per_weight > 1  # the products' instructions outlast their bytes on an Orin Nano
    mp = plan.MemoryPlan("orin-nano-8gb", 0, 0, 0, 0, 0, 0, 0, 12 * ms_of_bytes, board.bandwidth, 1,
                         products=(packed, vocab), board=board)
    ms, rows = mp.decode_ms()
    assert [(r.kernel, r.bound) for r in rows] == [("tinygemm", "instructions"), ("fma", "memory")]
    assert rows[0].issue_ms == pytest.approx(per_weight, rel=1e-3) and rows[1].memory_ms == pytest.approx(10, rel=1e-3)
    assert ms == pytest.approx(per_weight + 10 + 1, rel=1e-3)  # + the 1 ms of other bytes
    untaken = plan.instructions_per_weight("sm87", "int4")  # an INT4 product tinygemm does not take: ours
    assert untaken[1] != "tinygemm" and untaken[0] == min(v for k, v in json.loads(plan.SASS_COUNTS.read_text())[
        "families"]["sm87"]["int4"].items() if k != "tinygemm")
    assert plan.instructions_per_weight("sm110", "int4")[2] == "sm90"  # not counted: the nearest family's
    assert plan.MemoryPlan("this", 0, 0, 0, 0, 0, 0, 0, ms_of_bytes, board.bandwidth, 1).decode_ms() == (
        pytest.approx(1.0, rel=1e-3), [])  # no cores known: the bandwidth floor alone



def test_serve_refuses_what_cannot_fit(tmp_path, caplog):
    """The engine process checks the plan before it loads a weight (the server holds no GPU
    memory of its own): `jetserve serve` exits 1 with the plan in its log."""
    from jetserve.cli import main

    _sparse_checkpoint(tmp_path / "bf16", _qwen3_4b_tensors(awq=False), QWEN3_4B)
    with caplog.at_level(logging.ERROR, logger="jetserve.server.app"):
        code = main(["serve", "--model", str(tmp_path / "bf16"), "--device", "cpu", "--max-num-seqs", "512",
                     "--max-model-len", "40960", "--port", "0", "--metrics-port", "0", "--openai-port", "0"])
    failed = [r.getMessage() for r in caplog.records if "failed to load" in r.getMessage()]
    assert code == 1 and failed and "does not fit" in failed[0] and "KV cache" in failed[0]


def test_bench_quant_precompiles_the_mma_kernels_tiles():
    """`bench quant` compiles, before it times anything, the tiles the tuning will time on a GPU:
    the MMA kernel's among them, INT4 and INT8 (else each compiles in the timing process, one
    after another)."""
    require_module("triton")
    from jetserve.bench.quant import projection_variants

    variants = projection_variants(["qwen3-0.6b"], ["int4", "int8"], 4)
    assert {v[0] for v in variants if v[4] is not None and v[4].mma} == {"int4", "int8"}


def test_bench_quant_projects_each_product_on_each_board():
    """`bench quant`'s kernel table projects each product on every Jetson board as `jetserve plan`
    does, and again at the share of bandwidth the kernel measured on this GPU reached."""
    from jetserve.bench.quant import jetson_projection
    from jetserve.engine import plan

    n, k = 19456, 2560
    size = n * k // 2 + n * (k // 128) * 5
    full, half = (jetson_projection("gate_up", n, k, size, "int4", True, share) for share in (1.0, 0.5))
    assert set(full) == set(plan.BOARDS)
    for name, board in plan.BOARDS.items():
        (t,) = plan.product_times(board, (plan.Product("gate_up", 1, n * k, size, "int4", True),))
        assert full[name]["memory_us"] == pytest.approx(size / board.bandwidth * 1e6, abs=0.01)
        assert full[name]["bound"] == t.bound and full[name]["kernel"] == "tinygemm"
        assert full[name]["at_measured_share_us"] == max(full[name]["memory_us"], full[name]["instructions_us"])
        assert half[name]["at_measured_share_us"] == pytest.approx(
            max(2 * full[name]["memory_us"], full[name]["instructions_us"]), abs=0.02)
