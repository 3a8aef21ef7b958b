"""Bearer-token checks: the inference token for inference, the control plane's own credential for
Control, nothing for health (probes need no secret).

Clients send `authorization: Bearer <token>` metadata; the comparison is constant-time. Control
(drain, limits) must not ride on the token every kiosk holds, and a kiosk app is a local peer too:
once any token is set, Control takes the control token (`--control-api-key-file`) or a peer on a
Unix socket that only the service's user (and root) can connect to, never the inference token and
never loopback TCP. With no token at all, Control is served to local peers (Unix socket, loopback).
"""

from __future__ import annotations

import hmac
import os
import stat

import grpc

from jetserve.config import read_secret

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
    """`token` guards inference; `control_token` also opens the agent's reads. Control itself is
    let through to its servicer, which decides from the peer as well (`control_refusal`): the
    interceptor does not see who is calling."""

    def __init__(self, token: str | None, control_token: str | None = None):
        self._expected = ("Bearer " + token).encode() if token else None
        self._control = ("Bearer " + control_token).encode() if control_token else None
        # A unary handler answers streaming methods too: the client just sees the status.
        self._denied = grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        if method.startswith(CONTROL_PREFIX):
            return await continuation(handler_call_details)
        accepted = [self._expected]
        if self._control and method in CONTROL_READS:
            accepted.append(self._control)
        if None in accepted:  # no token guards this method
            return await continuation(handler_call_details)
        if bearer_matches(handler_call_details.invocation_metadata, *accepted):
            return await continuation(handler_call_details)
        return self._denied


def bearer_matches(metadata, *tokens: bytes) -> bool:
    """Whether the call's `authorization` metadata is one of `tokens` (b"Bearer ...")."""
    offered = dict(metadata or ()).get("authorization", "")
    if isinstance(offered, str):
        offered = offered.encode()
    return any(hmac.compare_digest(offered, token) for token in tokens)


def unix_socket_exposure(path: str | None) -> str | None:
    """Why a peer on the Unix socket at `path` may be someone other than root or the service's user,
    or None if it may not. grpcio hands the servicer no socket to ask SO_PEERCRED of, so this asks
    what connect(2) itself checks: write permission on the socket file. A file owned by the
    service's user that group and others cannot write admits only that user and root."""
    if not path or path.startswith("@"):
        return "it is %s" % ("abstract (no file permissions)" if path else "not configured")
    try:
        st = os.stat(path)
    except OSError as exc:
        return "it cannot be checked (%s)" % exc.strerror
    if st.st_uid != os.geteuid():
        return "%s is owned by uid %d, not the service's uid %d" % (path, st.st_uid, os.geteuid())
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "%s (mode %04o) lets other users connect" % (path, stat.S_IMODE(st.st_mode))
    return None


def control_refusal(peer: str, metadata, api_key: str | None, control_key: str | None,
                    unix_socket: str | None):
    """None if this Control call may go on, else (status, message). Any token set: the control
    token, or the Unix socket when only the service's user and root can reach it. No token at all:
    local peers, as the agent on the device is one."""
    if control_key and bearer_matches(metadata, ("Bearer " + control_key).encode()):
        return None
    on_socket = peer.startswith("unix:")
    exposure = unix_socket_exposure(unix_socket) if on_socket else None
    if on_socket and exposure is None:
        return None
    if not api_key and not control_key:
        if is_local_peer(peer):
            return None
        return (grpc.StatusCode.PERMISSION_DENIED,
                "ControlService is served to local peers only (Unix socket, loopback) unless the server has "
                "--control-api-key-file")
    why = "; the Unix socket does not prove the caller (%s)" % exposure if exposure else ""
    if control_key:
        return (grpc.StatusCode.UNAUTHENTICATED,
                "ControlService needs the control token (--control-api-key-file), or the Unix socket of the "
                "service's user; the inference token does not open it" + why)
    return (grpc.StatusCode.PERMISSION_DENIED,
            "ControlService is served only on the Unix socket of the service's user (or with "
            "--control-api-key-file) when the server has an inference token; the inference token and "
            "loopback do not open it" + why)


def is_local_peer(peer: str) -> bool:
    """Whether a gRPC peer string names this machine (Unix socket or loopback)."""
    return peer.startswith(LOCAL_PEERS)


def read_token(api_key: str | None, api_key_file: str | None, flag: str = "--api-key-file") -> str | None:
    """The token from `--api-key` or the first line of a token file, which only its owner may
    read (`config.read_secret`)."""
    if api_key_file:
        return read_secret(api_key_file, flag)
    return api_key or None
