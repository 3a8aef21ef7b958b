"""`jetserve serve` as systemd runs it: a subprocess with NOTIFY_SOCKET, stopped by SIGTERM."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server.conftest import free_port, greedy
from jetserve.cli import build_parser
from jetserve.server import cli
from jetserve.server.cli import demo_model_dir
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc


def jetserve(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "jetserve.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


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


def test_systemd_sees_ready_watchdog_stopping_and_sigterm_drains(tiny_model, tmp_path, notify_socket):
    """SIGTERM drains gRPC and the OpenAI API alike: open streams finish, new ones are refused."""
    config = tmp_path / "jetserve.toml"
    config.write_text('[serve]\ndevice = "cpu"\nnum-kv-blocks = 256\nmax-num-seqs = 2\n'
                      'drain-grace-period = 30\nmetrics-port = 0\n')
    env = dict(os.environ, NOTIFY_SOCKET=notify_socket.address, WATCHDOG_USEC="1000000")
    openai_port = free_port()
    # Flags override the file: max-num-seqs 2 there, 3 here.
    server = jetserve("serve", "--config", str(config), "--model", str(tiny_model), "--port", "0",
                      "--max-num-seqs", "3", "--openai-port", str(openai_port), env=env)
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

        open_stream = inference.Generate(pb.GenerateRequest(text="robot", sampling=greedy(400, ignore_eos=True)),
                                         timeout=120)
        first = next(open_stream)
        sdk = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % openai_port, api_key="-", max_retries=0)
        model = sdk.models.list().data[0].id
        open_http = iter(sdk.completions.create(model=model, prompt="kiosk", max_tokens=40, temperature=0,
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
        assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 400
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        rest_http = [first_http] + list(open_http)
        assert rest_http[-1].choices[0].finish_reason == "length"
        channel.close()
        assert server.wait(30) == 0
    finally:
        server.kill()
        output = server.communicate()[0]
    assert "Traceback" not in output, output


def test_streams_past_the_grace_period_are_cancelled(tiny_model, notify_socket):
    env = dict(os.environ, NOTIFY_SOCKET=notify_socket.address)
    server = jetserve("serve", "--model", str(tiny_model), "--device", "cpu", "--num-kv-blocks", "256",
                      "--port", "0", "--metrics-port", "0", "--openai-port", "0", "--drain-grace-period", "0.3",
                      env=env)
    try:
        target = re.search(r"on (\S+)", notify_socket.wait_for("READY=1", server)).group(1)
        with grpc.insecure_channel(target) as channel:
            stream = pb_grpc.InferenceServiceStub(channel).Generate(
                pb.GenerateRequest(text="robot", sampling=greedy(500, ignore_eos=True)), timeout=30)
            next(stream)
            server.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as cut:
                list(stream)
            assert cut.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert server.wait(30) == 0
    finally:
        server.kill()
        output = server.communicate()[0]
    assert "grace period" in output


def test_a_model_that_fails_to_load_exits_1_with_the_reason(tmp_path, notify_socket):
    env = dict(os.environ, NOTIFY_SOCKET=notify_socket.address)
    server = jetserve("serve", "--model", str(tmp_path), "--port", "0", "--metrics-port", "0", "--openai-port", "0",
                      env=env)
    output = server.communicate(timeout=60)[0]
    assert server.returncode == 1
    assert "config.json" in output
    assert "STOPPING=1" in notify_socket.wait_for("STOPPING=1", server, timeout=1)


def test_without_model_it_serves_the_bundled_demo(notify_socket):
    env = dict(os.environ, NOTIFY_SOCKET=notify_socket.address)
    server = jetserve("serve", "--device", "cpu", "--max-model-len", "512", "--port", "0", "--metrics-port", "0",
                      "--openai-port", "0", env=env)
    try:
        target = re.search(r"on (\S+)", notify_socket.wait_for("READY=1", server)).group(1)
        with grpc.insecure_channel(target) as channel:
            info = pb_grpc.InferenceServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert Path(info.model) == Path(demo_model_dir()) and info.has_chat_template
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
    finally:
        server.kill()
        server.communicate()


def test_without_model_or_demo_it_says_to_pass_model(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "demo_model_dir", lambda: str(tmp_path))  # an install without the demo
    args = build_parser().parse_args(["serve"])
    with pytest.raises(SystemExit) as exit_:
        args.func(args)
    assert "demo model is not bundled" in str(exit_.value) and "--model" in str(exit_.value)
