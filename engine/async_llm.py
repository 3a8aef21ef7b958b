"""The streaming engine for the service (vLLM V1's AsyncLLM): submit → async iterator of deltas.

This is the front end: it tokenizes and checks prompts in the caller's frame, hands token ids to
the engine core (its own process by default, see `EngineConfig.engine_core_process`, or
a thread), and turns the core's token deltas into text (`OutputProcessor`) on the event loop
that started it (on the core's thread for an in-process core), never in the step loop. A
request for n completions goes to the core as n requests (vLLM V1's parallel sampling), its
stream tagged by index; with prefix caching on and a prompt of a full block or more, the first
goes alone and the others once its prompt's KV is cached, which they then share. Each stream
reads from a `RequestOutputCollector` on its own event loop, so several servers (gRPC, HTTP) on
different loops may share one engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from jetserve.engine.config import EngineConfig
from jetserve.engine.core import CoreOutput
from jetserve.engine.core_client import InprocClient, MPClient
from jetserve.engine.core_process import CoreProcess
from jetserve.engine.errors import EngineError, PromptTooLongError, QueueFullError
from jetserve.engine.output_processor import OutputProcessor, RequestOutputCollector
from jetserve.engine.outputs import RequestOutput
from jetserve.engine.prompts import check_prompt, queued_bytes
from jetserve.engine.protocol import EngineClient, EngineStats, ModelInfo
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.tokenizer import Tokenizer


class AsyncLLM:
    def __init__(self, config: EngineConfig, on_status=None, core_process: CoreProcess | None = None):
        """`core_process`: the core's process started before `config` was made (core_process.py)."""
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.model) if config.has_tokenizer else None
        self._processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, RequestOutputCollector] = {}
        self._lock = threading.Lock()  # streams and processor: the caller's loops and the core's reader
        self._error: BaseException | None = None
        self._stopping = False
        if config.engine_core_process:
            self.core = MPClient(config, on_status, self._on_outputs, self._on_death, core_process)
        else:
            if core_process is not None:
                core_process.close()
            self.core = InprocClient(config, on_status, self._on_outputs, self._on_death)

    @property
    def model_info(self) -> ModelInfo:
        info = self.core.model_info
        k = self.core.stats().num_speculative_tokens
        return dataclasses.replace(info, num_speculative_tokens=k)

    @property
    def last_heartbeat(self) -> float:
        return self.core.last_heartbeat

    def start(self) -> None:
        self.core.start()

    def shutdown(self) -> None:
        self._stopping = True
        self.core.shutdown()

    # -- the caller's side (event loop) ---------------------------------------------------

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream deltas of one request. Leaving the iteration early aborts the request."""
        if self._error is not None or self._stopping:
            raise EngineError(f"engine is not running: {self._error or 'shut down'}")
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        cfg = self.config
        text, ids = check_prompt(prompt, self.tokenizer, cfg.model_config.vocab_size, cfg.max_model_len)
        arrival = time.monotonic()
        collector = RequestOutputCollector(asyncio.get_running_loop())
        room = self.core.stats().max_num_seqs + cfg.max_waiting
        if params.n > room:  # not even an empty queue holds it: no retry would help
            raise ValueError(f"n={params.n} completions cannot be admitted: this server holds at most {room} "
                             f"(max_num_seqs + max_waiting)")
        with self._lock:
            # At most max_num_seqs of the requests in the core run (n a request); the rest wait.
            # Counted here, under the lock, so a burst between two steps cannot slip past the bound.
            if len(self._processor.requests) + params.n > room:
                raise QueueFullError(f"waiting queue is full ({cfg.max_waiting} requests); retry later")
            # And their prompts' bytes, which the memory plan counts: a flood of long prompts is
            # refused here, not by the OOM killer.
            cost, held = queued_bytes(len(ids), params.n), self._processor.queued_bytes
            if cost > cfg.max_queued_bytes:
                raise PromptTooLongError(
                    f"prompt of {len(ids)} tokens x {params.n} completion(s) needs {cost} bytes of the queue, "
                    f"more than all of max_queued_bytes={cfg.max_queued_bytes}")
            if held + cost > cfg.max_queued_bytes:
                raise QueueFullError(f"queued prompts are at their memory budget ({held} of max_queued_bytes="
                                     f"{cfg.max_queued_bytes} bytes held, this one needs {cost}); retry later")
            hold_back = params.n > 1 and cfg.enable_prefix_caching and len(ids) > cfg.block_size
            children = self._processor.add(request_id, text, ids, params, arrival, hold_back)
            self._streams[request_id] = collector
        finished = False
        try:  # from here the request holds its place in the queue: however this ends, it gives it back
            for child in children:
                self.core.add_request(child)
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop the request (each of its n completions) in the core, where their blocks are freed;
        a stream still being read ends with a last delta whose finish_reason is "abort"."""
        with self._lock:
            collector = self._streams.pop(request_id, None)
            last, running = self._processor.abort(request_id, time.monotonic())
        if collector is not None and last is not None:
            _deliver(collector.loop, collector.put, last)
        if running:
            self.core.abort(running)

    def set_max_num_seqs(self, n: int) -> None:
        """Returns once the new cap is in effect (and in `stats()`)."""
        self.core.call("set_max_num_seqs", n)

    def set_num_speculative_tokens(self, k: int) -> None:
        """Returns once the new draft length cap is in effect (and in `stats()`)."""
        self.core.call("set_num_speculative_tokens", k)

    def stats(self) -> EngineStats:
        """A snapshot taken after the core's latest step or control call (never blocks on a step)."""
        return self.core.stats()

    # -- the core client's side (the reading event loop, or the core's thread) -------------

    def _on_outputs(self, outputs: list[CoreOutput]) -> None:
        """Text for the core's deltas; one hand-over per event loop for all of them."""
        deliveries: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._lock:
            processed = self._processor.process_outputs(outputs, time.monotonic())
            for request_id, item in processed.deltas:
                done = not isinstance(item, RequestOutput) or item.finished
                collector = self._streams.pop(request_id, None) if done else self._streams.get(request_id)
                if collector is not None:
                    deliveries[collector.loop].append((collector, item))
        for child in processed.to_add:  # completions held back until their prompt's KV was cached
            self.core.add_request(child)
        if processed.to_abort:  # ended here: the core stops them and frees their blocks
            self.core.abort(processed.to_abort)
        for loop, items in deliveries.items():
            _deliver(loop, _put_all, items)

    def _on_death(self, exc: BaseException) -> None:
        self._error = exc
        with self._lock:
            streams, self._streams = self._streams, {}
            for request_id in list(self._processor.parents):
                self._processor.drop(request_id)
        for collector in streams.values():
            _deliver(collector.loop, collector.put, exc)


def _put_all(items) -> None:
    for collector, item in items:
        collector.put(item)


def _deliver(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """fn(*args) on `loop`: now when we run on it (the core's deltas read by that loop), else by a wake-up."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn(*args)
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that loop is closed: its streams are gone with it
        pass


def open_engine(config: EngineConfig, on_status=None, core_process: CoreProcess | None = None) -> EngineClient:
    """The streaming engine for `config.backend` (blocking: loads the model)."""
    if config.backend == "tensorrt-llm":
        from jetserve.engine.backends.trtllm import TensorRTLLMEngine
        if core_process is not None:
            core_process.close()
        return TensorRTLLMEngine(config, on_status)
    return AsyncLLM(config, on_status, core_process)
