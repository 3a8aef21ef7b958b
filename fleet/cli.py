"""`jetserve fleet run|status|send`: the fleet controller and its operator commands.

Standard library only at module level, like every part's CLI.
"""

import json
import logging
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Optional

from jetserve import fdbudget
from jetserve.config import add_config_flag, add_flags, log_level_setting, number_in, setting
from jetserve.wire.mqtt import MqttOptions


@dataclass
class FleetOptions:
    """The controller's settings (`jetserve fleet run`; `status` shares `db` and `fleet`)."""

    db: str = setting("/var/lib/jetserve/fleet.db", "registry: an SQLite file, or postgresql://USER@HOST/DB shared "
                                                    "by replicas on several hosts (password from ~/.pgpass or "
                                                    "$PGPASSFILE, never the command line)", metavar="PATH|URL")
    http: str = setting("127.0.0.1:8080", "read-only HTTP page, API and Prometheus /metrics ('' to disable); "
                                          "beyond loopback it needs a token and TLS", metavar="HOST:PORT")
    http_token_file: Optional[str] = setting(None, "bearer token every HTTP request must carry (the file mode 0600)",
                                             metavar="FILE")
    http_tls_cert: Optional[str] = setting(None, "serve HTTPS with this certificate chain", metavar="PEM")
    http_tls_key: Optional[str] = setting(None, "... and this private key", metavar="PEM")
    http_max_connections: int = setting(
        1000, "open HTTP connections at most (1..%d; fewer if the file-descriptor limit leaves fewer beside MQTT and "
              "the database); at the cap an idle one makes room, with none idle a new one gets 503"
              % fdbudget.MAX_CONNECTIONS, type=int, metavar="N")
    http_header_timeout: float = setting(
        10.0, "a connection must send each request within this (at most %g; slowloris)" % fdbudget.MAX_DEADLINE_S,
        type=float, metavar="SECONDS")
    share: Optional[str] = setting(None, "join $share/GROUP to split the fleet between replicas", metavar="GROUP")
    client_id: Optional[str] = setting(None, "MQTT client id (default: jetserve-fleet-<host>)")
    silence_factor: float = setting(3.0, "offline after this many report intervals without a message",
                                   type=number_in(1, 1000))
    stall_timeout: float = setting(30.0, "exit (to be restarted) when ingestion is stuck on one step this many "
                                         "seconds", type=number_in(1, 86400))
    log_level: str = log_level_setting()
    fleet: Optional[str] = setting(None, "only this fleet (default: every fleet)")


def register(subparsers):
    fleet = subparsers.add_parser("fleet", help="fleet controller: registry, status, commands")
    commands = fleet.add_subparsers(dest="fleet_command", metavar="COMMAND")
    fleet.set_defaults(func=lambda args: fleet.print_help() or 2)

    run = commands.add_parser("run", help="subscribe to the fleet, keep the registry, serve HTTP")
    add_flags(run, FleetOptions)
    add_flags(run, MqttOptions, "MQTT")
    add_config_flag(run, "fleet", FleetOptions, MqttOptions)
    run.set_defaults(func=run_controller)

    status = commands.add_parser("status", help="print the fleet as a table")
    add_flags(status, FleetOptions, only=("db", "fleet"))
    status.add_argument("--json", action="store_true")
    add_config_flag(status, "fleet", FleetOptions, MqttOptions)
    status.set_defaults(func=run_status)

    send = commands.add_parser("send", help="send a command to a device and print its reply")
    send.add_argument("device", help="DEVICE or FLEET/DEVICE")
    send.add_argument("command", help="drain, resume, set-limits or report-now")
    send.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                      help="set-limits argument, e.g. --set max_num_seqs=2")
    send.add_argument("--timeout", type=number_in(0.1, 3600), default=10.0)
    send.add_argument("--fleet", default="default", help="fleet of DEVICE when not given as FLEET/DEVICE")
    add_flags(send, MqttOptions, "MQTT")
    add_config_flag(send, "fleet", FleetOptions, MqttOptions)
    send.set_defaults(func=run_send)


def _host_port(text):
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError("--http must be HOST:PORT, got %r" % text)
    return host.strip("[]"), int(port)  # [::1]:8080 too


def run_controller(args):
    import os
    import socket

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jetserve.fleet import web
    from jetserve.fleet.controller import Controller
    from jetserve.fleet.registry import Registry, RegistryError
    from jetserve.wire.mqtt import MqttConfigError, MqttOptions

    try:
        server = None
        if args.http:
            host, port = _host_port(args.http)
            token = web.read_token(args.http_token_file) if args.http_token_file else None
            if bool(args.http_tls_cert) != bool(args.http_tls_key):
                raise ValueError("--http-tls-cert and --http-tls-key go together")
            web.check_exposure(host, token, args.http_tls_cert)
        registry = Registry(args.db)
        controller = Controller(MqttOptions.from_args(args), registry,
                                args.client_id or "jetserve-fleet-%s" % socket.gethostname(), fleet=args.fleet,
                                share=args.share, silence_factor=args.silence_factor,
                                stall_timeout=args.stall_timeout)
        if args.http:
            budget = fdbudget.Budget({"HTTP": args.http_max_connections}, web.RESERVE_FDS)
            logging.info("%s", budget)
            server = web.Server(registry, host, port, token, args.http_tls_cert, args.http_tls_key,
                                controller.metrics.registry, budget.caps["HTTP"], args.http_header_timeout)
    except (ValueError, OSError, RegistryError, MqttConfigError) as exc:
        sys.exit("jetserve fleet run: %s" % exc)
    except ImportError as exc:
        sys.exit("jetserve fleet run: the HTTP page needs pip install 'jetserve[fleet]' (or --http ''): %s" % exc)
    if server:
        logging.info("fleet page on %s://%s:%d/%s", server.scheme, *server.address[:2],
                     " (token required)" if token else "")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if controller.run(stop):
        logging.shutdown()
        os._exit(1)  # a stuck thread may hold the registry: a normal exit would wait on it
    if server:
        server.stop()
    registry.close()
    return 0


def run_status(args):
    import os

    from jetserve.fleet.registry import Registry, RegistryError
    from jetserve.fleet.web import device_row

    if "://" not in args.db and not os.path.exists(args.db):
        sys.exit("jetserve fleet status: no registry at %s (is `jetserve fleet run` using it?)" % args.db)
    try:
        registry = Registry(args.db)
    except RegistryError as exc:
        sys.exit("jetserve fleet status: %s" % exc)
    devices = registry.devices(args.fleet)
    refused = [r for r in registry.rejections() if not args.fleet or r["fleet"] == args.fleet]
    registry.close()
    if args.json:
        print(json.dumps(devices, indent=2))
        return 0
    columns = ("fleet", "device", "state", "jetpack", "last_seen_utc", "gaps", "reasons")
    rows = [columns] + [tuple(map(_cell, map(device_row(d).get, columns))) for d in devices]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    if refused:
        print("\nrefused messages (failed the message checks):")
        for r in refused:
            print("  %s/%s %s: %d, last: %s" % (_cell(r["fleet"]), _cell(r["device"]), r["kind"], r["count"],
                                                 _cell(r["last_error"])))
    return 0


def _cell(value):
    """A value as the table shows it. What devices reported is shown, never obeyed: a control
    character (a terminal escape sequence, a newline that would forge a row, a bidi override) is
    written as its escape."""
    text = "; ".join(value) if isinstance(value, list) else "-" if value is None else str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def run_send(args):
    from jetserve.fleet.send import send
    from jetserve.wire.mqtt import MqttConfigError, MqttOptions
    from jetserve.wire.topics import check_name

    fleet, _, device = args.device.rpartition("/")
    try:
        fleet, device = check_name("fleet", fleet or args.fleet), check_name("device", device)
        command_args = {}
        for item in args.set:
            key, _, value = item.partition("=")
            command_args[key] = int(value)
        reply = send(MqttOptions.from_args(args), fleet, device, args.command, command_args, args.timeout)
    except ValueError as exc:
        sys.exit("jetserve fleet send: bad argument: %s" % exc)
    except (TimeoutError, MqttConfigError) as exc:
        sys.exit("jetserve fleet send: %s" % exc)
    print(json.dumps(reply, indent=2, sort_keys=True))
    return 0 if reply.get("ok") else 1
