"""Quality of weight-only quantization on the demo model: perplexity on held-out Python and the
MTP head's draft agreement, bf16 vs INT8 vs INT4 (on the fly, AWQ and GPTQ layouts).

Held-out text: the sources of an installed pip package (jinja2 by default); the demo model was
trained on CPython's standard library. How the weights are made:
- int8: `--quantization int8`, per output channel, symmetric, round to nearest (in the loader);
- int4: `--quantization int4`, group 128, zero points, round to nearest (in the loader); like
  int8, with the vocab projection (and the embedding tied to it) INT8 per channel;
- int4-awq: AWQ checkpoint (group 128, zero points) packed by AutoAWQ's `WQLinear_GEMM` from
  AutoAWQ's round-to-nearest quantizer (its formula, without the activation-aware scale search);
- int4-gptq: GPTQ (v1) checkpoint, group 128, symmetric round to nearest, converted to GPTQ's
  layout by AutoAWQ's `unpack_reorder_pack` (no GPTQ Hessian error compensation).
MTP heads are quantized with the base (`auto`) or kept in bf16 (`none`); agreement is the
top-1 match of the head's draft with the base's own greedy token at chain depths 1 and 2, the
greedy acceptance rate it predicts (`mtp_fit.distill_loss`).
"""

DEFAULT_PACKAGE = "jinja2"


def add_arguments(p):
    p.add_argument("--model", help="default: the bundled demo model")
    p.add_argument("--package", default=DEFAULT_PACKAGE, help="held-out text: this installed package's .py files")
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")


def run(args) -> dict:
    import importlib.util
    import tempfile
    from pathlib import Path

    import torch
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from jetserve.bench.common import environment, write_results
    from jetserve.engine.config import QuantizationConfig
    from jetserve.engine.model.checkpoint import Checkpoint
    from jetserve.engine.model.loader import load_model

    model_dir = Path(args.model or Path(__import__("jetserve").__file__).parent / "models" / "demo")
    package = Path(importlib.util.find_spec(args.package).origin).parent
    files = sorted(package.rglob("*.py"))
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids[:args.max_tokens]
    windows = torch.tensor(ids[:len(ids) // (args.seq_len + 3) * (args.seq_len + 3)]).view(-1, args.seq_len + 3)
    device = torch.device(args.device)
    result = {"env": environment(device), "model": str(model_dir), "heldout": {
        "package": args.package, "files": len(files), "tokens": windows.numel()}, "activations": "bfloat16",
        "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = {"bf16": (model_dir, None), "int8": (model_dir, "int8"), "int4": (model_dir, "int4"),
                       "int4-awq": (_write(model_dir, Path(tmp) / "awq", sym=False), None),
                       "int4-gptq": (_write(model_dir, Path(tmp) / "gptq", sym=True), None)}
        runs = [(name, draft) for name in checkpoints for draft in (("auto", "none") if name != "bf16" else ("auto",))]
        for name, draft in tqdm(runs, desc="[perplexity]", unit="variant"):
            path, requested = checkpoints[name]
            quantization = QuantizationConfig.resolve(Checkpoint(path).config, requested, draft)
            model = load_model(str(path), torch.bfloat16, device, args.seq_len + 3, quantization=quantization)
            ppl, agree = _evaluate(model, windows.to(device), args.batch_size)
            key = name if draft == "auto" else f"{name}, bf16 MTP head"
            result["variants"][key] = {"perplexity": round(ppl, 4), "mtp_agreement_by_depth": [round(a, 4) for a in agree]}
    base = result["variants"]["bf16"]["perplexity"]
    for v in result["variants"].values():
        v["perplexity_vs_bf16"] = f"{(v['perplexity'] / base - 1) * 100:+.2f}%"
    write_results(args.out, result, {})
    return result


def _evaluate(model, windows, batch_size):
    """Perplexity of next-token prediction over every window, and the MTP draft agreement."""
    import math

    import torch
    import torch.nn.functional as F

    from jetserve.engine.offline.mtp_fit import distill_loss

    nll, count, agree = 0.0, 0, []
    with torch.no_grad():
        for batch in windows.split(batch_size):
            ids = batch[:, :-3]
            positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0])
            hidden = model(ids, positions, [None] * model.num_kv_layers, None)
            logits = model.compute_logits(hidden).float()
            nll += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:-2].flatten(), reduction="sum").item()
            count += ids.numel()
            agree.append(distill_loss(model, batch, depth=2)[1])
    return math.exp(nll / count), [sum(a[d] for a in agree) / len(agree) for d in range(2)]


def _write(model_dir, out, sym: bool):
    """The demo checkpoint with every projection (MTP head's too) 4-bit, group 128, packed by
    AutoAWQ: AWQ layout (zero points) or, symmetric, converted to GPTQ's v1 layout."""
    import json
    import shutil

    import torch
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import unpack_reorder_pack
    from safetensors.torch import save_file

    from jetserve.engine.model.checkpoint import Checkpoint

    ckpt = Checkpoint(model_dir)
    quantizer = AwqQuantizer.__new__(AwqQuantizer)  # its formula needs only these three settings
    quantizer.w_bit, quantizer.group_size, quantizer.zero_point = 4, 128, not sym
    tensors = {}
    for name in ckpt.names():
        tensor = ckpt.get(name)
        if not (name.endswith("proj.weight") or name == "mtp.fc.weight"):
            tensors[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        fake, scales, zeros = quantizer.pseudo_quantize_tensor(tensor.float())
        zeros = torch.full_like(scales, 8) if sym else zeros  # stored unsigned: -8..7 around 8
        linear = torch.nn.Linear(tensor.shape[1], tensor.shape[0], bias=False)
        linear.weight.data = fake
        packed = WQLinear_GEMM.from_linear(linear, 4, 128, False, scales.t().contiguous(), zeros.t().contiguous())
        qweight, qzeros = packed.qweight, packed.qzeros
        if sym:
            qweight, qzeros = unpack_reorder_pack(qweight, qzeros, 4)
        tensors.update({f"{prefix}.qweight": qweight.contiguous(), f"{prefix}.qzeros": qzeros.contiguous(),
                        f"{prefix}.scales": packed.scales.contiguous()})
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors")
    config = dict(ckpt.config)
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False} if sym else
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"})
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(model_dir / "tokenizer.json", out / "tokenizer.json")
    return out
