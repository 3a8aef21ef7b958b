"""The `jetserve` command: one entry point, each part registers its own subcommands.

Parts are imported lazily so that `jetserve agent` and `jetserve doctor` run on a device
with no torch (JetPack 5, Python 3.8) and start fast everywhere.
"""

import argparse
import importlib
import sys

from jetserve import __version__
from jetserve.config import ConfigError, set_defaults_from_file

# Modules that define `register(subparsers)`; each added subcommand sets `func` on its parser.
PARTS = (
    "jetserve.server.cli",  # serve, generate, chat
    "jetserve.engine.cli",  # mtp inspect|merge|fit
    "jetserve.bench.cli",  # bench ...
    "jetserve.agent.cli",  # agent, doctor
    "jetserve.fleet.cli",  # fleet ...
)


def build_parser():
    parser = argparse.ArgumentParser(prog="jetserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version="jetserve " + __version__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in PARTS:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            # A part whose dependencies are not installed (torch on an agent-only device)
            # is left out; its commands say why when asked for.
            missing = getattr(exc, "name", None) or str(exc)
            _register_unavailable(subparsers, name, missing)
            continue
        module.register(subparsers)
    return parser


# The commands of each part, so a missing dependency can be reported by command name.
_COMMANDS = {
    "jetserve.server.cli": ("serve", "generate", "chat"),
    "jetserve.engine.cli": ("mtp",),
    "jetserve.bench.cli": ("bench",),
    "jetserve.agent.cli": ("agent", "doctor"),
    "jetserve.fleet.cli": ("fleet",),
}


def _register_unavailable(subparsers, part, missing):
    def unavailable(args):
        sys.exit("jetserve %s: not available here: missing Python module %r "
                 "(install jetserve[serve] for the engine and the service)" % (args.command, missing))

    for command in _COMMANDS[part]:
        if command in subparsers.choices:
            continue
        sub = subparsers.add_parser(command, help="(unavailable: needs %s)" % missing)
        sub.add_argument("rest", nargs=argparse.REMAINDER)
        sub.set_defaults(func=unavailable)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        # Second pass: the file's values become defaults, so explicit flags still win.
        try:
            set_defaults_from_file(args.config_parser, args.config, args.config_table)
        except ConfigError as exc:
            parser.error(str(exc))
        args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
