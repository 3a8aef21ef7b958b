"""A small fleet load test (`jetserve bench fleet`): 50 simulated devices, each with its own broker
account, against a real mosquitto with deploy/'s ACL and a real controller: nothing lost, offline
told within 1.5 x keepalive, both for a killed device (Will) and a cut line (silence)."""

import json
import subprocess
import sys

import pytest

from tests.agent.conftest import REPO
from tests.tools import require_tool


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_fifty_devices_nothing_lost_offline_detected(backend, request, tmp_path):
    require_tool("mosquitto_passwd")
    extra = []
    if backend == "postgresql":
        url = request.getfixturevalue("postgres_url")
        extra = ["--backend", "postgresql", "--postgres", url, "--replicas", "2"]
    out = subprocess.run([sys.executable, "-m", "jetserve.cli", "bench", "fleet", "--devices", "50",
                          "--duration", "8", "--ramp", "2", "--interval", "1", "--keepalive", "4",
                          "--offline", "0.1", "--alert-every", "3", "--lag-goal", "5"] + extra,
                         cwd=REPO, capture_output=True, timeout=240)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    run = json.loads(out.stdout)["runs"][0]
    print({k: v for k, v in run.items() if k != "series"})
    assert run["messages"] >= 50 * 8 and run["lost"] == 0 and run["sessions_failed"] == 0 and run["drained"]
    offline = run["offline"]
    assert offline["killed"]["devices"] + offline["cut"]["devices"] == 5
    assert all(kind["detected"] == kind["devices"] for kind in offline.values())
    assert run["offline"]["killed"]["max_s"] <= 6 and run["offline"]["cut"]["max_s"] <= 6  # 1.5 x keepalive
    assert run["goals_met"]
