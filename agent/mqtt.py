"""One way to build a paho-mqtt 2.x client (MQTT v5, callback API 2) from the CLI's MQTT options.

Shared by the agent, the fleet controller and `jetserve fleet send`, so TLS and credentials work
the same everywhere.
"""

import os
import ssl

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


class MqttConfigError(RuntimeError):
    pass


def new_client(client_id, args):
    """A client with credentials and TLS from `args` (mqtt_user, mqtt_password[_file], mqtt_ca...)."""
    client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
                         client_id=client_id, protocol=mqtt.MQTTv5)
    password = args.mqtt_password
    if args.mqtt_password_file:
        try:
            with open(args.mqtt_password_file) as f:
                password = f.read().strip()
        except OSError as exc:
            raise MqttConfigError("cannot read MQTT password file %s: %s"
                                  % (args.mqtt_password_file, exc.strerror))
    if args.mqtt_user:
        client.username_pw_set(args.mqtt_user, password)
    if args.mqtt_tls or args.mqtt_ca:
        for path in (args.mqtt_ca, args.mqtt_cert, args.mqtt_key):
            if path and not os.path.isfile(path):
                raise MqttConfigError("TLS file %s does not exist" % path)
        client.tls_set(ca_certs=args.mqtt_ca, certfile=args.mqtt_cert, keyfile=args.mqtt_key,
                       cert_reqs=ssl.CERT_REQUIRED)
    return client


def session_properties(expiry_s):
    """CONNECT properties asking the broker to keep the session (subscriptions, queued QoS 1)."""
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = expiry_s
    return props
