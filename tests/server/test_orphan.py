"""A server killed outright (SIGKILL, as the OOM killer kills) takes its engine core with it, leaves
no IPC sockets behind, and the next server on the same ports serves; a process of a dead server's
that still runs is refused with its pid."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server.conftest import free_port, greedy
from tests.server.test_serve import NotifySocket, jetserve
from jetserve.engine import lifeline
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

GONE_WITHIN_S = 5.0
ROUNDS = 5
STREAMS = 12  # of 450 tokens: at most 4 a step (the demo drafts 3)


def alive(pids):
    """Those still running (a zombie holds no memory: it only waits for its parent to reap it)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def wait_until(condition, timeout):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A temp dir of the test's own for the IPC directories (those of other servers on this
    machine are not the test's to count); tempfile's cached choice too, for this process."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


@pytest.mark.timeout(900)  # six loads of the demo model: minutes on a busy 2-core machine
def test_a_server_killed_with_sigkill_leaves_no_process_and_no_ipc_files(run_dir, tmp_path):
    notify = NotifySocket(tmp_path / "notify")
    env = dict(os.environ, NOTIFY_SOCKET=notify.address)
    ports = {"--port": free_port(), "--metrics-port": free_port(), "--openai-port": free_port()}
    flags = [str(x) for pair in ports.items() for x in pair]
    target = "127.0.0.1:%d" % ports["--port"]
    server = None
    try:
        for attempt in range(ROUNDS + 1):
            # The demo model on the CPU, on the same ports every round: the last round's are free again.
            server = jetserve("serve", "--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "1", *flags,
                              env=env)
            notify.wait_for("READY=1", server)
            with grpc.insecure_channel(target) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING
                if attempt == ROUNDS:
                    break
                tree = [server.pid] + [p.pid for p in psutil.Process(server.pid).children(recursive=True)]
                assert len(tree) >= 2, tree  # the server and its engine core
                assert len(list(run_dir.glob(lifeline.PREFIX + "*"))) == 1  # the core's IPC sockets
                # Streams one at a time (--max-num-seqs 1), more steps in all than the core's output
                # queue holds (ZMQ's high-water mark, 1000 messages): a core left to finish them
                # would block on a send nobody reads rather than go idle and look at its parent.
                stub = pb_grpc.InferenceServiceStub(channel)
                streams = [stub.Generate(pb.GenerateRequest(text="robot", sampling=greedy(450, ignore_eos=True)))
                           for _ in range(STREAMS)]
                next(streams[0])  # the core is mid-stream: stepping and sending, not idle
                server.kill()
                killed = time.monotonic()
                gone = wait_until(lambda: not alive(tree) and not list(run_dir.glob(lifeline.PREFIX + "*")),
                                  GONE_WITHIN_S)
                elapsed = time.monotonic() - killed
                left = alive(tree)
                for pid in left:  # a failure leaves nothing behind either
                    os.kill(pid, signal.SIGKILL)
                for stream in streams:
                    stream.cancel()
            output = server.communicate(timeout=10)[0]  # its end: every process that held its stdout is gone
            assert gone, "after %.1f s: alive %s, left %s\n%s" % (
                elapsed, left, list(run_dir.iterdir()), output)
            assert output.count("is gone") == 1 and "Traceback" not in output, output  # the core said why, once
            print("round %d: the server's tree and IPC files gone %.2f s after SIGKILL" % (attempt, elapsed))
        server.send_signal(signal.SIGTERM)  # and the ordinary stop still drains and ends it all
        assert server.wait(30) == 0
        assert not list(run_dir.glob(lifeline.PREFIX + "*"))
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.communicate()
        notify.sock.close()


CHILD = """
import logging, sys, time
from jetserve.engine import lifeline
logging.basicConfig(filename=sys.argv[1], level=logging.INFO, format="%(message)s")
lifeline.hold(int(sys.argv[-2]), int(sys.argv[-1]))
print("held", flush=True)
time.sleep(120)
"""

# A server that starts its child from a thread that then ends (as the engine core is started by
# the loading thread) and, with "fork", forks a process that keeps a copy of its end of the lifeline.
SERVER = """
import os, subprocess, sys, threading, time
from jetserve.engine import lifeline
started = []

def start():  # and wait, as the loading thread waits for Ready, until the child has asked for its signal
    started.append(lifeline.spawn([sys.executable, "-c", sys.argv[1], sys.argv[3]], stdout=subprocess.PIPE, text=True))
    assert started[0][0].stdout.readline() == "held\\n"

thread = threading.Thread(target=start)
thread.start()
thread.join()
child, sentinel = started[0]
if sys.argv[2] == "fork" and os.fork() == 0:
    time.sleep(120)  # keeps the server's end open
    os._exit(0)
time.sleep(0.5)  # the parent-death signal for the thread's end has come by now
print(child.pid, child.poll(), flush=True)
if sys.argv[2] == "closed":  # as the dead server's end would be, whatever still runs
    sys.stdin.readline()
    os.close(sentinel)
time.sleep(120)  # until the test kills us
"""


@pytest.mark.parametrize("how", ["killed", "killed-with-a-fork", "closed"])
def test_a_child_outlives_the_thread_that_started_it_but_not_its_server(how, tmp_path):
    """The end of the thread that started the child ends nothing; the server's death does, by
    both means (whichever comes first says so): the parent-death signal (Linux) even where a fork
    kept the server's end of the lifeline open, and the lifeline's EOF on its own."""
    if how == "killed-with-a-fork" and not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    log = tmp_path / "child.log"
    server = subprocess.Popen([sys.executable, "-c", SERVER, CHILD, how.replace("killed-with-a-", ""), str(log)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    forked = []
    try:
        child, code = server.stdout.readline().split()
        child = int(child)
        assert code == "None"  # alive, after the thread that started it ended
        forked = [p.pid for p in psutil.Process(server.pid).children() if p.pid != child]
        assert len(forked) == (how == "killed-with-a-fork")
        assert log.read_text() == ""
        if how == "closed":
            server.stdin.write("close\n")
            server.stdin.flush()
        else:
            server.kill()
        assert wait_until(lambda: not alive([child]), GONE_WITHIN_S), "the child outlived its server"
        why = {"killed": "(parent-death signal|its end of our lifeline closed)",
               "killed-with-a-fork": "parent-death signal", "closed": "its end of our lifeline closed"}[how]
        assert re.fullmatch(r"the server \(pid %d\) is gone \(%s\): exiting\n" % (server.pid, why), log.read_text())
        assert alive(forked) == forked  # the fork still holds the server's end
    finally:
        server.kill()
        server.wait()
        for pid in alive(forked):
            os.kill(pid, signal.SIGKILL)


def dead_servers_ipc_dir():
    """The IPC directory of a server that made it and died: nothing removed it."""
    made = subprocess.run([sys.executable, "-c", "from jetserve.engine import lifeline; print(lifeline.ipc_dir()[0])"],
                          capture_output=True, text=True, check=True)
    return made.stdout.strip()


def test_the_next_start_clears_a_dead_servers_ipc_dir_and_refuses_one_still_held(run_dir, tiny_model):
    stale = dead_servers_ipc_dir()
    assert os.path.dirname(stale) == str(run_dir)
    Path(stale, "input").touch()
    mine, lock = lifeline.ipc_dir()  # a live server's (this process's): never touched
    try:
        assert lifeline.clear_stale(0) == []
        assert not os.path.exists(stale) and os.path.isdir(mine)

        # Again, but a process of that server's still runs there (its command line names the directory).
        stale = dead_servers_ipc_dir()
        orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "ipc://%s/input" % stale])
        refused = None
        try:
            # Popen returns once the child's exec is past its point of no return, which comes before
            # the kernel sets up the new command line: until then /proc/PID/cmdline reads empty (a
            # loaded machine stretches that moment), and the scan would take the directory as free.
            assert wait_until(lambda: any(stale in arg for arg in psutil.Process(orphan.pid).cmdline()), 30)
            assert lifeline.clear_stale(0.2) == [(stale, [orphan.pid])] and os.path.isdir(stale)
            refused = jetserve("serve", "--model", str(tiny_model), "--device", "cpu", "--port", "0",
                               "--metrics-port", "0", "--openai-port", "0")
            output = refused.communicate(timeout=120)[0]
            assert refused.returncode == 1, output
            assert ("process %d, started by an earlier jetserve server that is gone, still runs" % orphan.pid) in output
            assert "kill %d" % orphan.pid in output and "Traceback" not in output, output
        finally:
            orphan.kill()
            orphan.wait()
            if refused is not None and refused.poll() is None:
                refused.kill()
                refused.communicate()
        assert lifeline.clear_stale(0) == [] and not os.path.exists(stale)
    finally:
        shutil.rmtree(mine)
        os.close(lock)
