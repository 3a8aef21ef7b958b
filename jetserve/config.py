"""Settings: each part's are one dataclass; its flags and its TOML keys are made from the fields.

A field made with `setting(default, help, ...)` is a setting: `add_flags` gives it the flag
`--name-with-dashes` (argparse's keywords in the field's metadata), and `from_args` reads it back,
so a default is written once, in the dataclass. One TOML file configures a device: `[serve]`,
`[agent]` and `[fleet]` tables whose keys are the same settings, dashes or underscores
(`max-num-seqs` or `max_num_seqs`); values from the file become the parser's defaults, so flags
given on the command line always win. A value from the file passes through its flag's own type,
choices and action, so the file can set nothing the command line would refuse. Python 3.8
compatible and standard library only (the agent imports it on a device's Python 3.8, without torch).
"""

import argparse
import dataclasses
import errno
import json
import math
import os
import stat
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on the agent's Python 3.8/3.10
    import tomli as tomllib


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # every long-running command's --log-level
DEFAULT_HOST = "127.0.0.1"  # every listener's address unless asked otherwise: loopback
DEFAULT_PORT = 50051  # the service's gRPC port
DEFAULT_ADDRESS = "%s:%d" % (DEFAULT_HOST, DEFAULT_PORT)  # where the service's clients (chat, the agent) look
# The file's tables: one file configures a device, and a table by any other name (`[srve]`) or a key
# outside every table would configure nothing, silently.
TABLES = ("serve", "agent", "fleet")
# A settings file is a few hundred bytes; reading is bounded so that a wrong path (a log, a disk
# image, /dev/zero) is refused rather than read into memory.
MAX_CONFIG_BYTES = 1 << 20
MAX_SECRET_BYTES = 64 << 10  # a token or password file: one line


class ConfigError(ValueError):
    pass


def log_level(text):
    """`--log-level`'s type: a level name in any case (`debug` as `DEBUG`), checked."""
    level = str(text).upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError("invalid choice: %r (choose from %s)" % (text, ", ".join(LOG_LEVELS)))
    return level


def int_in(low, high):
    """A flag's type: an integer in [low, high] (a port, a field of the wire's int32), so a value
    out of range is refused by name at the start, not wrapped or overflowed by a C library later."""
    def parse(text):
        try:
            value = int(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError("must be an integer in [%d, %d], got %r" % (low, high, text))
        return value
    return parse


port_number = int_in(0, 65535)


def number_in(low, high):
    """A flag's type: a finite number in [low, high] (a period, a timeout, a margin), so that 0 is
    not a busy loop, NaN not a deadline that never passes, and 1e9 not a service that never answers."""
    def parse(text):
        try:
            value = float(text)
        except (TypeError, ValueError):
            value = math.nan
        if not low <= value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError("must be a number in [%g, %g], got %r" % (low, high, text))
        return value
    return parse


def seconds(text):
    """A flag's type: a duration, finite and not negative (NaN would compare false to every deadline)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError("must be seconds, a finite number >= 0, got %r" % (text,))
    return value


def nonempty(text):
    """A flag's type for an address, a path or a secret: '' would mean "any address", "no file" or
    "no token" without saying so (an unset shell variable), so it is refused."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


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


def read_file(path, limit):
    """The bytes of the regular file `path`, at most `limit` of them. Opened without blocking, so
    a FIFO named by mistake cannot hang a start, and a device (/dev/zero), a directory or a file
    past `limit` is refused before it fills memory: as OSError, with `filename` and `strerror`,
    as the system's own refusals are, so every caller's message for those serves these too."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise OSError(errno.EFBIG, "larger than %d KiB" % (limit // 1024), path)
    return b"".join(chunks)


def read_secret(path, flag, private=True):
    """The first line of the token or password file `path` (named by `flag`), stripped: kept out
    of `ps` and of the settings file. `private`: like ssh with a private key, a file other users
    may read or write is refused, since its secret is spent. ValueError naming `flag`, or OSError."""
    if private:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError("%s %s is accessible by other users (mode %04o): chmod 600 it, owned by the "
                             "service's user" % (flag, path, stat.S_IMODE(mode)))
    try:
        lines = read_file(path, MAX_SECRET_BYTES).decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError("%s %s is not UTF-8 text" % (flag, path))
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError("%s %s is empty" % (flag, path))
    return token


def _read_config(path):
    if not path:
        raise ConfigError("--config is empty: name a TOML file")
    try:
        return read_file(path, MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError("cannot read config %s: %s" % (path, exc.strerror or exc))


def read_table(path, table):
    """Return the `[table]` of a TOML file as a dict with underscore keys."""
    data = _read_config(path)
    try:
        doc = tomllib.loads(data.decode("utf-8"))  # TOML is UTF-8 by definition
    except UnicodeDecodeError as exc:
        raise ConfigError("config %s is not UTF-8 text (byte %d)" % (path, exc.start))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config %s is not valid TOML: %s" % (path, exc))
    except RecursionError:  # tomllib's parser recurses into each nested array or table
        raise ConfigError("config %s is not valid TOML: nested too deeply" % path)
    strays = sorted(name for name in doc if name not in TABLES)
    if strays:
        raise ConfigError("config %s: %s: the file holds only the tables [%s] (each key goes under one)"
                          % (path, ", ".join(strays), "], [".join(TABLES)))
    section = doc.get(table, {})
    if not isinstance(section, dict):
        raise ConfigError("config %s: [%s] must be a table" % (path, table))
    values = {}
    for key, value in section.items():
        name = key.replace("-", "_")
        if name in values:
            raise ConfigError("config %s: [%s] sets %s twice (dashes and underscores are one key)"
                              % (path, table, key.replace("_", "-")))
        values[name] = value
    return values


def _flag_value(parser, action, value):
    """`value` from the file as the flag `action` would give it: an on/off flag takes true or
    false; any other flag takes what its type parses, a string as it is and anything else as JSON
    (a table for --speculative-config), and a setting whose value is text takes only a string
    (`host = 5` is a mistake, not "5"). Raises ValueError saying why."""
    if action.nargs == 0:  # store_true, store_false, --x/--no-x: the key names the dest
        if not isinstance(value, bool):
            raise ValueError("must be true or false")
        return value
    items = value if isinstance(value, list) and action.nargs in ("+", "*") else [value]
    if not items:
        raise ValueError("needs at least one value")
    converted = []
    for item in items:
        text = item if isinstance(item, str) else json.dumps(item, default=str)
        if "\0" in text:  # no command line can carry one, and no path or name holds one
            raise ValueError("must not contain a NUL character")
        try:
            result = action.type(text) if action.type else text
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc))
        except (TypeError, ValueError):
            raise ValueError("invalid %s value" % getattr(action.type, "__name__", "its"))
        if isinstance(result, str) and not isinstance(item, str):
            raise ValueError("must be a string")
        if action.choices is not None and result not in action.choices:
            raise ValueError("invalid choice (choose from %s)" % ", ".join(map(str, action.choices)))
        converted.append(result)
    scratch = argparse.Namespace()  # the flag's own action (e.g. one that flattens lists) stores it
    action(parser, scratch, converted if action.nargs in ("+", "*") else converted[0], action.option_strings[0])
    return getattr(scratch, action.dest)


def set_defaults_from_file(parser, path, table):
    """Make the file's `[table]` the parser's defaults; a key that is none of the parser's
    settings (`add_config_flag`'s) is an error, not ignored, and so is a value its flag refuses.
    A key of the table that this command has no flag for (`doctor` reads `[agent]`) is left out."""
    values = read_table(path, table)
    unknown = sorted(set(values) - set(parser.get_default("config_keys") or ()))
    if unknown:
        raise ConfigError("config %s: unknown key(s) in [%s]: %s" % (path, table, ", ".join(unknown)))
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    defaults = {}
    for key, value in values.items():
        if key in actions:
            try:
                defaults[key] = _flag_value(parser, actions[key], value)
            except ValueError as exc:
                shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:76] + " ..."  # one line
                raise ConfigError("config %s: [%s] %s = %s: %s" % (path, table, key.replace("_", "-"), shown, exc))
    parser.set_defaults(**defaults)


def add_config_flag(parser, table, *classes, only=None):
    """Give a subcommand `--config FILE.toml`, read from the file's `[table]` (see cli.main):
    its keys are the settings of `classes` (those in `only`, where given)."""
    assert table in TABLES, table
    keys = sorted(key for cls in classes for key, _ in settings(cls) if only is None or key in only)
    parser.add_argument("--config", metavar="FILE.toml",
                        help="read defaults from [%s] of this TOML file; flags override it" % table)
    parser.set_defaults(config_parser=parser, config_table=table, config_keys=keys)
