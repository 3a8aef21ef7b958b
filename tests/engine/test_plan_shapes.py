"""`jetserve plan --model qwen3-4b`: the common Qwen3 shapes by name, offline (config.json shipped,
no weights), with the same plan a real checkpoint of that shape gets."""

import json

import pytest

from jetserve.cli import main
from jetserve.engine.plan import known_shapes, shape_config

SHAPES = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"]
# Parameters of the published checkpoints (tied embeddings counted once), in billions.
PARAMETERS = {"qwen3-0.6b": 0.596, "qwen3-1.7b": 1.72, "qwen3-4b": 4.02, "qwen3-8b": 8.19}


def test_the_shapes_are_shipped():
    assert known_shapes() == sorted(SHAPES)
    assert shape_config("Qwen3-4B")["hidden_size"] == 2560 and shape_config("qwen3-5b") is None


@pytest.mark.parametrize("name", SHAPES)
def test_each_shape_plans_by_name(name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no directory of that name here: the name is what resolves
    assert main(["plan", "--model", name, "--device", "thor", "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("%s: the shape of Hugging Face's Qwen/Qwen3-" % name) and "no weights" in out
    row = next(line for line in out.splitlines() if line.startswith("weights "))
    weights_gib = float(row.split()[1])
    assert weights_gib * 2**30 / 2 == pytest.approx(PARAMETERS[name] * 1e9, rel=0.02)  # bf16: 2 bytes each


def test_the_readme_example_runs_offline(capsys):
    """README: 4B INT4 with two 4096-token sequences fits an 8 GB Orin Nano; bf16 does not (exit 1)."""
    common = ["plan", "--model", "qwen3-4b", "--device", "orin-nano-8gb", "--max-model-len", "4096",
              "--max-num-seqs", "2"]
    assert main(common + ["--quantization", "int4"]) == 0
    out = capsys.readouterr().out
    assert "weights         2.19 GiB  int4" in out and "fits: +2.28 GiB to spare" in out, out
    assert main(common) == 1 and "DOES NOT FIT" in capsys.readouterr().out


def test_an_unknown_name_lists_the_known_ones(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "qwen3-5b", "--device", "thor"]) == 2
    err = capsys.readouterr().err
    assert "known shape: qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b" in err, err


def test_a_directory_of_that_name_wins(tmp_path, monkeypatch, capsys):
    """A checkpoint directory called qwen3-4b is that checkpoint, not the shipped shape."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen3-4b").mkdir()
    (tmp_path / "qwen3-4b" / "config.json").write_text(json.dumps(shape_config("qwen3-0.6b")))
    assert main(["plan", "--model", "qwen3-4b", "--device", "thor"]) == 2  # no weights in that directory
    assert "the shape of" not in capsys.readouterr().out


def _products(out: str) -> dict[str, tuple[str, str, str, str]]:
    """The plan's batch-1 table: product → (format, kernel, a token, bound)."""
    table = out.split("  product ")[1].splitlines()[1:]
    return {row.split()[0]: (row.split()[1], row.split()[2], row.split()[3], row.split()[-1]) for row in table}


def test_each_product_is_projected_with_the_kernel_it_takes(capsys):
    """The INT4 projections take the MMA kernel, not torch's W4A16 kernel (model/int4pack.py: only
    where the MMA kernel does not take a shape), the vocab projection takes INT8; on an Orin Nano
    the MMA kernel's few instructions a weight leave the 4B's INT4 products bound by memory, as its
    vocab projection is, each said."""
    common = ["plan", "--device", "orin-nano-8gb", "--max-model-len", "4096", "--quantization", "int4"]
    main([*common, "--model", "qwen3-4b"])
    big = _products(capsys.readouterr().out)
    assert list(big) == ["q·k·v", "o", "gate·up", "down", "vocab"]
    assert all(big[name][:3] == ("int4", "MMA", "x36") for name in ["q·k·v", "o", "gate·up", "down"])
    assert big["vocab"] == ("int8", "MMA", "x1", "memory")
    assert {big[name][3] for name in ["q·k·v", "o", "gate·up", "down"]} == {"memory"}
    main([*common, "--model", "qwen3-0.6b"])
    small = _products(capsys.readouterr().out)
    assert all(small[name][0] == "int4" and small[name][1] != "tinygemm" and small[name][2] == "x28"
               for name in ["q·k·v", "o", "gate·up", "down"])
