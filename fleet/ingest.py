"""Group commit: the MQTT thread queues each message as it came (topic and payload bytes); one
writer checks what is waiting, stores it as one registry transaction and only then acknowledges it
to the broker.

Why one transaction for many: applying each message in its own transaction cost a commit and
several database round trips a message, and with PostgreSQL that is what held two replicas behind
1,000 devices. A batch here is whatever waits (up to MAX_BATCH messages or BATCH_BYTES of
payload), stored by `Registry.apply` in a few statements whatever its size; a quiet fleet gets
batches of one and no added delay.

Why the queue holds bytes, not checked documents: a parsed document costs several times its
payload in Python objects, and the queue is full exactly when the fleet comes back at once (a
broker restart, a controller's start with its session's backlog). Queued as received, the
queue's worst case is its byte bound, whatever the devices send; only the batch being stored is
ever parsed. Checking costs the same CPU on either thread (one interpreter lock).

At least once: the controller acknowledges QoS 1 messages itself (paho's manual ack), in the
order received, after the commit. A controller that dies first gets them again from its
persistent session; the registry recognises replays by (epoch, n), and a state message applied
twice leaves the same row. The queue is bounded twice: CAPACITY messages, which the MQTT Receive
Maximum we announce equals (the broker holds the rest rather than us), and QUEUE_BYTES of
payload; a full queue (QoS 0 floods, large payloads) makes the MQTT thread wait.

A batch the database cannot take now (locked, unreachable, deadlock) is tried again, unacknowledged,
until it can; if that lasts past the stall timeout the process exits to be restarted, losing
nothing. A batch that fails on its own content is split until the one message at fault is found:
that one is logged, counted (`failed`) and dropped, the rest are stored.
"""

import collections
import logging
import math
import threading
import time
from typing import NamedTuple, Optional

from jetserve.fleet.registry import Message
from jetserve.fleet.stores import StoreError

log = logging.getLogger(__name__)
CAPACITY = 2048  # messages received but not yet committed (also the MQTT Receive Maximum)
QUEUE_BYTES = 8 * 2**20  # payload bytes received but not yet committed: the queue's memory bound
MAX_BATCH = 512  # messages a transaction: bounds how long it holds its devices' locks
BATCH_BYTES = 2**20  # payload bytes a transaction: bounds the parsed documents alive at once
RETRY_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # pauses before trying a batch again, the last repeated


class Received(NamedTuple):
    """A message as queued, unchecked: where it came and what it says, and how to ack it."""
    topic: str
    payload: bytes
    mid: int
    qos: int


class Checked(NamedTuple):
    """A message as stored: the checked Message (None for one that is not ours), its ack, and the
    device's timestamp (for the lag)."""
    message: Optional[Message]
    mid: int
    qos: int
    ts: Optional[float]


class Queue:
    """FIFO of Received bounded in messages and in payload bytes. A message larger than the byte
    bound still goes in, alone, so nothing the broker accepts can wedge the queue."""

    def __init__(self, capacity=CAPACITY, max_bytes=QUEUE_BYTES):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items = collections.deque()
        self.bytes = 0
        self._changed = threading.Condition()

    def __len__(self):
        return len(self._items)

    def put(self, received):
        """Waits while the queue is full."""
        size = len(received.payload)
        with self._changed:
            while self._items and (len(self._items) >= self.capacity or self.bytes + size > self.max_bytes):
                self._changed.wait()
            self._items.append(received)
            self.bytes += size
            self._changed.notify_all()

    def take(self, max_items, max_bytes, timeout):
        """The oldest messages, at least one and within both bounds; [] after `timeout` s empty."""
        with self._changed:
            if not self._items and not self._changed.wait_for(lambda: self._items, timeout):
                return []
            batch, size = [], 0
            while self._items and len(batch) < max_items:
                nxt = len(self._items[0].payload)
                if batch and size + nxt > max_bytes:
                    break
                batch.append(self._items.popleft())
                size += nxt
            self.bytes -= size
            self._changed.notify_all()
            return batch


class GroupCommit:
    def __init__(self, registry, check, acknowledge, metrics, liveness, committed):
        """`check(topic, payload)` → the Message to store or None; `acknowledge(mid, qos)` after each
        commit, then `committed(messages, outcomes, unborn)`."""
        self.registry, self.check, self.acknowledge = registry, check, acknowledge
        self.metrics, self.liveness, self.committed = metrics, liveness, committed
        self._queue = Queue()
        metrics.queue_capacity.set(CAPACITY)
        metrics.queue_depth.set_function(lambda: len(self._queue))
        metrics.queue_capacity_bytes.set(QUEUE_BYTES)
        metrics.queue_bytes.set_function(lambda: self._queue.bytes)

    def put(self, received):
        """Queue one message (waits while the queue is full: back-pressure on the MQTT thread)."""
        self._queue.put(received)

    def run(self, stopping):
        """The writer thread: until `stopping` is set and nothing is left waiting."""
        while not (stopping.is_set() and not len(self._queue)):
            batch = self._queue.take(MAX_BATCH, BATCH_BYTES, timeout=0.5)
            if batch:
                with self.liveness.busy("write"):
                    self._store([self._checked(r) for r in batch], stopping)

    def _checked(self, received):
        try:
            message = self.check(received.topic, received.payload)
        except Exception:  # a bug: this message is dropped (acknowledged, counted as ignored), the thread is not
            log.exception("checking a message on %s failed", received.topic[:200])
            message = None
        return Checked(message, received.mid, received.qos, _timestamp(message))

    def _store(self, batch, stopping):
        messages = [c.message for c in batch if c.message is not None]
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                outcomes, unborn = self.registry.apply(messages)
                break
            except StoreError as exc:  # the database could not, this time: the same batch again soon
                self.metrics.store_errors.inc()
                if attempt == 0:
                    log.warning("storing %d message(s) failed, trying again: %s", len(messages), exc)
                if stopping.is_set():
                    return  # unacknowledged: the broker hands them to the next run
                time.sleep(RETRY_S[min(attempt, len(RETRY_S) - 1)])
                attempt += 1
            except Exception:  # the batch's own content: find the message at fault
                if len(batch) > 1:
                    half = len(batch) // 2
                    self._store(batch[:half], stopping)
                    self._store(batch[half:], stopping)
                    return
                log.exception("the registry refused %s/%s's %s message; dropped", messages[0].fleet,
                              messages[0].device, messages[0].kind)
                outcomes, unborn = ["failed"], set()
                break
        now = time.time()
        self.metrics.commit.observe(time.monotonic() - started)
        self.metrics.batch.observe(len(batch))
        for checked in batch:
            self.acknowledge(checked.mid, checked.qos)
            if checked.message is None:
                self.metrics.messages.labels("other", "ignored").inc()
            elif checked.ts is not None:
                self.metrics.lag.observe(max(0.0, now - checked.ts))
        for message, outcome in zip(messages, outcomes):
            self.metrics.messages.labels(message.kind, outcome).inc()
        self.committed(messages, outcomes, unborn)


def _timestamp(message):
    """When the device says it sent `message` (its `ts`), if it says so with a usable number."""
    ts = message.doc.get("ts") if message is not None and message.doc is not None else None
    return float(ts) if type(ts) in (int, float) and math.isfinite(ts) else None
