"""Group commit: the MQTT thread checks and queues each message; one writer stores what is waiting
as one registry transaction and only then acknowledges it to the broker.

Why: applying each message in its own transaction cost a commit and several database round trips
a message, and with PostgreSQL that is what held two replicas behind 1,000 devices. A batch here
is whatever waits (up to MAX_BATCH), stored by `Registry.apply` in a few statements whatever its
size; a quiet fleet gets batches of one and no added delay.

At least once: the controller acknowledges QoS 1 messages itself (paho's manual ack), in the
order received, after the commit. A controller that dies first gets them again from its
persistent session; the registry recognises replays by (epoch, n), and a state message applied
twice leaves the same row. The queue is bounded: the MQTT Receive Maximum we announce equals its
size, so the broker holds the rest rather than us, and a full queue (QoS 0 floods) makes the MQTT
thread wait.

A batch the database cannot take now (locked, unreachable, deadlock) is tried again, unacknowledged,
until it can; if that lasts past the stall timeout the process exits to be restarted, losing
nothing. A batch that fails on its own content is split until the one message at fault is found:
that one is logged, counted (`failed`) and dropped, the rest are stored.
"""

import logging
import queue
import time
from typing import NamedTuple, Optional

from jetserve.fleet.registry import Message
from jetserve.fleet.stores import StoreError

log = logging.getLogger(__name__)
CAPACITY = 2048  # messages checked but not yet committed
MAX_BATCH = 512  # messages a transaction: bounds how long it holds its devices' locks
RETRY_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # pauses before trying a batch again, the last repeated


class Received(NamedTuple):
    """A message as queued: what to store (None for one that is not ours) and how to ack it."""
    message: Optional[Message]
    mid: int
    qos: int
    ts: Optional[float]  # the device's timestamp, for the lag


class GroupCommit:
    def __init__(self, registry, acknowledge, metrics, liveness, committed):
        """`acknowledge(mid, qos)` after each commit, then `committed(messages, outcomes, unborn)`."""
        self.registry, self.acknowledge, self.metrics, self.liveness = registry, acknowledge, metrics, liveness
        self.committed = committed
        self._queue = queue.Queue(CAPACITY)
        metrics.queue_capacity.set(CAPACITY)
        metrics.queue_depth.set_function(self._queue.qsize)

    def put(self, received):
        """Queue one message (waits while the queue is full: back-pressure on the MQTT thread)."""
        self._queue.put(received)

    def run(self, stopping):
        """The writer thread: until `stopping` is set and nothing is left waiting."""
        while not (stopping.is_set() and self._queue.empty()):
            try:
                batch = [self._queue.get(timeout=0.5)]
            except queue.Empty:
                continue
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            with self.liveness.busy("write"):
                self._store(batch, stopping)

    def _store(self, batch, stopping):
        messages = [r.message for r in batch if r.message is not None]
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
        for received in batch:
            self.acknowledge(received.mid, received.qos)
            if received.message is None:
                self.metrics.messages.labels("other", "ignored").inc()
            elif received.ts is not None:
                self.metrics.lag.observe(max(0.0, now - received.ts))
        for message, outcome in zip(messages, outcomes):
            self.metrics.messages.labels(message.kind, outcome).inc()
        self.committed(messages, outcomes, unborn)
