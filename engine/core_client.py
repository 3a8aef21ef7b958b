"""How the front end (`AsyncLLM`) reaches the engine core (vLLM V1's EngineCoreClient).

`MPClient`: the core in its own process (`core.run_engine_core`), so the step loop never shares
a GIL with the servers; requests in and deltas out over ZMQ, the deltas read by the event loop
that started it. Its death is seen at once: that loop watches the process sentinel beside the socket.
`InprocClient`: the core in a thread of this process (no spawn, no IPC).
`SyncClient`: the core stepped by the caller's own thread (offline `LLMEngine`).

They call `on_outputs(list[CoreOutput])` (from that event loop, or from the core's thread) and
`on_death(exc)` once if the core dies; `call` returns only once a control is in effect, and
`stats()` is never older than it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import queue
import subprocess
import threading
import time

import msgspec

from jetserve.engine.config import EngineConfig
from jetserve.engine.core_process import CoreProcess
from jetserve.engine.core import (
    IDLE_TICK, Abort, AddRequest, Call, CoreMessage, CoreOutput, EngineCore, Failed, Outputs, Ready, Reply, Shutdown,
    Status, encode_hook)
from jetserve.engine.errors import EngineError
from jetserve.engine.protocol import EngineStats, ModelInfo

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0


class _Calls:
    """Control calls waiting for their Reply."""

    def __init__(self):
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[threading.Event, list]] = {}
        self._lock = threading.Lock()
        self._dead = False

    def new(self) -> tuple[int, threading.Event, list]:
        call_id, done, result = next(self._ids), threading.Event(), []
        with self._lock:
            if self._dead:
                raise EngineError("engine core died")
            self._waiting[call_id] = (done, result)
        return call_id, done, result

    def answer(self, reply: Reply) -> None:
        with self._lock:
            done, result = self._waiting.pop(reply.call_id, (None, None))
        if done is not None:
            result.append(reply.error)
            done.set()

    def wait(self, call_id: int, done: threading.Event, result: list) -> None:
        if not done.wait(CALL_TIMEOUT_S):
            with self._lock:
                self._waiting.pop(call_id, None)
            raise EngineError(f"engine did not answer within {CALL_TIMEOUT_S:g} s")
        if result[0] is None:
            return
        if result[0] == _DEAD:
            raise EngineError("engine core died")
        raise ValueError(result[0])

    def fail_all(self) -> None:
        """The core died: every waiting call and every later one fails at once."""
        with self._lock:
            self._dead = True
            waiting, self._waiting = self._waiting, {}
        for done, result in waiting.values():
            result.append(_DEAD)
            done.set()


_DEAD = "\0dead"


class _CoreClient:
    """What both clients offer the front end; each says how a request reaches its core (`_send`)
    and keeps `_stats` (the core's latest snapshot) and `_calls` (control calls in flight)."""

    _stats: EngineStats
    _calls: _Calls

    def stats(self) -> EngineStats:
        return self._stats

    def add_request(self, request: AddRequest) -> None:
        self._send(request)

    def abort(self, request_ids: list[str]) -> None:
        self._send(Abort(request_ids))

    def call(self, method: str, *args) -> None:
        call_id, done, result = self._calls.new()
        self._send(Call(call_id, method, list(args)))
        self._calls.wait(call_id, done, result)

    def _send(self, request) -> None:
        raise NotImplementedError


class InprocClient(_CoreClient):
    """The core driven by a thread of this process."""

    def __init__(self, config: EngineConfig, on_status, on_outputs, on_death):
        self.core = EngineCore(config, on_status=on_status)
        self.model_info: ModelInfo = self.core.model_info
        self._on_outputs, self._on_death = on_outputs, on_death
        self._stats = self.core.stats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._calls = _Calls()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.last_heartbeat = time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jetserve-engine-core", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _send(self, request) -> None:
        self._inbox.put(request)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self.last_heartbeat = time.monotonic()
                outputs = self._apply()
                if self.core.has_work():
                    outputs.extend(self.core.step())
                elif not outputs:
                    self._wake.wait(IDLE_TICK)
                    self._wake.clear()
                self._stats = self.core.stats()
                if outputs:
                    self._on_outputs(outputs)
        except BaseException as exc:  # noqa: BLE001 - the engine is dead: say so, stop the heartbeat
            log.exception("engine step loop died")
            self.last_heartbeat = float("-inf")
            self._calls.fail_all()
            self._on_death(EngineError(f"engine failed: {exc}"))

    def _apply(self) -> list:
        outputs = []
        while True:
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if isinstance(request, AddRequest):
                refused = self.core.add(request)
                if refused is not None:
                    outputs.append(refused)
            elif isinstance(request, Abort):
                outputs.extend(self.core.abort(request))
            else:
                reply = self.core.call(request)
                self._stats = reply.stats
                self._calls.answer(reply)


class MPClient(_CoreClient):
    """The core in its own process, over ZMQ. A fresh interpreter (`python -m jetserve.engine.core`,
    the config pickled on its stdin): CUDA does not survive a fork, and unlike multiprocessing's
    spawn it never re-runs the caller's `__main__`. A lifeline joins the two (`lifeline.spawn`):
    our end turns readable the moment the core exits, however it exits, and the core exits the
    moment we do."""

    def __init__(self, config: EngineConfig, on_status, on_outputs, on_death, process: CoreProcess | None = None):
        """`process`: one started before the configuration was made (`jetserve serve` does), else
        started here."""
        import zmq

        self._on_outputs, self._on_death = on_outputs, on_death
        self._core = process or CoreProcess.start()
        self.process, self.sentinel = self._core.process, self._core.sentinel
        try:
            self._context = zmq.Context(io_threads=1)
            self._inbox = self._context.socket(zmq.PUSH)  # the core's inbox
            self._inbox.setsockopt(zmq.SNDHWM, 0)  # requests are small and few: queue them, never block
            self._outbox = self._context.socket(zmq.PULL)
            # A core started earlier has been connecting all along: ZMQ retries until these exist.
            self._inbox.bind(self._core.input_address)
            self._outbox.bind(self._core.output_address)
        except BaseException:
            self._core.close()
            raise
        self._send_lock = threading.Lock()  # ZMQ sockets are not thread-safe; several threads send
        self._encode = msgspec.msgpack.Encoder(enc_hook=encode_hook).encode
        self._decode = msgspec.msgpack.Decoder(CoreMessage).decode
        self._calls = _Calls()
        self._stopping = self._dead = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the one that reads the core (start())
        self._loop_thread: int | None = None
        try:
            self._core.hand_over(pickle.dumps(config))
        except OSError:  # it died before reading it: said below, by its exit
            pass
        try:
            ready = self._wait_ready(on_status)
        except BaseException:
            self._close()
            raise
        self.model_info: ModelInfo = ready.model_info
        self._stats: EngineStats = ready.stats
        self.last_heartbeat = time.monotonic()

    def _wait_ready(self, on_status) -> Ready:
        """Forward the core's loading progress until it is Ready; its failure is raised here."""
        import zmq

        poller = zmq.Poller()
        poller.register(self._outbox, zmq.POLLIN)
        poller.register(self.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._outbox in events:
                message = self._decode(self._outbox.recv())
                if isinstance(message, Ready):
                    return message
                if isinstance(message, Failed):
                    raise EngineError(f"the engine core failed to start: {message.message}")
                if isinstance(message, Status) and on_status is not None:
                    on_status(message.text)
            elif self.sentinel in events:
                raise EngineError(f"the engine core exited while loading (exit code {self.process.wait()})")

    def start(self) -> None:
        """Read the core's messages on the calling event loop: deltas go to their streams with no
        thread hand-over and no wait for the GIL, as vLLM's AsyncMPClient does. The sentinel is
        watched beside the socket, so a death is seen at once."""
        import zmq

        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._outbox_fd = self._outbox.getsockopt(zmq.FD)
        self._loop.add_reader(self._outbox_fd, self._read_outputs)
        self._loop.add_reader(self.sentinel, self._core_exited)
        # ZMQ's descriptor signals changes, not pending messages: whatever came before is read now.
        self._read_outputs()

    def call(self, method: str, *args) -> None:
        if threading.get_ident() == self._loop_thread:  # its Reply is read by this very loop
            raise RuntimeError(f"{method} waits for the engine core's reply, which this event loop reads: "
                               "call it from another thread (asyncio.to_thread)")
        super().call(method, *args)

    def shutdown(self) -> None:
        self._stopping = True
        if self.process.poll() is None:
            self._send(Shutdown())
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("the engine core did not stop within 10 s: killing it")
        self._stop_reading()
        self._close()

    def _stop_reading(self) -> None:
        """Take the socket and the sentinel off the loop (on its own thread) before they close."""
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        removed = threading.Event()

        def remove():
            loop.remove_reader(self._outbox_fd)
            loop.remove_reader(self.sentinel)
            removed.set()

        if threading.get_ident() == self._loop_thread:
            remove()
            return
        try:
            loop.call_soon_threadsafe(remove)
        except RuntimeError:  # closed meanwhile: its readers went with it
            return
        removed.wait(10)

    def _close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._context.destroy(linger=0)
        self._core.close()

    def _send(self, request) -> None:
        import zmq

        frame = self._encode(request)
        with self._send_lock:
            if self._dead or (self._stopping and not isinstance(request, Shutdown)):
                return
            try:
                self._inbox.send(frame, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # the core is gone (nobody reads): its death is reported by the reader
                pass

    def _read_outputs(self) -> None:
        """Every message waiting (deltas, replies, heartbeats), then one hand-over of all the
        deltas: a front end that fell behind catches up in one pass, not one per step."""
        import zmq

        outputs = []
        while True:
            try:
                message = self._decode(self._outbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            self.last_heartbeat = time.monotonic()
            if isinstance(message, Outputs):
                self._stats = message.stats
                outputs += message.outputs
            elif isinstance(message, Reply):
                self._stats = message.stats
                self._calls.answer(message)
        if outputs:
            self._on_outputs(outputs)

    def _core_exited(self) -> None:
        self._read_outputs()  # its last words come before its exit
        self._stop_reading()
        if self._stopping:
            return
        self._dead = True
        code = self.process.wait()
        log.error("the engine core process died (exit code %s)", code)
        self.last_heartbeat = float("-inf")
        self._calls.fail_all()
        self._on_death(EngineError(f"the engine core process died (exit code {code})"))


class SyncClient:
    """The core stepped by the caller's own thread (vLLM V1's InprocClient), for offline
    `LLMEngine`: the same requests, aborts and controls as the other clients, with no thread
    and no queue between; a refused request raises its ValueError here."""

    def __init__(self, config: EngineConfig, on_status=None):
        self.core = EngineCore(config, on_status=on_status)
        self._call_ids = itertools.count()

    @property
    def model_info(self) -> ModelInfo:
        return self.core.model_info

    def stats(self) -> EngineStats:
        return self.core.stats()

    def add_request(self, request: AddRequest) -> None:
        self.core.add_request(request)

    def abort(self, request_ids: list[str]) -> list[CoreOutput]:
        return self.core.abort(Abort(request_ids))

    def call(self, method: str, *args) -> None:
        reply = self.core.call(Call(next(self._call_ids), method, list(args)))
        if reply.error is not None:
            raise ValueError(reply.error)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> list[CoreOutput]:
        return self.core.step()
