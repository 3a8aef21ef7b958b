"""`jetserve bench serve` end to end on the tiny model: a real server, the load spread over client
processes, the engine alone on the same workload. Checks the accounting, not the speed."""

import json
import subprocess
import sys

import pytest

from jetserve.bench.serve import summarize
from tests.agent.conftest import REPO


def test_bench_serve_counts_every_token_and_splits_ttft(tiny_model, tmp_path):
    out = subprocess.run([sys.executable, "-m", "jetserve.cli", "bench", "serve", "--model", str(tiny_model),
                          "--device", "cpu", "--concurrency", "3", "--request-rate", "50", "--prompt-len", "8",
                          "--output-len", "5,3", "--rounds", "2", "--repeats", "1", "--engine-steps", "2",
                          "--client-processes", "2", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (tmp_path / "serve.png").stat().st_size > 0
    served = result["servers"]["process"]
    assert served["client_processes"] == 2
    assert sorted(served["settings"]) == ["3x3", "3x5", "50/s x3", "50/s x5"]
    for name, setting in served["settings"].items():
        requests = 3 * 2 if setting["rate"] else setting["concurrency"] * 2
        for run in setting["runs"]:  # every request's every token, whichever process read it
            assert run["requests"] == requests and run["tokens"] == requests * setting["output_len"]
            assert 1 <= run["messages"] <= run["tokens"]
        assert setting["of_engine"] == setting["tok_s_median"] / result["engine"]["workload"][name]["tok_s_median"]
        closed = setting["rate"] is None
        assert (setting["of_step"] is not None) == (setting["of_step_steady"] is not None) == closed
        if closed:  # the engine's decode tok/s at that batch: its step time over consecutive steps
            step = result["engine"]["step_ms"][name]
            assert setting["engine_step_tok_s"] == 3e3 / step and len(result["engine"]["step_ms_windows"][name]) == 3
            assert setting["of_step_steady"] == setting["steady_tok_s_median"] / setting["engine_step_tok_s"]
        assert 0 <= setting["client_cpu"] and 0 <= setting["frontend_cpu_us_per_token"]
    ttft = served["idle_ttft"]
    # The server's own arrival-to-first-token lies inside the client's TTFT.
    assert 0 < ttft["server_ms"] <= ttft["client_ms"]
    assert ttft["service_ms"] == ttft["client_ms"] - result["engine"]["prefill_ms"]


def test_steady_state_counts_only_tokens_while_every_stream_decodes():
    """Closed loop: from the last stream's first token to the first stream's last; ramp and tail out."""
    def request(stream, start, stamps, counts):
        return {"stream": stream, "start": start, "stamps": stamps, "counts": counts, "server_ttft": None}

    run = {"start": 0.0, "client_cpu": 0.1, "results": [
        request("a", 0.0, [1.0, 2.0, 3.0, 4.0], [1, 1, 2, 1]),  # stream a: two requests
        request("a", 4.0, [5.0, 6.0], [1, 1]),
        request("b", 0.0, [2.5, 3.5, 4.5, 5.5], [1, 1, 1, 1]),  # b starts late, ends first (5.5)
    ]}
    summary = summarize(run)
    # window (2.5, 5.5]: a's 3.0 (2), 4.0 (1), 5.0 (1); b's 3.5, 4.5, 5.5 (1 each) = 7 tokens in 3 s
    assert summary["steady_tok_s"] == pytest.approx(7 / 3)
    assert summary["tok_s"] == pytest.approx(11 / 6) and summary["tokens"] == 11 and summary["messages"] == 10
    one = {**run, "results": [request(None, 0.0, [1.0, 2.0], [1, 1])]}  # Poisson arrivals: no streams
    assert summarize(one)["steady_tok_s"] is None
