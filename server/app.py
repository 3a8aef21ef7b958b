"""The server's life: listen at once, load the engine in the background, serve, drain, stop.

Listening before the model is loaded lets health answer NOT_SERVING (and systemd show STATUS=
progress) during a load and CUDA-graph capture that take minutes on a Jetson.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import gc
import logging
import os
import signal
import socket
import threading
import time
from contextlib import aclosing
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jetserve import fdbudget, notify
from jetserve.engine import lifeline
from jetserve.server.auth import BearerTokenInterceptor, control_refusal
from jetserve.server.errors import RpcError
from jetserve.server.guard import MAX_MESSAGE_BYTES, MalformedRequestInterceptor
from jetserve.server.metrics import Metrics
from jetserve.server.options import ServeOptions
from jetserve.server.servicer import ControlServicer, InferenceServicer
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICES = tuple(pb.DESCRIPTOR.services_by_name[name].full_name for name in ("InferenceService", "ControlService"))
# The engine's step loop turns at least every 0.5 s even when idle; a heartbeat older than this
# (or than the watchdog period, if that is longer) means it is wedged or dead.
STALE_AFTER_S = 2.0
HEARTBEAT_CHECK_S = 0.1
# After the drain's grace period: time for the aborted streams' last messages to leave.
ABORT_FLUSH_S = 5.0
# How long a process left by a server killed outright may take to see it gone and exit (its
# lifeline ends it at once; freeing a loaded model's memory is what takes time).
ORPHAN_WAIT_S = 5.0
HURRIED_FLUSH_S = 0.5  # the same after a second stop signal: the operator wants out
DRAIN_REPORT_S = 5.0  # how often a drain says what it still waits for
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Connections each front end may hold (the fd budget may grant fewer), beside what the process opens
# after start: the engine's pipes and ZMQ sockets, the weights' files while they load, metrics scrapes.
MAX_CONNECTIONS = {"gRPC": 512, "OpenAI": 512}
RESERVE_FDS = 64
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not finished its gRPC handshake by then is closed


# A newcomer's first answer comes from the demo: say what to expect before it looks broken.
DEMO_NOTE = (" (the bundled demo: a 7.7M-parameter model trained on CPython's standard library; "
             "it continues any prompt with Python-looking text, it is not an assistant)")


def _is_demo(model) -> bool:
    from jetserve import demo_model_dir

    return Path(str(model)).resolve() == Path(demo_model_dir()).resolve()


class StartError(Exception):
    """The server cannot start (a port in use): one line for the operator, no traceback."""


def _credentials(options: ServeOptions):
    if not options.tls_cert:
        return None
    ca = Path(options.tls_client_ca).read_bytes() if options.tls_client_ca else None
    pair = (Path(options.tls_key).read_bytes(), Path(options.tls_cert).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def _refuse_if_taken(host: str, port: int, what: str) -> None:
    """Bind the port once ourselves, so a clash is one line; grpcio would first log its C core's
    own error for it, and uvicorn's socket would raise with a traceback."""
    if not port:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartError("%s: host %s cannot be resolved (%s)" % (what, host, exc.strerror)) from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no clash
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise StartError("%s port %d is in use: is another jetserve serving there? (--%s)"
                                     % (what, port, _FLAGS[what])) from None
                if exc.errno == errno.EACCES:
                    raise StartError("%s port %d needs privileges this user lacks (--%s)"
                                     % (what, port, _FLAGS[what])) from None
                # Anything else (e.g. no IPv6 here) is left for the server's own bind to judge.


_FLAGS = {"gRPC": "port", "metrics": "metrics-port", "OpenAI API": "openai-port"}


def _refuse_if_socket_taken(path: str) -> None:
    """A Unix socket someone answers on is in use; a stale file is grpcio's to replace."""
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return
    raise StartError("unix socket %s is in use: is another jetserve serving there?" % path)


def _load_in_thread(make_engine, on_status) -> asyncio.Future:
    """A daemon thread, unlike asyncio.to_thread, does not hold up a SIGTERM during a long load."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(method, value):
        if not future.done():  # not cancelled by a shutdown meanwhile
            method(value)

    def work():
        try:
            outcome = (future.set_result, make_engine(on_status))
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop
            outcome = (future.set_exception, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the event loop is gone: the server stopped during the load
            pass

    threading.Thread(target=work, name="jetserve-load", daemon=True).start()
    return future


class JetServer:
    """gRPC (Inference, Control, health, reflection) and metrics around one engine.

    `make_engine(on_status)` builds and returns the loaded engine (AsyncLLM); it runs in a thread.
    """

    def __init__(self, make_engine: Callable[[Callable[[str], None]], object], options: ServeOptions):
        self.options = options
        self.engine = None
        self.engine_alive = False  # its heartbeat is fresh
        self.draining = False
        self.stopping = False
        self.metrics = Metrics(lambda: self.engine)
        self.port: int | None = None
        self.address: str | None = None  # host:port once listening
        self.metrics_port: int | None = None
        self.openai_port: int | None = None
        self.started_at = time.time()
        self.loading: asyncio.Task | None = None
        self._make_engine = make_engine
        self._health = health.aio.HealthServicer()
        self._open: dict[str, object] = {}  # request id → engine: streams between admission and their last delta
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()  # a second SIGINT/SIGTERM: stop without the grace period
        self._grpc: grpc.aio.Server | None = None
        self._metrics_http = None
        self._openai_http = None  # uvicorn.Server
        self._openai_task: asyncio.Task | None = None
        self.budget: fdbudget.Budget | None = None
        self._heartbeat: asyncio.Task | None = None

    # -- what the front ends ask -------------------------------------------------------------

    @property
    def model_name(self) -> str | None:
        """The name clients and metrics use for the served model (None while loading)."""
        return self.metrics.model_name

    def loaded(self):
        if self.engine is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "model is still loading; retry when health says SERVING")
        return self.engine

    def authorize_control(self, context) -> None:
        """Control is the agent's: see auth.control_refusal for who may call it."""
        opts = self.options
        refused = control_refusal(context.peer(), context.invocation_metadata(), opts.api_key,
                                  opts.control_api_key, opts.unix_socket)
        if refused:
            raise RpcError(*refused)

    def admit(self):
        """The engine, if a new stream may start now."""
        if self.draining:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "server is draining: not accepting new streams")
        return self.loaded()

    async def stream(self, prompt, params, request_id: str):
        """One request's deltas, for every front end: admission (refused while draining), the open
        streams the drain waits for, metrics, and an abort in the engine if the consumer leaves early."""
        engine = self.admit()
        timer = self.metrics.request(params)
        self._open[request_id] = engine
        self._idle.clear()
        try:
            async with aclosing(engine.generate(prompt, params, request_id)) as outputs:
                async for out in outputs:
                    timer.observe(out)
                    yield out
        except (GeneratorExit, asyncio.CancelledError):
            timer.abandoned()
            raise
        finally:
            self._open.pop(request_id, None)
            if not self._open:
                self._idle.set()

    def abort_all(self) -> None:
        """End every open stream: each gets a last delta whose finish_reason is abort."""
        for request_id, engine in list(self._open.items()):
            engine.abort(request_id)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no stream is open; False if some still are after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def hurry(self) -> None:
        """Cut a drain short: what is still open is aborted now (the operator's second Ctrl-C)."""
        if not self._hurry.is_set():
            log.warning("second stop signal: not waiting for open streams")
        self._hurry.set()

    async def _wait_idle_unless_hurried(self, timeout: float) -> bool:
        """wait_idle, saying every few seconds what it still waits for; False once hurried."""
        deadline = time.monotonic() + timeout
        while not self._idle.is_set() and not self._hurry.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            idle, hurry = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._hurry.wait())
            await asyncio.wait([idle, hurry], timeout=min(left, DRAIN_REPORT_S), return_when=asyncio.FIRST_COMPLETED)
            idle.cancel()
            hurry.cancel()
            if self._open and not self._hurry.is_set() and deadline > time.monotonic():
                log.info("draining: %d stream(s) still open, %.0f s of the grace period left",
                         len(self._open), deadline - time.monotonic())
        return self._idle.is_set()

    async def set_draining(self, draining: bool) -> None:
        if not draining and self.stopping:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "server is shutting down; it cannot resume")
        self.draining = draining
        await self._update_health()

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Clear what a server killed outright left, listen on every configured address, then start
        loading the engine."""
        opts = self.options
        held = await asyncio.to_thread(lifeline.clear_stale, ORPHAN_WAIT_S)
        if held:  # a second model beside it would not fit in the memory the CPU and GPU share
            pids = " ".join(str(pid) for _, found in held for pid in found)
            raise StartError("process %s, started by an earlier jetserve server that is gone, still runs "
                             "(holding the model it loaded): stop it (kill %s) and start again" % (pids, pids))
        token_check = [BearerTokenInterceptor(opts.api_key, opts.control_api_key)] \
            if opts.api_key or opts.control_api_key else []
        try:
            self.budget = fdbudget.Budget({name: n for name, n in MAX_CONNECTIONS.items()
                                           if name == "gRPC" or opts.openai_port}, RESERVE_FDS)
        except ValueError as exc:
            raise StartError(str(exc)) from None
        log.info("%s", self.budget)
        # grpcio turns SO_REUSEPORT on by default: a second server would silently share the port.
        self._grpc = grpc.aio.server(interceptors=token_check + [MalformedRequestInterceptor()],
                                     options=[("grpc.so_reuseport", 0),
                                              ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
                                     + fdbudget.grpc_options(self.budget.caps["gRPC"], HANDSHAKE_TIMEOUT_S))
        pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(self), self._grpc)
        pb_grpc.add_ControlServiceServicer_to_server(ControlServicer(self), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(SERVICES + (health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc)
        await self._update_health()

        host = "[%s]" % opts.host if ":" in opts.host and not opts.host.startswith("[") else opts.host
        address = "%s:%d" % (host, opts.port)
        credentials = _credentials(opts)
        _refuse_if_taken(opts.host, opts.port, "gRPC")
        if opts.metrics_port:
            _refuse_if_taken(opts.metrics_host, opts.metrics_port, "metrics")
        if opts.openai_port:
            _refuse_if_taken(opts.host, opts.openai_port, "OpenAI API")
        if opts.unix_socket:
            _refuse_if_socket_taken(opts.unix_socket)
        try:
            if credentials is not None:
                self.port = self._grpc.add_secure_port(address, credentials)
            else:
                self.port = self._grpc.add_insecure_port(address)
        except RuntimeError:
            raise StartError("port %d is in use (or %s cannot be bound): is another jetserve serving there?"
                             % (opts.port, host)) from None
        if opts.unix_socket:  # local clients; file permissions guard it, TLS would add nothing
            try:
                self._grpc.add_insecure_port("unix:" + opts.unix_socket)
            except RuntimeError:
                raise StartError("unix socket %s cannot be bound (in use, or its directory is missing)"
                                 % opts.unix_socket) from None
        await self._grpc.start()
        self.address = "%s:%d" % (host, self.port)
        log.info("gRPC listening on %s%s%s", self.address, " (TLS)" if credentials else "",
                 " and unix:" + opts.unix_socket if opts.unix_socket else "")
        if opts.metrics_port:
            try:
                self._metrics_http = self.metrics.serve_http(opts.metrics_host, opts.metrics_port)
            except OSError as exc:
                await self._grpc.stop(0)
                raise StartError("metrics port %d is in use (%s)" % (opts.metrics_port, exc.strerror)) from None
            self.metrics_port = self._metrics_http.server_port
            log.info("metrics on http://%s:%d/metrics", opts.metrics_host, self.metrics_port)
        if opts.openai_port:
            try:
                await self._start_openai(host)
            except OSError as exc:  # taken between the check and now, or a certificate that does not load
                await self._grpc.stop(0)
                if self._metrics_http is not None:
                    self._metrics_http.shutdown()
                raise StartError("OpenAI API port %d cannot be served (%s)"
                                 % (opts.openai_port, exc.strerror or exc)) from None
        self.loading = asyncio.create_task(self._load())

    async def _start_openai(self, host: str) -> None:
        import anyio

        from jetserve.server.openai_api import create_app, make_http_server

        # anyio loads its asyncio backend (dozens of modules) at its first use: starlette's first
        # streamed response would wait for those imports on the event loop, with every stream.
        await anyio.sleep(0)
        self._openai_http, sock = make_http_server(create_app(self), self.options, self.budget.caps["OpenAI"])
        self._openai_task = asyncio.create_task(self._openai_http.serve(sockets=[sock]))
        self.openai_port = sock.getsockname()[1]
        log.info("OpenAI-compatible API on http%s://%s:%d/v1", "s" if self.options.tls_cert else "", host,
                 self.openai_port)

    async def _load(self) -> None:
        def on_status(text: str) -> None:
            log.info("%s", text)
            notify.status(text)

        on_status("loading the model")
        engine = await _load_in_thread(self._make_engine, on_status)
        engine.start()
        self.metrics.bind(engine.model_info.served_model_name, engine.model_info.max_model_len)
        self.engine = engine
        self.engine_alive = True
        await self._update_health()
        model = engine.model_info.served_model_name  # the one name clients use, as /v1/models says
        notify.notify("READY=1", "STATUS=serving %s on %s" % (model, self.address))
        log.info("serving %s%s", model, DEMO_NOTE if _is_demo(engine.model_info.model) else "")
        self._heartbeat = asyncio.create_task(self._follow_heartbeat(engine))

    async def _follow_heartbeat(self, engine) -> None:
        """Health and the systemd watchdog follow the engine's own step loop, not this event loop:
        a wedged or dead engine turns health NOT_SERVING and stops the WATCHDOG=1 pings, so
        systemd restarts the service even though gRPC still answers."""
        period = notify.watchdog_period()
        stale_after = max(STALE_AFTER_S, period or 0.0)
        last_ping = 0.0
        while True:
            age = time.monotonic() - engine.last_heartbeat
            alive = age <= stale_after
            if alive != self.engine_alive:
                if alive:
                    log.warning("engine heartbeat is back")
                else:
                    log.error("engine heartbeat is %.1f s old: health NOT_SERVING, watchdog not pinged", age)
                self.engine_alive = alive
                await self._update_health()
            if alive and period and time.monotonic() - last_ping >= min(period, 1.0):
                notify.notify("WATCHDOG=1")
                last_ping = time.monotonic()
            # Often enough that a dead core (its heartbeat set to -inf) turns health off at once.
            await asyncio.sleep(HEARTBEAT_CHECK_S)

    async def _update_health(self) -> None:
        status = SERVING if self.engine_alive and not self.draining else NOT_SERVING
        for service in ("",) + SERVICES:
            await self._health.set(service, status)

    async def shutdown(self) -> None:
        """STOPPING=1, refuse new streams, give open ones the grace period, then stop everything."""
        self.stopping = True
        await self.set_draining(True)
        notify.notify("STOPPING=1", "STATUS=draining")
        grace = self.options.drain_grace_period
        if self._open:
            log.info("draining: waiting up to %g s for %d open stream(s) to finish; signal again to stop now",
                     grace, len(self._open))
        if not await self._wait_idle_unless_hurried(grace):
            # Every client, whatever its language, gets a last delta with finish_reason abort and
            # a clean end (gRPC status OK; the HTTP stream's last chunk), not a cancelled call.
            if self._hurry.is_set():
                log.warning("stopping now: aborting %d open stream(s)", len(self._open))
            else:
                log.warning("%d stream(s) still open after the %g s grace period: aborting them",
                            len(self._open), grace)
            self.abort_all()
            await self.wait_idle(ABORT_FLUSH_S if not self._hurry.is_set() else HURRIED_FLUSH_S)
        hurried = self._hurry.is_set()
        await self._health.enter_graceful_shutdown()
        await self._grpc.stop(0 if hurried else 1.0)
        if self._openai_http is not None:
            self._openai_http.config.timeout_graceful_shutdown = 0 if hurried else 1.0
            self._openai_http.should_exit = True
            await self._openai_task
        if self.loading is not None:
            self.loading.cancel()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        log.info("stopped")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own default, fixed


def map_large_allocations() -> None:
    """Give every allocation of 128 KiB or more its own mapping, returned to the OS when freed
    (glibc's malloc; elsewhere nothing to do). By default glibc raises that threshold to the
    largest block freed so far, so the transient buffers of a long prompt's request (its
    message, its parse) come from the heap, where the holes they leave are filled only in part
    by the arrays that stay: each queued request would grow RSS by a hole beside what it holds."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def freeze_startup_heap() -> None:
    """Move what start-up made (the modules, the tokenizer, the apps) out of the collector's
    scans, as the engine core does and as vLLM's API server does: otherwise the first full
    collection the requests' garbage triggers walks that whole heap on the event loop while
    every stream waits (on a small board, the first streamed answer's first byte waited for it).
    A process-wide choice, so it is made here, where the process serves, not in JetServer."""
    gc.collect()
    gc.freeze()


async def serve(make_engine, options: ServeOptions) -> int:
    """Run until SIGTERM/SIGINT (then drain) or until the model fails to load (exit status 1)."""
    map_large_allocations()
    server = JetServer(make_engine, options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([stopped, server.loading], return_when=asyncio.FIRST_COMPLETED)
    failed = server.loading.done() and not server.loading.cancelled() and server.loading.exception()
    if failed:  # one line; the traceback only at --log-level DEBUG
        log.error("the model failed to load: %s", failed, exc_info=failed if log.isEnabledFor(logging.DEBUG) else None)
        notify.status("failed to load the model: %s" % failed)
    else:
        if server.loading.done():
            freeze_startup_heap()
        await stopped
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal cuts the drain short
        loop.add_signal_handler(sig, server.hurry)
    await server.shutdown()
    return 1 if failed else 0
