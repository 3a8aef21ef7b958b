"""Real parts for the agent and fleet tests: a mosquitto on a loopback port, a gRPC service
implementing jetserve.v1 ControlService/GetStats (+ grpc.health.v1), and the agent and the controller
as `python -m jetserve.cli` processes. Everything started here is stopped here.
"""

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

from jetserve.v1 import inference_pb2, inference_pb2_grpc

SYSROOTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sysroots")
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout, interval=0.05, what="condition"):
    """Poll until predicate() is truthy; returns its value or fails the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail("timed out after %.1fs waiting for %s" % (timeout, what))
        time.sleep(interval)


def copy_sysroot(name, dest):
    """A writable copy of a fixture sysroot (device-tree symlink kept)."""
    path = os.path.join(str(dest), name)
    shutil.copytree(os.path.join(SYSROOTS, name), path, symlinks=True)
    return path


def set_zone_temp(sysroot, zone_type, millideg):
    """Write a zone's `temp` the way the kernel shows it (millidegrees, newline)."""
    base = os.path.join(sysroot, "sys/devices/virtual/thermal")
    for zone in os.listdir(base):
        with open(os.path.join(base, zone, "type")) as f:
            if f.read().strip() == zone_type:
                tmp = os.path.join(base, zone, "temp.tmp")
                with open(tmp, "w") as f:
                    f.write("%d\n" % millideg)
                os.replace(tmp, os.path.join(base, zone, "temp"))
                return
    raise KeyError(zone_type)


class Broker:
    """A real mosquitto on 127.0.0.1:<free port>, with persistence so a restart keeps sessions."""

    def __init__(self, workdir, extra=""):
        self.dir, self.port = str(workdir), free_port()
        self.conf = os.path.join(self.dir, "mosquitto.conf")
        with open(self.conf, "w") as f:
            # `user`: stay the test's user (as root mosquitto would drop to `mosquitto`, who cannot
            # read pytest's private tmp dirs).
            f.write("user %s\nlistener %d 127.0.0.1\npersistence true\npersistence_location %s/\n"
                    "log_dest file %s/mosquitto.log\n%s\n"
                    % (getpass.getuser(), self.port, self.dir, self.dir, extra or "allow_anonymous true"))
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([MOSQUITTO, "-c", self.conf], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mosquitto did not start: %s" % self.proc.stderr.read().decode())
                time.sleep(0.05)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self.proc.stderr.close()
        self.proc = None

    def log(self):
        with open(os.path.join(self.dir, "mosquitto.log")) as f:
            return f.read()


@pytest.fixture
def broker(tmp_path):
    workdir = tmp_path / "broker"
    workdir.mkdir()
    running = Broker(workdir).start()
    yield running
    running.stop()


class Process:
    """A `python -m jetserve.cli ...` child with its output in a file; stopped by the fixture."""

    def __init__(self, args, log_path):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "jetserve.cli"] + [str(a) for a in args],
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env)

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self, sig=signal.SIGTERM, timeout=15):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def spawn(tmp_path):
    """spawn(name, *cli_args) → a running Process; all are stopped at the end of the test."""
    started = []

    def start(name, *args):
        process = Process(list(args), str(tmp_path / ("%s-%d.log" % (name, len(started)))))
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop()


def agent_args(broker, sysroot, state_dir, device, service, *extra):
    return ["agent", "--sysroot", sysroot, "--mqtt-port", broker.port, "--fleet", "lab",
            "--device-id", device, "--state-dir", state_dir, "--service", service,
            "--service-timeout", "1", "--no-jtop", "--reconnect-max", "1"] + list(extra)


def controller_args(broker, db, *extra):
    return ["fleet", "run", "--db", db, "--mqtt-port", broker.port, "--http", "",
            "--client-id", "controller-%d" % broker.port, "--keepalive", "5"] + list(extra)


class FakeService(inference_pb2_grpc.ControlServiceServicer, inference_pb2_grpc.InferenceServiceServicer):
    """The service side of jetserve.v1 ControlService and GetStats, recording every call."""

    def __init__(self, max_num_seqs=8, num_speculative_tokens=3):
        self.max_num_seqs, self.num_speculative_tokens, self.draining = max_num_seqs, num_speculative_tokens, False
        self.calls, self._lock = [], threading.Lock()

    def _reply(self, name, **fields):
        with self._lock:
            self.calls.append((name, fields))
        return getattr(inference_pb2, name + "Response")(
            draining=self.draining, max_num_seqs=self.max_num_seqs,
            num_speculative_tokens=self.num_speculative_tokens, message=name)

    def Drain(self, request, context):
        self.draining = True
        self.health.set("", self.health_pb2.HealthCheckResponse.NOT_SERVING)
        return self._reply("Drain")

    def Resume(self, request, context):
        self.draining = False
        self.health.set("", self.health_pb2.HealthCheckResponse.SERVING)
        return self._reply("Resume")

    def SetLimits(self, request, context):
        fields = {}
        if request.HasField("max_num_seqs"):
            self.max_num_seqs = fields["max_num_seqs"] = request.max_num_seqs
        if request.HasField("num_speculative_tokens"):
            self.num_speculative_tokens = fields["num_speculative_tokens"] = request.num_speculative_tokens
        return self._reply("SetLimits", **fields)

    def GetStats(self, request, context):
        return inference_pb2.GetStatsResponse(max_num_seqs=self.max_num_seqs, draining=self.draining,
                                              speculative=inference_pb2.SpeculativeStats(
                                                  num_speculative_tokens=self.num_speculative_tokens))

    def control_calls(self):
        with self._lock:
            return list(self.calls)


@pytest.fixture
def service():
    """A live gRPC server on loopback with ControlService, InferenceService.GetStats and grpc.health.v1."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    fake = FakeService()
    fake.health, fake.health_pb2 = health.HealthServicer(), health_pb2
    fake.health.set("", health_pb2.HealthCheckResponse.SERVING)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    inference_pb2_grpc.add_ControlServiceServicer_to_server(fake, server)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(fake, server)
    health_pb2_grpc.add_HealthServicer_to_server(fake.health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    fake.address = "127.0.0.1:%d" % port
    yield fake
    server.stop(grace=None)
