"""`jetserve bench serve` end to end on the tiny model: a real server, the load spread over client
processes, the engine alone on the same workload. Checks the accounting, not the speed."""

import json
import subprocess
import sys

from tests.agent.conftest import REPO


def test_bench_serve_counts_every_token_and_splits_ttft(tiny_model, tmp_path):
    out = subprocess.run([sys.executable, "-m", "jetserve.cli", "bench", "serve", "--model", str(tiny_model),
                          "--device", "cpu", "--concurrency", "3", "--request-rate", "50", "--prompt-len", "8",
                          "--output-len", "5", "--rounds", "2", "--repeats", "1", "--engine-steps", "2",
                          "--client-processes", "2", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (tmp_path / "serve.png").stat().st_size > 0
    served = result["servers"]["process"]
    assert served["client_processes"] == 2
    assert sorted(served["settings"]) == ["3", "50/s"]
    for name, setting in served["settings"].items():
        requests = 3 * 2 if setting["rate"] else setting["concurrency"] * 2
        for run in setting["runs"]:  # every request's every token, whichever process read it
            assert run["requests"] == requests and run["tokens"] == requests * 5
            assert 1 <= run["messages"] <= run["tokens"]
        assert setting["of_engine"] == setting["tok_s_median"] / result["engine"]["workload"][name]["tok_s_median"]
        assert (setting["of_step"] is None) == (setting["rate"] is not None)
        assert 0 <= setting["client_cpu"] and 0 <= setting["frontend_cpu_us_per_token"]
    ttft = served["idle_ttft"]
    # The server's own arrival-to-first-token lies inside the client's TTFT.
    assert 0 < ttft["server_ms"] <= ttft["client_ms"]
    assert ttft["service_ms"] == ttft["client_ms"] - result["engine"]["prefill_ms"]
