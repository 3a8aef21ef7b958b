"""A process's file descriptors, shared out once at start so that no client can take them all.

Every connection a client opens costs the server a descriptor, and RLIMIT_NOFILE caps them for the
whole process: past it accept() fails with EMFILE, and so do the MQTT reconnect, the database, the
log and the metrics endpoint. asyncio then retries accept() in a loop that feeds itself (one
retry timer per failed call of a batch as large as the listen backlog), so an idle flood also
pins a core. As nginx and envoy cap each listener below the process's limit, so here:

- `Budget`: the limit read at start (the soft one raised toward the hard one as far as the caps
  ask), what is already open, a reserve for everything that is not a client, and each listener's
  cap out of the rest.
- `Listener`: a listening socket whose accept() keeps to its cap. At the cap a newcomer takes the
  place of the oldest connection not being answered (so an idle flood cannot shut anyone out);
  with none such it is answered 503 (plain HTTP) or closed (TLS) at once, holding a descriptor
  only for that moment. An EMFILE anyway (something else took them) pauses
  accepting instead of retrying in a loop.
- `http_protocol`: uvicorn's HTTP/1.1, whose connections must deliver each request (headers and
  body) within a deadline: an idle or dribbling client (slowloris) is closed, not kept.

gRPC's C core accepts on its own threads; `grpc_options` gives it the same cap and deadline.
Standard library only at module level, Python 3.8 syntax (it is imported by the CLIs).
"""

import errno
import logging
import os
import resource
import socket
import time

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16384  # no listener's cap goes above this, whatever the limit
MIN_CONNECTIONS = 4  # a budget that leaves a listener fewer is a configuration error, said at start
MAX_DEADLINE_S = 60.0  # the longest request deadline a setting may ask for
PAUSE_S = 1.0  # accepting waits this long after an EMFILE: descriptors come back as connections close
REFUSE_AT_ONCE = 64  # refusals per accept() call: a flood cannot keep the event loop in one call
EVICTION_TURNS = 8  # event-loop turns newcomers may wait for an evicted connection to close
WARN_EVERY_S = 60.0  # the log says the cap is reached at most this often, not once a refusal
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def open_descriptors():
    """How many descriptors this process has open now (0 where /proc and /dev/fd are missing)."""
    for path in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(path)) - 1  # listdir's own
        except OSError:
            continue
    return 0


class Budget:
    """`wanted` maps each listener to the connections it would hold; `reserve` is what the rest of
    the process may still open after start (MQTT, database, log, metrics, an engine). The caps are
    the wanted ones when the limit allows, else each scaled down alike; one more descriptor per
    listener is kept for the connection it refuses."""

    def __init__(self, wanted, reserve):
        for name, n in wanted.items():
            if not isinstance(n, int) or not 1 <= n <= MAX_CONNECTIONS:
                raise ValueError("%s: max connections must be 1..%d, got %r" % (name, MAX_CONNECTIONS, n))
        self.in_use, self.reserve = open_descriptors(), reserve
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = self.in_use + reserve + sum(wanted.values()) + len(wanted)
        if soft != resource.RLIM_INFINITY and soft < need:
            raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                soft = raised
            except (ValueError, OSError) as exc:  # a sandbox may forbid it: live with the soft limit
                log.warning("cannot raise the file-descriptor limit from %d to %d: %s", soft, raised, exc)
        self.limit = soft
        spare = (MAX_CONNECTIONS * len(wanted) if soft == resource.RLIM_INFINITY
                 else soft - self.in_use - reserve - len(wanted))
        total = sum(wanted.values())
        self.caps = {name: n if spare >= total else spare * n // total for name, n in wanted.items()}
        if wanted and min(self.caps.values()) < MIN_CONNECTIONS:
            raise ValueError(
                "the file-descriptor limit (%d, %d open at start, %d kept for the rest of the process) leaves "
                "%s fewer than %d connections: raise LimitNOFILE= (ulimit -n) to at least %d"
                % (soft, self.in_use, reserve, min(self.caps, key=self.caps.get), MIN_CONNECTIONS, need))

    def __str__(self):
        return "file descriptors: limit %d, %d open at start, %d kept for the rest of the process; %s" % (
            self.limit, self.in_use, self.reserve,
            ", ".join("%s at most %d connections" % item for item in sorted(self.caps.items())))


def http_refusal(body, content_type="text/plain; charset=utf-8"):
    """The whole 503 a Listener sends past its cap, before it closes the connection."""
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: %s\r\nContent-Length: %d\r\nRetry-After: 1\r\n"
            b"Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\n%s"
            % (content_type.encode(), len(body), body))


class Listener(socket.socket):
    """A listening socket that keeps at most `cap` of the connections it accepted open, counted by
    their sockets (so one that a TLS handshake or the protocol dropped is counted out too).
    asyncio's selector loop accepts through it (uvloop would accept in C, past it): give it to
    uvicorn as `sockets=[...]`, and set `connections` to uvicorn's `server_state.connections` (of
    `http_protocol`) so that at the cap the oldest connection not being answered makes room,
    whatever it is waiting for: a TLS handshake, its request, the next one on a kept-alive
    connection. Only when every one is being answered is the newcomer refused."""

    @classmethod
    def wrap(cls, sock, cap, refusal=None):
        """`sock` (bound) as a Listener; `refusal` is what a refused connection gets (None: closed)."""
        listener = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        listener.cap, listener.refusal, listener.connections, listener.refused = cap, refusal, None, 0
        listener._open, listener._paused_until, listener._warned, listener._waits = [], 0.0, -WARN_EVERY_S, 0
        return listener

    def accept(self):
        if time.monotonic() < self._paused_until:  # the caller stops its batch and waits for readiness
            raise BlockingIOError(errno.EAGAIN, "accepting paused: out of file descriptors")
        if self._evicting():
            raise BlockingIOError(errno.EAGAIN, "waiting for an evicted connection to close")
        for _ in range(REFUSE_AT_ONCE):
            try:
                conn, address = super().accept()
            except OSError as exc:
                if exc.errno in OUT_OF_DESCRIPTORS:
                    # asyncio drops its reader on this error and adds it back a second later; the
                    # pause turns the rest of its batch into one quiet BlockingIOError.
                    self._paused_until = time.monotonic() + PAUSE_S
                raise
            # At the cap the descriptor kept for refusals holds the newcomer while an evicted
            # connection closes: never more than cap + 1 open.
            if self._room() or (len(self._open) == self.cap and self._evict()):
                self._open.append(conn)
                return conn, address
            self._refuse(conn)
        raise BlockingIOError(errno.EAGAIN, "refused %d connections past the cap" % REFUSE_AT_ONCE)

    def open_connections(self):
        self._open = [conn for conn in self._open if conn.fileno() != -1]
        return len(self._open)

    def _room(self):
        return len(self._open) < self.cap or self.open_connections() < self.cap

    def _evicting(self):
        """An evicted connection is still closing (its transport sees the shutdown on the loop's
        next turns): newcomers wait in the backlog, not refused (a browser opens several at once),
        for a few turns at most."""
        if len(self._open) <= self.cap or self.open_connections() <= self.cap or self._waits >= EVICTION_TURNS:
            self._waits = 0 if len(self._open) <= self.cap else self._waits
            return False
        self._waits += 1
        return True

    def _evict(self):
        """Shut down the oldest connection not being answered; False if there is none."""
        if self.connections is None:
            return False
        answering = set()
        for protocol in list(self.connections):
            sock = protocol.transport.get_extra_info("socket") if not protocol.arriving() else None
            if sock is not None:
                answering.add(sock.fileno())
        for conn in self._open:
            if conn.fileno() not in answering:
                try:  # its transport reads the end and closes it: the descriptor stays asyncio's to close
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return True
        return False

    def _refuse(self, conn):
        self.refused += 1
        if time.monotonic() - self._warned >= WARN_EVERY_S:
            self._warned = time.monotonic()
            log.warning("%s: %d connections open, the cap, all being answered: refusing new ones (%d so far)",
                        "%s:%d" % self.getsockname()[:2], self.cap, self.refused)
        try:
            conn.setblocking(False)
            if self.refusal is not None:
                try:  # what the client already sent: read, so that the close is a FIN and not a reset
                    conn.recv(65536)
                except OSError:
                    pass
                conn.send(self.refusal)
        except OSError:
            pass
        finally:
            conn.close()


def listen(host, port, cap, refusal=None):
    """A bound Listener on host:port (an IPv6 address as `::1`, with or without brackets)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return Listener.wrap(socket.create_server((host, port), family=family), cap, refusal)


def check_deadline(seconds):
    if not 0 < seconds <= MAX_DEADLINE_S:
        raise ValueError("the request deadline must be in (0, %g] seconds, got %r" % (MAX_DEADLINE_S, seconds))
    return seconds


def http_protocol(deadline_s):
    """uvicorn's HTTP/1.1 protocol, whose connections must deliver each request, headers and body,
    within `deadline_s` of opening or of their last answer (uvicorn itself times a connection out
    only once it has answered on it, and never while a request arrives)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    check_deadline(deadline_s)

    class RequestDeadline(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._answered = 0
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._answered += 1
            self._arm()

        def _arm(self):
            self.loop.call_later(deadline_s, self._expire, self._answered)

        def arriving(self):
            """No request is being answered: none yet, or one still arriving."""
            return (self.cycle is None or self.cycle.response_complete or self.cycle.more_body) \
                and not self.transport.is_closing()

        def _expire(self, answered):
            if answered == self._answered and self.arriving():
                self.transport.close()

    return RequestDeadline


def grpc_options(cap, deadline_s):
    """grpc.server options with the same limits: at most `cap` connections (past it grpc closes a
    new one at once), and a client must finish its HTTP/2 handshake within `deadline_s`."""
    return [("grpc.max_allowed_incoming_connections", cap),
            ("grpc.server_handshake_timeout_ms", int(check_deadline(deadline_s) * 1000))]
