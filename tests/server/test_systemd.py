"""systemd/jetserve.service passes `systemd-analyze verify` and says what the service relies on."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools import require_tool

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "jetserve.service"

@pytest.fixture
def systemd_analyze():
    return require_tool("systemd-analyze")


needs_analyze = pytest.mark.usefixtures("systemd_analyze")


def verify(text, tmp_path):
    """verify insists that ExecStart's binary exists: a copy points at this machine's jetserve."""
    binary = shutil.which("jetserve") or sys.executable + " -m jetserve.cli"
    unit = tmp_path / "jetserve.service"
    unit.write_text(text.replace("/usr/local/bin/jetserve", binary))
    out = subprocess.run([require_tool("systemd-analyze"), "verify", str(unit)], capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout + out.stderr


@needs_analyze
def test_the_unit_verifies_cleanly(tmp_path):
    text = UNIT.read_text()
    assert re.search(r"^ExecStart=/usr/local/bin/jetserve serve ", text, re.M)
    returncode, output = verify(text, tmp_path)
    assert returncode == 0 and "jetserve.service" not in output, output  # no warning names our unit


@needs_analyze
def test_verify_reports_a_broken_setting(tmp_path):
    returncode, output = verify(UNIT.read_text().replace("Type=notify", "Type=notifyy"), tmp_path)
    assert returncode != 0 or "jetserve.service" in output


def unit_settings():
    settings = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_the_unit_is_a_sandboxed_notify_service_that_still_reaches_the_gpu():
    settings = unit_settings()
    expected = {"Type": "notify", "Restart": "on-failure", "WatchdogSec": "30", "User": "jetserve",
                "ProtectSystem": "strict", "NoNewPrivileges": "yes", "PrivateTmp": "yes", "ProtectHome": "yes",
                "RuntimeDirectory": "jetserve", "StateDirectory": "jetserve", "DevicePolicy": "closed"}
    assert {key: settings.get(key, [None])[0] for key in expected} == expected
    assert set(settings["SupplementaryGroups"][0].split()) == {"video", "render"}
    allowed = {value.split()[0] for value in settings["DeviceAllow"]}
    assert {"/dev/nvmap", "char-nvhost*", "char-nvidia*"} <= allowed
    assert "PrivateDevices" not in settings  # it would hide the GPU nodes
    assert "--unix-socket /run/jetserve/" in settings["ExecStart"][0]


def test_the_tile_cache_lives_in_the_units_cache_directory(monkeypatch):
    """Timed tiles outlive restarts and reboots: under the unit's environment jetserve's cache
    is its CacheDirectory= (not /tmp, which PrivateTmp= empties at every restart)."""
    from jetserve.engine.config import cache_root

    settings = unit_settings()
    for line in settings["Environment"]:
        for pair in line.split():
            monkeypatch.setenv(*pair.split("=", 1))
    assert cache_root() == Path("/var/cache") / settings["CacheDirectory"][0]


@needs_analyze
def test_the_unit_stays_hardened():
    """The inference service holds the model and the GPU: `systemd-analyze security` <= 3.5."""
    from tests.fleet.test_units import exposure

    assert exposure(UNIT) <= 3.5
