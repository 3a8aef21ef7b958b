"""The `jetserve` command: one entry point, each part registers its own subcommands.

Every part's `cli` module imports only the standard library at module level (and parses on
Python 3.8), so `jetserve agent` and `jetserve doctor` run on a device without torch, and
`jetserve --help` is instant everywhere. Heavy imports happen inside the commands.
"""

import argparse
import importlib
import os
import signal
import sys

from jetserve import __version__
from jetserve.config import ConfigError, set_defaults_from_file

# Modules that define `register(subparsers)`; each subcommand sets `func` on its parser.
PARTS = (
    "jetserve.server.cli",  # serve, generate, chat
    "jetserve.engine.cli",  # mtp inspect|merge|fit
    "jetserve.bench.cli",  # bench ...
    "jetserve.agent.cli",  # agent, doctor
    "jetserve.fleet.cli",  # fleet ...
)


class Parser(argparse.ArgumentParser):
    """argparse, with a refusal on one line: `jetserve serve`'s usage is forty lines, and printed
    first it would bury the line that says which flag is wrong. Subcommands' parsers are of the
    same class (add_subparsers makes them so)."""

    def error(self, message):
        self.exit(2, "%s: error: %s (see `%s --help`)\n" % (self.prog, message, self.prog))


def build_parser():
    parser = Parser(prog="jetserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version="jetserve " + __version__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in PARTS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a part that exists but is broken must not hide
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:  # `--config ""` (an unset variable) is refused, not skipped
        # Second pass: the file's values become defaults, so explicit flags still win.
        try:
            set_defaults_from_file(args.config_parser, args.config, args.config_table)
        except ConfigError as exc:
            args.config_parser.error(str(exc))
        args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        status = args.func(args) or 0
        sys.stdout.flush()  # here, where a closed pipe can be caught, not at exit
        return status
    except BrokenPipeError:
        # `jetserve doctor --json | head`: the reader has all it wants. Quiet, as other Unix tools,
        # and stdout pointed at /dev/null so the interpreter's own flush at exit finds no pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except ModuleNotFoundError as exc:
        # e.g. `jetserve serve` on an agent-only device with no torch installed.
        sys.exit("jetserve %s: Python module %r is not installed here "
                 "(the engine and the service need `pip install jetserve[serve]` and torch)"
                 % (args.command, exc.name))


if __name__ == "__main__":
    sys.exit(main())
