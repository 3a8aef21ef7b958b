"""Load a Qwen3 (+MTP) checkpoint into `Qwen3ForCausalLM`, checking every tensor.

The checkpoint's names map onto our fused parameters: q|k|v → qkv_proj, gate|up → gate_up_proj;
`mtp.*` (Qwen3-Next) or `model.layers.{N+j}.{enorm,hnorm,eh_proj,shared_head.norm}` (DeepSeek)
→ `mtp[j]`. A tensor that is missing or has the wrong shape is an error that names it.
With weight-only quantization (model/quant.py) the projections become `QuantLinear`s before any
memory is allocated: AWQ/GPTQ tensors are unpacked into our layout, float ones quantized while
loading, so a model whose float weights would not fit the device never exists in float.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch
from tqdm import tqdm

from jetserve.engine.model.checkpoint import Checkpoint, CheckpointError
from jetserve.engine.config import ON_THE_FLY, ModelConfig, QuantizationConfig
from jetserve.engine.model.qwen3 import Linear, Qwen3ForCausalLM, RotaryEmbedding
from jetserve.engine.model import int4pack, int8pack, quant

# Tensors read and copied to the device at once: a copy out of the page cache is the host's
# memcpy, which one thread does not keep the bus busy with.
LOAD_THREADS = 4
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# safetensors dtypes a float parameter loads from (FP8 needs scales this loader does not read).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.replace("torch.", "")]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} (or auto), got {name!r}") from None


def block_sources(prefix: str) -> dict[str, list[str]]:
    """Our decoder-block parameter → the checkpoint tensors it is made of (concatenated)."""
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
    return {
        "input_layernorm.weight": [f"{prefix}.input_layernorm.weight"],
        "post_attention_layernorm.weight": [f"{prefix}.post_attention_layernorm.weight"],
        "self_attn.qkv_proj.weight": [f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"],
        "self_attn.o_proj.weight": [f"{attn}.o_proj.weight"],
        "self_attn.q_norm.weight": [f"{attn}.q_norm.weight"],
        "self_attn.k_norm.weight": [f"{attn}.k_norm.weight"],
        "mlp.gate_up_proj.weight": [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
        "mlp.down_proj.weight": [f"{mlp}.down_proj.weight"],
    }


def _mtp_sources(ckpt: Checkpoint, cfg: ModelConfig, j: int) -> dict[str, list[str]]:
    deepseek = f"model.layers.{cfg.num_hidden_layers + j}"
    if f"{deepseek}.eh_proj.weight" in ckpt:
        head = {"fc.weight": "eh_proj", "pre_fc_norm_embedding.weight": "enorm",
                "pre_fc_norm_hidden.weight": "hnorm", "norm.weight": "shared_head.norm"}
        sources = {ours: [f"{deepseek}.{theirs}.weight"] for ours, theirs in head.items()}
        block = deepseek
    else:
        # Qwen3-Next: one fc and norm pair shared by every MTP layer.
        sources = {name: [f"mtp.{name}"] for name in
                   ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")}
        block = f"mtp.layers.{j}"
    sources.update({f"block.{k}": v for k, v in block_sources(block).items()})
    return sources


def parameter_sources(ckpt: Checkpoint, cfg: ModelConfig) -> dict[str, list[str]]:
    sources = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        sources.update({f"layers.{i}.{k}": v for k, v in block_sources(f"model.layers.{i}").items()})
    for j in range(cfg.num_mtp_layers):
        sources.update({f"mtp.{j}.{k}": v for k, v in _mtp_sources(ckpt, cfg, j).items()})
    return sources


def build_meta_model(ckpt: Checkpoint, dtype: torch.dtype, max_positions: int,
                     quantization: QuantizationConfig | None = None, device: torch.device | None = None):
    """The model as it will be on `device`, on the meta device (no memory), checked against the
    checkpoint's metadata: (model, parameter → checkpoint tensors, projection → quantization
    mode). The memory plan sizes the weights from it, the loader fills it."""
    cfg = ModelConfig.from_dict(ckpt.config)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, max_positions).to(dtype)
        sources = parameter_sources(ckpt, cfg)
        if quantization and quantization.vocab and cfg.tie_word_embeddings:  # one table: the quantized projection's
            sources = {"lm_head.weight" if name == "embed_tokens.weight" else name: names
                       for name, names in sources.items()}
        modes = quantization_modes(ckpt, model, sources, quantization) if quantization else {}
        for name, mode in modes.items():
            if mode != "dequantize":
                module = name.removesuffix(".weight")
                linear = model.get_submodule(module)
                model.set_submodule(module, _quant_linear(linear, quantization, mode, dtype, device))
        if "lm_head.weight" in modes and cfg.tie_word_embeddings:
            model.embed_tokens = quant.QuantEmbedding(model.lm_head, dtype)
    # Every float tensor is checked here, those quantized while loading too (as the float weight they
    # stand for); packed ones are read_quantized's to check.
    checked = {name: p for name, p in model.named_parameters() if name not in modes}
    for name, mode in modes.items():
        if mode in ON_THE_FLY and f"{sources[name][0].removesuffix('.weight')}.qweight" not in ckpt:
            module = model.get_submodule(name.removesuffix(".weight"))
            checked[name] = torch.empty(module.out_features, module.in_features, device="meta")
    _check(ckpt, cfg, checked, {name: sources[name] for name in checked})
    return model, sources, modes


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, max_positions: int,
               progress: Callable[[str], None] | None = None,
               quantization: QuantizationConfig | None = None) -> Qwen3ForCausalLM:
    ckpt = Checkpoint(model_dir)
    cfg = ModelConfig.from_dict(ckpt.config)
    model, sources, modes = build_meta_model(ckpt, dtype, max_positions, quantization, device)

    # nn.Module.to_empty, less its torch.empty_like on meta tensors: that one's meta kernel is
    # Python which imports torch's symbolic-shape machinery (sympy), seconds of every start.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions).to(device)  # fp32 tables
    if cfg.tie_word_embeddings and "lm_head.weight" not in modes:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    quantizing = threading.Lock()
    inference = torch.is_inference_mode_enabled()  # the caller's: its tensors are written in it

    def fill(name: str, names: list[str]) -> None:
        with torch.inference_mode(inference), torch.no_grad():  # both are a thread's own
            if name not in modes:
                _copy_rows(params[name], [ckpt.get(s) for s in names])
                return
            module = model.get_submodule(name.removesuffix(".weight"))
            if (modes[name] in ON_THE_FLY and len(names) == 1 and names[0] in ckpt  # from a float tensor
                    and _weights(ckpt, names) > quant.MAX_DEQUANTIZED):
                return _quantize_by_rows(ckpt, names[0], module, modes[name], device, quantizing)
            weight = _quantized_weight(ckpt, names, quantization, modes[name], device, quantizing)
            if modes[name] == "dequantize":
                params[name].copy_(quant.dequantize(weight, dtype))
            else:
                module.load(weight)

    # One report of progress, never two on one stream: with `progress` (the service's log records)
    # no bar; without it a bar, on a terminal only (tqdm's None).
    bar = tqdm(total=len(sources), desc="loading weights", unit="tensor", leave=False,
               disable=True if progress else None)
    with ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="load") as pool:
        futures = [pool.submit(fill, name, names) for name, names in sources.items()]
        try:
            for n, future in enumerate(as_completed(futures)):
                future.result()
                bar.update()
                if progress and n % 16 == 0:
                    progress(f"loading weights {n + 1}/{len(sources)}")
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        finally:
            bar.close()
    return model.eval()


def quantization_modes(ckpt: Checkpoint, model: Qwen3ForCausalLM, sources: dict[str, list[str]],
                       config: QuantizationConfig) -> dict[str, str]:
    """How each projection loads: "packed" (AWQ/GPTQ tensors as they are), "int8" or "int4"
    (quantized while loading, from a float tensor or from packed ones: MTP heads asked for int8)
    or "dequantize" (packed, kept in the model dtype: MTP heads asked for none). The vocab
    projection (and an embedding tied to it) is quantized on the fly with the others
    (`QuantizationConfig.vocab`), else kept in the model dtype, as in AWQ and GPTQ exports."""
    modes = {}
    for name, names in sources.items():
        module = name.removesuffix(".weight")
        if module == "lm_head":
            if config.vocab and f"{names[0].removesuffix('.weight')}.qweight" not in ckpt:
                modes[name] = config.vocab
            continue
        if not isinstance(model.get_submodule(module), Linear):
            continue
        packed = f"{names[0].removesuffix('.weight')}.qweight" in ckpt
        want = config.draft if name.startswith("mtp.") else "auto"
        if want == "int8":
            modes[name] = "int8"
        elif packed:
            modes[name] = "dequantize" if want == "none" else "packed"
        elif want == "auto" and config.on_the_fly:
            modes[name] = config.method
    return modes


def _quant_linear(linear: Linear, config: QuantizationConfig, mode: str, dtype: torch.dtype,
                  device: torch.device | None) -> quant.QuantLinear:
    """The (meta) module a projection becomes, shaped from metadata alone; in tinygemm's layout
    where its kernel runs on `device` (model/int4pack.py; None: the device is not known), in torch's
    INT8 CPU layout where that kernel does (model/int8pack.py)."""
    k, n = linear.in_features, linear.out_features
    bits, group, sym = (config.bits, config.group_size, False) if mode == "packed" else ON_THE_FLY[mode]
    tinygemm = device is not None and int4pack.applies(bits, k if group == -1 else group, n, k, dtype, device)
    int8mm = int8pack.applies(bits, group, k, not sym, device)
    return quant.QuantLinear(k, n, bits, group, has_zeros=not sym,
                             tinygemm=torch.device(device).type if tinygemm else None,
                             int8pack_dtype=dtype if int8mm else None)


def _quantized_weight(ckpt: Checkpoint, names: list[str], config: QuantizationConfig, mode: str,
                      device: torch.device, quantizing: threading.Lock) -> quant.QuantizedWeight:
    """A projection in our quantized layout (on `device`, where quantizing a 4B model takes
    seconds instead of minutes on a CPU). One projection is quantized at a time, whatever the
    loading threads: its fp32 temporaries are several times its float weight."""
    if f"{names[0].removesuffix('.weight')}.qweight" in ckpt:
        with quantizing:
            weight = quant.read_quantized(ckpt, [s.removesuffix(".weight") for s in names], config)
            if mode in ("packed", "dequantize"):
                return weight
            tensor = quant.dequantize(weight, torch.float32).to(device)
    else:
        parts = [ckpt.get(s) for s in names]
        tensor = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype,
                             device=device)
        _copy_rows(tensor, parts)
    with quantizing:
        return quant.quantize(tensor, *ON_THE_FLY[mode])


def _weights(ckpt: Checkpoint, names: list[str]) -> int:
    return sum(math.prod(ckpt.shape(s)) for s in names)


def _quantize_by_rows(ckpt: Checkpoint, name: str, module: quant.QuantLinear, mode: str, device: torch.device,
                      quantizing: threading.Lock) -> None:
    """A float tensor past MAX_DEQUANTIZED weights (a vocab projection) quantized into `module` a
    block of rows at a time: its float copy and fp32 temporaries would otherwise be several times
    the largest projection's, at the load's peak (an 8 GB board's limit)."""
    shape = ckpt.shape(name)
    if shape != (module.out_features, module.in_features):
        raise CheckpointError(f"{ckpt.dir}: tensor {name!r} has shape {list(shape)}, "
                              f"expected {[module.out_features, module.in_features]}")
    if ckpt.dtype(name) not in FLOAT_DTYPES:
        raise CheckpointError(f"{ckpt.dir}: tensor {name!r} is {ckpt.dtype(name)}, expected one of "
                              f"{', '.join(FLOAT_DTYPES)}")
    rows = max(1, quant.MAX_DEQUANTIZED // shape[1])
    for lo in range(0, shape[0], rows):
        block = ckpt.rows(name, lo, lo + rows).to(device)
        with quantizing:
            module.load(quant.quantize(block, *ON_THE_FLY[mode]), row=lo)


def _copy_rows(dest: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """The checkpoint's tensors of a fused parameter, each into its rows: no concatenated copy
    on the host first."""
    row = 0
    for part in parts:
        dest[row:row + part.shape[0]].copy_(part)
        row += part.shape[0]


def _check(ckpt: Checkpoint, cfg: ModelConfig, params: dict, sources: dict[str, list[str]]) -> None:
    """Every parameter is covered, by tensors of the right shapes; say which one is not."""
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, names in sources.items():
        shape = tuple(params[name].shape)
        if name.endswith("qkv_proj.weight"):
            expected = [(q_rows, shape[1]), (kv_rows, shape[1]), (kv_rows, shape[1])]
        elif name.endswith("gate_up_proj.weight"):
            expected = [(shape[0] // 2, shape[1])] * 2
        else:
            expected = [shape]
        for source, want in zip(names, expected):
            if source not in ckpt:
                raise CheckpointError(f"{ckpt.dir}: tensor {source!r} is missing")
            found = ckpt.shape(source)
            if found != want:
                raise CheckpointError(f"{ckpt.dir}: tensor {source!r} has shape {list(found)}, "
                                      f"expected {list(want)}")
            if ckpt.dtype(source) not in FLOAT_DTYPES:  # copying would cast integers (packed words) silently
                raise CheckpointError(f"{ckpt.dir}: tensor {source!r} is {ckpt.dtype(source)}, expected one of "
                                      f"{', '.join(FLOAT_DTYPES)}")
    missing = set(params) - set(sources)
    if missing:
        raise CheckpointError(f"no checkpoint tensor maps to {sorted(missing)}")
