"""systemd/: the agent and fleet units verify, and are sandboxed (`systemd-analyze security` <= 4.5)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.agent.conftest import REPO
from tests.tools import require_tool


@pytest.mark.parametrize("unit", ["jetserve-agent.service", "jetserve-fleet.service"])
def test_systemd_units_verify(unit, tmp_path):
    analyze = require_tool("systemd-analyze")
    with open(os.path.join(REPO, "systemd", unit)) as f:
        text = f.read()
    assert re.search(r"^ExecStart=/usr/local/bin/jetserve ", text, re.M)
    # verify insists that ExecStart's binary exists: point a copy at this machine's jetserve.
    binary = shutil.which("jetserve") or sys.executable + " -m jetserve.cli"
    (tmp_path / unit).write_text(text.replace("/usr/local/bin/jetserve", binary))
    out = subprocess.run([analyze, "verify", str(tmp_path / unit)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=60)
    assert out.returncode == 0, out.stdout.decode()
    assert unit.encode() not in out.stdout, out.stdout.decode()  # no warnings about our unit


def test_systemd_verify_catches_a_broken_unit(tmp_path):
    analyze = require_tool("systemd-analyze")
    (tmp_path / "broken.service").write_text("[Service]\nExecStart=relative/path\n")
    out = subprocess.run([analyze, "verify", str(tmp_path / "broken.service")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=60)
    assert out.returncode != 0 or b"broken.service" in out.stdout


MAX_EXPOSURE = 4.5


def exposure(path):
    """`systemd-analyze security --offline=true`'s overall exposure (0 = locked down, 10 = exposed)."""
    out = subprocess.run([require_tool("systemd-analyze"), "security", "--offline=true", str(path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60).stdout.decode()
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
    assert match, out
    return float(match.group(1))


@pytest.mark.parametrize("unit", ["jetserve-agent.service", "jetserve-fleet.service"])
def test_systemd_units_are_sandboxed(unit, tmp_path):
    require_tool("systemd-analyze")
    score = exposure(os.path.join(REPO, "systemd", unit))
    print("%s: exposure %.1f" % (unit, score))
    assert score <= MAX_EXPOSURE
    (tmp_path / unit).write_text("[Service]\nExecStart=/usr/local/bin/jetserve agent\n")
    assert exposure(tmp_path / unit) > MAX_EXPOSURE, "an unsandboxed unit scores above the bound"


def test_the_fleet_unit_is_notify_with_a_watchdog():
    with open(os.path.join(REPO, "systemd", "jetserve-fleet.service")) as f:
        settings = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line and line[0] != "#")
    assert (settings["Type"], settings["WatchdogSec"], settings["Restart"]) == ("notify", "60", "on-failure")
