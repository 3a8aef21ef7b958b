"""Which gRPC status an exception becomes. The message always names the field or the cause;
a traceback never reaches the client, it goes to the log."""

from __future__ import annotations

import logging

import grpc

from jetserve.engine.errors import EngineError, NoChatTemplateError, PromptTooLongError, QueueFullError

log = logging.getLogger(__name__)


class RpcError(Exception):
    """Raised by the servicers for conditions they detect themselves."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, RpcError):
        return exc.code, str(exc)
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    # Both subclass ValueError, so they come first.
    if isinstance(exc, (PromptTooLongError, NoChatTemplateError)):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, EngineError):
        return grpc.StatusCode.UNAVAILABLE, "engine stopped: %s" % exc
    log.error("unexpected error while serving a request", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error: %s (details in the server log)" % type(exc).__name__
