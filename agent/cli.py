"""`jetserve agent` (the on-device sidecar) and `jetserve doctor` (the compatibility gate).

Standard library only at module level: this parses on the device's Python 3.8 without torch.
"""

import json
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Optional

from jetserve.agent.thermal import ThermalPolicy
from jetserve.config import DEFAULT_ADDRESS, add_config_flag, add_flags, int_in, log_level_setting, number_in, setting
from jetserve.wire.mqtt import MqttOptions

SERVICE_STATE_DIR = "/var/lib/jetserve-agent"  # systemd's StateDirectory=jetserve-agent


def default_state_dir(environ=os.environ, euid=None):
    """Where the outbox lives unless --state-dir says: the service's StateDirectory= (systemd
    passes it as $STATE_DIRECTORY), root's /var/lib/jetserve-agent, and for anyone else (a
    `jetserve agent --once` tried by hand) $XDG_STATE_HOME/jetserve-agent, else
    ~/.local/state/jetserve-agent: a user may not write /var/lib, and an outbox is state that
    should outlive the run (XDG's state directory, not its cache)."""
    if environ.get("STATE_DIRECTORY"):
        return environ["STATE_DIRECTORY"].split(":")[0]
    if (os.geteuid() if euid is None else euid) == 0:
        return SERVICE_STATE_DIR
    home = environ.get("XDG_STATE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"),
                                                         ".local", "state")
    return os.path.join(home, "jetserve-agent")


@dataclass
class AgentOptions:
    """The agent's settings, besides the thermal margins (ThermalPolicy) and the broker's (MqttOptions)."""

    sysroot: str = setting("/", "read /sys, /proc, /etc under this root")
    device_id: Optional[str] = setting(None, "device name (default: the host name)")
    fleet: str = setting("default", "fleet name (a topic level)")
    service: str = setting(DEFAULT_ADDRESS, "inference service gRPC address (or unix:///run/jetserve/grpc.sock)")
    service_timeout: float = setting(2.0, "seconds per gRPC call", type=number_in(0.05, 600))
    service_token_file: Optional[str] = setting(None, "the service's control-plane token (its "
                                                      "--control-api-key-file)", metavar="FILE")
    interval: float = setting(10.0, "seconds between health reports", type=number_in(0.05, 86400))
    state_dir: str = setting(default_state_dir(), "where the outbox lives (as the service: $STATE_DIRECTORY; "
                                                  "root: %s; else $XDG_STATE_HOME/jetserve-agent; default: "
                                                  "%%(default)s)" % SERVICE_STATE_DIR)
    outbox_limit: int = setting(10000, "messages kept while the broker is away (oldest health dropped first)",
                                type=int)
    once_timeout: float = setting(10.0, "with --once, seconds to wait for the broker", type=number_in(0.1, 86400))
    reconnect_max: int = setting(30, "longest reconnect backoff, s", type=int_in(1, 3600))
    no_jtop: bool = setting(False, "never use jetson-stats", action="store_true")
    log_level: str = log_level_setting()


def register(subparsers):
    agent = subparsers.add_parser("agent", help="run the on-device agent (health, thermals, MQTT)",
                                  description=__doc__.splitlines()[0])
    agent.add_argument("--once", action="store_true", help="probe, publish one report, exit")
    add_flags(agent, AgentOptions)
    add_flags(agent, ThermalPolicy, "thermal load shedding")
    add_flags(agent, MqttOptions, "MQTT")
    add_config_flag(agent, "agent", AgentOptions, ThermalPolicy, MqttOptions)
    agent.set_defaults(func=run_agent)

    doctor = subparsers.add_parser("doctor", help="what this device may run (JetPack gate)")
    add_flags(doctor, AgentOptions, only=("sysroot",))
    doctor.add_argument("--json", action="store_true", help="machine-readable verdict")
    add_config_flag(doctor, "agent", AgentOptions, ThermalPolicy, MqttOptions)  # the table is the agent's
    doctor.set_defaults(func=run_doctor)


def run_doctor(args):
    from jetserve.device.compat import check, format_table
    from jetserve.device.probe import ProbeError, probe

    try:
        verdict = check(probe(args.sysroot))
    except ProbeError as exc:
        sys.exit("jetserve doctor: %s" % exc)
    print(json.dumps(verdict.to_dict(), indent=2) if args.json else format_table(verdict))
    return 1 if verdict.status == "fail" else 0


def run_agent(args):
    import socket

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jetserve.agent.daemon import Agent
    from jetserve.agent.outbox import OutboxError
    from jetserve.device.probe import ProbeError
    from jetserve.wire.mqtt import MqttConfigError
    from jetserve.wire.topics import check_name

    args.device_id = args.device_id or socket.gethostname().split(".")[0]
    try:
        check_name("fleet", args.fleet)
        check_name("device", args.device_id)
        account = "%s/%s" % (args.fleet, args.device_id)
        if args.mqtt_user and args.mqtt_user != account:
            logging.warning("--mqtt-user %s is not %s: under deploy/'s ACL the broker will refuse every "
                            "message this agent sends", args.mqtt_user, account)
        agent = Agent(args)
    except (ValueError, ProbeError, OutboxError, MqttConfigError) as exc:
        sys.exit("jetserve agent: %s" % exc)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop_event.set())
    return agent.run(once=args.once)
