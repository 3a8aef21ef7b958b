"""Shipped tile tables (engine/model/tile_tables.py): a serving engine takes its tiles from them
and times none; the rule for shapes no table lists; `jetserve tune`'s tables; every shipped
table names only tiles the current kernels offer for the Qwen3 shapes (a changed candidate set
fails here until the tables are tuned again)."""

import json
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from jetserve.bench.common import SHAPES  # noqa: E402
from jetserve.engine.model import kernels, tile_tables  # noqa: E402
from jetserve.engine.model.kernels import ADD_NORM, NORM, PLAIN, SILU_MUL, FusedKernels, Tile, candidate_tiles  # noqa: E402
from jetserve.engine.model.quant import QuantizedWeight  # noqa: E402
from jetserve.engine.model.quant_kernels import fitting_tiles  # noqa: E402
from jetserve.engine.model.tile_cache import TileCache, shape_key  # noqa: E402
from jetserve.engine.model.tile_tables import PrefillConfig, TileTable  # noqa: E402
from jetserve.engine.tune import table_from_caches  # noqa: E402

A, B, C = Tile(4, 1024, 4), Tile(8, 1024, 4, pdl=True), Tile(2, 2048, 4)
ROWS = (1, 2, 4, 8, 16, 32, 64)


def _key(n, k, rows=1, prologue=PLAIN):
    return (prologue, rows, n, k, torch.bfloat16)


def test_a_listed_shape_takes_its_best_ranked_tile_this_gpu_can_run():
    table = TileTable("sm90", {shape_key(_key(4096, 1024)): [B, A, None]})
    assert table.choose(_key(4096, 1024), [None, A, B], default=A) == (B, "table")
    # Before Hopper no candidate has PDL: the tile is read without it, not skipped.
    assert table.choose(_key(4096, 1024), [None, A, B._replace(pdl=False)], default=A) == (B._replace(pdl=False),
                                                                                          "table")
    # Nor is one whose L2 prefetch comes with its PDL (kernels.with_pdl).
    fetching = TileTable("sm90", {shape_key(_key(4096, 1024)): [B._replace(prefetch=True), A]})
    assert fetching.choose(_key(4096, 1024), [None, A, B._replace(pdl=False)], default=A) == \
        (B._replace(pdl=False), "table")
    assert fetching.choose(_key(4096, 1024), [None, A, B, B._replace(prefetch=True)], default=A) == \
        (B._replace(prefetch=True), "table")
    # A tile the candidates lack (another kernel version's) gives way to the next ranked.
    assert table.choose(_key(4096, 1024), [None, A], default=C) == (A, "table")
    assert table.choose(_key(4096, 1024), [C], default=C) == (C, "default")


def test_a_shape_no_table_lists_takes_its_nearest_of_the_same_kind():
    small, big = shape_key(_key(1024, 1024)), shape_key(_key(16384, 4096))
    table = TileTable("sm90", {small: [A], big: [C], shape_key(_key(1024, 1024, rows=8)): [B]})
    assert table.choose(_key(12288, 3072), [None, A, B, C], default=None) == (C, "nearest")
    assert table.choose(_key(1536, 768), [None, A, B, C], default=None) == (A, "nearest")
    # Another row bucket, prologue or dtype is another kind: its own entries, else first-fit.
    assert table.choose(_key(16384, 4096, rows=8), [None, A, B, C], default=None) == (B, "nearest")
    assert table.choose(_key(1024, 1024, prologue=NORM), [None, A, B, C], default=A) == (A, "default")
    assert table.choose(("quant", PLAIN, 1, 1024, 1024, 4, 128, torch.float32, torch.bfloat16),
                        [A, C], default=C) == (C, "default")


def test_a_serving_engine_times_no_tile_and_computes_the_product():
    """A weight big enough to be timed takes the table's tile untimed (timing would fail in the
    interpreter); results are the product's, whatever tile runs."""
    x, w = torch.randn(2, 256), torch.randn(300, 256)  # 300 KB: past the untuned size
    key = (PLAIN, 2, 300, 256, torch.float32)
    tiles = candidate_tiles(2, PLAIN, kernels.pdl_supported(x.device))
    table = TileTable("test", {shape_key(key): [tiles[-1]]})
    fused = FusedKernels(table=table)
    torch.testing.assert_close(fused.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert fused.chosen == {key: tiles[-1]} and fused.sources == {key: "table"} and not fused.tuning_times
    other = FusedKernels()  # no table: first-fit, as an untimed engine always did
    torch.testing.assert_close(other.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert other.chosen == {key: tiles[1]} and other.sources == {key: "default"}


def test_a_tuned_choice_beats_the_table(tmp_path):
    x, w = torch.randn(1, 256), torch.randn(300, 256)
    key = (PLAIN, 1, 300, 256, torch.float32)
    tiles = candidate_tiles(1, PLAIN, kernels.pdl_supported(x.device))
    cache = TileCache(tmp_path, {"device": {"name": "cpu"}})
    cache.store(key, tiles, [1.0] * (len(tiles) - 1) + [0.5], tiles[-1])
    fused = FusedKernels(tile_cache=TileCache(tmp_path, {"device": {"name": "cpu"}}),
                         table=TileTable("test", {shape_key(key): [tiles[1]]}))
    fused.linear(x, w)
    assert fused.chosen[key] == tiles[-1] and fused.sources[key] == "tuned"


def _model_keys(shape: str, rows: int, bits: int | None):
    """The skinny-product keys a Qwen3 shape's decoder layers bring at `rows` rows (bf16
    activations; INT8 per channel, INT4 in groups of 128, as quantized on the fly), and its vocab
    projection's in bf16."""
    s = SHAPES[shape]
    h, i, o = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"] * s["head_dim"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * s["head_dim"]
    products = [(ADD_NORM, qkv, h), (PLAIN, h, o), (ADD_NORM, 2 * i, h), (SILU_MUL, h, i)]
    if bits is None:
        return [(p, rows, n, k, torch.bfloat16) for p, n, k in products] + \
            [(PLAIN, rows, s["vocab_size"], h, torch.bfloat16)]
    return [("quant", p, rows, n, k, bits, k if bits == 8 else 128, torch.float32, torch.bfloat16)
            for p, n, k in products]


def _offered(key: str, pdl: bool) -> set:
    """The candidates the kernels offer for a stored key now."""
    parts = key.split("|")
    if parts[0] != "quant":
        return set(candidate_tiles(int(parts[1]), int(parts[0]), pdl))
    prologue, rows, n, k, bits, group = map(int, parts[1:7])
    weight = QuantizedWeight(torch.empty(n, k * bits // 32, dtype=torch.int32, device="meta"),
                             torch.empty(n, k // group, dtype=torch.float32, device="meta"), None, bits, group)
    return set(fitting_tiles(rows, weight, prologue, pdl)) | {None}


@pytest.mark.parametrize("name", ["sm87", "sm90", "sm110"])
def test_each_shipped_table_reads_and_offers_only_current_candidates(name):
    table = tile_tables.shipped(name)
    assert table.name == name and len(table.shapes) >= 100 and isinstance(table.prefill, PrefillConfig)
    pdl = name != "sm87"
    for key, ranked in table.shapes.items():
        offered = _offered(key, pdl)
        assert ranked and all(t in offered for t in ranked), key
        assert pdl or not any(t and t.pdl for t in ranked), key  # no PDL before Hopper


def test_the_h200_table_lists_every_qwen3_product_it_was_tuned_on():
    table = tile_tables.shipped("sm90")
    for shape in ("qwen3-0.6b", "qwen3-4b"):
        for rows in ROWS:
            for key in _model_keys(shape, rows, None):
                assert table.ranked(key)[1] == "table", key
    for rows in ROWS:  # both shapes in INT8 and INT4
        for key in [k for shape in ("qwen3-0.6b", "qwen3-4b") for bits in (8, 4) for k in _model_keys(shape, rows, bits)]:
            if _offered(shape_key(key), True) != {None}:  # rows no quantized tile takes: the float path
                assert table.ranked(key)[1] == "table", key


def test_a_family_without_a_table_takes_the_nearest_family():
    assert tile_tables.shipped("sm86").name == "sm87"  # desktop Ampere: Orin's generation
    assert tile_tables.shipped("sm89").name == "sm90"
    assert tile_tables.for_device(torch.device("cpu")) is tile_tables.EMPTY


def test_derive_drops_what_the_family_lacks_and_keeps_the_ranking():
    key = shape_key(_key(16384, 1024))
    split = Tile(16, 256, 4, 4, pdl=True, dot=True)
    fetching = split._replace(prefetch=True, block_n=32)
    source = TileTable("sm90", {key: [split, None, split._replace(pdl=False), fetching, A]}, PrefillConfig(), "timed")
    assert tile_tables.derive(source, "sm87", pdl=False, note="derived").shapes[key] == \
        [split._replace(pdl=False), None, fetching._replace(pdl=False, prefetch=False), A]  # deduplicated, order kept
    thor = tile_tables.derive(source, "sm110", pdl=True, note="derived")
    assert thor.shapes[key] == source.shapes[key] and thor.source == "derived"


@pytest.mark.parametrize("family, pdl", [("sm87", False), ("sm110", True)])
def test_the_shipped_derived_tables_are_the_measured_one_derived(family, pdl):
    """Orin's and Thor's tables are sm90's as `derive` reads it (tools/derive_tile_tables.py): a
    change to the measured table that was not carried over to them fails here."""
    measured = TileTable.read(tile_tables.TABLES / "sm90.json")
    shipped = TileTable.read(tile_tables.TABLES / f"{family}.json")
    assert shipped.shapes == tile_tables.derive(measured, family, pdl, note="").shapes
    assert shipped.prefill == measured.prefill and "derived from sm90" in shipped.source


def test_a_table_round_trips_and_is_made_from_tile_caches(tmp_path):
    key = _key(4096, 1024)
    piped = Tile(64, 16, 4, 4, apart=True, pdl=True, dot=True, stages=3, prefetch=True)
    table = tile_tables.from_timings("sm90", {key: {None: 3.0, A: 1.0, B: 2.0, C: float("inf"), piped: 2.5}},
                                     PrefillConfig(128, 8, 2), "test")
    assert table.shapes[shape_key(key)] == [A, B, piped, None]  # fastest first; one that could not run is dropped
    path = tmp_path / "t.json"
    path.write_text(table.to_json())
    again = TileTable.read(path)
    assert again.shapes == table.shapes and again.prefill == table.prefill
    assert len(path.read_text().splitlines()) == 3  # the head, one line a shape, the end
    # A tile past the format's first eight fields keeps them up to its last one not at its default; one
    # at their defaults is stored as before them.
    assert json.loads(path.read_text())["shapes"][shape_key(key)] == [list(A)[:8], list(B)[:8], list(piped)[:10], None]
    old = tmp_path / "old.json"  # from when tables held `ahead`, a step-wide L2 prefetch since removed: still read
    old.write_text(json.dumps({**json.loads(path.read_text()), "ahead": 0.5}))
    assert TileTable.read(old).shapes == table.shapes
    fp = {"device": {"name": "NVIDIA H200", "capability": "9.0"}}
    cache = TileCache(tmp_path / "tiles", fp)
    cache.store(key, [None, A, B], [3.0, 2.0, 1.0], B)
    built = table_from_caches([str(cache.path)])
    assert built.name == "sm90" and built.shapes[shape_key(key)] == [B, A, None]
    assert len(built.shapes) > 1  # over the shipped table


def test_jetserve_tune_without_a_gpu_says_why():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "jetserve.cli", "tune", "--model", "demo", "--device", "cpu"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and "nothing to tune" in out.stderr and "Traceback" not in out.stderr


def test_tune_from_a_cache_file_without_an_engine(tmp_path):
    fp = {"device": {"name": "NVIDIA H200", "capability": "9.0"}}
    cache = TileCache(tmp_path, fp)
    cache.store(_key(777, 1024), [None, A], [2.0, 1.0], A)
    out = tmp_path / "table.json"
    done = subprocess.run([sys.executable, "-m", "jetserve.cli", "tune", "--from-cache", str(cache.path), "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    # stored as the format's first eight fields: stages and prefetch at their defaults are left out
    assert doc["family"] == "sm90" and doc["shapes"][shape_key(_key(777, 1024))] == [list(A)[:8], None]


@pytest.mark.parametrize("text, says", [("[1, 2]", "not a tile cache file"), ("{", "Expecting"),
                                        ('{"fingerprint": {"device": {}}, "shapes": 7}', "'shapes' must be")])
def test_tune_refuses_a_file_that_is_no_tile_cache(tmp_path, text, says):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    done = subprocess.run([sys.executable, "-m", "jetserve.cli", "tune", "--from-cache", str(bad), "--family", "sm90",
                           "--out", str(tmp_path / "t.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "t.json").exists()


def test_a_stream_probe_result_updates_only_the_shapes_it_beat_by_more_than_the_spread(tmp_path):
    """tools/table_from_stream.py: a probed product whose fastest tile beat the shipped one by
    more than MIN_GAIN takes the timed tiles fastest first, the table's old ones after (at most
    MAX_RANKED), q·k·v (probed as every layer but the first runs it, the residual added) in the
    first layer's twin too; one that won by less, and row counts not asked for, stay as they were."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    key = shape_key(("quant", ADD_NORM, 16, 4096, 1024, 8, 1024, torch.float32, torch.bfloat16))
    first = shape_key(("quant", NORM, 16, 4096, 1024, 8, 1024, torch.float32, torch.bfloat16))
    close = shape_key((ADD_NORM, 16, 6144, 1024, torch.bfloat16))
    old = [Tile(1, 256, 8), Tile(8, 128, 4)]
    table = TileTable("sm90", {key: old, first: [old[1]], close: [B]}, PrefillConfig(), "timed")
    path = tmp_path / "sm90.json"
    path.write_text(table.to_json())
    dot = Tile(64, 16, 4, 4, apart=True, pdl=True, dot=True, stages=3)
    rows = [{"shape": "qwen3-0.6b", "name": "qkv", "format": "int8", "rows": 16, "shipped_tile": list(old[0]),
             "shipped_us": 24.0, "pipelined_us": 21.0, "pipelined_tile": list(dot), "cublas_us": 11.0},
            {"shape": "qwen3-0.6b", "name": "gate_up", "format": "bf16", "rows": 16, "shipped_tile": list(B),
             "shipped_us": 7.5, "cublas_us": 7.2},  # 4%: within the spread
            {"shape": "qwen3-0.6b", "name": "gate_up", "format": "bf16", "rows": 1, "shipped_tile": list(B),
             "shipped_us": 7.5, "cublas_us": 1.0}]  # a row count not asked for
    (tmp_path / "stream.json").write_text(json.dumps({"rows": rows}))
    done = subprocess.run([sys.executable, os.path.join(root, "tools", "table_from_stream.py"),
                           str(tmp_path / "stream.json"), "--table", str(path), "--rows", "16"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr
    updated = TileTable.read(path)
    assert updated.shapes[key] == [None, dot, old[0], old[1]] and updated.shapes[close] == [B]
    assert updated.shapes[first] == [None, dot, old[0], old[1]]
    assert "2 shapes changed" in done.stderr


def test_a_one_row_sweep_ranks_only_the_tiles_the_engine_offers(tmp_path):
    """tools/table_from_stream.py on a gemv sweep (tools/quant_gemv_h200.py): the product's tiles
    fastest first, the shipped one among them, a swept tile that is no candidate (the engine would
    pass over it) left out; the table's old ones after."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    key = shape_key(("quant", SILU_MUL, 1, 1024, 3072, 8, 3072, torch.float32, torch.bfloat16))
    shipped = Tile(64, 128, 8, 4, pdl=True, one_row=True)
    offered, stray = Tile(64, 128, 8, 8, pdl=True, one_row=True), Tile(64, 128, 8, 3, pdl=True, one_row=True)
    path = tmp_path / "sm90.json"
    path.write_text(TileTable("sm90", {key: [shipped, Tile(4, 128, 4)]}, PrefillConfig(), "timed").to_json())
    sweep = {"qwen3-0.6b down int8": {"shipped": repr(shipped), "shipped_us": 5.0,
                                      "us": {f"shipped {shipped!r}": 5.0, repr(offered): 4.0, repr(stray): 3.0}}}
    (tmp_path / "gemv.json").write_text(json.dumps(sweep))
    done = subprocess.run([sys.executable, os.path.join(root, "tools", "table_from_stream.py"),
                           str(tmp_path / "gemv.json"), "--table", str(path), "--rows", "1"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr
    assert TileTable.read(path).shapes[key] == [offered, shipped, Tile(4, 128, 4)]
    assert "1 shapes changed" in done.stderr


def test_the_step_probe_writes_only_gains_past_the_spread(tmp_path):
    """tools/step_tiles_probe.py --table: a shape whose new tile took more than MIN_GAIN off the
    step takes the timed ranking (the table's old tiles after); a smaller gain leaves its entry;
    the table says where the rows came from. The quantized candidates it times leave out the
    prefetching twins and, at one row, the tensor-core tiles, never the current choice."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("step_tiles_probe", os.path.join(root, "tools", "step_tiles_probe.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    won = shape_key(("quant", SILU_MUL, 1, 2560, 9728, 8, 9728, torch.float32, torch.bfloat16))
    level = shape_key(("quant", PLAIN, 1, 2560, 4096, 8, 4096, torch.float32, torch.bfloat16))
    old, new = Tile(4, 128, 4, 4, pdl=True), Tile(32, 64, 4, 16, pdl=True, one_row=True)
    path = tmp_path / "sm90.json"
    path.write_text(TileTable("sm90", {won: [old, A], level: [old]}, PrefillConfig(), "timed").to_json())
    changed = {won: {"was_ms": 2.656, "best_ms": 2.607, "ranked": [[list(new), 2.607], [list(old), 2.656]]},
               level: {"was_ms": 2.656, "best_ms": 2.650, "ranked": [[list(new), 2.650], [list(old), 2.656]]}}
    probe.write_table(path, changed, "step tiles")
    table = TileTable.read(path)
    assert table.shapes[won] == [new, old, A] and table.shapes[level] == [old]
    assert table.source == "timed; step tiles"
    weight = probe._weight_like(("quant", SILU_MUL, 1, 2560, 9728, 8, 9728, torch.float32, torch.bfloat16))
    every = fitting_tiles(1, weight, SILU_MUL, pdl=True)
    kept = probe._quant_tiles(every, 1, Tile(64, 16, 4, 4, pdl=True, dot=True))
    assert new in kept and kept[-1] == Tile(64, 16, 4, 4, pdl=True, dot=True)
    assert not [t for t in kept[:-1] if t.prefetch or t.dot] and len(kept) < len(every)
