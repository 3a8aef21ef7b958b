"""One TOML file configures a device: `[serve]`, `[agent]` and `[fleet]` tables.

Keys are the long command-line flags with dashes or underscores (`max-num-seqs` or
`max_num_seqs`). Values from the file become the parser's defaults, so flags given on the
command line always win. Python 3.8 compatible (the agent runs there).
"""

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on the agent's Python 3.8/3.10
    import tomli as tomllib


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # every long-running command's --log-level


class ConfigError(ValueError):
    pass


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
    """Make the file's `[table]` the parser's defaults; unknown keys are an error, not ignored."""
    values = read_table(path, table)
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError("config %s: unknown key(s) in [%s]: %s" % (path, table, ", ".join(unknown)))
    parser.set_defaults(**values)


def add_config_flag(parser, table):
    """Give a subcommand `--config FILE.toml`, read from the file's `[table]` (see cli.main)."""
    parser.add_argument("--config", metavar="FILE.toml",
                        help="read defaults from [%s] of this TOML file; flags override it" % table)
    parser.set_defaults(config_parser=parser, config_table=table)
