"""Is the controller still working? Its threads mark what they are busy with; a supervisor asks.

A thread that died, or one stuck in a single step (a callback, a registry write) longer than the
stall timeout, means the process no longer ingests: it should exit and be restarted rather than
sit there looking alive. Under systemd the same verdict gates the WATCHDOG=1 pings.
"""

import contextlib
import threading
import time


class Liveness:
    def __init__(self, stall_timeout):
        self.stall_timeout = stall_timeout
        self._lock = threading.Lock()
        self._threads = {}  # name → Thread that must stay alive
        self._busy = {}  # name → monotonic start of the step in progress

    def watch(self, name, thread):
        with self._lock:
            self._threads[name] = thread

    @contextlib.contextmanager
    def busy(self, name):
        """Mark one step of `name`'s work; a step that never ends is a stall."""
        with self._lock:
            self._busy[name] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._busy.pop(name, None)

    def problem(self):
        """What is wrong (a sentence), or None while every thread lives and keeps moving."""
        now = time.monotonic()
        with self._lock:
            for name, thread in self._threads.items():
                if not thread.is_alive():
                    return "the %s thread has stopped" % name
            for name, since in self._busy.items():
                if now - since > self.stall_timeout:
                    return "the %s thread is stuck (one step for %.0f s)" % (name, now - since)
        return None
