"""OpenAI-compatible HTTP API (`/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`)
on FastAPI + uvicorn, as vLLM serves it.

It shares the one engine with gRPC through `JetServer.stream` (admission, drain, metrics) and
depends only on the engine's streaming contract. Errors use OpenAI's JSON shape, with the HTTP
code each gRPC status maps to.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
import socket
import ssl
import time
import uuid

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from jetserve import fdbudget
from jetserve.server.errors import RpcError, status_for
from jetserve.engine.prompts import token_array
from jetserve.server.guard import MAX_MESSAGE_BYTES, check_room, tokenized
from jetserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest

# What gRPC takes in a message, in JSON's longer spelling of token ids (~7 bytes an id against ~3).
MAX_BODY_BYTES = 4 * MAX_MESSAGE_BYTES
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never read by the client that left
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
}
OPEN_PATHS = ("/health",)  # probes need no secret, as gRPC health
REQUEST_DEADLINE_S = 10.0  # a connection must deliver each request (headers and body) within this
REFUSAL = fdbudget.http_refusal(json.dumps({"error": {
    "message": "the server is at its connection limit; retry in a moment", "type": "service_unavailable",
    "param": None, "code": 503}}).encode(), "application/json")


def error_response(status: int, kind: str, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


# A bad value's message starts with the field it names ("SamplingParams.temperature must ...",
# "logit_bias: keys ...", "max_tokens is ..."): that field is OpenAI's `param`.
_NAMED_FIELD = re.compile(r"^(?:SamplingParams\.)?([a-z_]+)\b")
_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)


def param_of(message: str) -> str | None:
    match = _NAMED_FIELD.match(message)
    return match.group(1) if match and match.group(1) in _FIELDS else None


def error_for(exc: BaseException) -> JSONResponse:
    """The one classification of errors (status_for, shared with gRPC), in OpenAI's shape."""
    code, message = status_for(exc)
    status, kind = HTTP_STATUS.get(code, (500, "server_error"))
    return error_response(status, kind, message, param_of(message) if status == 400 else None)


def sse(payload) -> str:
    return "data: %s\n\n" % (payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":")))


class _Server(uvicorn.Server):
    """JetServer owns the signals (SIGTERM drains both front ends); uvicorn must not take them."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def make_http_server(app, options, max_connections: int) -> tuple[uvicorn.Server, socket.socket]:
    """The server and its bound socket, which keeps to `max_connections` (at the cap a newcomer takes
    an idle connection's place, or gets a 503 at once). A port in use or a bad certificate fail
    here, as OSError or ssl.SSLError, not later inside uvicorn (which would exit the process)."""
    tls = {}
    if options.tls_cert:
        tls = dict(ssl_certfile=options.tls_cert, ssl_keyfile=options.tls_key)
        if options.tls_client_ca:
            tls.update(ssl_ca_certs=options.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(app, host=options.host, port=options.openai_port, lifespan="off",
                            http=fdbudget.http_protocol(REQUEST_DEADLINE_S), log_level="warning",
                            access_log=False, timeout_graceful_shutdown=1, **tls)
    config.load()
    sock = fdbudget.listen(options.host, options.openai_port, max_connections, None if tls else REFUSAL)
    server = _Server(config)
    sock.connections = server.server_state.connections
    return server, sock


class Guard:
    """ASGI middleware: the bearer token (constant-time, as gRPC's), and any error a route raises
    as OpenAI's JSON with its HTTP code (never a traceback to the client)."""

    def __init__(self, app, expected: bytes | None):
        self.app, self.expected = app, expected

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            offered = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(offered, self.expected):
                denied = error_response(401, "authentication_error",
                                        "missing or wrong bearer token (header 'Authorization: Bearer <token>')")
                return await denied(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - status_for logs the unexpected ones
            if started:
                raise
            await error_for(exc)(scope, receive, send)


def create_app(server) -> FastAPI:
    """`server` is the JetServer: its engine, `stream`, drain state and options."""
    app = FastAPI(title="jetserve", docs_url=None, redoc_url=None, openapi_url=None)
    expected = ("Bearer " + server.options.api_key).encode() if server.options.api_key else None

    app.add_middleware(Guard, expected=expected)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # no field to name: where the JSON broke
            return error_response(400, "invalid_request_error", "the request body is not valid JSON: %s"
                                  % first.get("ctx", {}).get("error", "decode error"))
        where = ".".join(str(part) for part in first.get("loc", ())[1:])
        # A validator's own words, without pydantic's "Value error, " before them.
        why = str(first["ctx"]["error"]) if first.get("type") == "value_error" else first.get("msg", "invalid")
        return error_response(400, "invalid_request_error", "%s: %s" % (where or "body", why), where or None)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error_response(exc.status_code, "invalid_request_error", str(exc.detail))

    @app.get("/health")
    async def health():
        """200 while serving; 503 while loading, draining or when the engine stopped turning."""
        if server.engine_alive and not server.draining:
            return JSONResponse({"status": "SERVING"})
        return JSONResponse({"status": "NOT_SERVING"}, status_code=503)

    @app.get("/v1/models")
    async def models():
        engine = server.loaded()
        return {"object": "list", "data": [model_card(server, engine)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        engine = server.loaded()
        check_model(server, name)
        return model_card(server, engine)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parsed_body(request, CompletionRequest)
        engine = server.loaded()
        check_model(server, body.model)
        if body.echo or body.suffix:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "echo and suffix are not supported")
        if body.best_of is not None and body.best_of != body.n:  # ignored, it would promise a choice never made
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"best_of={body.best_of} is not supported: every one "
                           f"of the n={body.n} samples is returned (leave best_of unset, or equal to n)")
        params = body.sampling_params(body.max_tokens, body.logprobs)
        prompts = body.prompts()
        body.prompt = ""  # its token lists live on as int32 arrays, not as Python ints, from here on
        prompts = [await asyncio.to_thread(tokenized, prompt, engine) for prompt in prompts]
        for prompt in prompts:
            check_room(prompt, params, engine.model_info.max_model_len)
        return await respond(request, server, body, "cmpl", prompts, params, engine, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parsed_body(request, ChatCompletionRequest)
        engine = server.loaded()
        check_model(server, body.model)
        if engine.tokenizer is None:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer, so no chat template")
        body.refuse_unsupported()
        params = body.sampling_params(body.requested_max_tokens(), body.requested_logprobs())
        # Off the event loop; message content never becomes control tokens (no forged turns).
        text, ids = await asyncio.to_thread(engine.tokenizer.encode_chat, [m.as_dict() for m in body.messages],
                                            max_tokens=engine.model_info.max_model_len)
        prompt = {"prompt": text, "prompt_token_ids": token_array(ids)}
        check_room(prompt, params, engine.model_info.max_model_len,
                   "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        return await respond(request, server, body, "chatcmpl", [prompt], params, engine, chat=True)

    return app


async def parsed_body(request: Request, model: type[BaseModel]):
    """The JSON body as `model`, read here rather than by FastAPI: a route's body parameter keeps
    FastAPI's decoded JSON alive while the route runs, which for a token prompt is a Python int
    and list slots an id, several times the id's bytes on the wire, for as long as the request
    waits in the queue. Here pydantic reads the bytes itself, the route keeps only the model, and
    a body past MAX_BODY_BYTES is refused (413) before it is read whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HTTPException(413, "the request body is %s bytes; at most %d are taken" % (declared, MAX_BODY_BYTES))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HTTPException(413, "the request body is over %d bytes" % MAX_BODY_BYTES)
        chunks.append(chunk)
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as exc:  # answered as FastAPI's own validation errors are (invalid_body)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                      for e in exc.errors(include_url=False)]) from None


def model_card(server, engine) -> dict:
    return {"id": server.model_name, "object": "model", "created": int(server.started_at), "owned_by": "jetserve",
            "max_model_len": engine.model_info.max_model_len}


def check_model(server, name: str | None) -> None:
    if name and name != server.model_name:
        raise RpcError(grpc.StatusCode.NOT_FOUND, "model %r does not exist; this server serves %r"
                       % (name, server.model_name))


async def respond(request: Request, server, body, kind: str, prompts: list, params, engine, chat: bool):
    """Start one engine request per prompt; the first delta of each is awaited here, so a request
    the engine refuses gets its HTTP error before any streaming starts. Until the response
    starts, a client that leaves (a request queued behind others, a long non-streamed one) ends
    the engine's work at once, not when the work would have answered."""
    rid = "%s-%s" % (kind, uuid.uuid4().hex)
    streams = [server.stream(prompt, params, "%s-%d" % (rid, i)) for i, prompt in enumerate(prompts)]
    disconnected = asyncio.ensure_future(wait_disconnected(request))
    firsts = None
    try:
        firsts = await until_disconnected(first_deltas(streams), disconnected)
    finally:
        if firsts is None:  # refused, or the client left
            disconnected.cancel()
            for stream in streams:
                await stream.aclose()
    if firsts is None:
        return Response(status_code=CLIENT_CLOSED)
    shape = (Chat if chat else Completion)(rid, server.model_name, params.n, params.logprobs)
    if body.stream:  # from here Starlette watches the connection
        disconnected.cancel()
        return StreamingResponse(stream_events(shape, streams, firsts, body.include_usage),
                                 media_type="text/event-stream")
    try:  # collect_all closes the streams however it ends
        result = await until_disconnected(collect_all(shape, streams, firsts), disconnected)
    finally:
        disconnected.cancel()
    return JSONResponse(result) if result is not None else Response(status_code=CLIENT_CLOSED)


async def first_deltas(streams) -> list:
    return [await anext(stream) for stream in streams]


async def until_disconnected(work, disconnected: asyncio.Future):
    """`work`'s result, or None once the client has gone (the work cancelled and awaited)."""
    task = asyncio.ensure_future(work)
    await asyncio.wait([task, disconnected], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def wait_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _deltas(stream, first):
    yield first
    async for out in stream:
        yield out


async def merged(streams, firsts):
    """(prompt index, delta) from every prompt's stream as they come. However this ends (done,
    an error, the client gone), every stream is closed, which aborts what is still running."""
    if len(streams) == 1:
        try:
            async for out in _deltas(streams[0], firsts[0]):
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i):
        try:
            async for out in _deltas(streams[i], firsts[i]):
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        open_streams = len(streams)
        while open_streams:
            i, out = await queue.get()
            if out is None:
                open_streams -= 1
            else:
                yield i, out
        for task in tasks:
            task.result()  # an engine error in one stream is the request's error
    finally:
        # Shielded: a cancelled response (the client left) must still close every stream.
        await asyncio.shield(asyncio.ensure_future(_close(tasks, streams)))


async def _close(tasks, streams) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for stream in streams:
        await stream.aclose()


async def collect_all(shape, streams, firsts) -> dict:
    async for i, out in merged(streams, firsts):
        shape.add(i, out)
    return shape.response()


async def stream_events(shape, streams, firsts, include_usage: bool):
    try:
        async for chunk in shape.start_chunks():
            yield sse(chunk)
        async for i, out in merged(streams, firsts):
            for chunk in shape.chunks(i, out):
                yield sse(chunk)
        if include_usage:
            yield sse(shape.usage_chunk())
    except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream
        yield sse(json.loads(error_for(exc).body))
    yield sse("[DONE]")


class _Shape:
    """Accumulates a response from deltas; Chat and Completion differ only in how choices look."""

    object_name = ""
    chunk_name = ""

    def __init__(self, rid: str, model: str, n: int, num_logprobs: int | None):
        self.rid, self.model, self.n, self.num_logprobs = rid, model, n, num_logprobs
        self.created = int(time.time())
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens = 0
        self.choices: dict[int, dict] = {}
        self.prompt_logprobs: dict[int, list] = {}  # by prompt, with vLLM's prompt_logprobs

    def _index(self, i: int, output) -> int:
        return i * self.n + output.index

    def _count(self, i: int, out) -> list | None:
        """Count a delta's tokens; returns its prompt logprobs (vLLM's form) if it brings them."""
        self.prompt_tokens[i] = len(out.prompt_token_ids)
        self.completion_tokens += sum(len(o.token_ids) for o in out.outputs)
        if out.prompt_logprobs is None:
            return None
        self.prompt_logprobs[i] = [None if entry is None else {
            str(t): {"logprob": c.logprob, "rank": c.rank, "decoded_token": c.decoded_token} for t, c in entry.items()}
            for entry in out.prompt_logprobs]
        return self.prompt_logprobs[i]

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    def usage_chunk(self) -> dict:
        return {"id": self.rid, "object": self.chunk_name, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}

    def response(self) -> dict:
        return {"id": self.rid, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": [self.choices[k] for k in sorted(self.choices)], "usage": self.usage()}

    def chunks(self, i, out):
        """One SSE chunk for a delta of completion set `i`: each output as a choice in this shape's
        form; prompt logprobs (vLLM's extension) in the first chunk of the prompt's first choice."""
        prompt_logprobs = self._count(i, out)
        choices = []
        for o in out.outputs:
            choice = {"index": self._index(i, o), **self._delta(o), "logprobs": None, "finish_reason": o.finish_reason}
            self._add_logprobs(choice, o)
            choices.append(choice)
        if prompt_logprobs is not None:
            choices[0]["prompt_logprobs"] = prompt_logprobs
        return [self._chunk(choices)]

    def _chunk(self, choices) -> dict:
        return {"id": self.rid, "object": self.chunk_name, "created": self.created, "model": self.model,
                "choices": choices}

    async def start_chunks(self):
        return
        yield


class Completion(_Shape):
    object_name = chunk_name = "text_completion"

    def response(self) -> dict:
        """vLLM's: each choice carries its prompt's prompt_logprobs when they were asked for."""
        body = super().response()
        for choice in body["choices"]:
            prompt = choice["index"] // self.n
            if prompt in self.prompt_logprobs:
                choice["prompt_logprobs"] = self.prompt_logprobs[prompt]
        return body

    def add(self, i, out) -> None:
        self._count(i, out)
        for o in out.outputs:
            choice = self.choices.setdefault(self._index(i, o), {
                "index": self._index(i, o), "text": "", "logprobs": None, "finish_reason": None})
            choice["text"] += o.text
            self._add_logprobs(choice, o)
            choice["finish_reason"] = o.finish_reason

    def _delta(self, output) -> dict:
        return {"text": output.text}

    def _add_logprobs(self, choice, output) -> None:
        entries = getattr(output, "logprobs", None)
        if entries is None:
            return
        lp = choice["logprobs"] = choice["logprobs"] or {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else 0
        for token_id, candidates in zip(output.token_ids, entries):
            token = candidates[token_id].decoded_token
            lp["tokens"].append(token)
            lp["token_logprobs"].append(candidates[token_id].logprob)
            lp["top_logprobs"].append({c.decoded_token: c.logprob for t, c in candidates.items()
                                       if c.rank <= self.num_logprobs or t == token_id})  # vLLM's: N and the token
            lp["text_offset"].append(offset)
            offset += len(token)


class Chat(_Shape):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def response(self) -> dict:
        """vLLM's: the conversation's prompt_logprobs beside the choices when they were asked for."""
        body = super().response()
        if self.prompt_logprobs:
            body["prompt_logprobs"] = self.prompt_logprobs[0]
        return body

    def add(self, i, out) -> None:
        self._count(i, out)
        for o in out.outputs:
            choice = self.choices.setdefault(self._index(i, o), {
                "index": self._index(i, o), "message": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None})
            choice["message"]["content"] += o.text
            self._add_logprobs(choice, o)
            choice["finish_reason"] = o.finish_reason

    async def start_chunks(self):
        """OpenAI's first chunk of each choice carries the role."""
        yield self._chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for k in range(self.n)])

    def _delta(self, output) -> dict:
        return {"delta": {"content": output.text} if output.text else {}}

    def _add_logprobs(self, choice, output) -> None:
        entries = getattr(output, "logprobs", None)
        if entries is None:
            return
        lp = choice["logprobs"] = choice["logprobs"] or {"content": []}
        for token_id, candidates in zip(output.token_ids, entries):
            lp["content"].append({**self._entry(candidates[token_id]), "top_logprobs": [
                self._entry(c) for c in sorted(candidates.values(), key=lambda c: c.rank)
                if c.rank <= self.num_logprobs]})

    @staticmethod
    def _entry(candidate) -> dict:
        token = candidate.decoded_token
        return {"token": token, "logprob": candidate.logprob, "bytes": list(token.encode("utf-8"))}
