"""The TensorRT-LLM backend around the mapping: memory budget, end ids, stats loop, absence."""

import asyncio
import importlib.util
import json
import queue
import threading
import time

import pytest

from jetserve.engine import EngineArgs, open_engine
from jetserve.engine.backends.trtllm import (IterationStats, apply_iteration_stats, checkpoint_end_ids,
                                             checkpoint_weight_bytes, kv_cache_fraction, parse_version)
from jetserve.engine.errors import EngineError
from jetserve.engine.protocol import EngineStats

GIB = 1 << 30


@pytest.mark.parametrize("utilization,free,total,weights", [
    (0.9, 79 * GIB, 80 * GIB, 16 * GIB), (0.5, 20 * GIB, 24 * GIB, 1 * GIB), (0.95, 140 * GIB, 141 * GIB, 8 * GIB)])
def test_kv_cache_fraction_spends_exactly_vllms_budget(utilization, free, total, weights):
    fraction = kv_cache_fraction(utilization, free, total, weights)
    assert 0 < fraction <= 1
    kv = fraction * (free - weights)  # what TensorRT-LLM gives the KV cache once the weights are in
    assert kv + (total - free) + weights == pytest.approx(utilization * total)


def test_kv_cache_fraction_refuses_when_nothing_is_left():
    with pytest.raises(ValueError, match="leaves no memory for the KV cache.*40.0 GiB are in use"):
        kv_cache_fraction(0.5, 40 * GIB, 80 * GIB, 1 * GIB)


def test_weight_bytes_follow_the_load_dtype(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 600)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 400)
    assert checkpoint_weight_bytes(tmp_path, "float32", "auto") == 1000
    assert checkpoint_weight_bytes(tmp_path, "float32", "bfloat16") == 500


def test_end_ids_of_a_checkpoint_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert checkpoint_end_ids(tmp_path) == [3]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert checkpoint_end_ids(tmp_path) == [5, 7]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(EngineError, match="no tokenizer.json and no eos_token_id.*--backend torch"):
        checkpoint_end_ids(bare)


def test_versions_parse_with_their_suffixes():
    assert parse_version("1.2.0rc2") == (1, 2) and parse_version("1.0.0") == (1, 0)
    assert parse_version("0.12.0-jetson") < (1, 0) <= parse_version("1.4.0rc4")


class NeverQuietStats:
    """TensorRT-LLM's iteration-stats surface over a queue a producer never stops filling.

    The one fake here (TensorRT-LLM cannot be installed): `get_stats` reads until the queue has
    been quiet for `timeout`, as TensorRT-LLM's does; `get_stats_async` hands over one entry at
    a time and ends after `timeout` without one.
    """

    def __init__(self, period=0.001):
        self.queue, self.closed, self.produced = queue.Queue(), threading.Event(), 0
        threading.Thread(target=self._produce, args=(period,), daemon=True).start()

    def _produce(self, period):
        while not self.closed.wait(period):
            self.produced += 1
            self.queue.put(json.dumps({"numActiveRequests": 4, "numQueuedRequests": self.produced % 3,
                                       "kvCacheStats": {"usedNumBlocks": 30, "maxNumBlocks": 120},
                                       "specDecodingStats": {"numDraftTokens": 3, "numAcceptedTokens": 2,
                                                             "acceptanceLength": 1.67}}))

    def get_stats(self, timeout):
        out = []
        while not self.closed.is_set():
            try:
                out.append(self.queue.get(timeout=timeout))
            except queue.Empty:
                break
        return out

    def get_stats_async(self, timeout):
        source = self

        class Stream:
            def __aiter__(self):
                return self

            async def __anext__(self):
                waited = 0.0
                while waited < timeout:
                    try:
                        return source.queue.get_nowait()
                    except queue.Empty:
                        await asyncio.sleep(0.001)
                        waited += 0.001
                raise StopAsyncIteration
        return Stream()


def test_stats_loop_beats_on_time_under_steady_load():
    fake, beats, seen = NeverQuietStats(), [], []
    stopping = threading.Event()
    loop = IterationStats(fake, 0.05, seen.append, lambda: beats.append(time.monotonic()))
    thread = threading.Thread(target=loop.run, args=(stopping,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30  # a bound for a starved machine, not the measure
    while len(beats) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    stopping.set()
    fake.closed.set()
    thread.join(5)
    assert len(beats) >= 4, f"{len(beats)} heartbeats while the executor produced {fake.produced} stats"
    assert seen and all(s["numActiveRequests"] == 4 for s in seen)  # JSON strings arrive as dicts
    assert not thread.is_alive()


def test_iteration_stats_become_engine_stats():
    s = EngineStats(max_num_seqs=8)
    for _ in range(2):
        s = apply_iteration_stats(s, {"numActiveRequests": 4, "numQueuedRequests": 1,
                                      "kvCacheStats": {"usedNumBlocks": 30, "maxNumBlocks": 120},
                                      "specDecodingStats": {"numDraftTokens": 3, "numAcceptedTokens": 2,
                                                            "acceptanceLength": 1.67}}, 3)
    assert (s.num_running, s.num_waiting, s.kv_usage, s.max_num_seqs) == (4, 1, 0.25, 8)
    assert (s.num_draft_tokens, s.num_accepted_tokens, s.num_speculative_tokens) == (6, 4, 3)
    assert s.acceptance_rate == pytest.approx(2 / 3) and s.mean_accepted_length == 1.67


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed")
def test_missing_tensorrt_llm_is_a_clear_error(tiny):
    path, _ = tiny
    with pytest.raises(EngineError, match="TensorRT-LLM is not installed.*not on Jetson.*--backend torch"):
        open_engine(EngineArgs(model=str(path), backend="tensorrt-llm").resolve())
