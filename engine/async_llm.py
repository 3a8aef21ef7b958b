"""The streaming engine for the service: submit → async iterator of deltas.

The step loop runs in its own thread, so the event loop never waits on a forward pass.
Requests and aborts cross into that thread through a queue and are applied between steps;
deltas cross back with `call_soon_threadsafe`. The loop turns at least every
`IDLE_TICK` seconds, so `last_heartbeat` going stale means the engine is wedged.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator

from jetserve.engine.config import EngineConfig
from jetserve.engine.errors import EngineError, QueueFullError
from jetserve.engine.llm_engine import LLMEngine
from jetserve.engine.outputs import RequestOutput
from jetserve.engine.protocol import EngineClient, EngineStats, ModelInfo
from jetserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDLE_TICK = 0.5


class AsyncLLM:
    def __init__(self, config: EngineConfig, on_status=None):
        self.engine = LLMEngine(config, on_status=on_status)
        self.max_waiting = config.max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats = self.engine.stats()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.last_heartbeat = time.monotonic()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model_info

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jetserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the caller's side (event loop) ---------------------------------------------------

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream deltas of one request. Leaving the iteration early aborts the request."""
        if self._error is not None or self._stopping:
            raise EngineError(f"engine is not running: {self._error or 'shut down'}")
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        text, ids = self.engine.tokenize_prompt(prompt)  # bad prompts fail here, in the caller's frame
        prompt = {"prompt": text, "prompt_token_ids": ids}  # tokenized once: the engine only checks the ids
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already streaming")
            # At most max_num_seqs of the open streams run; the rest wait. Counted here, under
            # the lock, so a burst between two steps cannot slip past the bound.
            if len(self._streams) >= self.engine.scheduler.max_num_seqs + self.max_waiting:
                raise QueueFullError(f"waiting queue is full ({self.max_waiting} requests); retry later")
            stream: asyncio.Queue = asyncio.Queue()
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._submit(("add", request_id, prompt, params, time.monotonic()))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def set_max_num_seqs(self, n: int) -> None:
        self._call(self.engine.set_max_num_seqs, n)

    def set_num_speculative_tokens(self, k: int) -> None:
        self._call(self.engine.set_num_speculative_tokens, k)

    def stats(self) -> EngineStats:
        """A snapshot taken after the latest step (never blocks on a forward pass)."""
        return self._stats

    def _call(self, fn, *args) -> None:
        """Run `fn` between steps on the engine thread and re-raise its error here."""
        done = threading.Event()
        result: list = []
        self._submit(("call", lambda: fn(*args), result, done))
        if not done.wait(timeout=30):
            raise EngineError("engine did not answer within 30 s")
        if result:
            raise result[0]

    def _submit(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self.last_heartbeat = time.monotonic()
                self._apply_commands()
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        self._deliver(output)
                else:
                    self._wake.wait(IDLE_TICK)
                    self._wake.clear()
                self._stats = self.engine.stats()
        except BaseException as exc:  # the engine is dead: fail every stream, stop the heartbeat
            log.exception("engine step loop died")
            self._error = exc
            for request_id in list(self._streams):
                self._deliver_error(request_id, EngineError(f"engine failed: {exc}"))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, request_id, prompt, params, arrival = command
                if request_id not in self._streams:  # cancelled before it reached the engine
                    continue
                try:
                    self.engine.add_request(request_id, prompt, params, arrival)
                except ValueError as exc:
                    self._deliver_error(request_id, exc)
            elif kind == "abort":
                output = self.engine.abort(command[1])
                if output is not None:
                    self._deliver(output)
                with self._lock:
                    self._streams.pop(command[1], None)
            else:
                _, fn, result, done = command
                try:
                    fn()
                except Exception as exc:
                    result.append(exc)
                done.set()

    def _deliver(self, output: RequestOutput) -> None:
        with self._lock:
            target = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, output)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            target = self._streams.pop(request_id, None)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, exc)


def open_engine(config: EngineConfig, on_status=None) -> EngineClient:
    """The streaming engine for `config.backend` (blocking: loads the model)."""
    if config.backend == "tensorrt-llm":
        from jetserve.engine.backends.trtllm import TensorRTLLMEngine
        return TensorRTLLMEngine(config, on_status)
    return AsyncLLM(config, on_status)
