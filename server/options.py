"""`ServeOptions`: the service's settings (listeners, tokens, TLS, drain), one field each.

The fields are `jetserve serve`'s "service" flags and the keys of `[serve]` in the TOML file
(jetserve.config.setting); the engine's are `EngineArgs`. Standard library only and Python 3.8
syntax: `jetserve --help` builds the flags from here on a device without grpc.
"""

from dataclasses import dataclass
from typing import Optional

from jetserve.config import DEFAULT_HOST, DEFAULT_PORT, log_level_setting, nonempty, port_number, seconds, setting


@dataclass
class ServeOptions:
    # Ports are checked here: grpcio takes a port modulo 65536 (70000 served on 4464). Addresses,
    # paths and tokens may not be '': an empty host binds every interface, an empty token or TLS
    # file turns auth or TLS off, without a word.
    host: str = setting(DEFAULT_HOST, "address of every listener", type=nonempty)
    port: int = setting(DEFAULT_PORT, "gRPC port, 0 = any free one (JetServer.port tells which)", type=port_number)
    openai_port: int = setting(8000, "OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, "
                                     "/v1/models, /health), 0 = off (default: %(default)s, vLLM's)", type=port_number)
    unix_socket: Optional[str] = setting(None, "also listen on this Unix socket (local clients)", type=nonempty,
                                         metavar="PATH")
    metrics_port: int = setting(9400, "Prometheus endpoint port, 0 = off", type=port_number)
    api_key: Optional[str] = setting(None, "require 'authorization: Bearer KEY' (visible in ps: prefer --api-key-file)",
                                     type=nonempty)
    api_key_file: Optional[str] = setting(None, "read the bearer token from the first line of FILE "
                                                "(mode 600: a file others can read is refused)", type=nonempty,
                                            metavar="FILE")
    control_api_key_file: Optional[str] = setting(
        None, "ControlService's own token (drain, limits); without it Control is served on --unix-socket "
              "when only the service's user can connect to it (and, with no --api-key, on loopback), never "
              "on the inference token", type=nonempty, metavar="FILE")
    # Plain HTTP without auth: loopback unless asked otherwise.
    metrics_host: str = setting(DEFAULT_HOST, "address of the plain-HTTP metrics endpoint", type=nonempty)
    tls_cert: Optional[str] = setting(None, "serve TLS with this certificate chain (needs --tls-key)", type=nonempty,
                                      metavar="PEM")
    tls_key: Optional[str] = setting(None, "private key of --tls-cert", type=nonempty, metavar="PEM")
    tls_client_ca: Optional[str] = setting(None, "require client certificates signed by this CA (mTLS)",
                                           type=nonempty, metavar="PEM")
    drain_grace_period: float = setting(30.0, "on SIGTERM, how long open streams may finish", type=seconds,
                                        metavar="SECONDS")
    log_level: str = log_level_setting()
    # No flag (a token on the command line is visible in ps): read from control_api_key_file.
    control_api_key: Optional[str] = None  # None: Control only from local peers (auth.control_refusal)
