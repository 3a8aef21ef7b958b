"""Bearer-token check for every RPC except health, so probes need no secret.

Clients send `authorization: Bearer <token>` metadata. The comparison is constant-time.
"""

from __future__ import annotations

import hmac

import grpc

# Load balancers, systemd helpers and the agent's liveness probe call health without a token.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


async def _deny(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token (metadata 'authorization: Bearer <token>')")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = ("Bearer " + token).encode()
        # A unary handler answers streaming methods too: the client just sees the status.
        self._denied = grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        offered = metadata.get("authorization", "")
        if isinstance(offered, str):
            offered = offered.encode()
        if hmac.compare_digest(offered, self._expected):
            return await continuation(handler_call_details)
        return self._denied


def read_token(api_key: str | None, api_key_file: str | None) -> str | None:
    """The token from `--api-key` or the first line of `--api-key-file` (kept out of `ps`)."""
    if api_key_file:
        with open(api_key_file, encoding="utf-8") as f:
            token = f.readline().strip()
        if not token:
            raise ValueError("--api-key-file %s is empty" % api_key_file)
        return token
    return api_key or None
