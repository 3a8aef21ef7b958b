"""Checkpoints from the internet, or from a failing disk: every lie in them is a CheckpointError
(a ValueError) that names the file and the field or tensor, before anything is built from it;
nothing hangs, and nothing a checkpoint says can make the loader build or read without bound."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from jetserve.engine import LLM, EngineArgs
from jetserve.engine import tokenizer as tokenizer_module
from jetserve.engine.config import QuantizationConfig
from jetserve.engine.model import checkpoint as checkpoint_module
from jetserve.engine.model.checkpoint import Checkpoint, CheckpointError
from jetserve.engine.model.loader import build_meta_model
from jetserve.engine.offline.mtp_checkpoint import inspect
from jetserve.engine.tokenizer import Tokenizer
from tests.engine.builders import build_qwen3

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def variant(tiny, tmp_path):
    """A copy of the tiny checkpoint with config.json changed: `patch`'s keys set (None: removed)."""
    def make(name="variant", **patch):
        path = tmp_path / name
        shutil.copytree(tiny[0], path)
        config = json.loads((path / "config.json").read_text())
        for key, value in patch.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (path / "config.json").write_text(json.dumps(config))
        return path
    return make


def meta_model(path):
    """The loader's first step (the plan's too): the model as config.json shapes it, checked
    against the checkpoint's metadata."""
    return build_meta_model(Checkpoint(path), torch.float32, 64)


@pytest.mark.parametrize("patch, message", [
    ({"hidden_size": 10**9}, r"hidden_size must be an integer in \[1, 1048576\], got 1000000000"),
    ({"num_hidden_layers": 1025}, r"num_hidden_layers must be an integer in \[1, 1024\], got 1025"),
    ({"mtp_num_hidden_layers": 1025}, r"mtp_num_hidden_layers must be an integer in \[0, 1024\], got 1025"),
    ({"mtp_num_hidden_layers": "x"}, r"mtp_num_hidden_layers must be an integer in \[0, 1024\], got 'x'"),
    ({"num_attention_heads": -4}, r"num_attention_heads must be an integer in \[1, 1048576\], got -4"),
    ({"num_attention_heads": 0}, r"num_attention_heads must be an integer in \[1, 1048576\], got 0"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ({"head_dim": None, "num_attention_heads": 5, "num_key_value_heads": 5},
     "no head_dim, and num_attention_heads=5 does not divide hidden_size=64"),
    ({"vocab_size": 0}, r"vocab_size must be an integer in \[1, 16777216\], got 0"),
    ({"hidden_size": "64"}, r"hidden_size must be an integer in \[1, 1048576\], got '64'"),
    ({"num_hidden_layers": 2.0}, r"num_hidden_layers must be an integer in \[1, 1024\], got 2.0"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings must be an integer in \[1, 1073741824\], got 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
     r"rope_theta must be a number in \(0, inf\), got nan"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, r"rope_theta must be a number in \(0, inf\)"),
    ({"rms_norm_eps": "x"}, r"rms_norm_eps must be a number in \(0, 1\), got 'x'"),
    ({"rope_parameters": [1]}, r"rope_parameters must be an object, got \[1\]"),
    ({"architectures": "Qwen3ForCausalLM"}, "architectures must be a list of names, got 'Qwen3ForCausalLM'"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
])
def test_config_values_of_the_wrong_type_or_out_of_range_are_named(variant, patch, message):
    path = variant(**patch)
    with pytest.raises(CheckpointError, match=f"^config.json: {message}"):
        meta_model(path)


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "unreadable: a JSON object expected, found list"),
    ("[" * 100_000 + "]" * 100_000, "unreadable: maximum recursion depth"),
    ('{"x": ' + "9" * 5000 + "}", "unreadable: Exceeds the limit"),
])
def test_json_that_is_not_a_plain_object_is_named(variant, text, message):
    path = variant()
    for name in ("config.json", "model.safetensors.index.json", "tokenizer_config.json", "generation_config.json"):
        copy = variant(name.replace(".", "-"))
        (copy / name).write_text(text)
        with pytest.raises(CheckpointError, match=f"{name}: {message}"):
            Checkpoint(copy)
            Tokenizer.from_pretrained(copy)
    (path / "config.json").write_bytes(b"\xff{}")
    with pytest.raises(CheckpointError, match="config.json: unreadable: 'utf-8' codec"):
        Checkpoint(path)


def test_checkpoint_files_must_be_regular_files_of_bounded_size(variant, monkeypatch):
    """A FIFO would block the reader for ever, /dev/zero would fill memory: a file that is not a
    regular one is refused before it is opened (/dev/null stands in for both here)."""
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        path = variant(name.replace(".", "-"))
        (path / name).unlink()
        (path / name).symlink_to(os.devnull)
        with pytest.raises(CheckpointError, match=f"{name}: not a regular file"):
            Checkpoint(path)
            Tokenizer.from_pretrained(path)
    path = variant()
    monkeypatch.setattr(checkpoint_module, "MAX_JSON_BYTES", 512)
    with pytest.raises(CheckpointError, match=r"config.json: larger than 0 MiB"):
        Checkpoint(path)
    monkeypatch.setattr(checkpoint_module, "MAX_JSON_BYTES", 2**20)
    monkeypatch.setattr(tokenizer_module, "MAX_TOKENIZER_BYTES", 1024)
    with pytest.raises(CheckpointError, match="tokenizer.json: larger than 0 MiB"):
        Tokenizer.from_pretrained(path)


def test_an_index_names_only_files_of_its_directory_that_hold_its_tensors(variant):
    path = variant()
    names = list(load_file(path / "model.safetensors"))
    index = path / "model.safetensors.index.json"
    outside = variant("outside")
    for file in ("../outside/model.safetensors", str(outside / "model.safetensors"), 5, "."):
        index.write_text(json.dumps({"weight_map": dict.fromkeys(names, file)}))
        with pytest.raises(CheckpointError,
                           match=r"weight_map\['model\.[a-z_.0-9]+'\] must name a file in this directory"):
            Checkpoint(path)
    save_file({"other": torch.zeros(1)}, path / "other.safetensors")
    index.write_text(json.dumps({"weight_map": {**dict.fromkeys(names, "model.safetensors"),
                                                "model.norm.weight": "other.safetensors"}}))
    with pytest.raises(CheckpointError, match="maps 'model.norm.weight' to other.safetensors, which does not hold it"):
        meta_model(path)


def test_a_float_parameter_from_an_integer_tensor_is_refused(variant):
    path = variant()
    tensors = load_file(path / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.embed_tokens.weight' is I32, expected one of F16, BF16, F32"):
        meta_model(path)


@pytest.mark.parametrize("name, tensor, message", [
    ("model.embed_tokens.weight", lambda t: t.to(torch.int32), "'model.embed_tokens.weight' is I32, expected one of"),
    ("model.layers.0.self_attn.o_proj.weight", lambda t: t.to(torch.int16), "'model.layers.0.self_attn.o_proj.weight' is I16"),
    ("model.layers.0.mlp.up_proj.weight", lambda t: t[:-1], r"'model.layers.0.mlp.up_proj.weight' has shape \[255, 128\]"),
])
def test_a_float_tensor_quantized_while_loading_is_checked_as_a_float_one(tmp_path, name, tensor, message):
    """--quantization int8 quantizes the projections and the tied embedding (the vocab projection)
    while loading: an integer tensor or a wrong shape among them is refused, named, before any
    memory is allocated, as it is without quantization."""
    path = tmp_path / "model"
    build_qwen3(path, vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,  # INT8: dims of 64
                num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    tensors = load_file(path / "model.safetensors")
    tensors[name] = tensor(tensors[name]).contiguous()
    save_file(tensors, path / "model.safetensors")
    quantization = QuantizationConfig.resolve(json.loads((path / "config.json").read_text()), "int8", "auto")
    with pytest.raises(CheckpointError, match=message):
        build_meta_model(Checkpoint(path), torch.float32, 64, quantization)


@pytest.mark.parametrize("qc, message", [
    ([1], r"quantization_config must be an object, got \[1\]"),
    ({"quant_method": "gptq", "bits": "four"}, "quantization_config.bits must be an integer, got 'four'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, r"group_size must be -1 \(per channel\) or an integer"),
    ({"quant_method": "awq", "bits": 4, "group_size": -5}, r"group_size must be -1 \(per channel\) or an integer"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128.5}, r"group_size must be .* got 128\.5"),
])
def test_quantization_config_garbage_is_named(qc, message):
    with pytest.raises(CheckpointError, match=message):
        QuantizationConfig.resolve({"quantization_config": qc}, None, "auto")


def test_a_quantization_group_that_does_not_divide_the_input_dim_is_refused(tmp_path):
    """GPTQ tensors whose scales agree with group_size 7 (128 // 7 groups): refused while the
    model is shaped, not left to dequantize 126 columns of 128 at the first step."""
    base = tmp_path / "base"
    build_qwen3(base, vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    tensors, g = load_file(base / "model.safetensors"), torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        n, k = tensors.pop(name).shape
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.qweight"] = torch.randint(0, 2**30, (k // 8, n), generator=g, dtype=torch.int32)
        tensors[f"{prefix}.qzeros"] = torch.randint(0, 2**30, (k // 7, n // 8), generator=g, dtype=torch.int32)
        tensors[f"{prefix}.scales"] = torch.rand(k // 7, n, generator=g).half()
    save_file(tensors, base / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 7, "desc_act": False}
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization group size 7 does not divide a projection's input dim 128"):
        LLM(str(base), device="cpu", enforce_eager=True)


def test_generation_config_token_ids_must_be_token_ids(variant):
    path = variant()
    for value in ("x", [-5], [10**12], {"a": 1}, ["a"], True):
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        with pytest.raises(CheckpointError,
                           match=r"generation_config.json: eos_token_id must be a token id in \[0, 16777216\)"):
            Tokenizer.from_pretrained(path)


@pytest.mark.parametrize("template, message", [
    ("{{ 'x' * 1001 }}", "repetition longer than 1000 items"),
    ("{{ [0] * 2 * 501 }}", "repetition longer than 1000 items"),
    ("{{ 3 ** 1000 }}", "power of more than 1000 bits"),
    ("{% for i in range(600) %}{{ messages[0].content }}{% endfor %}", "the prompt grows past 1000 characters"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "maximum recursion depth"),
])
def test_a_chat_template_cannot_build_without_bound(tiny, monkeypatch, template, message):
    """The template is the checkpoint's code, run on each chat request: a render that would build
    a huge string, number or prompt, or recurse without end, is a ValueError naming the template."""
    monkeypatch.setattr(tokenizer_module, "MAX_TEMPLATE_CHARS", 1000)
    tok = Tokenizer.from_pretrained(tiny[0])
    tok.chat_template = template
    with pytest.raises(ValueError, match=f"^chat template: {message}"):
        tok.apply_chat_template(CHAT)
    tok.chat_template = "{% for i in range(3) %}{{ messages[0].content * 2 }}{% endfor %}"
    assert tok.apply_chat_template(CHAT) == "hihihihihihi"  # within the bounds: rendered


def test_mtp_inspect_names_bad_layer_counts(variant):
    with pytest.raises(CheckpointError, match=r"mtp_num_hidden_layers must be an integer in \[0, 1024\], got 'x'"):
        inspect(variant("text", mtp_num_hidden_layers="x"))
    with pytest.raises(CheckpointError, match="config.json lacks 'num_hidden_layers'"):
        inspect(variant("none", num_hidden_layers=None))
    assert inspect(variant("fine"))["config_layers"] == 0


def test_a_config_that_lies_is_named_by_resolve_too(variant):
    """`jetserve plan` and `serve` resolve first: the same errors, before any model is shaped."""
    with pytest.raises(CheckpointError, match=r"^config.json: num_hidden_layers must be .* got 1000000"):
        EngineArgs(model=str(variant(num_hidden_layers=10**6)), device="cpu").resolve()


def test_a_chat_template_that_does_not_compile_is_said_at_load(tiny, tmp_path, caplog):
    """The template is compiled while the model loads (not at the first chat request): one that
    does not compile is a warning at start naming the checkpoint, and each chat request is then a
    ValueError with the same reason; plain prompts are unaffected."""
    config = json.loads((tiny[0] / "tokenizer_config.json").read_text())
    broken = tmp_path / "broken-template"
    shutil.copytree(tiny[0], broken)
    (broken / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% for m in %}"}))
    with caplog.at_level("WARNING", logger="jetserve.engine.tokenizer"):
        tok = Tokenizer.from_pretrained(broken)
    assert f"{broken}: the chat template does not compile" in caplog.text, caplog.text
    with pytest.raises(ValueError, match="^chat template: "):
        tok.apply_chat_template(CHAT)
    assert tok.encode("hi")
