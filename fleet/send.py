"""`jetserve fleet send`: publish one command to a device and wait for its reply.

MQTT v5 request/response: the request names a Response Topic of its own under the device's
`cmd/reply` (where the ACL lets the device write) and carries the request id as Correlation Data;
the device answers there with the same data, so concurrent senders never see each other's replies.
"""

import json
import threading
import uuid

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from jetserve.wire import topics
from jetserve.wire.mqtt import new_client


def send(mqtt_options, fleet, device, command, command_args, timeout):
    """The device's reply dict; raises TimeoutError when the broker or the device does not answer."""
    request_id = uuid.uuid4().hex
    response_topic = "%s/%s" % (topics.topic(fleet, device, topics.REPLY), request_id)
    subscribed, answered = threading.Event(), threading.Event()
    reply = {}

    def on_connect(client, userdata, flags, reason_code, properties):
        if not reason_code.is_failure:
            client.subscribe(response_topic, qos=1)

    def on_message(client, userdata, message):
        if getattr(message.properties, "CorrelationData", None) != request_id.encode():
            return
        try:
            doc = json.loads(message.payload.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return
        if isinstance(doc, dict):
            reply.update(doc)
            answered.set()

    client = new_client("jetserve-send-" + request_id[:12], mqtt_options)
    client.on_connect = on_connect
    client.on_subscribe = lambda *a: subscribed.set()
    client.on_message = on_message
    client.connect_async(mqtt_options.host, mqtt_options.port, keepalive=mqtt_options.keepalive)
    client.loop_start()
    try:
        if not subscribed.wait(timeout):
            raise TimeoutError("broker %s not reachable (or refused us) within %ss"
                               % (mqtt_options.address, timeout))
        properties = Properties(PacketTypes.PUBLISH)
        properties.ResponseTopic = response_topic
        properties.CorrelationData = request_id.encode()
        request = {"id": request_id, "command": command, "args": command_args}
        client.publish(topics.topic(fleet, device, topics.CMD), json.dumps(request), qos=1, properties=properties)
        if not answered.wait(timeout):
            raise TimeoutError("no reply from %s/%s within %ss" % (fleet, device, timeout))
        return reply
    finally:
        client.disconnect()
        client.loop_stop()
