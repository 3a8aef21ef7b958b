"""sd_notify over real Unix datagram sockets, path and abstract."""

import os
import socket
import time

import pytest

from jetserve import notify


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path, monkeypatch):
    """A socket like systemd's; NOTIFY_SOCKET points at it. Yields a function that reads one datagram."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    else:
        address = "@jetserve-test-%d-%d" % (os.getpid(), time.monotonic_ns())
        sock.bind("\0" + address[1:])
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)

    def receive(timeout=2.0):
        sock.settimeout(timeout)
        return sock.recv(4096).decode()

    yield receive
    sock.close()


def test_lines_arrive_as_one_datagram(notify_socket):
    assert notify.notify("READY=1", "STATUS=serving")
    assert notify_socket() == "READY=1\nSTATUS=serving"


def test_status_is_one_line(notify_socket):
    notify.status("loading\nweights  3/10")
    assert notify_socket() == "STATUS=loading weights 3/10"


def test_without_systemd_nothing_is_sent(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify("READY=1") is False


def test_a_missing_socket_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert notify.notify("READY=1") is False


def test_watchdog_period_is_half_of_watchdog_sec_and_only_for_us(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert notify.watchdog_period() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert notify.watchdog_period() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_period() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert notify.watchdog_period() is None
