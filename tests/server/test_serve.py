"""`jetserve serve` as systemd runs it: a subprocess with NOTIFY_SOCKET, stopped by SIGTERM."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server.conftest import LONG_CONTEXT, free_port, greedy
from jetserve.cli import build_parser
from jetserve.server import cli
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc


def jetserve(*args, env=None, **kwargs):
    # One torch thread: on a busy 2-core machine a second one spins at every op's barrier.
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "jetserve.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **kwargs)


class NotifySocket:
    """The receiving end systemd would hold, collecting every datagram."""

    def __init__(self, path):
        self.address = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.address)
        self.sock.settimeout(0.2)
        self.received = []

    def wait_for(self, line, process, timeout=60):
        """Read until a datagram holds `line`; returns that datagram."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                datagram = self.sock.recv(4096).decode()
            except socket.timeout:
                if process.poll() is not None:
                    raise AssertionError("jetserve exited: %s" % process.communicate()[0]) from None
                continue
            self.received.append(datagram)
            if line in datagram.split("\n"):
                return datagram
        raise AssertionError("no %s within %ss; got %r" % (line, timeout, self.received))


@pytest.fixture
def notify_socket(tmp_path):
    sock = NotifySocket(tmp_path / "notify")
    yield sock
    sock.sock.close()


OPEN_TOKENS = 448  # the tiny model's 512 positions, less room for the prompts


def test_systemd_sees_ready_watchdog_stopping_and_sigterm_drains(tiny_model, tmp_path, notify_socket):
    """SIGTERM drains gRPC and the OpenAI API alike: open streams finish, new ones are refused."""
    config = tmp_path / "jetserve.toml"
    config.write_text('[serve]\ndevice = "cpu"\nnum-kv-blocks = 256\nmax-num-seqs = 2\n'
                      'drain-grace-period = 30\nmetrics-port = 0\n')
    env = dict(os.environ, NOTIFY_SOCKET=notify_socket.address, WATCHDOG_USEC="1000000")
    openai_port = free_port()
    # Flags override the file: max-num-seqs 2 there, 3 here.
    server = jetserve("serve", str(tiny_model), "--config", str(config), "--port", "0", "--max-num-seqs", "3",
                      "--openai-port", str(openai_port), "--served-model-name", "kiosk-llm", env=env)
    try:
        ready = notify_socket.wait_for("READY=1", server)
        assert any("loading" in d for d in notify_socket.received[:-1]), notify_socket.received  # STATUS= first
        target = re.search(r"STATUS=serving .* on (\S+)", ready).group(1)
        notify_socket.wait_for("WATCHDOG=1", server, timeout=5)

        channel = grpc.insecure_channel(target)
        inference, control = pb_grpc.InferenceServiceStub(channel), pb_grpc.ControlServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        stats = inference.GetStats(pb.GetStatsRequest(), timeout=10)
        assert (stats.max_num_seqs, stats.kv_blocks_total) == (3, 256)  # flag over file, file over default

        # No deadline: on a loaded machine the stream may take long; pytest's timeout bounds the test.
        # Long enough (near max_model_len) that on a fast machine the streams outlive the probes
        # below: the drain ends, and the port closes, when the last open stream does.
        open_stream = inference.Generate(pb.GenerateRequest(text="robot", sampling=greedy(OPEN_TOKENS, ignore_eos=True)))
        first = next(open_stream)
        sdk = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % openai_port, api_key="-", max_retries=0)
        model = sdk.models.list().data[0].id
        assert model == "kiosk-llm"
        open_http = iter(sdk.completions.create(model=model, prompt="kiosk", max_tokens=OPEN_TOKENS, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        first_http = next(open_http)
        server.send_signal(signal.SIGTERM)
        notify_socket.wait_for("STOPPING=1", server, timeout=10)

        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            list(inference.Generate(pb.GenerateRequest(text="hi", sampling=greedy(2)), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        with pytest.raises(grpc.RpcError) as resumed:
            control.Resume(pb.ResumeRequest(), timeout=10)
        assert resumed.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        with pytest.raises(openai.APIStatusError) as refused_http:
            sdk.completions.create(model=model, prompt="hi", max_tokens=2)
        assert refused_http.value.status_code == 503

        rest = list(open_stream)  # the open streams still run to their end
        assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == OPEN_TOKENS
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        rest_http = [first_http] + list(open_http)
        assert rest_http[-1].choices[0].finish_reason == "length"
        channel.close()
        assert server.wait(30) == 0
    finally:
        server.kill()
        output = server.communicate()[0]
    assert "Traceback" not in output, output


WANTED = 60_000


def test_streams_past_the_grace_period_end_with_finish_reason_abort(tiny_long_model, notify_socket):
    env = dict(os.environ, NOTIFY_SOCKET=notify_socket.address)
    server = jetserve("serve", "--model", str(tiny_long_model), "--device", "cpu", "--max-model-len", str(LONG_CONTEXT),
                      "--num-kv-blocks", str(LONG_CONTEXT // 16 + 8),
                      "--port", "0", "--metrics-port", "0", "--openai-port", "0", "--drain-grace-period", "0.3",
                      env=env)
    try:
        target = re.search(r"on (\S+)", notify_socket.wait_for("READY=1", server)).group(1)
        with grpc.insecure_channel(target) as channel:
            # Tens of thousands of steps: seconds on the fastest machine, far past the 0.3 s grace.
            stream = pb_grpc.InferenceServiceStub(channel).Generate(
                pb.GenerateRequest(text="robot", sampling=greedy(WANTED, ignore_eos=True)))
            next(stream)
            server.send_signal(signal.SIGTERM)
            rest = list(stream)  # a clean end (status OK): no exception
            assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
            assert 1 + sum(len(m.token_ids) for m in rest) < WANTED and rest[-1].usage.completion_tokens > 0
            assert stream.code() == grpc.StatusCode.OK
        assert server.wait(30) == 0
    finally:
        server.kill()
        output = server.communicate()[0]
    assert "grace period" in output


def test_a_model_that_fails_to_load_exits_1_with_one_line(tmp_path, notify_socket):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    env = dict(os.environ, NOTIFY_SOCKET=notify_socket.address)
    server = jetserve("serve", "--model", str(tmp_path), "--port", "0", "--metrics-port", "0", "--openai-port", "0",
                      env=env)
    output = server.communicate(timeout=120)[0]
    assert server.returncode == 1
    assert re.search(r"config.json lacks '\w+'", output) and "Traceback" not in output, output
    assert "STOPPING=1" in notify_socket.wait_for("STOPPING=1", server, timeout=1)


@pytest.mark.parametrize("model", ["missing", "empty"])
def test_a_missing_or_empty_model_dir_is_one_line_and_exit_1(tmp_path, model):
    path = tmp_path / model
    if model == "empty":
        path.mkdir()
    done = subprocess.run([sys.executable, "-m", "jetserve.cli", "serve", "--model", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "jetserve serve: --model %s %s (expected a Hugging Face checkpoint directory)"
        % (path, "is not a directory" if model == "missing" else "has no config.json")]


def test_a_port_in_use_is_refused_with_its_number(tiny_model):
    """grpcio would share a port whose owner set SO_REUSEPORT (its own default): we never do."""
    with socket.socket() as owner:
        owner.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        owner.bind(("127.0.0.1", 0))
        owner.listen()
        port = owner.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "jetserve.cli", "serve", "--model", str(tiny_model),
                               "--device", "cpu", "--port", str(port), "--metrics-port", "0"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "port %d is in use" % port in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_without_model_it_serves_the_bundled_demo(notify_socket):
    env = dict(os.environ, NOTIFY_SOCKET=notify_socket.address)
    server = jetserve("serve", "--device", "cpu", "--max-model-len", "512", "--port", "0", "--metrics-port", "0",
                      "--openai-port", "0", env=env)
    try:
        target = re.search(r"on (\S+)", notify_socket.wait_for("READY=1", server)).group(1)
        with grpc.insecure_channel(target) as channel:
            info = pb_grpc.InferenceServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.model == "demo" and info.has_chat_template  # the name /v1/models gives, not a path
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=30)[0]
        assert server.returncode == 0
        # The start log says what the demo's answers will look like, before they look broken.
        assert "serving demo (the bundled demo" in output and "Python-looking text" in output, output
    finally:
        server.kill()
        server.communicate()


def test_without_model_or_demo_it_says_to_pass_model(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "demo_model_dir", lambda: str(tmp_path))  # an install without the demo
    args = build_parser().parse_args(["serve"])
    with pytest.raises(SystemExit) as exit_:
        args.func(args)
    assert "demo model is not bundled" in str(exit_.value) and "--model" in str(exit_.value)


FROZEN_PROBE = r"""
import gc, json, os, signal, sys, threading, urllib.request

from jetserve.cli import main

port = int(sys.argv[1])


def probe():
    # Once serving (the model loaded: start-up's heap frozen), the modules the first streamed
    # answer imports on the event loop, and what the collector still scans against what start-up
    # froze out of its scans.
    while not gc.get_freeze_count():
        threading.Event().wait(0.05)
    before = set(sys.modules)
    body = json.dumps({"prompt": "The kiosk", "max_tokens": 8, "stream": True}).encode()
    while True:
        try:
            request = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                if b"[DONE]" in response.read():
                    break
        except OSError:
            threading.Event().wait(0.2)
    print("HEAP " + json.dumps({"frozen": gc.get_freeze_count(), "scanned": len(gc.get_objects()),
                                "imported": sorted(set(sys.modules) - before)}), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


threading.Thread(target=probe, daemon=True).start()
sys.exit(main(sys.argv[2:]))
"""


def test_the_startup_heap_is_out_of_the_collectors_scans(tiny_model):
    """Once `jetserve serve` serves, what start-up made (modules, tokenizer, apps) is frozen out of
    the garbage collector's scans, so a full collection on the event loop walks the requests'
    objects, not the whole heap: before, the first streamed answer's first byte waited for such a
    collection (bench/results/first-stream-cpu has the times). Nor does that answer import
    anything: anyio's backend once loaded at the first stream, on the event loop."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", FROZEN_PROBE, str(port), "serve", "--model", str(tiny_model),
                           "--device", "cpu", "--max-model-len", "512", "--port", "0", "--metrics-port", "0",
                           "--openai-port", str(port)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    heap = json.loads(done.stdout.split("HEAP ", 1)[1].splitlines()[0])
    assert heap["frozen"] > 10 * heap["scanned"], heap
    assert heap["imported"] == [], "the first streamed answer waited for these imports"
