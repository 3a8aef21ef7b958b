"""The settings surface against a hostile file or command line: every bad setting is one line
naming it, exit status 2 (1 for files `serve` reads after parsing), no traceback, no hang.

The refusals come from the parsers alone, in this process as `jetserve.cli.main` runs them (parse,
the file's [serve] as defaults, parse again), and from a real `jetserve` process where a hang, a
traceback or main's own wiring is what is tested. Nothing loads a model."""

import os
import subprocess
import sys

import pytest

from jetserve.cli import build_parser
from jetserve.config import MAX_CONFIG_BYTES, ConfigError, set_defaults_from_file
from jetserve.engine import EngineArgs

PORTS = ["--port", "0", "--openai-port", "0", "--metrics-port", "0"]  # never the default ports


def jetserve(*args, timeout=60):
    """A real `jetserve` process; the timeout only guards against a hang."""
    return subprocess.run([sys.executable, "-m", "jetserve.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def refusal(capsys, argv):
    """The one line `jetserve ARGV`'s parsers refuse it with, exit status 2 (as cli.main)."""
    parser = build_parser()
    with pytest.raises(SystemExit) as done:
        args = parser.parse_args(argv)
        if args.config is not None:
            try:
                set_defaults_from_file(args.config_parser, args.config, args.config_table)
            except ConfigError as exc:
                args.config_parser.error(str(exc))
            parser.parse_args(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def parsed(tmp_path, text, *flags):
    """`serve`'s namespace with [serve] of a file holding `text` (as `jetserve.cli.main`)."""
    conf = tmp_path / "jetserve.toml"
    conf.write_text(text)
    argv = ["serve", "--config", str(conf), *flags]
    parser = build_parser()
    args = parser.parse_args(argv)
    set_defaults_from_file(args.config_parser, args.config, args.config_table)
    return parser.parse_args(argv)


@pytest.mark.parametrize("line, named", [
    # A string is truthy: "false" turned chunked prefill on.
    ('enable-chunked-prefill = "false"', "enable-chunked-prefill = 'false': must be true or false"),
    ("enforce-eager = 1", "enforce-eager = 1: must be true or false"),
    ('dtype = "foo"', "dtype = 'foo': invalid choice (choose from auto, float32"),
    ('quantization = "int9"', "quantization = 'int9': invalid choice"),
    ("max-num-seqs = [1]", "max-num-seqs = [1]: invalid int value"),
    ("max-num-seqs = true", "max-num-seqs = True: invalid int value"),
    ("max-num-seqs = 1.5", "max-num-seqs = 1.5: invalid int value"),
    ('max-num-seqs = "abc"', "max-num-seqs = 'abc': invalid int value"),
    ("host = {a = 1}", "host = {'a': 1}: must be a string"),
    ("model = 5", "model = 5: must be a string"),
    ("log-level = 5", "log-level = 5: invalid choice"),
    ('cudagraph-capture-sizes = [1, "x"]', "expected integers, got 'x'"),
    ('model = "a\\u0000b"', "must not contain a NUL character"),
    ("port = 70000", "port = 70000: must be an integer in [0, 65535]"),
    ("port = 1180591620717411303424", "must be an integer in [0, 65535]"),
    ("drain-grace-period = nan", "drain-grace-period = nan: must be seconds, a finite number >= 0"),
    ('host = ""', "host = '': must not be empty"),
    ('api-key = ""', "api-key = '': must not be empty"),
    ("max-num-seqs = 3\nmax_num_seqs = 4", "[serve] sets max-num-seqs twice"),
])
def test_a_bad_value_in_the_file_is_refused_naming_the_file_the_key_and_the_value(tmp_path, capsys, line, named):
    """The file's values went to the namespace as they were, past every type and choice the
    flag checks: each is now refused as the same value on the command line would be."""
    conf = tmp_path / "jetserve.toml"
    conf.write_text("[serve]\n%s\n" % line)
    err = refusal(capsys, ["serve", "--config", str(conf), *PORTS])
    assert err.startswith("jetserve serve: error: config %s: " % conf) and named in err, err


def test_the_file_gives_what_the_flags_would_and_a_flag_still_wins(tmp_path):
    args = parsed(tmp_path, '[serve]\nmax-model-len = "4k"\nenable-chunked-prefill = false\nport = "8001"\n'
                            'cudagraph-capture-sizes = [1, 2, 8]\nserved-model-name = ["kiosk", "alias"]\n'
                            'cudagraph-mode = "FULL_DECODE_ONLY"\ndrain-grace-period = 5\n'
                            'speculative-config = {method = "mtp", num_speculative_tokens = 2}\n',
                  "--max-num-seqs", "5", "--enable-chunked-prefill")
    engine = EngineArgs.from_cli_args(args)
    assert (engine.max_model_len, engine.enable_chunked_prefill, engine.cudagraph_capture_sizes, engine.max_num_seqs,
            engine.served_model_name, engine.cudagraph_mode, engine.speculative_config) == \
        (4000, True, [1, 2, 8], 5, "kiosk", "full_decode_only", {"method": "mtp", "num_speculative_tokens": 2})
    assert (args.port, args.drain_grace_period) == (8001, 5.0)
    assert parsed(tmp_path, "[serve]\nport = 6000\n", "--port", "7000").port == 7000


@pytest.mark.parametrize("text, named", [
    ("[srve]\nmax-num-seqs = 3\n", "srve: the file holds only the tables [serve], [agent], [fleet]"),
    ("max-num-seqs = 3\n[serve]\n", "max-num-seqs: the file holds only the tables"),
])
def test_a_table_by_another_name_or_a_key_outside_every_table_is_refused(tmp_path, capsys, text, named):
    """Either configured nothing, silently."""
    conf = tmp_path / "jetserve.toml"
    conf.write_text(text)
    assert named in refusal(capsys, ["serve", "--config", str(conf), *PORTS])


@pytest.mark.parametrize("argv, named", [
    (["--port", "70000"], "argument --port: must be an integer in [0, 65535], got '70000'"),  # grpcio: 4464
    (["--metrics-port", "-1"], "argument --metrics-port: must be an integer in [0, 65535]"),
    (["--host="], "argument --host: must not be empty"),  # bound every interface
    (["--api-key="], "argument --api-key: must not be empty"),  # turned auth off
    (["--tls-cert="], "argument --tls-cert: must not be empty"),
    (["--drain-grace-period", "nan"], "argument --drain-grace-period: must be seconds"),
    (["--drain-grace-period", "-1"], "argument --drain-grace-period: must be seconds"),
])
def test_a_bad_serve_flag_is_one_line(capsys, argv, named):
    """One line, not the forty lines of `serve`'s usage above it."""
    err = refusal(capsys, ["serve", *PORTS, *argv])
    assert err.startswith("jetserve serve: error: ") and named in err, err


@pytest.mark.parametrize("flag", ["--max-tokens", "--top-k", "--seed"])
def test_a_client_number_the_request_cannot_carry_is_refused_by_the_flag(capsys, flag):
    """protobuf's ValueError (a traceback) before: the fields are int32 (seed int64)."""
    err = refusal(capsys, ["generate", "hi", "--target", "unix:/nonexistent", flag, str(2**70)])
    assert "argument %s: must be an integer in [" % flag in err, err


def test_an_empty_config_path_is_refused_not_skipped():
    """`--config "$CONF"` with CONF unset served with no file at all, on the defaults."""
    done = jetserve("serve", "--config=", *PORTS)
    assert done.returncode == 2 and done.stderr == \
        "jetserve serve: error: --config is empty: name a TOML file (see `jetserve serve --help`)\n", done.stderr


def test_files_that_are_no_settings_file_are_refused_without_reading_them(tmp_path):
    """/dev/zero was read until memory ran out, a FIFO hung the start, bytes that are not UTF-8 or
    arrays nested past the recursion limit gave a traceback; now each is one line, exit 2."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.toml"
    zero.symlink_to("/dev/zero")
    big = tmp_path / "big.toml"
    with open(big, "wb") as f:
        f.write(b"[serve]\n")
        f.truncate(MAX_CONFIG_BYTES + 1)  # sparse: the size is what counts
    (tmp_path / "latin1.toml").write_bytes(b'[serve]\nmodel = "\xff"\n')
    (tmp_path / "deep.toml").write_text("[serve]\nmodel = " + "[" * 100000 + "\n")
    for name, why in [(fifo, "not a regular file"), (zero, "not a regular file"),
                      (tmp_path, "not a regular file"), (big, "larger than 1024 KiB"),
                      (tmp_path / "latin1.toml", "is not UTF-8 text (byte 17)"),
                      (tmp_path / "deep.toml", "is not valid TOML: nested too deeply"),
                      (tmp_path / "missing.toml", "cannot read config")]:
        done = jetserve("serve", "--config", name, *PORTS)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1 and why in done.stderr and str(name) in done.stderr, done.stderr


def test_serves_own_refusals_are_one_line_and_exit_1(tmp_path):
    """A token file missing, not UTF-8, or MODEL and --model that disagree were tracebacks; an
    empty --model served the demo; --api-key with --api-key-file dropped one unsaid; an engine
    count out of bounds was refused only once the listeners were up and the model loading."""
    bad = tmp_path / "token"
    bad.write_bytes(b"\xff\n")
    bad.chmod(0o600)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for argv, line in [(["--api-key-file", tmp_path / "none"], "--api-key-file %s: No such file or directory"
                         % (tmp_path / "none")),
                       (["--api-key-file", bad], "--api-key-file %s is not UTF-8 text" % bad),
                       (["--api-key", "k", "--api-key-file", bad], "--api-key and --api-key-file both name the token"),
                       (["--model="], "--model '' is not a directory"),
                       ([model, "--model", "%s/" % model], "MODEL %r and --model %r disagree" % (str(model), "%s/" % model)),
                       # engine counts out of bounds: refused before any listener, not at model load
                       (["--max-num-seqs", "0"], "max_num_seqs must be an integer in [1, 2147483647], got 0"),
                       (["--max-num-batched-tokens", 2**40], "max_num_batched_tokens must be an integer in [1, "),
                       (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1], got 1.5")]:
        done = jetserve("serve", "--no-engine-core-process", *PORTS, *argv)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("jetserve serve: " + line), done.stderr


def test_every_token_password_and_certificate_file_is_read_bounded(tmp_path):
    """Each file read for a secret (the service's, the agent's, the fleet page's, MQTT's) or a
    client's certificate: a FIFO once hung the start, /dev/zero or a long file without a newline
    was read whole into memory. Now each is refused naming its flag, before it is read; a good
    file still gives its first line."""
    from jetserve.agent.service import read_control_token
    from jetserve.config import MAX_SECRET_BYTES
    from jetserve.fleet import web
    from jetserve.server.auth import read_token
    from jetserve.wire.mqtt import MqttConfigError, MqttOptions, new_client

    fifo, zero, long = tmp_path / "fifo", tmp_path / "zero", tmp_path / "long"
    os.mkfifo(fifo, 0o600)
    zero.symlink_to("/dev/zero")
    with open(long, "wb") as f:
        f.truncate(MAX_SECRET_BYTES + 1)  # sparse: no newline anywhere
    long.chmod(0o600)
    good = tmp_path / "good"
    good.write_text("a-token-of-more-than-16-characters\nignored\n")
    good.chmod(0o600)
    readers = [(lambda p: read_token(None, str(p)), "--api-key-file"),
               (read_control_token, "--service-token-file"),
               (web.read_token, "--http-token-file"),
               (lambda p: new_client("t", MqttOptions(user="u", password_file=str(p))), "--mqtt-password-file")]
    for read, flag in readers:
        for path, why in [(fifo, "not a regular file"), (zero, "not a regular file"),
                          (tmp_path, "not a regular file"), (long, "larger than 64 KiB")]:
            with pytest.raises((OSError, ValueError, MqttConfigError)) as refused:
                read(path)
            said = str(refused.value) if not isinstance(refused.value, OSError) else \
                "%s: %s" % (refused.value.filename, refused.value.strerror)  # what each command prints
            # /dev/zero is open to everyone: a reader of private files refuses it for that first
            assert (why in said or path == zero and "accessible by other users" in said) and str(path) in said, \
                (flag, said)
    assert read_token(None, str(good)) == read_control_token(str(good)) == web.read_token(str(good)) == \
        "a-token-of-more-than-16-characters"
    done = jetserve("generate", "hi", "--tls-ca", zero, "--target", "127.0.0.1:9")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == ["jetserve generate: cannot read %s: not a regular file" % zero], \
        done.stderr
