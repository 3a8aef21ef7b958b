"""The fleet controller: MQTT in, registry out, plus a silence sweep and the HTTP page.

It keeps a persistent MQTT session (clean_start off, a session expiry) so messages published
while it reconnects wait at the broker for it. With `--share GROUP` several replicas split the
fleet's stream (`$share/GROUP/...`); shared subscriptions get no retained births, so a replica
learns a device at its next report instead.
"""

import json
import logging
import socket
import threading

from jetserve.wire import topics
from jetserve.wire.mqtt import MqttOptions, new_client, session_properties

log = logging.getLogger(__name__)
SESSION_EXPIRY_S = 24 * 3600


class Controller:
    def __init__(self, args, registry):
        self.args, self.registry, self.mqtt = args, registry, MqttOptions.from_args(args)
        self.connected = threading.Event()
        self.client = new_client(args.client_id or "jetserve-fleet-%s" % socket.gethostname(), self.mqtt)
        self.client.reconnect_delay_set(1, 10)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *_: log.info("subscribed; receiving the fleet's messages")

    def start(self):
        self.client.connect_async(self.mqtt.host, self.mqtt.port, keepalive=self.mqtt.keepalive,
                                  clean_start=False, properties=session_properties(SESSION_EXPIRY_S))
        self.client.loop_start()

    def stop(self):
        self.client.disconnect()
        self.client.loop_stop()

    def run(self, stop_event):
        """Serve until `stop_event`, sweeping for silent devices twice a second."""
        self.start()
        try:
            while not stop_event.wait(0.5):
                for fleet, device in self.registry.sweep(self.args.silence_factor):
                    log.warning("%s/%s: offline (silent)", fleet, device)
        finally:
            self.stop()

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        if reason_code.is_failure:
            log.error("broker %s refused the controller: %s", self.mqtt.address, reason_code)
            return
        client.subscribe([(topics.subscription(self.args.fleet, kind, self.args.share), 1)
                          for kind in (topics.STATE, topics.HEALTH, topics.ALERT)])
        self.connected.set()
        log.info("controller connected to %s", self.mqtt.address)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        self.connected.clear()
        log.warning("controller disconnected (%s)", reason_code)

    def _on_message(self, client, userdata, message):
        parsed = topics.parse(message.topic)
        try:
            doc = json.loads(message.payload.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            doc = None
        if parsed is None or not isinstance(doc, dict):
            log.warning("ignoring a malformed message on %s", message.topic)
            return
        fleet, device, kind = parsed
        if kind == topics.STATE:
            outcome = self.registry.state(fleet, device, doc)
        else:
            outcome = self.registry.data(fleet, device, kind, doc)
        (log.debug if outcome in ("new", "birth") else log.info)(
            "%s/%s %s n=%s: %s", fleet, device, kind, doc.get("n"), outcome)
