"""The engine core: the step loop with nothing else in it (vLLM V1's EngineCore / EngineCoreProc).

Requests come in as checked token ids; out go token deltas with the token-level finish reasons
(EOS, stop token ids, max_tokens, max_model_len). Text (detokenization, stop strings) is the
front end's (`output_processor.py`), so it never costs a step. `EngineCore` applies the messages
below between steps; a thread drives it (`InprocClient`) or, in its own process,
`run_engine_core`: a busy loop that drains requests, aborts and control calls from one ZMQ
socket, steps, and pushes the step's deltas with a stats snapshot to another (msgpack, msgspec).
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import shutil
import signal
import sys

import msgspec

from jetserve.engine import lifeline
from jetserve.engine.config import EngineConfig
from jetserve.engine.llm_engine import LLMEngine
from jetserve.engine.plan import refuse_if_it_cannot_fit
from jetserve.engine.outputs import LogprobsLists
from jetserve.engine.protocol import EngineStats, ModelInfo
from jetserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# An idle core still reports this often: a front end that hears nothing for longer knows it is wedged.
IDLE_TICK = 0.5


# -- front end → core -------------------------------------------------------------------------

class AddRequest(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class Abort(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_ids: list[str]


class Call(msgspec.Struct, tag=True, array_like=True, gc=False):
    """A live control (`set_max_num_seqs`, `set_num_speculative_tokens`), answered by a Reply
    once it is in effect."""

    call_id: int
    method: str
    args: list


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


CoreRequest = AddRequest | Abort | Call | Shutdown
CONTROLS = ("set_max_num_seqs", "set_num_speculative_tokens")


# -- core → front end -------------------------------------------------------------------------

class CoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's new tokens after a step; `error` set: the core refused the request."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    first_scheduled_time: float | None = None  # when the core first gave it compute (queue time's end)
    logprobs: LogprobsLists | None = None  # of token_ids, for a request that asked
    prompt_logprobs: LogprobsLists | None = None  # of the prompt's tokens after the first, once


class Outputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: list[CoreOutput]
    stats: EngineStats


class Reply(msgspec.Struct, tag=True, array_like=True, gc=False):
    call_id: int
    error: str | None
    stats: EngineStats  # taken after the call: whoever reads stats next sees it applied


class Status(msgspec.Struct, tag=True, array_like=True, gc=False):
    text: str  # loading progress, for systemd's STATUS=


class Ready(msgspec.Struct, tag=True, array_like=True, gc=False):
    model_info: ModelInfo
    stats: EngineStats


class Failed(msgspec.Struct, tag=True, array_like=True, gc=False):
    message: str


CoreMessage = Outputs | Reply | Status | Ready | Failed


class EngineCore:
    """An LLMEngine without text, and the messages that drive it between steps."""

    def __init__(self, config: EngineConfig, on_status=None):
        refuse_if_it_cannot_fit(config)  # here, not in the server: it alone holds the GPU (and torch)
        self.engine = LLMEngine(config, on_status=on_status, detokenize=False)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[CoreOutput]:
        return [_core_output(o) for o in self.engine.step()]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def add(self, request: AddRequest) -> CoreOutput | None:
        try:
            self.engine.add_request(request.request_id, {"prompt_token_ids": request.prompt_token_ids},
                                    request.params, request.arrival_time)
        except ValueError as exc:
            return CoreOutput(request.request_id, [], "abort", error=str(exc))
        return None

    def abort(self, request: Abort) -> list[CoreOutput]:
        return [_core_output(o) for o in map(self.engine.abort, request.request_ids) if o is not None]

    def call(self, request: Call) -> Reply:
        error = None
        try:
            if request.method not in CONTROLS:
                raise ValueError(f"unknown control {request.method!r}")
            getattr(self.engine, request.method)(*request.args)
        except ValueError as exc:
            error = str(exc)
        return Reply(request.call_id, error, self.engine.stats())


def _core_output(output) -> CoreOutput:
    completion = output.outputs[0]
    return CoreOutput(output.request_id, completion.token_ids, completion.finish_reason, completion.stop_reason,
                      first_scheduled_time=output.metrics.first_scheduled_time, logprobs=completion.logprobs,
                      prompt_logprobs=output.prompt_logprobs)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """The core process: load, say Ready (or Failed), then the busy loop until Shutdown or until
    the front end's process is gone."""
    import zmq

    # SIGINT (a Ctrl-C to the process group) and SIGTERM are the front end's to handle: it drains
    # and then sends Shutdown. A dead front end is noticed through the parent pid.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.device == "cpu":  # leave a core to the front end, or the two processes fight over every one
        import torch
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    parent = os.getppid()
    context = zmq.Context(io_threads=1)
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(input_address)
    outbox.connect(output_address)
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(CoreRequest).decode

    def send(message) -> None:
        outbox.send(encode(message), copy=False)

    try:
        core = EngineCore(config, on_status=lambda text: send(Status(text)))
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, which decides
        send(Failed(f"{type(exc).__name__}: {exc}"))
        outbox.close(linger=5000)
        raise SystemExit(1) from None
    # The model, graphs and buffers live as long as the process: out of the collector's scans, a
    # collection in the busy loop costs the requests' objects, not the whole heap (as vLLM's core).
    gc.collect()
    gc.freeze()
    send(Ready(core.engine.model_info, core.stats()))
    try:
        while True:
            if not core.has_work() and not inbox.poll(IDLE_TICK * 1000):
                if os.getppid() != parent:
                    return
                send(Outputs([], core.stats()))  # the heartbeat
                continue
            outputs: list[CoreOutput] = []
            while True:
                try:
                    request = decode(inbox.recv(zmq.NOBLOCK, copy=False).buffer)
                except zmq.Again:
                    break
                if isinstance(request, AddRequest):
                    refused = core.add(request)
                    if refused is not None:
                        outputs.append(refused)
                elif isinstance(request, Abort):
                    outputs.extend(core.abort(request))
                elif isinstance(request, Call):
                    send(core.call(request))
                else:
                    return
            if core.has_work():
                outputs.extend(core.step())
            send(Outputs(outputs, core.stats()))
    finally:
        context.destroy(linger=0)


def main(argv: list[str]) -> None:
    """`python -m jetserve.engine.core INPUT OUTPUT LIFELINE_FD SERVER_PID`, the EngineConfig pickled
    on stdin (what `MPClient` starts through `lifeline.spawn`)."""
    input_address, output_address, lifeline_fd, server_pid = argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s[core]: %(message)s")
    _live_with_server(int(lifeline_fd), int(server_pid), input_address)
    config = pickle.loads(sys.stdin.buffer.read())
    run_engine_core(config, input_address, output_address)


def _live_with_server(lifeline_fd: int, server_pid: int, input_address: str) -> None:
    """Before the load: a server that dies, even mid-load, takes this process (and the model's
    memory) with it; its IPC directory, which it can no longer remove, goes with us."""
    ipc_dir = os.path.dirname(input_address.removeprefix("ipc://"))
    lifeline.hold(lifeline_fd, server_pid, on_gone=lambda: shutil.rmtree(ipc_dir, ignore_errors=True))


if __name__ == "__main__":
    main(sys.argv[1:])
    # Triton's extension reports what it still holds at interpreter exit (a screen of "nanobind:
    # leaked" lines in the server's log); everything the core owns is closed by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
