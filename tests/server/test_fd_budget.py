"""Issue 34 on the device service: idle floods on its OpenAI and gRPC ports, with its descriptors
limited as a unit would limit them. Each port answers (or refuses) within 2 s, the other port
keeps serving, the process stays idle and under its limit, and the idle connections are closed
at the request or handshake deadline.

A real `jetserve serve` child (the bundled demo model, CPU) under a small RLIMIT_NOFILE; its CPU
time and open descriptors are read from /proc."""

import json
import os
import re
import resource
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jetserve.server import app, openai_api
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc
from tests.agent.conftest import REPO, free_port, wait_for
from tests.fleet.test_fd_budget import ANSWER_S, MAX_CPU_S, WINDOW_S, Limited, answer, flood
from tests.server.conftest import greedy

NOFILE = 160
FLOOD = 200  # more connections than the whole limit


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """`jetserve serve` on the demo model, loaded; (child, gRPC port, OpenAI port, caps)."""
    grpc_port, openai_port = free_port(), free_port()
    child = Limited(["-m", "jetserve.cli", "serve", "--device", "cpu", "--max-num-seqs", "2", "--port", grpc_port,
                     "--openai-port", openai_port, "--metrics-port", "0"],
                    str(tmp_path_factory.mktemp("fd") / "serve.log"), NOFILE)
    wait_for(lambda: "serving" in child.output() or child.proc.poll() is not None, 240, interval=0.2,
             what="the demo model to load")
    assert child.proc.poll() is None, child.output()
    caps = {name: int(n) for name, n in re.findall(r"(gRPC|OpenAI) at most (\d+) connections", child.output())}
    assert set(caps) == {"gRPC", "OpenAI"} and max(caps.values()) < NOFILE // 2, child.output()
    yield child, grpc_port, openai_port, caps
    child.stop()


def generate(port):
    with grpc.insecure_channel("127.0.0.1:%d" % port) as channel:
        request = pb.GenerateRequest(text="robot", sampling=greedy(4, ignore_eos=True))
        return sum(len(r.token_ids) for r in pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=30))


def health(port):
    """(status name or the gRPC error code, seconds) of one Health.Check, given ANSWER_S."""
    start = time.monotonic()
    with grpc.insecure_channel("127.0.0.1:%d" % port) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
            outcome = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as err:
            outcome = err.code()
    return outcome, time.monotonic() - start


def closed_by_server(connections, within):
    """Every connection reaches EOF (or a reset) from the server's side within `within` s."""
    deadline = time.monotonic() + within
    for s in connections:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass


def test_an_idle_flood_on_the_openai_port_leaves_it_answering_grpc_serving_and_the_cpu_idle(service):
    child, grpc_port, openai_port, caps = service
    base = "http://127.0.0.1:%d" % openai_port
    assert answer(base + "/health")[0] == 200
    before = child.open_fds()
    idle = flood(openai_port, FLOOD)
    try:
        wait_for(lambda: child.open_fds() >= before + caps["OpenAI"] - 2, 10, what="the flood to fill the cap")
        cpu, start = child.cpu_seconds(), time.monotonic()
        outcomes = [answer(base + path) for path in ("/health", "/v1/models", "/health")]
        tokens = generate(grpc_port)  # the other front end has its own cap
        time.sleep(max(0.0, WINDOW_S - (time.monotonic() - start)))
        spent, window = child.cpu_seconds() - cpu, time.monotonic() - start
        fds = child.open_fds()
        print("caps %s; OpenAI answers %s; gRPC %d tokens; CPU %.2f s over %.1f s (a generation included); "
              "%d fds of %d" % (caps, [(s, round(t, 3)) for s, _, t in outcomes], tokens, spent, window, fds, NOFILE))
        # Idle connections give their places up: the API itself answers.
        assert all(status == 200 and seconds < ANSWER_S for status, _, seconds in outcomes), outcomes
        assert json.loads(outcomes[1][1])["data"][0]["id"] == "demo"
        assert tokens == 4
        assert spent <= MAX_CPU_S + 1.0, "%.2f s of CPU in %.1f s" % (spent, window)
        assert fds <= NOFILE - app.RESERVE_FDS // 2, "descriptors kept for the rest of the process"
        # Slowloris: the admitted idle connections are closed at the request deadline.
        closed_by_server(idle, openai_api.REQUEST_DEADLINE_S + 20)
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: answer(base + "/health")[0] == 200, 10, what="the OpenAI port after the flood")
    assert "out of system resource" not in child.output()


def test_an_idle_flood_on_the_grpc_port_is_refused_at_once_and_closed_at_the_handshake_deadline(service):
    child, grpc_port, openai_port, caps = service
    assert health(grpc_port)[0] == "SERVING"
    idle = flood(grpc_port, FLOOD)
    try:
        cpu, start = child.cpu_seconds(), time.monotonic()
        outcomes = [health(grpc_port) for _ in range(3)]
        page = answer("http://127.0.0.1:%d/health" % openai_port)
        time.sleep(max(0.0, WINDOW_S - (time.monotonic() - start)))
        spent, window = child.cpu_seconds() - cpu, time.monotonic() - start
        fds = child.open_fds()
        print("caps %s; gRPC health %s; OpenAI /health %s; CPU %.2f s over %.1f s; %d fds of %d"
              % (caps, outcomes, page[0], spent, window, fds, NOFILE))
        assert all(outcome in ("SERVING", grpc.StatusCode.UNAVAILABLE) and seconds < ANSWER_S + 0.5
                   for outcome, seconds in outcomes), outcomes
        assert page[0] == 200
        assert spent <= MAX_CPU_S, "%.2f s of CPU in %.1f s" % (spent, window)
        assert fds <= NOFILE - app.RESERVE_FDS // 2
        closed_by_server(idle, app.HANDSHAKE_TIMEOUT_S + 20)
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: health(grpc_port)[0] == "SERVING", 10, what="gRPC after the flood")


def test_the_service_unit_limit_fits_both_caps():
    with open(os.path.join(REPO, "systemd", "jetserve.service")) as f:
        limit = int(re.search(r"^LimitNOFILE=(\d+)$", f.read(), re.M).group(1))
    code = ("from jetserve.fdbudget import Budget; from jetserve.server import app\n"
            "print(Budget(app.MAX_CONNECTIONS, app.RESERVE_FDS).caps == app.MAX_CONNECTIONS)")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=REPO, timeout=60, check=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    assert out.stdout.strip() == b"True", "LimitNOFILE=%d leaves fewer than %s" % (limit, app.MAX_CONNECTIONS)
