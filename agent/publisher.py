"""The agent's MQTT session, with Sparkplug B's rules: birth and death by bdSeq, seq per session,
rebirth on request; the outbox flushed in order; commands in, replies out (MQTT v5 request/response).
`on_command(payload, response_topic, correlation_data, retained)` gets each command as it came.

Every connect takes the next bdSeq (0-255, on disk) and puts it in the Will (`{online: false,
bdSeq}`, QoS 1, not retained: the death certificate) and in the birth that follows (QoS 1, not
retained, `seq` 0), so a late death from an old session cannot be mistaken for the current one.
Each later data message of the session carries `seq` +1 mod 256; a rebirth (asked for by the
controller) publishes the birth again, same bdSeq, seq back to 0. The Will is written at connect,
so it carries no time: the controller stamps it on arrival. A clean stop publishes the death
itself first, stamped with the time of the disconnect.

Data only leaves through the outbox and is forgotten on PUBACK. paho re-sends what it had in flight
when a connection dropped (with the seq it was first sent with); new rows wait until those are
acknowledged, so the broker sees every message in order.
"""

import collections
import json
import logging
import threading
import time

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from jetserve.wire import topics
from jetserve.wire.mqtt import new_client

log = logging.getLogger(__name__)
WINDOW = 50  # messages handed to paho and not yet acknowledged


class Publisher:
    def __init__(self, mqtt_options, fleet, device, outbox, birth, on_command, reconnect_max=30):
        self.fleet, self.device, self.mqtt = fleet, device, mqtt_options
        self.outbox, self.birth, self.on_command = outbox, birth, on_command
        self.bdseq = None
        self._seq = 0  # Sparkplug seq of the last message of this session (the birth's is 0)
        self._seq_lock = threading.Lock()  # seq order = publish order, across paho's thread and ours
        self.connected = threading.Event()
        self._wake = threading.Event()
        self._acks = collections.deque()  # mids acknowledged by the broker, for the flusher
        self._inflight = {}  # mid → (n, connection generation); only the flusher touches it
        self._generation = 0
        self._last_handed = 0
        self._stopping = False
        self._refused = None
        self._unreachable = False  # the last connect attempt failed: said once per outage
        self.client = new_client("jetserve-%s-%s" % (self.fleet, self.device), mqtt_options)
        self.client.reconnect_delay_set(1, reconnect_max)
        self.client.on_pre_connect = self._on_pre_connect
        self.client.on_connect = self._on_connect
        self.client.on_connect_fail = self._on_connect_fail
        self.client.on_disconnect = self._on_disconnect
        self.client.on_publish = self._on_publish
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *_: log.info("listening for commands on %s", self.topic(topics.CMD))
        self._flusher = threading.Thread(target=self._flush_loop, name="outbox-flush", daemon=True)

    def topic(self, kind):
        return topics.topic(self.fleet, self.device, kind)

    def start(self):
        self.client.connect_async(self.mqtt.host, self.mqtt.port, keepalive=self.mqtt.keepalive)
        self.client.loop_start()
        self._flusher.start()

    def publish(self, kind, doc):
        """Queue a health or alert document; it leaves when the broker is reachable."""
        n = self.outbox.add(kind, self.topic(kind), doc)
        self._wake.set()
        return n

    def may_reply_to(self, response_topic):
        """A request's Response Topic is honoured when it is our reply topic or below it (where the
        ACL lets us write); anything else would be refused by the broker or name another device."""
        own = self.topic(topics.REPLY)
        below = response_topic.startswith(own + "/") and len(response_topic) <= 512
        return response_topic == own or (below and not any(c in response_topic for c in "+#\0"))

    def reply(self, doc, response_topic=None, correlation_data=None):
        """Answer a command: to its Response Topic with its Correlation Data (MQTT v5), else on
        `cmd/reply`."""
        properties = Properties(PacketTypes.PUBLISH)
        if correlation_data is not None:
            properties.CorrelationData = correlation_data
        topic = response_topic if response_topic and self.may_reply_to(response_topic) else self.topic(topics.REPLY)
        self.client.publish(topic, json.dumps(doc), qos=1, properties=properties)

    def rebirth(self):
        """Publish the birth again (same session, same bdSeq); seq starts over at 0."""
        if not self.connected.is_set():
            raise RuntimeError("not connected: the next connect publishes a birth anyway")
        self._publish_birth(self.client)
        return {"bdSeq": self.bdseq}

    def wait_flushed(self, timeout):
        """True once the outbox is empty (everything acknowledged by the broker)."""
        deadline = time.monotonic() + timeout
        while self.outbox.stats()["pending"]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout=5.0):
        """Publish the offline state first (a clean disconnect sends no Will), then disconnect."""
        self._stopping = True
        self._wake.set()
        if self.connected.is_set():
            death = dict(self._death(), ts=time.time())  # the moment of the disconnect
            info = self.client.publish(self.topic(topics.STATE), json.dumps(death, sort_keys=True), qos=1)
            try:
                info.wait_for_publish(timeout)
            except (RuntimeError, ValueError):
                log.warning("could not publish the offline state before stopping")
        self.client.disconnect()
        self.client.loop_stop()
        self._flusher.join(timeout)

    def _death(self):
        return {"online": False, "bdSeq": self.bdseq}

    def _publish_birth(self, client):
        with self._seq_lock:
            self._seq = 0
            birth = dict(self.birth, online=True, bdSeq=self.bdseq, seq=0, ts=time.time())
            client.publish(self.topic(topics.STATE), json.dumps(birth, sort_keys=True), qos=1)

    def _publish_data(self, topic, doc):
        with self._seq_lock:
            self._seq = (self._seq + 1) % 256
            return self.client.publish(topic, json.dumps(dict(doc, seq=self._seq), sort_keys=True), qos=1)

    # paho callbacks (network thread)

    def _on_pre_connect(self, client, userdata):
        self.bdseq = self.outbox.next_bdseq()
        client.will_set(self.topic(topics.STATE), json.dumps(self._death(), sort_keys=True), qos=1, retain=False)

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        if reason_code.is_failure:
            if self._refused != str(reason_code):
                log.error("broker %s refused the connection: %s", self.mqtt.address, reason_code)
            self._refused = str(reason_code)
            return
        self._refused = None
        self._unreachable = False
        log.info("connected to %s, bdSeq %d", self.mqtt.address, self.bdseq)
        self._publish_birth(client)
        client.subscribe(self.topic(topics.CMD), qos=1)
        self._generation += 1
        self.connected.set()
        self._wake.set()

    def _on_connect_fail(self, client, userdata):
        """No broker at the address (refused, unreachable): said at once, not after a wait."""
        if not self._unreachable:
            log.warning("no broker reachable at %s; messages wait in the outbox while it retries", self.mqtt.address)
        self._unreachable = True

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        self.connected.clear()
        if not self._stopping:
            log.warning("disconnected from the broker (%s); queuing to the outbox", reason_code)

    def _on_publish(self, client, userdata, mid, reason_code, properties):
        # paho may hold its own locks here: hand the ack to the flusher, never block.
        if reason_code.is_failure:
            log.error("broker refused message mid=%d: %s", mid, reason_code)
        self._acks.append(mid)
        self._wake.set()

    def _on_message(self, client, userdata, message):
        properties = message.properties
        self.on_command(message.payload, getattr(properties, "ResponseTopic", None),
                        getattr(properties, "CorrelationData", None), bool(message.retain))

    # flusher thread

    def _flush_loop(self):
        while not self._stopping:
            self._wake.wait(0.5)
            self._wake.clear()
            while self._acks:
                entry = self._inflight.pop(self._acks.popleft(), None)
                if entry is not None:
                    self.outbox.ack(entry[0])
            if not self.connected.is_set():
                continue
            generation = self._generation
            if any(gen < generation for _, gen in self._inflight.values()):
                continue  # paho is re-sending the previous connection's messages first
            for n, topic, doc in self.outbox.pending(self._last_handed, WINDOW - len(self._inflight)):
                info = self._publish_data(topic, doc)
                if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):  # NO_CONN: queued
                    log.error("publish failed: %s", mqtt.error_string(info.rc))
                    break
                self._inflight[info.mid] = (n, generation)
                self._last_handed = n
