"""The agent runs on JetPack 5's Python 3.8: vermin finds nothing newer in what it imports
(itself, the device facts and the MQTT contract it shares with the fleet)."""

import subprocess

from tests.agent.conftest import REPO
from tests.tools import require_tool


def test_agent_code_targets_python_38():
    vermin = require_tool("vermin")
    out = subprocess.run([vermin, "--no-tips", "--violations", "-t=3.8-", "agent/", "device/", "wire/", "jetserve/__init__.py",
                          "jetserve/atomic.py", "jetserve/cli.py", "jetserve/config.py"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stdout.decode()


def test_vermin_catches_a_violation(tmp_path):
    """The check above can fail: a 3.9-only call is reported."""
    vermin = require_tool("vermin")
    (tmp_path / "new.py").write_text("print('jetserve'.removeprefix('jet'))\n")
    out = subprocess.run([vermin, "--no-tips", "--violations", "-t=3.8-", str(tmp_path / "new.py")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert out.returncode != 0
