"""Bad input gives a clear message, never a traceback."""

import subprocess
import sys

from tests.agent.conftest import REPO


def jetserve(*args):
    return subprocess.run([sys.executable, "-m", "jetserve.cli"] + [str(a) for a in args], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)


def test_bad_config_and_bad_names(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[agent]\nmqtt-hots = 'x'\n")
    out = jetserve("agent", "--config", bad)
    assert out.returncode == 2 and b"unknown key(s) in [agent]: mqtt_hots" in out.stdout
    out = jetserve("agent", "--sysroot", tmp_path / "nope", "--state-dir", tmp_path)
    assert out.returncode == 1 and b"sysroot" in out.stdout and b"Traceback" not in out.stdout
    out = jetserve("agent", "--device-id", "a/b", "--state-dir", tmp_path)
    assert out.returncode == 1 and b"invalid device name" in out.stdout and b"Traceback" not in out.stdout
    out = jetserve("agent", "--mqtt-ca", tmp_path / "missing.pem", "--state-dir", tmp_path, "--sysroot", tmp_path)
    assert out.returncode == 1 and b"TLS file" in out.stdout and b"Traceback" not in out.stdout


def test_config_file_values_become_defaults(tmp_path):
    conf = tmp_path / "jetserve.toml"
    conf.write_text("[agent]\nsysroot = '/definitely/not/here'\n")
    out = jetserve("agent", "--config", conf, "--state-dir", tmp_path)
    assert out.returncode == 1 and b"/definitely/not/here" in out.stdout
