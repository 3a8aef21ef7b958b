"""`jetserve agent` (the on-device sidecar) and `jetserve doctor` (the compatibility gate).

Standard library only at module level: this parses on the device's Python 3.8 without torch.
"""

import json
import logging
import signal
import sys

from jetserve.config import LOG_LEVELS, add_config_flag
from jetserve.wire.mqtt import add_flags as add_mqtt_flags

def register(subparsers):
    agent = subparsers.add_parser("agent", help="run the on-device agent (health, thermals, MQTT)",
                                  description=__doc__.splitlines()[0])
    agent.add_argument("--sysroot", default="/", help="read /sys, /proc, /etc under this root")
    agent.add_argument("--once", action="store_true", help="probe, publish one report, exit")
    agent.add_argument("--device-id", help="device name (default: the host name)")
    agent.add_argument("--service", default="127.0.0.1:50051",
                       help="inference service gRPC address (or unix:///run/jetserve/grpc.sock)")
    agent.add_argument("--service-timeout", type=float, default=2.0, help="seconds per gRPC call")
    agent.add_argument("--service-token-file", metavar="FILE",
                       help="the service's control-plane token (its --control-api-key-file)")
    agent.add_argument("--interval", type=float, default=10.0, help="seconds between health reports")
    agent.add_argument("--state-dir", default="/var/lib/jetserve-agent", help="where the outbox lives")
    agent.add_argument("--outbox-limit", type=int, default=10000,
                       help="messages kept while the broker is away (oldest health dropped first)")
    agent.add_argument("--once-timeout", type=float, default=10.0,
                       help="with --once, seconds to wait for the broker")
    agent.add_argument("--reconnect-max", type=int, default=30, help="longest reconnect backoff, s")
    agent.add_argument("--passive-margin", type=float, default=5.0,
                       help="shed load this many degrees below a zone's passive trip")
    agent.add_argument("--critical-margin", type=float, default=3.0,
                       help="drain this many degrees below a zone's critical trip")
    agent.add_argument("--hysteresis", type=float, default=5.0,
                       help="degrees below a threshold before restoring a level")
    agent.add_argument("--no-jtop", action="store_true", help="never use jetson-stats")
    agent.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    agent.add_argument("--fleet", default="default", help="fleet name (a topic level)")
    add_mqtt_flags(agent)
    add_config_flag(agent, "agent")
    agent.set_defaults(func=run_agent)

    doctor = subparsers.add_parser("doctor", help="what this device may run (JetPack gate)")
    doctor.add_argument("--sysroot", default="/", help="read /etc, /proc, /sys under this root")
    doctor.add_argument("--json", action="store_true", help="machine-readable verdict")
    add_config_flag(doctor, "agent")
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
