"""Settings: each part's are one dataclass; its flags and its TOML keys are made from the fields.

A field made with `setting(default, help, ...)` is a setting: `add_flags` gives it the flag
`--name-with-dashes` (argparse's keywords in the field's metadata), and `from_args` reads it back,
so a default is written once, in the dataclass. One TOML file configures a device: `[serve]`,
`[agent]` and `[fleet]` tables whose keys are the same settings, dashes or underscores
(`max-num-seqs` or `max_num_seqs`); values from the file become the parser's defaults, so flags
given on the command line always win. Python 3.8 compatible and standard library only (the agent
imports it on a device's Python 3.8, without torch).
"""

import argparse
import dataclasses
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on the agent's Python 3.8/3.10
    import tomli as tomllib


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # every long-running command's --log-level
DEFAULT_HOST = "127.0.0.1"  # every listener's address unless asked otherwise: loopback
DEFAULT_PORT = 50051  # the service's gRPC port
DEFAULT_ADDRESS = "%s:%d" % (DEFAULT_HOST, DEFAULT_PORT)  # where the service's clients (chat, the agent) look


class ConfigError(ValueError):
    pass


def log_level(text):
    """`--log-level`'s type: a level name in any case (`debug` as `DEBUG`), checked."""
    level = str(text).upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError("invalid choice: %r (choose from %s)" % (text, ", ".join(LOG_LEVELS)))
    return level


def setting(default=None, help=None, name=None, **flag):
    """A dataclass field that is a setting: flag and TOML key `name` (default: the field's name),
    `help`, and argparse's keywords in `flag` (type, choices, action, nargs, metavar, aliases).
    `help` gains "(default: ...)" unless it says what the default is itself (or it is None/False)."""
    return dataclasses.field(default=default, metadata={"setting": dict(flag, help=help, name=name)})


def log_level_setting():
    """Every long-running command's `--log-level` (a function: a dataclass field is one class's)."""
    return setting("INFO", "logging threshold, in any case", type=log_level, choices=LOG_LEVELS)


def settings(cls):
    """(key, field) of every setting of a dataclass: its flag's dest and the TOML key."""
    return [(f.metadata["setting"]["name"] or f.name, f) for f in dataclasses.fields(cls) if "setting" in f.metadata]


def add_flags(parser, cls, title=None, only=None):
    """`--key` for every setting of `cls` (or those named in `only`), in a group if `title`."""
    target = parser.add_argument_group(title) if title else parser
    for key, field in settings(cls):
        if only is not None and key not in only:
            continue
        flag = dict(field.metadata["setting"])
        del flag["name"]
        aliases = flag.pop("aliases", ())
        if field.default is not None and field.default is not False and "default" not in (flag["help"] or ""):
            flag["help"] = ((flag["help"] or "") + " (default: %(default)s)").lstrip()
        target.add_argument("--" + key.replace("_", "-"), *aliases, dest=key, default=field.default, **flag)
    return target


def from_args(cls, args, **values):
    """An instance of `cls` with its settings from a namespace `add_flags` filled; `values` set
    the fields that are no flags (or override)."""
    found = {f.name: getattr(args, key) for key, f in settings(cls) if hasattr(args, key)}
    found.update(values)
    return cls(**found)


def read_table(path, table):
    """Return the `[table]` of a TOML file as a dict with underscore keys."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ConfigError("cannot read config %s: %s" % (path, exc.strerror or exc))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config %s is not valid TOML: %s" % (path, exc))
    section = doc.get(table, {})
    if not isinstance(section, dict):
        raise ConfigError("config %s: [%s] must be a table" % (path, table))
    return {key.replace("-", "_"): value for key, value in section.items()}


def set_defaults_from_file(parser, path, table):
    """Make the file's `[table]` the parser's defaults; a key that is none of the parser's
    settings (`add_config_flag`'s) is an error, not ignored."""
    values = read_table(path, table)
    unknown = sorted(set(values) - set(parser.get_default("config_keys") or ()))
    if unknown:
        raise ConfigError("config %s: unknown key(s) in [%s]: %s" % (path, table, ", ".join(unknown)))
    parser.set_defaults(**values)


def add_config_flag(parser, table, *classes, only=None):
    """Give a subcommand `--config FILE.toml`, read from the file's `[table]` (see cli.main):
    its keys are the settings of `classes` (those in `only`, where given)."""
    keys = sorted(key for cls in classes for key, _ in settings(cls) if only is None or key in only)
    parser.add_argument("--config", metavar="FILE.toml",
                        help="read defaults from [%s] of this TOML file; flags override it" % table)
    parser.set_defaults(config_parser=parser, config_table=table, config_keys=keys)
