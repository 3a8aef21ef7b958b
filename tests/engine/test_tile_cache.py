"""The tile cache on disk: choices round-trip, anything they depend on invalidates them, a bad
file is ignored with a warning and rewritten, concurrent writers leave a valid file, and engines
take cached choices without timing. Without a GPU the kernels run in Triton's interpreter, where
timing a tile (a CUDA graph) cannot happen: a shape the cache did not answer fails there."""

import json
import logging
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.tools import require_module

require_module("triton")

from jetserve.engine import LLM, SamplingParams  # noqa: E402
from jetserve.engine.config import EngineArgs  # noqa: E402
from jetserve.engine.model import kernels, quant  # noqa: E402
from jetserve.engine.model.kernels import PLAIN, FusedKernels, Tile, candidate_tiles  # noqa: E402
from jetserve.engine.model.quant_kernels import QuantFusedKernels, candidates  # noqa: E402
from jetserve.engine.model.tile_cache import MAX_FILE_BYTES, TileCache, fingerprint  # noqa: E402
from jetserve.engine.runner import tune_kernels  # noqa: E402

from tests.engine.builders import build_qwen3  # noqa: E402
from tests.engine.test_mixed_graphs import BLOCK_SIZE, NUM_BLOCKS, SMALL, fused_model  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KEY = (kernels.NORM, 1, 6144, 2560, torch.bfloat16)
CANDIDATES = candidate_tiles(1, kernels.NORM, pdl=True)


def times_for(candidates, fastest):
    """Times (ms) where candidate `fastest` wins and one tile could not run."""
    return [0.005 if i == fastest else math.inf if i == 1 else 0.01 + i / 1000 for i in range(len(candidates))]


@pytest.fixture
def fp():
    return fingerprint(DEVICE)


def test_choices_round_trip(tmp_path, fp):
    """Float and quantized shapes, a Triton tile and cuBLAS (None), times with one that could not
    run: a new cache over the same directory returns them as stored."""
    cache = TileCache(tmp_path, fp)
    assert cache.lookup(KEY, CANDIDATES) is None
    tile = CANDIDATES[5]
    cache.store(KEY, CANDIDATES, times_for(CANDIDATES, 5), tile)
    quant_key = ("quant", kernels.ADD_NORM, 2, 2560, 9728, 4, 128, torch.float32, torch.bfloat16)
    cache.store(quant_key, CANDIDATES[:3], [0.2, 0.3, 0.4], None)
    again = TileCache(tmp_path, fp)
    entry = again.lookup(KEY, CANDIDATES)
    assert entry.tile == tile and entry.candidates == tuple(CANDIDATES)
    assert entry.times_ms == tuple(times_for(CANDIDATES, 5)) and entry.times_ms[1] == math.inf
    assert again.lookup(quant_key, CANDIDATES[:3]).tile is None
    assert [p.name for p in tmp_path.glob("*.json")] == [cache.path.name]
    doc = json.loads(cache.path.read_text())  # readable: the choice, its candidates, their times
    stored = doc["shapes"]["1|1|6144|2560|torch.bfloat16"]
    assert stored["tile"] == list(tile) and stored["times_ms"][1] is None


@pytest.mark.parametrize("change", [("device", {"name": "NVIDIA H200", "sms": 132}), ("driver", 13000),
                                    ("cuda", "12.6"), ("torch", "2.99.0"), ("triton", "9.9.9"),
                                    ("kernels", "0" * 16), ("format", 0)])
def test_anything_a_choice_depends_on_invalidates_it(tmp_path, fp, change, caplog):
    """Another GPU, driver, CUDA, torch, Triton, kernel source or file format: another file, so a
    miss; that file copied over this one's name is foreign: ignored with a warning, rewritten."""
    TileCache(tmp_path, fp).store(KEY, CANDIDATES, times_for(CANDIDATES, 3), CANDIDATES[3])
    other = TileCache(tmp_path, {**fp, change[0]: change[1]})
    assert other.path != TileCache(tmp_path, fp).path and other.lookup(KEY, CANDIDATES) is None
    other.path.write_bytes(TileCache(tmp_path, fp).path.read_bytes())
    with caplog.at_level(logging.WARNING):
        foreign = TileCache(tmp_path, other.fingerprint)
    assert foreign.lookup(KEY, CANDIDATES) is None and "another GPU" in caplog.text
    foreign.store(KEY, CANDIDATES, times_for(CANDIDATES, 4), CANDIDATES[4])
    assert TileCache(tmp_path, other.fingerprint).lookup(KEY, CANDIDATES).tile == CANDIDATES[4]


def test_kernel_source_and_candidates_invalidate(tmp_path):
    """The fingerprint hashes the kernels' source: an edit changes it. A shape timed among other
    candidates (a tile added or dropped) misses, and is replaced when timed again."""
    source = tmp_path / "kernels.py"
    source.write_text("x = 1\n")
    before = fingerprint(DEVICE, [source])
    source.write_text("x = 2\n")
    assert fingerprint(DEVICE, [source])["kernels"] != before["kernels"]
    cache = TileCache(tmp_path, before)
    cache.store(KEY, CANDIDATES[:-1], times_for(CANDIDATES[:-1], 2), CANDIDATES[2])
    assert TileCache(tmp_path, before).lookup(KEY, CANDIDATES) is None
    assert TileCache(tmp_path, before).lookup(KEY, CANDIDATES[:-1]).tile == CANDIDATES[2]
    cache.store(KEY, CANDIDATES, times_for(CANDIDATES, 0), None)
    assert TileCache(tmp_path, before).lookup(KEY, CANDIDATES).tile is None


def _valid_doc(fp):
    return {"fingerprint": fp, "shapes": {"1|1|6144|2560|torch.bfloat16": {
        "tile": [4, 1024, 4, 1, False, True, False, False],
        "candidates": [None, [4, 1024, 4, 1, False, True, False, False]],
        "times_ms": [0.02, 0.01]}}}


def _with_entry(fp, **fields):
    doc = _valid_doc(fp)
    doc["shapes"]["1|1|6144|2560|torch.bfloat16"].update(fields)
    return json.dumps(doc)


HOSTILE = {
    "truncated": lambda fp: json.dumps(_valid_doc(fp))[:60],
    "not UTF-8": lambda fp: b"\xff\xfe{\x00",
    "not an object": lambda fp: "[1, 2, 3]",
    "nested deep": lambda fp: "[" * 200_000,
    "huge": lambda fp: json.dumps(_valid_doc(fp)) + " " * MAX_FILE_BYTES,
    "shapes a list": lambda fp: json.dumps({"fingerprint": fp, "shapes": []}),
    "too many shapes": lambda fp: json.dumps({"fingerprint": fp, "shapes": {str(i): 0 for i in range(5000)}}),
    "tile of strings": lambda fp: _with_entry(fp, tile=["4", "1024", "4", "1", False, True, False, False]),
    "bool where an int goes": lambda fp: _with_entry(fp, tile=[4, 1024, 4, True, False, True, False, False]),
    "int where a bool goes": lambda fp: _with_entry(fp, candidates=[None, [4, 1024, 4, 1, 0, 1, 0, 0]]),
    "unknown tile name": lambda fp: _with_entry(fp, tile="Tile(4, 1024, 4)"),
    "tile too short": lambda fp: _with_entry(fp, tile=[4, 1024, 4, 1, False, True, False]),
    "tile too long": lambda fp: _with_entry(fp, tile=[4, 1024, 4, 1, False, True, False, False, 3, True, True]),
    "bool where the stages go": lambda fp: _with_entry(fp, tile=[4, 1024, 4, 1, False, True, False, False, True]),
    "int where the prefetch goes": lambda fp: _with_entry(fp, tile=[4, 1024, 4, 1, False, True, False, False, 3, 1]),
    "tile not a candidate": lambda fp: _with_entry(fp, tile=[8, 1024, 4, 1, False, True, False, False]),
    "times too few": lambda fp: _with_entry(fp, times_ms=[0.01]),
    "negative time": lambda fp: _with_entry(fp, times_ms=[0.01, -1]),
    "NaN time": lambda fp: _with_entry(fp, times_ms=[0.01, float("nan")]),
    "time a string": lambda fp: _with_entry(fp, times_ms=[0.01, "fast"]),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_bad_file_is_ignored_with_a_warning_and_rewritten(tmp_path, fp, name, caplog):
    cache = TileCache(tmp_path, fp)
    content = HOSTILE[name](fp)
    cache.path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with caplog.at_level(logging.WARNING):
        bad = TileCache(tmp_path, fp)
    assert bad.shapes == {} and bad.lookup(KEY, CANDIDATES) is None
    assert "ignored" in caplog.text and cache.path.name in caplog.text
    bad.store(KEY, CANDIDATES, times_for(CANDIDATES, 6), CANDIDATES[6])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert TileCache(tmp_path, fp).lookup(KEY, CANDIDATES).tile == CANDIDATES[6]
    assert caplog.text == ""


def test_the_valid_document_of_the_hostile_cases_is_read(tmp_path, fp):
    """The hostile files above are this document spoiled one way each: unspoiled, it is read,
    its tiles stored before Tile had `stages` and `prefetch` (their defaults) as well as with them."""
    cache = TileCache(tmp_path, fp)
    cache.path.write_text(json.dumps(_valid_doc(fp)))
    tiles = [None, Tile(4, 1024, 4, pdl=True)]
    assert TileCache(tmp_path, fp).lookup(KEY, tiles).tile == tiles[1]
    staged = [None, Tile(4, 1024, 4, pdl=True, stages=3)]
    cache.path.write_text(_with_entry(fp, tile=list(staged[1]), candidates=[None, list(staged[1])]))
    assert TileCache(tmp_path, fp).lookup(KEY, staged).tile == staged[1]
    assert TileCache(tmp_path, fp).lookup(KEY, tiles) is None  # another tile: not this entry's candidates
    fetching = [None, Tile(4, 1024, 4, pdl=True, stages=3, prefetch=True)]
    cache.path.write_text(_with_entry(fp, tile=list(fetching[1]), candidates=[None, list(fetching[1])]))
    assert TileCache(tmp_path, fp).lookup(KEY, fetching).tile == fetching[1]


def test_an_unwritable_cache_warns_once_and_the_engine_goes_on(tmp_path, fp, caplog):
    """The cache directory is a file: every choice still holds in memory, one warning."""
    (tmp_path / "file").write_text("")
    cache = TileCache(tmp_path / "file", fp)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            cache.store((PLAIN, 1, 100 + i, 64, torch.float32), CANDIDATES, times_for(CANDIDATES, 2), CANDIDATES[2])
    assert caplog.text.count("not written") == 1
    assert cache.lookup((PLAIN, 1, 102, 64, torch.float32), CANDIDATES).tile == CANDIDATES[2]


WRITER = textwrap.dedent("""
    import pathlib, sys, time
    import torch
    from jetserve.engine.model.kernels import NORM, candidate_tiles
    from jetserve.engine.model.tile_cache import TileCache, fingerprint

    directory, name, go = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    tiles = candidate_tiles(1, NORM, pdl=True)
    cache = TileCache(directory, fingerprint(torch.device("cpu")))
    while not go.exists():
        time.sleep(0.01)
    for n in range(40):
        cache.store((name, n), tiles, [1.0] * len(tiles), tiles[n % len(tiles)])
""")


def test_concurrent_writers_leave_a_valid_file_with_both_choices(tmp_path):
    """Two processes storing at once (each store merges into the file under its lock and renames
    a whole new file over it): a valid file with all 80 shapes, and no temporary file left."""
    go = tmp_path / "go"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "tiles"), name, str(go)])
               for name in ("a", "b")]
    go.touch()
    assert [w.wait(timeout=600) for w in writers] == [0, 0]
    cache = TileCache(tmp_path / "tiles", fingerprint(torch.device("cpu")))
    tiles = candidate_tiles(1, kernels.NORM, pdl=True)
    for name in ("a", "b"):
        for n in range(40):
            assert cache.lookup((name, n), tiles).tile == tiles[n % len(tiles)]
    assert sorted(p.suffix for p in (tmp_path / "tiles").iterdir()) == [".json", ".lock"]


def test_fused_kernels_take_the_cached_tile_untimed(tmp_path, fp):
    """An engine that times tiles finds this shape in the cache: it takes that tile (not the
    first that fits) and times nothing (in the interpreter timing would fail); results are
    the product's. A shape the cache lacks is timed (on a GPU) or untimed (no timing)."""
    x, w = torch.randn(2, 256, device=DEVICE), torch.randn(300, 256, device=DEVICE)  # 300 KB: a timed size
    key = (PLAIN, 2, 300, 256, torch.float32)
    tiles = candidate_tiles(2, PLAIN, kernels.pdl_supported(DEVICE))
    TileCache(tmp_path, fp).store(key, tiles, times_for(tiles, len(tiles) - 1), tiles[-1])
    fused = FusedKernels(tile_timing=True, tile_cache=TileCache(tmp_path, fp))
    torch.testing.assert_close(fused.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert fused.chosen == {key: tiles[-1]} and fused.cached == {key}
    assert fused.tuning_times[key] == dict(zip(tiles, times_for(tiles, len(tiles) - 1)))
    assert fused.tuning_summary().startswith("1 shapes tuned on this GPU (0 timed now)")


def test_quantized_products_take_the_cached_tile_untimed(tmp_path, fp):
    x = torch.randn(2, 384, device=DEVICE)
    w = quant.quantize(torch.randn(64, 384, device=DEVICE), 4, 128, sym=False)
    key = ("quant", PLAIN, 2, 64, 384, 4, 128, torch.float32, torch.float32)
    tiles = candidates(2, w, PLAIN, kernels.pdl_supported(DEVICE), x.dtype)
    assert tiles[-1] is None and None not in tiles[:-1]  # past one row the float path too, last
    TileCache(tmp_path, fp).store(key, tiles, times_for(tiles, 2), tiles[2])
    fused = QuantFusedKernels(tile_timing=True, tile_cache=TileCache(tmp_path, fp))
    torch.testing.assert_close(fused.linear(x, w), F.linear(x, quant.dequantize(w, torch.float32)),
                               rtol=1e-4, atol=1e-4)
    assert fused.chosen == {key: tiles[2]} and fused.cached == {key}


@torch.inference_mode()
def test_start_up_tuning_takes_every_timed_shape_from_a_warm_cache(tmp_path, fp):
    """A second start: `tune_kernels` over a model whose gate·up and vocab projections are big
    enough to be timed finds each in the cache an earlier start filled (here with the widest
    tile, the interpreter's fastest), so it times nothing."""
    build_qwen3(tmp_path / "model", **{**SMALL, "hidden_size": 256, "intermediate_size": 128})
    first = FusedKernels(tile_timing=False)  # the shapes a start brings (a GPU's first start times them)
    model, kv = fused_model(tmp_path / "model", first)
    tune_kernels(model, kv, BLOCK_SIZE, NUM_BLOCKS, prefill=1, row_counts=[1])
    big = {key for key in first.chosen if key[2] * key[3] * 4 >= kernels._UNTUNED_BYTES}
    assert len(big) == 2
    cache, widest = TileCache(tmp_path / "tiles", fp), {}
    for key in big:
        tiles = candidate_tiles(key[1], key[0], kernels.pdl_supported(DEVICE))
        widest[key] = max(tiles[1:], key=lambda t: t.block_n)
        cache.store(key, tiles, times_for(tiles, tiles.index(widest[key])), widest[key])
    second = FusedKernels(tile_timing=True, tile_cache=TileCache(tmp_path / "tiles", fp))
    model.use_kernels(second)
    tune_kernels(model, kv, BLOCK_SIZE, NUM_BLOCKS, prefill=1, row_counts=[1])
    assert second.cached == big and set(second.tuning_times) == big
    assert {key: second.chosen[key] for key in big} == widest


def test_the_setting_resolves_once(tmp_path, monkeypatch):
    """--tile-cache-dir: the given directory; by default tiles/ under $JETSERVE_CACHE_DIR, else
    $XDG_CACHE_HOME/jetserve, else ~/.cache/jetserve; 'none' turns it off; and no directory
    where no tile is timed (a CPU, eager)."""
    build_qwen3(tmp_path / "model")
    model = str(tmp_path / "model")
    for name in ("JETSERVE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def resolved(device="cuda", **args):
        return EngineArgs(model=model, **args).resolve(device=device).tile_cache_dir

    assert resolved() == str(tmp_path / "home" / ".cache" / "jetserve" / "tiles")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolved() == str(tmp_path / "xdg" / "jetserve" / "tiles")
    monkeypatch.setenv("JETSERVE_CACHE_DIR", "/var/cache/jetserve")
    assert resolved() == "/var/cache/jetserve/tiles"
    assert resolved(tile_cache_dir="/srv/tiles") == "/srv/tiles"
    assert resolved(tile_cache_dir="none") is None
    assert resolved(enforce_eager=True) is None and resolved(device="cpu") is None


def test_the_setting_from_the_config_file_and_the_flag(tmp_path):
    """`tile-cache-dir` in [serve] of the TOML file; the flag overrides it (as `jetserve.cli.main`)."""
    from jetserve.cli import build_parser
    from jetserve.config import set_defaults_from_file

    config = tmp_path / "jetserve.toml"
    config.write_text('[serve]\ntile-cache-dir = "none"\n')
    for argv, expected in ([], "none"), (["--tile-cache-dir", "/srv/tiles"], "/srv/tiles"):
        argv = ["serve", "--config", str(config), *argv]
        parser = build_parser()
        args = parser.parse_args(argv)
        set_defaults_from_file(args.config_parser, args.config, args.config_table)
        assert EngineArgs.from_cli_args(parser.parse_args(argv)).tile_cache_dir == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_a_second_engine_start_times_no_tile(tmp_path):
    """On a GPU, end to end: the first engine times its tiles and keeps them; a second over the
    same directory takes every one from the file, times none, and runs the same tiles. Small on
    purpose (row counts 1 and 8, one projection big enough to be timed), every tile compiled."""
    build_qwen3(tmp_path / "model", **{**SMALL, "hidden_size": 256, "intermediate_size": 256})
    args = dict(device="cuda", dtype="bfloat16", max_num_seqs=1, cudagraph_capture_sizes=[1],
                max_num_batched_tokens=8, tile_cache_dir=str(tmp_path / "tiles"))
    first = LLM(str(tmp_path / "model"), **args).engine.runner.kernels
    assert first.tuning_times and not first.cached
    second_llm = LLM(str(tmp_path / "model"), **args)
    second = second_llm.engine.runner.kernels
    assert second.cached == set(second.tuning_times) == set(first.tuning_times)
    assert {key: second.chosen[key] for key in second.cached} == {key: first.chosen[key] for key in second.cached}
    out = second_llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4),
                              use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
