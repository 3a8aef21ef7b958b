"""What the service refuses before a request reaches the engine: malformed messages and oversized
fields, each with INVALID_ARGUMENT and a message that names the problem.

grpcio parses a request before the method runs, and a parse error surfaces as UNKNOWN
("Unexpected DecodeError"); the interceptor here parses it instead and answers the client.
It also takes a prompt's token ids out of the message as it parses (`WithTokenIds`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from jetserve.engine.prompts import token_array
from jetserve.v1 import inference_pb2 as pb

# Upper bounds of what one request may carry (docs/service.md, "Limits"). A message larger than
# MAX_MESSAGE_BYTES is refused by grpcio itself with RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = 4 * 2**20
MAX_REQUEST_ID_CHARS = 256
# A conversation's turns, through gRPC and HTTP alike: each is rendered by the chat template and
# tokenized before the prompt's length is known, so their number is bounded, not only their text.
MAX_CHAT_MESSAGES = 1024
_OWN_METHODS = "/jetserve.v1."


class _Malformed:
    """Stands in for a request that did not parse; the wrapped method answers INVALID_ARGUMENT."""

    def __init__(self, error: str):
        self.error = error


@dataclass(frozen=True)
class WithTokenIds:
    """A GenerateRequest whose token ids were moved, as it was parsed, into one int32 array
    beside the rest of the message (its `prompt` then unset). grpcio keeps what the parse
    returns for the whole call, and protobuf keeps packed ids in an arena that grows as they
    parse (to twice their int32s) and is freed only with the message: a queued prompt must not
    stay in it."""

    message: pb.GenerateRequest
    token_ids: array


def without_token_ids(message):
    """`message`, or a WithTokenIds of a copy without its token ids (those in an array)."""
    if not isinstance(message, pb.GenerateRequest) or message.WhichOneof("prompt") != "token_ids":
        return message
    ids = token_array(message.token_ids.ids)
    message.ClearField("token_ids")
    return WithTokenIds(pb.GenerateRequest.FromString(message.SerializeToString()), ids)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Parses jetserve's own unary-request methods leniently, so bad bytes (a varint that never
    ends, a length past the end, wire type 7, invalid UTF-8 in a string) get INVALID_ARGUMENT.
    Those that stream replies read their one request themselves: nothing of its bytes outlives
    its parse."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or handler.request_streaming or handler.request_deserializer is None
                or not handler_call_details.method.startswith(_OWN_METHODS)):
            return handler
        parse = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return without_token_ids(parse(data))
            except (DecodeError, ValueError) as exc:
                return _Malformed(str(exc) or type(exc).__name__)

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"malformed request message ({request.error}): not a valid protobuf "
                                f"encoding of the method's request type")

        if handler.unary_unary is not None:
            method = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Malformed):
                    return await refuse(request, context)
                return await method(request, context)

            return handler._replace(request_deserializer=lenient, unary_unary=unary)
        method = handler.unary_stream

        async def stream(requests, context):
            request = await context.read()  # a unary method's one message; its bytes are freed once parsed
            if request is grpc.aio.EOF:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message: the method takes one")
            if isinstance(request, _Malformed):
                await refuse(request, context)
            async for reply in method(request, context):
                yield reply

        # Served as a stream of requests (the same on the wire): grpcio's unary-request path keeps
        # the request's bytes as long as the call lasts, which for a queued prompt is its wait.
        return handler._replace(request_streaming=True, request_deserializer=lenient, unary_stream=None,
                                stream_stream=stream)


def check_request_id(request_id: str) -> str:
    """A client's request id is echoed in every message of its stream: bounded and printable."""
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters, got "
                         f"{len(request_id)} characters")
    return request_id


def check_messages(count: int) -> None:
    if count > MAX_CHAT_MESSAGES:
        raise ValueError(f"messages: at most {MAX_CHAT_MESSAGES} a conversation, got {count}")


def tokenized(prompt, engine):
    """A text prompt as {"prompt", "prompt_token_ids"}, for a worker thread: tokenizing a long
    prompt never stalls the event loop (health, other streams), and a text too long for
    max_model_len is refused by its length before any tokenizing; the engine only checks ids."""
    if isinstance(prompt, str) and engine.tokenizer is not None:
        return {"prompt": prompt,
                "prompt_token_ids": engine.tokenizer.encode_at_most(prompt, engine.model_info.max_model_len)}
    return prompt


def check_room(prompt, params, max_model_len: int, field: str = "max_tokens") -> None:
    """Refuse a max_tokens the context cannot hold, as vLLM does (a 400 naming both numbers),
    rather than quietly generating less than was asked. A prompt with no room at all is the
    engine's to refuse (FAILED_PRECONDITION); None asks for whatever room is left."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    if params.max_tokens is None or ids is None or len(ids) >= max_model_len:
        return
    room = max_model_len - len(ids)
    if params.max_tokens > room:
        raise ValueError(f"{field} is {params.max_tokens}, but only {room} tokens are left: max_model_len is "
                         f"{max_model_len} and the prompt has {len(ids)} tokens; ask for at most {room}")
