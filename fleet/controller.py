"""The fleet controller: MQTT in, every message checked, registry out; a silence sweep; liveness.

Nothing a device sends reaches the registry unchecked (`jetserve.wire.messages`): a message on a
topic whose fleet or device level is not a name (`topics.check_name`: what the ACL, the page and
`fleet send` can address) is logged and ignored, never registered; a message that fails its
checks is logged, counted per device and kind (`Registry.rejections`), alerted once per new
error, and dropped. No message can end the ingest thread, and if ingestion stops anyway (a thread
died, a step is stuck) the process exits non-zero so systemd (or compose) restarts it; under
systemd it is `Type=notify` and pings the watchdog only while ingestion is healthy.

The MQTT thread only queues what it receives; one writer checks the queued messages, stores them
a batch per transaction and acknowledges them after the commit (`ingest.GroupCommit`: at least
once, bounded in messages and bytes, with back-pressure). It keeps a persistent MQTT session
(clean_start off, a session expiry) so messages published while it reconnects, or not yet
acknowledged when it died, wait at the broker. With `--share GROUP` several replicas split the
fleet's stream (`$share/GROUP/...`). A device heard from without a known session (births are not
retained, as in Sparkplug) is asked for a rebirth, at most once per `REBIRTH_EVERY_S`.
"""

import json
import logging
import threading
import time
import uuid

from jetserve import notify
from jetserve.fleet import heap
from jetserve.fleet.ingest import CAPACITY, GroupCommit, Received
from jetserve.fleet.liveness import Liveness
from jetserve.fleet.metrics import Metrics
from jetserve.fleet.registry import Message
from jetserve.wire import messages, topics
from jetserve.wire.mqtt import new_client, session_properties

log = logging.getLogger(__name__)
SESSION_EXPIRY_S = 24 * 3600
SWEEP_EVERY_S = 0.5
REBIRTH_EVERY_S = 30.0
PARSERS = {
    topics.STATE: messages.parse_state,
    topics.HEALTH: lambda payload: messages.parse(messages.Health, payload),
    topics.ALERT: lambda payload: messages.parse(messages.Alert, payload, messages.MAX_ALERT),
}


class Controller:
    def __init__(self, mqtt_options, registry, client_id, fleet=None, share=None, silence_factor=3.0,
                 stall_timeout=30.0):
        self.mqtt, self.registry = mqtt_options, registry
        self.fleet, self.share, self.silence_factor = fleet, share, silence_factor
        self.liveness = Liveness(stall_timeout)
        self.metrics = Metrics()
        self.connected = threading.Event()
        self._stopping = threading.Event()
        self._rebirth_asked = {}  # (fleet, device) → when we last asked (writer thread)
        self.client = new_client(client_id, mqtt_options, manual_ack=True)
        self.writer = GroupCommit(registry, self._check, self.client.ack, self.metrics, self.liveness,
                                  self._committed)
        self.client.reconnect_delay_set(1, 10)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *_: log.info("subscribed; receiving the fleet's messages")
        self._ingest = threading.Thread(target=self.client.loop_forever, kwargs={"retry_first_connection": True},
                                        name="ingest", daemon=True)
        self._writer = threading.Thread(target=self.writer.run, args=(self._stopping,), name="write", daemon=True)
        self._sweeper = threading.Thread(target=self._sweep_loop, name="sweep", daemon=True)

    def run(self, stop_event):
        """Ingest until `stop_event`; returns 0, or 1 when ingestion stopped on its own."""
        self.client.connect_async(self.mqtt.host, self.mqtt.port, keepalive=self.mqtt.keepalive,
                                  clean_start=False, properties=session_properties(SESSION_EXPIRY_S, CAPACITY))
        for thread in (self._ingest, self._writer, self._sweeper):
            self.liveness.watch(thread.name, thread)
            thread.start()
        notify.notify("READY=1", "STATUS=connecting to %s" % self.mqtt.address)
        ping_every = notify.watchdog_period() or 1.0
        try:
            while not stop_event.wait(min(ping_every, 1.0)):
                problem = self.liveness.problem()
                if problem:
                    log.critical("ingestion stopped: %s; exiting so the service manager restarts us", problem)
                    return 1
                notify.notify("WATCHDOG=1")
            notify.notify("STOPPING=1")
            return 0
        finally:
            self._stopping.set()  # no more queued; what is queued is stored and acknowledged first
            if not self.liveness.problem():  # a stuck thread would hold these up: leave it to exit
                self._writer.join(10)
                self.client.disconnect()
                self._ingest.join(5)
                self._sweeper.join(5)

    # sweep thread

    def _sweep_loop(self):
        last_error, trimmed = None, time.monotonic()
        while not self._stopping.wait(SWEEP_EVERY_S):
            if time.monotonic() - trimmed >= heap.TRIM_EVERY_S:
                heap.trim()
                trimmed = time.monotonic()
            with self.liveness.busy("sweep"):
                try:
                    for fleet, device in self.registry.sweep(self.silence_factor):
                        log.warning("%s/%s: offline (silent)", fleet, device)
                    last_error = None
                except Exception as exc:  # the registry failed: say so once, try again next round
                    if str(exc) != last_error:
                        log.exception("sweeping the registry failed")
                    last_error = str(exc)

    # paho callbacks (ingest thread): none of them may raise

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        if reason_code.is_failure:
            log.error("broker %s refused the controller: %s", self.mqtt.address, reason_code)
            return
        client.subscribe([(topics.subscription(self.fleet, kind, self.share), 1) for kind in PARSERS])
        self.connected.set()
        notify.status("connected to %s" % self.mqtt.address)
        log.info("controller connected to %s", self.mqtt.address)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        self.connected.clear()
        if not self._stopping.is_set():
            notify.status("disconnected from %s (%s); reconnecting" % (self.mqtt.address, reason_code))
            log.warning("controller disconnected (%s)", reason_code)

    def _on_message(self, client, userdata, message):
        if self._stopping.is_set():
            return  # not acknowledged: the broker keeps it for the next run
        with self.liveness.busy("ingest"):
            self.metrics.received.inc()
            self.writer.put(Received(message.topic, message.payload, message.mid, message.qos))

    # writer thread

    def _check(self, topic, payload):
        """The Message to store: checked, or refused with the reason; None if not ours."""
        parsed = topics.parse(topic)
        if parsed is None or parsed[2] not in PARSERS:
            log.warning("ignoring a message on %s: not a jetserve topic", topic[:200])
            return None
        fleet, device, kind = parsed
        try:  # no account is ever made for such a name (add-user.sh): nobody to count or flag it against
            topics.check_name("fleet", fleet)
            topics.check_name("device", device)
        except ValueError:
            log.warning("ignoring a message on %s: its fleet or device is not a name (letters, digits, '.', '_', "
                        "'-'; at most 64)", topic[:200])
            return None
        try:
            return Message(fleet, device, kind, PARSERS[kind](payload).doc)
        except messages.MessageError as exc:
            log.warning("%s/%s %s refused: %s", fleet, device, kind, exc)
            return Message(fleet, device, kind, error=str(exc))

    def _committed(self, stored, outcomes, unborn):
        for message, outcome in zip(stored, outcomes):
            if message.kind == topics.STATE and message.error is None:
                self._rebirth_asked.pop((message.fleet, message.device), None)
            if message.error is None:
                (log.debug if outcome in ("new", "birth") else log.info)(
                    "%s/%s %s n=%s: %s", message.fleet, message.device, message.kind, message.doc.get("n"), outcome)
        for fleet, device in sorted(unborn):
            self._ask_rebirth(fleet, device)

    def _ask_rebirth(self, fleet, device):
        """Sparkplug's host rule: data from a node whose birth we lack → ask it to be born again."""
        now = time.monotonic()
        if now - self._rebirth_asked.get((fleet, device), -REBIRTH_EVERY_S) < REBIRTH_EVERY_S:
            return
        self._rebirth_asked[(fleet, device)] = now
        request = {"id": "rebirth-" + uuid.uuid4().hex[:12], "command": "rebirth"}
        self.client.publish(topics.topic(fleet, device, topics.CMD), json.dumps(request), qos=1)
        log.info("%s/%s: no birth on record; asked for a rebirth", fleet, device)
