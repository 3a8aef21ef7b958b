"""systemd/: the agent and fleet units verify."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.agent.conftest import REPO


@pytest.mark.parametrize("unit", ["jetserve-agent.service", "jetserve-fleet.service"])
def test_systemd_units_verify(unit, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
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
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    (tmp_path / "broken.service").write_text("[Service]\nExecStart=relative/path\n")
    out = subprocess.run([analyze, "verify", str(tmp_path / "broken.service")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=60)
    assert out.returncode != 0 or b"broken.service" in out.stdout
