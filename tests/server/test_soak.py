"""`jetserve bench soak`: three minutes of the whole mix against a live `jetserve serve` (the
bundled demo model, eager: the background compile of the CPU decode steps would land inside so
short a run), judged as the committed hour is; and the verdict's rules on made-up series, each
shown failing.

The load is bounded (two workers resting between requests, a long prompt every 20 s), so a busy
2-core box keeps up. RSS, KV blocks at idle and every status are judged as in the hour; latency
at 3x rather than 1.2x: the slices' medians shrug off a neighbour's burst, but so short a run has
only four TTFT slices a window, and a long prompt or a drain moves one of them with nothing
drifting. A 3x slowdown over three minutes still fails it; the 1.2x rule itself is shown failing
a 1.5x drift below, and the hour is judged by it."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from jetserve.bench.soak import MIX, judge
from tests.agent.conftest import REPO


@pytest.mark.timeout(900)
def test_three_minute_soak_of_the_mix_passes(tmp_path):
    out = subprocess.run([sys.executable, "-m", "jetserve.cli", "bench", "soak", "--minutes", "3", "--warmup", "30",
                          "--idle", "10", "--concurrency", "2", "--drain-every", "40", "--long-every", "20",
                          "--max-tokens", "32", "--p99-ratio", "3", "--serve-flags=--enforce-eager",
                          "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, timeout=840)
    result = json.loads((tmp_path / "result.json").read_text())
    verdict = result["verdict"]
    print({k: v for k, v in verdict.items()}, result["outcomes"], result["unexpected"])
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert verdict["passed"] and not result["unexpected"]
    assert (tmp_path / "soak.png").stat().st_size > 0 and (tmp_path / "COMMAND.md").exists()
    # every kind of request was sent and answered as it should be
    assert set(result["outcomes"]) == set(MIX) | {"long"}
    assert result["outcomes"]["cancel"].get("cancelled", 0) > 0
    assert result["outcomes"]["deadline"].get("deadline exceeded", 0) > 0
    assert all(result["outcomes"][kind].get("ok", 0) > 0 for kind in ("grpc", "openai", "grpc_n", "openai_n",
                                                                       "stalled", "long"))
    assert result["drains"] >= 3
    samples = result["samples"]
    assert len(samples) >= 180 and all(s["rss_server_mb"] and s["rss_core_mb"] for s in samples)
    assert verdict["kv_at_idle"]["blocks_used"] == 0 and verdict["kv_at_idle"]["max_during_load"] > 0


def _series(seconds=200, rss=(100.0, 100.0), kv_idle=0, itl=(0.01, 0.01), spike_at=None):
    """Samples and raw ITL/TTFT of a made-up run: 20 s warm-up, load to 180 s, idle after; RSS and
    ITL moving linearly from their first value to their second over the load."""
    samples, itl_values = [], []
    for t in range(seconds):
        x = min(1.0, t / 180)
        samples.append({"t": float(t), "rss_server_mb": rss[0] + (rss[1] - rss[0]) * x, "rss_core_mb": 500.0,
                        "kv_blocks_used": kv_idle if t >= 180 else 40, "running": 0 if t >= 180 else 2, "waiting": 0})
        if t < 180:
            value = itl[0] + (itl[1] - itl[0]) * x
            for i in range(20):
                itl_values.append((t + i / 20, value * (1 + i / 100) * (50 if spike_at == t else 1)))
    return samples, itl_values


ARGS = SimpleNamespace(rss_tolerance=0.05, p99_ratio=1.2, long_every=15.0, drain_every=15.0)


def _judge(samples, itl, ttft=None):
    return judge(samples, itl, itl if ttft is None else ttft, 0.0, 20.0, 180.0, 180.0, ARGS)


def test_a_flat_run_passes_and_one_slow_slice_does_not_fail_it():
    assert _judge(*_series())["passed"]
    samples, itl = _series(spike_at=175)  # a neighbour's burst in the last tenth: one ITL slice of four
    assert _judge(samples, itl, ttft=_series()[1])["passed"]


def test_a_window_holds_whole_periods_of_the_clocks():
    """TTFTs queued behind a long prompt every 20 s, nothing drifting: judged over 15-second
    tenths, one window holds a long prompt and the other none (a 10x "drift" by construction);
    windows of a whole drain period (40 s) hold two each and pass."""
    samples, itl = _series()
    ttft = [(t, 0.2 if (t - 5) % 20 < 2 else 0.02) for t, _ in itl]
    args = SimpleNamespace(rss_tolerance=0.05, p99_ratio=2.0, long_every=20.0, drain_every=40.0)
    verdict = judge(samples, itl, ttft, 0.0, 30.0, 180.0, 180.0, args)
    assert verdict["passed"] and verdict["tenth_s"] == 40.0, verdict
    args.long_every = args.drain_every = 1.0
    verdict = judge(samples, itl, ttft, 0.0, 30.0, 180.0, 180.0, args)
    assert not verdict["ttft_p99_ms"]["passed"] and verdict["tenth_s"] == 15.0, verdict


@pytest.mark.parametrize("series, rule", [
    (dict(rss=(100.0, 110.0)), "rss_server_mb"),  # +10% over the hour
    (dict(kv_idle=3), "kv_at_idle"),  # blocks held with nothing running
    (dict(itl=(0.01, 0.015)), "itl_p99_ms"),  # every step 1.5x slower at the end
])
def test_each_rule_fails_a_run_that_drifts(series, rule):
    verdict = _judge(*_series(**series))
    assert not verdict["passed"] and not verdict[rule]["passed"]
    assert all(verdict[other]["passed"] for other in ("rss_server_mb", "kv_at_idle", "itl_p99_ms") if other != rule)
