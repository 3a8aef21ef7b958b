"""sd_notify, written out: systemd learns that we are ready, what we are doing, that we are alive.

Shared by the inference service and the fleet controller (both `Type=notify` with a watchdog).

The protocol is one datagram of `KEY=value` lines to the Unix socket named in $NOTIFY_SOCKET
(a leading `@` means Linux's abstract namespace). It is small enough that a dependency on
python-systemd would cost more than it saves. Outside systemd every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*lines: str) -> bool:
    """Send `KEY=value` lines in one datagram; False when not under systemd or the send failed."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(lines).encode(), address)
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", os.environ["NOTIFY_SOCKET"], exc)
        return False
    return True


def status(text: str) -> bool:
    """STATUS= is one line shown by `systemctl status`."""
    return notify("STATUS=" + " ".join(text.split()))


def watchdog_period() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when no watchdog is armed."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
