"""A server's children live no longer than it, and what a dead server left behind is cleared.

Every process the server starts goes through `spawn`: the two ends of a socketpair join them,
and each end reads EOF the moment the other process is gone, however it went (SIGKILL, the OOM
killer, a crash), because the kernel closes a dead process's descriptors. The server watches its
end as the child's sentinel; the child (`hold`) watches its own from a thread and exits, with one
log line, even while its main thread is stuck (a step, or a send to a front end nobody reads).

On Linux the child also asks for a parent-death signal (prctl PR_SET_PDEATHSIG): it still comes
when a copy of the server's end outlives the server (a fork that kept it). The kernel sends that
signal when the *thread* that started the child ends, not its process: the engine core is started
by the server's loading thread, which ends once the model is loaded. So the signal only prompts a
look, and the child leaves only once it has a new parent.

A server's IPC sockets live in a directory of their own that it holds a lock on (`ipc_dir`). A
server killed before it could remove them leaves them behind; `clear_stale` removes them at the
next start, unless a process of the dead server's is still alive there, which it reports.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The parent-death signal: one nothing else sends us (the core ignores SIGTERM and SIGINT: its
# server drains first and then stops it).
DEATH_SIGNAL = signal.SIGUSR1
EXIT_ORPHANED = 3  # the exit status of a child whose server is gone
PREFIX = "jetserve-ipc-"


# -- the server's side ------------------------------------------------------------------------

def spawn(argv: list[str], **popen) -> tuple[subprocess.Popen, int]:
    """Start `argv` + [LIFELINE_FD, SERVER_PID] (for the child to `hold`); returns the process and
    the server's end of the lifeline, readable once the child is gone (close it when done)."""
    ours, theirs = socket.socketpair()  # not inheritable: no other child of ours keeps either end
    try:
        process = subprocess.Popen([*argv, str(theirs.fileno()), str(os.getpid())],
                                   pass_fds=(theirs.fileno(),), **popen)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, ours.detach()


def ipc_dir() -> tuple[str, int]:
    """A fresh directory for this server's IPC sockets, and the descriptor holding its lock (the
    lock ends with the process, so a dead server's directory is known as such). It is locked
    under a hidden name and then renamed: `clear_stale` never sees it unlocked."""
    staging = tempfile.mkdtemp(prefix="." + PREFIX)
    lock = os.open(staging, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = str(Path(staging).with_name(Path(staging).name[1:]))
        os.rename(staging, path)
    except BaseException:
        os.close(lock)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path, lock


def clear_stale(wait_s: float) -> list[tuple[str, list[int]]]:
    """Remove the IPC directories of dead servers (this user's, in this temp dir). One where a
    process of that server's still runs (its command line names the directory) is given `wait_s`
    to go on its own (its lifeline ends it); those still held then are returned with their pids."""
    deadline = time.monotonic() + wait_s
    while True:
        held = []
        for path in Path(tempfile.gettempdir()).glob(PREFIX + "*"):
            if _is_stale(path):
                pids = _processes_in(path)
                if pids:
                    held.append((path, pids))
                else:
                    shutil.rmtree(path, ignore_errors=True)
                    log.info("removed %s, left by a server that is gone", path)
        if not held or time.monotonic() >= deadline:
            return [(str(path), pids) for path, pids in held]
        time.sleep(0.1)


def _is_stale(path: Path) -> bool:
    """Ours, and no server holds its lock."""
    try:
        if path.lstat().st_uid != os.getuid() or not path.is_dir():
            return False
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # removed meanwhile
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its server is alive
    finally:
        os.close(fd)
    return True


def _processes_in(path: Path) -> list[int]:
    import psutil

    pids = []
    for process in psutil.process_iter(["cmdline"]):
        if any(str(path) in arg for arg in process.info["cmdline"] or ()):
            pids.append(process.pid)
    return pids


# -- the child's side -------------------------------------------------------------------------

def hold(fd: int, server_pid: int, on_gone: Callable[[], None] | None = None) -> None:
    """In the child, from its main thread, first thing: once the server `server_pid` is gone, log
    why, run `on_gone` (remove what only the server would have) and exit at once."""
    os.set_inheritable(fd, False)  # our own children must not keep our end open: the server's sentinel
    once = threading.Lock()

    def gone(why: str) -> None:
        if not once.acquire(blocking=False):
            return
        log.warning("the server (pid %d) is gone (%s): exiting", server_pid, why)
        try:
            if on_gone is not None:
                on_gone()
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(EXIT_ORPHANED)

    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 64):
                    break
            except OSError:
                break
        gone("its end of our lifeline closed")

    def on_death_signal(*_) -> None:
        if os.getppid() != server_pid:  # not merely the end of the thread that started us
            gone("parent-death signal")

    if sys.platform.startswith("linux"):
        signal.signal(DEATH_SIGNAL, on_death_signal)  # first: the signal may come at once
        _ask_parent_death_signal()
    if os.getppid() != server_pid:  # gone before we asked
        gone("not our parent any more")
    threading.Thread(target=watch, name="jetserve-lifeline", daemon=True).start()


def _ask_parent_death_signal() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(DEATH_SIGNAL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc: the lifeline alone
        pass
