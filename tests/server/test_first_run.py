"""What a new user meets in the first minutes (issue 31): a port clash is one line, a drain says
what it waits for and a second Ctrl-C ends it, the start log is log records only and names the
model as clients do, and a request asking for more than the context holds is refused by name."""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from tests.server.conftest import free_port, greedy
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

LOG_LEVELS = ("DEBUG ", "INFO ", "WARNING ", "ERROR ", "CRITICAL ")


def serve(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "jetserve.cli", "serve", "--device", "cpu", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.parametrize("which", ["port", "metrics-port", "openai-port", "unix-socket"])
def test_every_port_clash_is_one_line(tiny_model, tmp_path, which):
    """Whichever address is taken: exit 1, one line naming it, no traceback, and none of grpcio's
    C-core lines (`add_port.cc ... Failed to add port`)."""
    family = socket.AF_UNIX if which == "unix-socket" else socket.AF_INET
    with socket.socket(family) as owner:
        owner.bind(str(tmp_path / "taken.sock") if which == "unix-socket" else ("127.0.0.1", 0))
        owner.listen()
        taken = owner.getsockname()
        flags = {"port": "0", "metrics-port": "0", "openai-port": "0"}
        if which == "unix-socket":
            flags["unix-socket"] = taken
        else:
            flags[which] = str(taken[1])
        args = [part for flag, value in flags.items() for part in ("--" + flag, value)]
        done = subprocess.run([sys.executable, "-m", "jetserve.cli", "serve", "--model", str(tiny_model),
                               "--device", "cpu", *args], capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if not line.startswith(LOG_LEVELS)]
    what = taken if which == "unix-socket" else "port %d is in use" % taken[1]
    assert done.returncode == 1 and len(errors) == 1 and what in errors[0], done.stderr
    assert errors[0].startswith("jetserve serve: ") and "add_port" not in done.stderr, done.stderr


class Output:
    """A subprocess's output, line by line, as it comes."""

    def __init__(self, process):
        self.lines, self._queue = [], queue.Queue()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process):
        for line in process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError("no %r in the output: %s" % (text, "".join(self.lines)))


def test_a_second_ctrl_c_stops_the_drain_at_once(tiny_model):
    """The first SIGINT drains and says what it waits for; the second aborts what is open, so the
    600 s grace period is not waited out: the stream ends with FINISH_REASON_ABORT, not length.
    The work is bounded: one sequence at a time, 16 completions of at most 480 tokens each."""
    port = free_port()
    server = serve("--model", str(tiny_model), "--port", str(port), "--metrics-port", "0", "--openai-port", "0",
                   "--max-num-seqs", "1", "--num-kv-blocks", "64", "--drain-grace-period", "600")
    out = Output(server)
    try:
        out.wait_for("INFO jetserve.server.app: serving ")
        with grpc.insecure_channel("127.0.0.1:%d" % port) as channel:
            stream = pb_grpc.InferenceServiceStub(channel).Generate(pb.GenerateRequest(
                text="the kiosk", sampling=greedy(480, n=16, ignore_eos=True)), timeout=300)
            next(stream)  # admitted and decoding
            server.send_signal(signal.SIGINT)
            out.wait_for("draining: waiting up to 600 s for 1 open stream(s)")
            server.send_signal(signal.SIGINT)
            reasons = [m.finish_reason for m in stream if m.finish_reason]
        assert pb.FINISH_REASON_ABORT in reasons, reasons
        assert server.wait(60) == 0
        out.wait_for("INFO jetserve.server.app: stopped", timeout=10)
    finally:
        server.kill()
    log = "".join(out.lines)
    assert "stopping now: aborting 1 open stream(s)" in log, log
    # From the start to the drain, log records only: no progress bar sharing a line with them.
    start = log.split("second stop signal")[0]
    assert "\r" not in start and all(line.startswith(LOG_LEVELS) for line in start.splitlines()), start
    # The log names the model as clients do (its --served-model-name, default: --model as given).
    assert "serving %s" % tiny_model in log


def post(live, path, body: bytes):
    request = urllib.request.Request("http://127.0.0.1:%d%s" % (live.server.openai_port, path), data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_max_tokens_past_the_context_is_refused_naming_both_numbers(live, stubs):
    """As vLLM: prompt + max_tokens over max_model_len is a 400 (INVALID_ARGUMENT over gRPC), not a
    200 that quietly generates less than was asked."""
    room = live.engine.model_info.max_model_len - len(live.engine.tokenizer.encode("the kiosk"))
    status, body = post(live, "/v1/completions", json.dumps({"prompt": "the kiosk", "max_tokens": 10**9}).encode())
    assert status == 400 and body["error"]["param"] == "max_tokens", body
    assert "1000000000" in body["error"]["message"] and "only %d tokens are left" % room in body["error"]["message"]
    status, body = post(live, "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}).encode())
    assert status == 400 and body["error"]["param"] == "max_completion_tokens", body
    inference, _ = stubs
    with pytest.raises(grpc.RpcError) as refused:
        list(inference.Generate(pb.GenerateRequest(text="the kiosk", sampling=greedy(10**6))))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1000000" in refused.value.details() and "only %d tokens are left" % room in refused.value.details()
    # What fits is served, to the last token of room.
    status, body = post(live, "/v1/completions", json.dumps(
        {"prompt": "the kiosk", "max_tokens": room, "temperature": 0, "ignore_eos": True}).encode())
    assert status == 200 and body["usage"]["completion_tokens"] == room, body


@pytest.mark.parametrize("body, param, says", [
    (b'{"prompt": "hi", "temperature": -1}', "temperature", "temperature must be"),
    (b'{"prompt": "hi", "top_p": 2}', "top_p", "top_p must be"),
    (b'{"prompt": "hi", "n": 99}', "n", "less than or equal to 16"),
    (b'{"prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias", "token ids"),
    (b'{"prompt": "hi",', None, "not valid JSON"),
    (b'[1, 2]', None, "body: "),
])
def test_openai_errors_name_their_param(live, body, param, says):
    status, answer = post(live, "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == param and says in answer["error"]["message"], answer
