"""The terminal client behind `jetserve generate` and `jetserve chat`: stream text, then timing."""

from __future__ import annotations

import sys
import time

import grpc

from jetserve.config import read_file
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

MAX_PEM_BYTES = 1 << 20  # a certificate chain or key: far below; /dev/zero named by mistake: refused


def connect(args) -> pb_grpc.InferenceServiceStub:
    """A stub for `--target` (host:port or unix:/path), over TLS when `--tls-ca` is given."""
    if args.tls_ca:
        read = lambda path: read_file(path, MAX_PEM_BYTES) if path else None  # noqa: E731
        credentials = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))
        channel = grpc.secure_channel(args.target, credentials)
    else:
        channel = grpc.insecure_channel(args.target)
    return pb_grpc.InferenceServiceStub(channel)


def sampling(args) -> pb.SamplingOptions:
    options = pb.SamplingOptions(max_tokens=args.max_tokens, stop=args.stop or [], ignore_eos=args.ignore_eos)
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(options, name, getattr(args, name))
    return options


def metadata(args):
    return (("authorization", "Bearer " + args.api_key),) if args.api_key else ()


def stream(responses, out=sys.stdout, err=sys.stderr) -> str:
    """Print deltas as they come; end with TTFT and decode speed on stderr. Returns the text."""
    start = time.monotonic()
    first = last = None
    tokens = 0
    pieces = []
    reason = pb.FINISH_REASON_UNSPECIFIED
    for reply in responses:
        reason = reply.finish_reason or reason
        if reply.token_ids:
            last = time.monotonic()
            first = first or last
            tokens += len(reply.token_ids)
        pieces.append(reply.text)
        out.write(reply.text)
        out.flush()
    out.write("\n")
    # "length" says the reply was cut (max_tokens, or the end of max_model_len), "stop" that it ended.
    finish = pb.FinishReason.Name(reason).replace("FINISH_REASON_", "").lower()
    if first is None:
        err.write("(no tokens), finish_reason %s\n" % finish)
    else:
        # Decode speed: the tokens after the first, over the time after the first.
        rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
        err.write("%d tokens, finish_reason %s, TTFT %.0f ms, %.1f tok/s\n"
                  % (tokens, finish, (first - start) * 1e3, rate))
    return "".join(pieces)


def generate(args) -> int:
    stub = connect(args)
    request = pb.GenerateRequest(text=args.prompt, sampling=sampling(args))
    return _run(lambda: stream(stub.Generate(request, metadata=metadata(args))), args.target)


def chat(args) -> int:
    """One reply to `message`, or a conversation read from stdin line by line when none is given."""
    stub = connect(args)
    messages = [pb.ChatMessage(role="system", content=args.system)] if args.system else []

    def turn(text):
        messages.append(pb.ChatMessage(role="user", content=text))
        request = pb.ChatRequest(messages=messages, sampling=sampling(args))
        answer = stream(stub.Chat(request, metadata=metadata(args)))
        messages.append(pb.ChatMessage(role="assistant", content=answer))

    if args.message:
        return _run(lambda: turn(args.message), args.target)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        if line.strip():
            if not interactive:  # a transcript: each question above its reply, a blank line between turns
                sys.stdout.write("> %s\n" % line.strip())
            status = _run(lambda: turn(line.strip()), args.target)
            if not interactive:
                sys.stdout.write("\n")
            if status:
                return status


def _run(call, target: str) -> int:
    try:
        call()
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (exc.details() or ""):
            # gRPC's own words list addresses and errno text; what the user needs is the next step.
            sys.stderr.write("error: no server answers at %s: start one with `jetserve serve`, or pass --target "
                             "(%s)\n" % (target, exc.details()))
        else:
            sys.stderr.write("error: %s: %s\n" % (exc.code().name, exc.details()))
        return 1
    return 0
