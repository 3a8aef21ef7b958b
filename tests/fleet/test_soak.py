"""`jetserve bench fleet --soak`, short: 50 simulated devices for 90 s while the broker is
restarted (its sessions and queues kept on disk, as deploy/ has it) and the controller killed
with SIGKILL, each twice or more: every acknowledged report is in the registry, every device came
back, and the controller's RSS verdict is computed over each of its lives; and that verdict shown
failing on a controller that grows."""

import json
import subprocess
import sys
from types import SimpleNamespace

from jetserve.bench.fleet import _soak_verdict
from tests.agent.conftest import REPO
from tests.tools import require_tool


def test_short_fleet_soak_loses_nothing_through_broker_restarts_and_controller_kills(tmp_path):
    require_tool("mosquitto_passwd")
    out = subprocess.run([sys.executable, "-m", "jetserve.cli", "bench", "fleet", "--devices", "50", "--soak", "1.5",
                          "--fault-every", "25", "--ramp", "2", "--interval", "1", "--keepalive", "4",
                          "--offline", "0.1", "--alert-every", "3", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, timeout=280)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    run = json.loads((tmp_path / "result.json").read_text())["runs"][0]
    soak = run["soak"]
    print({k: v for k, v in run.items() if k not in ("series", "soak")}, soak["faults"], soak["controller_rss"])
    kinds = [f["kind"] for f in soak["faults"]]
    assert kinds.count("broker restart") >= 2 and kinds.count("controller kill -9") >= 2
    assert soak["reconnects"] >= 50  # every device lost its session at each broker restart, and came back
    assert run["messages"] >= 50 * 60 and run["lost"] == 0 and run["sessions_failed"] == 0 and run["drained"]
    assert any(life["growth"] is not None for life in soak["controller_rss"]["lives"])
    assert run["goals_met"] and (tmp_path / "fleet-soak.png").stat().st_size > 0


def test_the_soak_verdict_fails_a_controller_whose_rss_grows_and_a_lost_report():
    def faults(growth):
        rss = [{"t": float(t), "controllers": [50.0 * (1 + growth * t / 99)], "lives": [0], "broker": 10.0}
               for t in range(100)]
        return SimpleNamespace(rss=rss, events=[])

    args = SimpleNamespace(replicas=1, rss_tolerance=0.05, soak=1.0, fault_every=20.0)
    sim = SimpleNamespace(failed={}, reconnects=0, ended_at_stop=0)
    result = {"lost": 0, "drained": True, "offline": {}}
    assert _soak_verdict(args, faults(0.0), sim, result)["goals_met"]
    grown = _soak_verdict(args, faults(0.2), sim, result)
    assert not grown["goals_met"] and not grown["soak"]["controller_rss"]["flat"]
    assert not _soak_verdict(args, faults(0.0), sim, dict(result, lost=1))["goals_met"]
