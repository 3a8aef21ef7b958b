"""gRPC client for the inference service: Control (drain, resume, limits), GetStats and health.

The standard `grpc.health.v1.Health/Check` is called as a raw unary call: its request with an
empty service name is zero bytes and its reply is one varint field, so the agent does not need
grpcio-health-checking (which the base install does not carry).
"""

import grpc
from google.protobuf.json_format import MessageToDict

from jetserve.config import read_secret
from jetserve.v1 import inference_pb2, inference_pb2_grpc

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


class ServiceError(RuntimeError):
    def __init__(self, message, code=None):
        RuntimeError.__init__(self, message)
        self.code = code


def _serving_status(reply):
    """Decode HealthCheckResponse: field 1 (varint) is the status; absent means 0."""
    if len(reply) >= 2 and reply[0] == 0x08:
        return SERVING_STATUS.get(reply[1], "UNKNOWN")
    return SERVING_STATUS[0]


def _reply_dict(reply):
    return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def read_control_token(path):
    """The service's control-plane token (`--control-api-key-file` there), or None without a file."""
    if not path:
        return None
    try:  # not held to mode 600: the service's user owns it, and the agent may run as another
        return read_secret(path, "--service-token-file", private=False)
    except OSError as exc:
        raise ValueError("--service-token-file %s: %s" % (path, exc.strerror or exc))


class ServiceClient:
    """`control_token`: sent on every call when the service has a control-plane token; without
    one the service answers Control to local peers only, which is where the agent runs."""

    def __init__(self, address, timeout=2.0, control_token=None):
        self.address, self.timeout = address, timeout
        self._metadata = (("authorization", "Bearer " + control_token),) if control_token else ()
        self._channel = grpc.insecure_channel(address)
        self._control = inference_pb2_grpc.ControlServiceStub(self._channel)
        self._inference = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._health = self._channel.unary_unary(HEALTH_CHECK)

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise ServiceError("%s: %s %s" % (self.address, exc.code().name, exc.details() or ""),
                               exc.code())

    def health(self):
        """SERVING / NOT_SERVING / ...; UNKNOWN when the service has no health endpoint."""
        try:
            return _serving_status(self._call(self._health, b""))
        except ServiceError as exc:
            if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                return SERVING_STATUS[0]
            raise

    def stats(self):
        return _reply_dict(self._call(self._inference.GetStats, inference_pb2.GetStatsRequest()))

    def drain(self):
        return _reply_dict(self._call(self._control.Drain, inference_pb2.DrainRequest()))

    def resume(self):
        return _reply_dict(self._call(self._control.Resume, inference_pb2.ResumeRequest()))

    def set_limits(self, max_num_seqs=None, num_speculative_tokens=None):
        """Values above what the service started with are refused here, before it sees them
        (a service too old to say its limits gets the request and judges it itself)."""
        try:
            info = self._call(self._inference.GetModelInfo, inference_pb2.GetModelInfoRequest())
        except ServiceError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            info = inference_pb2.GetModelInfoResponse()  # says no limits: the service judges
        for name, value, limit in (("max_num_seqs", max_num_seqs, info.max_num_seqs_limit),
                                   ("num_speculative_tokens", num_speculative_tokens,
                                    info.num_speculative_tokens_limit)):
            if value is not None and info.max_num_seqs_limit and value > limit:
                raise ServiceError("set-limits: %s=%d is above %d, what the service at %s started with"
                                   % (name, value, limit, self.address), grpc.StatusCode.INVALID_ARGUMENT)
        request = inference_pb2.SetLimitsRequest(max_num_seqs=max_num_seqs,
                                                 num_speculative_tokens=num_speculative_tokens)
        return _reply_dict(self._call(self._control.SetLimits, request))

    def snapshot(self):
        """Health and stats for the health document; an unreachable service is a value, not an error."""
        try:
            stats = self.stats()
            return {"address": self.address, "health": self.health(), "stats": stats, "error": None}
        except ServiceError as exc:
            return {"address": self.address, "health": "UNREACHABLE", "stats": None, "error": str(exc)}

    def close(self):
        self._channel.close()
