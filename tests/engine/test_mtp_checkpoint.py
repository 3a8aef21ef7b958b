"""`jetserve mtp inspect|merge` on tiny random Qwen3 checkpoints built with transformers offline."""

import ast
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import require_module

torch = require_module("torch")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from jetserve.cli import main  # noqa: E402
from jetserve.engine.model.checkpoint import Checkpoint, CheckpointError  # noqa: E402
from jetserve.engine.offline.mtp_checkpoint import inspect, merge, parse_size  # noqa: E402

HIDDEN, LAYERS = 32, 2


def mtp_heads(base_state, style="qwen3-next", layers=1):
    """Random MTP heads shaped for the base: fc/norms plus one decoder block per layer."""
    gen = torch.Generator().manual_seed(1)
    block = {k[len("model.layers.0."):]: v for k, v in base_state.items() if k.startswith("model.layers.0.")}
    heads = {}
    for j in range(layers):
        prefix = f"mtp.layers.{j}." if style == "qwen3-next" else f"model.layers.{LAYERS + j}."
        heads.update({prefix + k: torch.randn(v.shape, generator=gen) for k, v in block.items()})
        if style == "deepseek":
            heads.update({prefix + "enorm.weight": torch.randn(HIDDEN, generator=gen),
                          prefix + "hnorm.weight": torch.randn(HIDDEN, generator=gen),
                          prefix + "eh_proj.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=gen),
                          prefix + "shared_head.norm.weight": torch.randn(HIDDEN, generator=gen)})
    if style == "qwen3-next":
        heads.update({"mtp.fc.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=gen),
                      "mtp.pre_fc_norm_embedding.weight": torch.randn(HIDDEN, generator=gen),
                      "mtp.pre_fc_norm_hidden.weight": torch.randn(HIDDEN, generator=gen),
                      "mtp.norm.weight": torch.randn(HIDDEN, generator=gen)})
    return heads


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A sharded random Qwen3 (GQA, head_dim != hidden/heads) plus tokenizer-side files."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("base")
    Qwen3ForCausalLM(config).save_pretrained(path, max_shard_size="20KB")
    (path / "tokenizer.json").write_text('{"fake": true}')
    (path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert (path / "model.safetensors.index.json").exists()
    return path


def state(model_dir):
    ckpt = Checkpoint(model_dir)
    return {name: ckpt.get(name) for name in ckpt.names()}


def write_checkpoint(path, tensors, config, like=None):
    """A single-file checkpoint, copying the non-weight files of `like`."""
    path.mkdir(parents=True, exist_ok=True)
    if like:
        for f in like.iterdir():
            if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, path / f.name)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def digest(path):
    files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def original(base, tmp_path_factory):
    """The checkpoint as trained: base + Qwen3-Next MTP heads in one file (bf16 heads, fp32 body)."""
    base_state = state(base)
    heads = {k: v.to(torch.bfloat16) for k, v in mtp_heads(base_state).items()}
    config = {**json.loads((base / "config.json").read_text()), "mtp_num_hidden_layers": 1}
    return write_checkpoint(tmp_path_factory.mktemp("full") / "ckpt", {**base_state, **heads}, config, like=base)


@pytest.fixture()
def heads_file(original, tmp_path):
    """The heads split off the original into one .safetensors file."""
    full = state(original)
    save_file({k: v for k, v in full.items() if k.startswith("mtp.")}, tmp_path / "mtp.safetensors")
    return tmp_path / "mtp.safetensors"


def test_split_and_merge_back_is_byte_identical(base, original, heads_file, tmp_path):
    before = {**digest(base), **digest(heads_file)}
    out = tmp_path / "out" / "merged"
    result = merge(base, heads_file, out, max_shard_size="24KB")

    assert {**digest(base), **digest(heads_file)} == before  # inputs untouched
    merged, expected = state(out), state(original)
    assert merged.keys() == expected.keys()
    assert all(same_bytes(merged[k], expected[k]) for k in expected)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert result["shards"] == len(shards) > 1
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    for shard in shards:  # every tensor sits where the index says
        with safe_open(out / shard, framework="pt") as f:
            assert all(index["weight_map"][k] == shard for k in f.keys())
    assert index["metadata"]["total_size"] == result["total_size"] == sum(
        t.numel() * t.element_size() for t in expected.values())

    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((original / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == ["merged"]  # no temp dir left behind
    assert result["style"] == "qwen3-next" and result["mtp_layers"] == 1


def test_inspect_reports_heads_and_share(base, original):
    report = inspect(original)
    heads = {k: v for k, v in state(original).items() if k.startswith("mtp.")}
    mtp_params = sum(v.numel() for v in heads.values())
    total = sum(v.numel() for v in state(original).values())
    assert report["has_mtp"] and report["style"] == "qwen3-next" and report["naming"] == "mtp.*"
    assert report["config_layers"] == report["found_layers"] == 1 and report["layers_match"]
    assert report["mtp_tensors"] == len(heads) == 11 + 4  # a decoder block (11) + fc and 3 norms
    assert (report["mtp_params"], report["total_params"]) == (mtp_params, total)
    assert report["mtp_share"] == pytest.approx(mtp_params / total)
    assert report["dtypes"] == ["bfloat16", "float32"] and report["mtp_dtypes"] == ["bfloat16"]
    assert report["files"] == ["model.safetensors"]

    plain = inspect(base)
    assert not plain["has_mtp"] and plain["style"] is None and plain["mtp_share"] == 0
    assert plain["files"] == sorted(p.name for p in base.glob("*.safetensors")) and len(plain["files"]) > 1


def test_inspect_flags_layer_count_mismatch(original, tmp_path):
    config = {**json.loads((original / "config.json").read_text()), "mtp_num_hidden_layers": 2}
    ckpt = write_checkpoint(tmp_path / "c", state(original), config)
    report = inspect(ckpt)
    assert (report["config_layers"], report["found_layers"], report["layers_match"]) == (2, 1, False)


def test_deepseek_heads_from_a_sharded_directory(base, tmp_path):
    heads = mtp_heads(state(base), style="deepseek", layers=2)
    src = tmp_path / "src"
    src.mkdir()
    names = sorted(heads)
    weight_map = {}
    for i, part in enumerate((names[:10], names[10:])):  # a sharded source with its own index
        save_file({k: heads[k] for k in part}, src / f"part{i}.safetensors")
        weight_map.update(dict.fromkeys(part, f"part{i}.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 2}))

    result = merge(base, src, tmp_path / "out")
    merged = state(tmp_path / "out")
    assert all(same_bytes(merged[k], v) for k, v in heads.items())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and "mtp_num_hidden_layers" not in config
    report = inspect(tmp_path / "out")
    assert report["style"] == result["style"] == "deepseek"
    assert report["naming"] == "model.layers.{N+j}.*" and report["found_layers"] == 2 and report["layers_match"]

    (src / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 3}))
    with pytest.raises(CheckpointError, match="declares 3 MTP layers, its tensors hold 2"):
        merge(base, src, tmp_path / "out2")


@pytest.mark.parametrize("name, shape, expected", [
    ("mtp.fc.weight", (HIDDEN, HIDDEN), [HIDDEN, 2 * HIDDEN]),
    ("mtp.norm.weight", (HIDDEN + 1,), [HIDDEN]),
    ("mtp.layers.0.self_attn.k_proj.weight", (16, HIDDEN), [32, HIDDEN]),
])
def test_mis_shaped_head_is_named_with_expected_and_found(base, heads_file, tmp_path, name, shape, expected):
    with safe_open(heads_file, framework="pt") as f:
        heads = {k: f.get_tensor(k) for k in f.keys()}
    heads[name] = torch.zeros(shape)
    save_file(heads, tmp_path / "bad.safetensors")
    message = f"{name} has shape {list(shape)}, expected {expected}"
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        merge(base, tmp_path / "bad.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refusals(base, original, heads_file, tmp_path):
    with pytest.raises(CheckpointError, match="outside the input"):
        merge(base, heads_file, base)
    with pytest.raises(CheckpointError, match="outside the input"):
        merge(base, heads_file, base / "sub")
    with pytest.raises(CheckpointError, match="outside the input"):
        merge(base, heads_file, heads_file.parent)  # would hold (and --force would delete) the source
    with pytest.raises(CheckpointError, match="already has MTP heads"):
        merge(original, heads_file, tmp_path / "o1")
    with pytest.raises(CheckpointError, match="no such file"):
        merge(base, tmp_path / "missing.safetensors", tmp_path / "o2")
    not_heads = tmp_path / "body.safetensors"
    save_file({"model.norm.weight": torch.ones(HIDDEN)}, not_heads)
    with pytest.raises(CheckpointError, match="model.norm.weight is not an MTP tensor"):
        merge(base, not_heads, tmp_path / "o3")
    mixed = tmp_path / "mixed.safetensors"
    save_file({"mtp.norm.weight": torch.ones(HIDDEN), f"model.layers.{LAYERS}.enorm.weight": torch.ones(HIDDEN)},
              mixed)
    with pytest.raises(CheckpointError, match="mixes both MTP namings"):
        merge(base, mixed, tmp_path / "o4")
    with pytest.raises(ValueError, match="max_shard_size"):
        merge(base, heads_file, tmp_path / "o5", max_shard_size="huge")


def test_replace_and_force(original, heads_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(CheckpointError, match="not empty"):
        merge(original, heads_file, out, replace=True)
    merge(original, heads_file, out, replace=True, force=True)
    assert not (out / "stale.txt").exists()
    merged, expected = state(out), state(original)
    assert merged.keys() == expected.keys() and all(same_bytes(merged[k], expected[k]) for k in expected)


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("500mb", 500 * 10**6),
                                        ("1.5KB", 1500), ("123", 123), (7, 7)])
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_cli_inspect_merge_and_errors(base, original, heads_file, tmp_path, capsys):
    assert main(["mtp", "inspect", str(original)]) == 0
    table = capsys.readouterr().out
    assert "MTP heads   yes, 15 tensors named mtp.* (qwen3-next style)" in table
    assert "MTP layers  1 in tensors, 1 in config.json" in table and "% of all weights" in table

    assert main(["mtp", "inspect", str(base), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["has_mtp"] is False

    out = tmp_path / "out"
    assert main(["mtp", "merge", str(base), str(heads_file), str(out), "--max-shard-size", "30KB"]) == 0
    assert "wrote" in capsys.readouterr().out and inspect(out)["has_mtp"]

    assert main(["mtp", "merge", str(base), str(heads_file), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jetserve mtp merge: ") and "not empty" in err and err.count("\n") == 1
    assert main(["mtp", "inspect", str(tmp_path / "nowhere")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_cli_as_a_subprocess(original):
    run = subprocess.run([sys.executable, "-m", "jetserve.cli", "mtp", "inspect", str(original), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["found_layers"] == 1
    bad = subprocess.run([sys.executable, "-m", "jetserve.cli", "mtp", "inspect", "/nonexistent"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1


def test_cli_module_parses_on_python_38():
    source = (Path(__file__).parents[2] / "engine" / "cli.py").read_text()
    tree = ast.parse(source, feature_version=(3, 8))
    imported = {a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert {m.split(".")[0] for m in imported} <= set(sys.stdlib_module_names)  # heavy ones wait in the commands
