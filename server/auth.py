"""Bearer-token checks: the inference token for inference, the control plane's own credential for
Control, nothing for health (probes need no secret).

Clients send `authorization: Bearer <token>` metadata; the comparison is constant-time. Control
(drain, limits) must not ride on the token every kiosk holds: with `--control-api-key-file` it
takes that token alone; without one it is served to local peers only (the Unix socket,
loopback), which is where the device's agent runs.
"""

from __future__ import annotations

import hmac
import os
import stat

import grpc

# Load balancers, systemd helpers and the agent's liveness probe call health without a token.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
CONTROL_PREFIX = "/jetserve.v1.ControlService/"
# What the control token opens besides Control: the read-only calls the agent makes.
CONTROL_READS = ("/jetserve.v1.InferenceService/GetStats", "/jetserve.v1.InferenceService/GetModelInfo")
LOCAL_PEERS = ("unix:", "ipv4:127.", "ipv6:[::1]")


async def _deny(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token (metadata 'authorization: Bearer <token>')")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """`token` guards inference (and Control when it has no token of its own); `control_token`,
    when given, is the only credential Control accepts."""

    def __init__(self, token: str | None, control_token: str | None = None):
        self._expected = ("Bearer " + token).encode() if token else None
        self._control = ("Bearer " + control_token).encode() if control_token else None
        # A unary handler answers streaming methods too: the client just sees the status.
        self._denied = grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        control = method.startswith(CONTROL_PREFIX)
        accepted = [self._control] if control and self._control else [self._expected]
        if self._control and method in CONTROL_READS:
            accepted.append(self._control)
        if None in accepted:  # no token guards this method
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        offered = metadata.get("authorization", "")
        if isinstance(offered, str):
            offered = offered.encode()
        if any(hmac.compare_digest(offered, token) for token in accepted):
            return await continuation(handler_call_details)
        return self._denied


def is_local_peer(peer: str) -> bool:
    """Whether a gRPC peer string names this machine (Unix socket or loopback)."""
    return peer.startswith(LOCAL_PEERS)


def read_token(api_key: str | None, api_key_file: str | None, flag: str = "--api-key-file") -> str | None:
    """The token from `--api-key` or the first line of a token file (kept out of `ps`). Like ssh
    with a private key, a file that other users can read is refused: the secret is spent."""
    if api_key_file:
        mode = os.stat(api_key_file).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError("%s %s is accessible by other users (mode %04o): chmod 600 it, owned by the "
                             "service's user" % (flag, api_key_file, stat.S_IMODE(mode)))
        with open(api_key_file, encoding="utf-8") as f:
            token = f.readline().strip()
        if not token:
            raise ValueError("%s %s is empty" % (flag, api_key_file))
        return token
    return api_key or None
