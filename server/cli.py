"""`jetserve serve`, `jetserve generate`, `jetserve chat`.

Standard library only at module level (and Python 3.8 syntax): `jetserve --help` and the
agent's commands import this module on devices without torch or grpc extras.
"""

import logging
import os
import sys

from jetserve import DEMO_MODEL, demo_model_dir
from jetserve.config import DEFAULT_ADDRESS, add_config_flag, add_flags, from_args, int_in, nonempty
from jetserve.server.options import ServeOptions

INT32 = int_in(-2**31, 2**31 - 1)  # the wire's int32 fields (max_tokens, top_k): protobuf refuses more
INT64 = int_in(-2**63, 2**63 - 1)  # and its int64 (seed)
NO_DEMO = ("no --model given, and the demo model is not bundled with this jetserve yet "
           "(expected at %s): pass --model DIR")


def register(subparsers):
    serve = subparsers.add_parser(
        "serve", help="serve a model over gRPC and OpenAI's HTTP API (Type=notify under systemd)",
        description="Serve a model over gRPC (with health and reflection) and an OpenAI-compatible HTTP API, "
                    "with Prometheus metrics.")
    engine_args = _add_engine_flags(serve)
    add_flags(serve, ServeOptions, "service")
    add_config_flag(serve, "serve", ServeOptions, *[engine_args] if engine_args else [])
    if engine_args:
        serve.set_defaults(func=run_serve)

    generate = subparsers.add_parser("generate", help="complete a prompt on a running server, streamed")
    generate.add_argument("prompt")
    _add_client_flags(generate)
    generate.set_defaults(func=lambda args: _run_client("generate", args))

    chat = subparsers.add_parser("chat", help="chat with a running server (one message, or lines from stdin)")
    chat.add_argument("message", nargs="?", help="one user message; without it, read one per line from stdin")
    chat.add_argument("--system", help="system prompt")
    _add_client_flags(chat)
    chat.set_defaults(func=lambda args: _run_client("chat", args))


def _add_engine_flags(parser):
    """vLLM's engine flags, as the engine defines them. On a device without the engine (agent
    only) `serve` is still listed, and running it says which module is missing. Returns
    `EngineArgs`, or None without the engine."""
    try:
        from jetserve.engine.config import EngineArgs
    except ModuleNotFoundError as exc:
        missing = exc

        def engine_missing(args):
            raise missing

        parser.description += " (Not available here: Python module %r is not installed.)" % exc.name
        parser.set_defaults(func=engine_missing)
        return None
    EngineArgs.add_cli_args(parser)
    return EngineArgs


def _add_client_flags(parser):
    parser.add_argument("--target", default=DEFAULT_ADDRESS, type=nonempty,
                        help="server address, host:port or unix:/path (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("JETSERVE_API_KEY"),
                        help="bearer token (default: $JETSERVE_API_KEY)")
    parser.add_argument("--tls-ca", metavar="PEM", type=nonempty, help="connect over TLS, trusting this CA")
    parser.add_argument("--tls-cert", metavar="PEM", type=nonempty, help="client certificate for mTLS")
    parser.add_argument("--tls-key", metavar="PEM", type=nonempty, help="private key of --tls-cert")
    # The server judges the values (and names the field); the flags refuse only what the request cannot carry.
    parser.add_argument("--max-tokens", type=INT32, default=256, help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, help="0 = greedy (default: the server's)")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=INT32)
    parser.add_argument("--seed", type=INT64)
    parser.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def _run_client(command, args):
    """`generate` or `chat`; a file a flag names that cannot be read (--tls-ca) is one line."""
    from jetserve.server import client

    try:
        return getattr(client, command)(args)
    except OSError as exc:
        if exc.filename is None:  # not a file: a closed pipe (cli.main's), a socket
            raise
        sys.exit("jetserve %s: cannot read %s: %s" % (command, exc.filename, exc.strerror))


DEMO_SPECULATIVE_CONFIG = {"method": "mtp", "num_speculative_tokens": 3}


def run_serve(args):
    if args.model is None:  # `jetserve serve MODEL`, as `vllm serve MODEL`; '' is refused below, not the demo
        args.model = args.model_tag
    if args.model is None or (args.model == DEMO_MODEL and not os.path.isdir(args.model)):
        demo = demo_model_dir()
        if not os.path.exists(os.path.join(demo, "config.json")):
            sys.exit("jetserve serve: " + NO_DEMO % demo)
        args.model = DEMO_MODEL  # resolved to its directory by the engine; clients ask for "demo"
        if args.speculative_config is None:  # the demo exists to show drafting: on unless asked otherwise
            args.speculative_config = DEMO_SPECULATIVE_CONFIG
    elif not os.path.isfile(os.path.join(args.model, "config.json")):
        what = "is not a directory" if not os.path.isdir(args.model) else "has no config.json"
        sys.exit("jetserve serve: --model %s %s (expected a Hugging Face checkpoint directory)"
                 % (args.model or "''", what))
    if bool(args.tls_cert) != bool(args.tls_key):
        sys.exit("jetserve serve: --tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        sys.exit("jetserve serve: --tls-client-ca needs --tls-cert and --tls-key")
    if args.api_key and args.api_key_file:  # read_token would take the file and drop the other unsaid
        sys.exit("jetserve serve: --api-key and --api-key-file both name the token: give one")
    from jetserve.engine.config import EngineArgs  # no torch: checked before the engine core starts

    try:  # MODEL and --model that disagree, a count out of bounds: one line, before any listener
        engine_args = EngineArgs.from_cli_args(args).check()
    except ValueError as exc:
        sys.exit("jetserve serve: %s" % exc)
    core_process = None
    if getattr(args, "backend", None) == "torch" and getattr(args, "engine_core_process", False):
        # Before anything heavy is imported here: the core imports torch and the model's modules
        # while this process imports its own and makes the configuration (core_process.py).
        from jetserve.engine.core_process import CoreProcess

        core_process = CoreProcess.start()
    import asyncio

    from jetserve.engine import open_engine
    from jetserve.server.app import StartError, serve

    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    engine_args = apply_compat_gate(engine_args)
    options = from_args(ServeOptions, args, api_key=_token(args.api_key, args.api_key_file, "--api-key-file"),
                        control_api_key=_token(None, args.control_api_key_file, "--control-api-key-file"))
    try:
        return asyncio.run(serve(lambda on_status: open_engine(engine_args.resolve(), on_status=on_status,
                                                               core_process=core_process), options))
    except StartError as exc:
        sys.exit("jetserve serve: %s" % exc)


def _token(api_key, path, flag):
    """auth.read_token, with a token file that is missing, unreadable, empty or open to others
    refused in one line naming the flag."""
    from jetserve.server.auth import read_token

    try:
        return read_token(api_key, path, flag)
    except OSError as exc:
        sys.exit("jetserve serve: %s %s: %s" % (flag, path, exc.strerror or exc))
    except ValueError as exc:  # UnicodeDecodeError too
        sys.exit("jetserve serve: %s" % (exc if not isinstance(exc, UnicodeDecodeError)
                                         else "%s %s is not UTF-8 text" % (flag, path)))


def apply_compat_gate(engine_args, sysroot="/"):
    """Run eager where the agent's compatibility gate forbids CUDA graphs (JetPack < 5.1)."""
    import dataclasses

    log = logging.getLogger("jetserve.server")
    if engine_args.enforce_eager:
        return engine_args
    try:
        from jetserve.device.compat import check
        from jetserve.device.probe import probe

        verdict = check(probe(sysroot))
    except (ImportError, OSError, ValueError) as exc:
        log.warning("compatibility gate unavailable (%s): CUDA graphs as the flags say", exc)
        return engine_args
    if verdict.cuda_graphs_allowed:
        return engine_args
    reasons = "; ".join(c.detail for c in verdict.checks if c.status != "ok")
    log.warning("CUDA graphs are not allowed on this device (%s): running with --enforce-eager", reasons)
    return dataclasses.replace(engine_args, enforce_eager=True)
