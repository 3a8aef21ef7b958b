"""Bad input gives a clear message, never a traceback."""

import os
import socket
import subprocess
import sys

from jetserve.config import set_defaults_from_file
from tests.agent.conftest import REPO, SYSROOTS


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


def test_help_shows_the_defaults():
    out = jetserve("agent", "--help")
    text = b" ".join(out.stdout.split())  # argparse wraps the help
    assert out.returncode == 0
    for expected in (b"--interval INTERVAL seconds between health reports (default: 10.0)",
                     b"(default: 127.0.0.1:50051)", b"trip (default: 5.0)", b"--mqtt-port MQTT_PORT (default: 1883)"):
        assert expected in text, text.decode()


def test_the_outbox_is_the_services_state_or_the_users():
    from jetserve.agent.cli import SERVICE_STATE_DIR, default_state_dir

    systemd = {"STATE_DIRECTORY": "/var/lib/jetserve-agent", "HOME": "/home/u"}
    assert default_state_dir(systemd, euid=999) == "/var/lib/jetserve-agent"  # User=jetserve, StateDirectory=
    assert default_state_dir({"HOME": "/root"}, euid=0) == SERVICE_STATE_DIR
    assert default_state_dir({"HOME": "/home/u"}, euid=1000) == "/home/u/.local/state/jetserve-agent"
    assert default_state_dir({"HOME": "/home/u", "XDG_STATE_HOME": "/x"}, euid=1000) == "/x/jetserve-agent"


def test_once_without_a_broker_says_so_at_once(tmp_path):
    """The warning comes from the failed connect, while --once still waits (60 s) for the broker."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["agent", "--once", "--once-timeout", "60", "--mqtt-port", port, "--state-dir", tmp_path,
            "--sysroot", os.path.join(SYSROOTS, "x86-host"), "--no-jtop", "--service-timeout", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "jetserve.cli"] + [str(a) for a in args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        lines = []
        for line in proc.stdout:  # until the warning, else until the agent gives up and exits
            lines.append(line)
            if b"no broker reachable at 127.0.0.1:%d" % port in line:
                break
        said = lines and b"no broker reachable" in lines[-1]
        assert said and proc.poll() is None, b"".join(lines).decode()  # said while it still waits
    finally:
        proc.kill()
        proc.wait()


def test_the_flags_and_the_toml_keys_are_the_same_settings(tmp_path):
    """Every flag of a configurable command but the command's own (--once, --json, ...) is a key of
    its table, and the parsed defaults are the dataclasses' own."""
    from jetserve.agent.cli import AgentOptions
    from jetserve.agent.thermal import ThermalPolicy
    from jetserve.cli import build_parser
    from jetserve.config import from_args
    from jetserve.wire.mqtt import MqttOptions

    parser = build_parser()
    own = {"config", "once", "json", "set", "timeout", "device", "command",  # the commands' own
           "func", "config_parser", "config_table", "config_keys", "fleet_command"}  # set_defaults'
    for argv in (["agent"], ["doctor"], ["fleet", "run"], ["fleet", "status"], ["fleet", "send", "d", "drain"]):
        args = parser.parse_args(argv)
        flags = set(vars(args)) - own
        assert flags <= set(args.config_keys), (argv, flags - set(args.config_keys))
    args = parser.parse_args(["agent"])
    assert from_args(AgentOptions, args) == AgentOptions() and from_args(ThermalPolicy, args) == ThermalPolicy()
    assert MqttOptions.from_args(args) == MqttOptions()
    conf = tmp_path / "jetserve.toml"
    conf.write_text("[agent]\npassive-margin = 7.5\nmqtt_host = 'broker.lan'\nfleet = 'lab'\nlog-level = 'debug'\n")
    argv = ["agent", "--config", str(conf), "--fleet", "field"]
    args = parser.parse_args(argv)
    set_defaults_from_file(args.config_parser, args.config, args.config_table)
    args = parser.parse_args(argv)
    assert (args.passive_margin, args.mqtt_host, args.fleet, args.log_level) == (7.5, "broker.lan", "field", "DEBUG")
    doctor = parser.parse_args(["doctor", "--config", str(conf)])  # the shared [agent] table is not refused
    set_defaults_from_file(doctor.config_parser, doctor.config, doctor.config_table)


def test_log_level_is_any_case_and_checked():
    from jetserve.cli import build_parser

    parser = build_parser()
    for argv in (["serve", "--log-level", "debug"], ["agent", "--log-level", "Warning"],
                 ["fleet", "run", "--log-level", "error"]):
        assert parser.parse_args(argv).log_level == argv[-1].upper()
    out = jetserve("agent", "--log-level", "verbose", "--state-dir", "/nonexistent")
    assert out.returncode == 2 and b"invalid choice: 'verbose'" in out.stdout, out.stdout


def test_periods_timeouts_margins_and_ports_are_bounded_on_the_command_line_and_in_the_file(tmp_path):
    """0 s between reports is a flood, NaN a deadline that never passes, a port past 65535 wraps:
    each is one line naming the flag and its range, exit status 2, from a flag or from the file."""
    import pytest

    from jetserve.cli import build_parser

    cases = [("agent", "--interval", "0"), ("agent", "--interval", "nan"), ("agent", "--service-timeout", "1e9"),
             ("agent", "--reconnect-max", "0"), ("agent", "--passive-margin", "-1"), ("agent", "--mqtt-port", "70000"),
             ("fleet run", "--silence-factor", "0.5"), ("fleet run", "--stall-timeout", "inf"),
             ("fleet send", "--timeout", "-1")]
    for command, flag, value in cases:
        argv = command.split() + (["dev", "drain"] if command == "fleet send" else []) + [flag, value]
        out = jetserve(*argv)
        lines = out.stdout.decode().strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and flag in lines[0] and "must be" in lines[0], out.stdout
    conf = tmp_path / "jetserve.toml"
    conf.write_text("[agent]\ninterval = 0\n")
    args = build_parser().parse_args(["agent", "--config", str(conf)])
    with pytest.raises(ValueError, match=r"interval = 0: must be a number in \[0.05, 86400\]"):
        set_defaults_from_file(args.config_parser, args.config, args.config_table)
