"""How a client reaches the broker: `MqttOptions` (one dataclass, filled from the CLI flags) and
one way to build a paho-mqtt 2.x client (MQTT v5, callback API 2) from it.

Shared by the agent, the fleet controller and `jetserve fleet send`, so TLS and credentials work
the same everywhere.
"""

import dataclasses
import os
import ssl
from typing import Optional

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


class MqttConfigError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class MqttOptions:
    host: str = "127.0.0.1"
    port: int = 1883
    user: Optional[str] = None
    password: Optional[str] = None
    password_file: Optional[str] = None
    tls: bool = False
    ca: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    keepalive: int = 30

    @classmethod
    def from_args(cls, args):
        """The options from a namespace filled by `add_flags` (`--mqtt-host` → `host`, ...)."""
        return cls(host=args.mqtt_host, port=args.mqtt_port, user=args.mqtt_user,
                   password=args.mqtt_password, password_file=args.mqtt_password_file,
                   tls=args.mqtt_tls or bool(args.mqtt_ca), ca=args.mqtt_ca, cert=args.mqtt_cert,
                   key=args.mqtt_key, keepalive=args.keepalive)

    @property
    def address(self):
        return "%s:%s" % (self.host, self.port)


def add_flags(parser):
    """The broker connection flags that fill `MqttOptions`, for every command that connects."""
    group = parser.add_argument_group("MQTT")
    group.add_argument("--mqtt-host", default=MqttOptions.host)
    group.add_argument("--mqtt-port", type=int, default=MqttOptions.port)
    group.add_argument("--mqtt-user", help="username (a device's is FLEET/DEVICE under the shipped ACL)")
    group.add_argument("--mqtt-password", help="password (prefer --mqtt-password-file)")
    group.add_argument("--mqtt-password-file", help="file holding the password")
    group.add_argument("--mqtt-tls", action="store_true", help="TLS with the system CAs")
    group.add_argument("--mqtt-ca", help="CA bundle for TLS (implies --mqtt-tls)")
    group.add_argument("--mqtt-cert", help="client certificate for TLS")
    group.add_argument("--mqtt-key", help="client key for TLS")
    group.add_argument("--keepalive", type=int, default=MqttOptions.keepalive,
                       help="MQTT keepalive in seconds; the broker declares us dead after 1.5x")


def new_client(client_id, options, manual_ack=False):
    """A client with the credentials and TLS of `options` (an `MqttOptions`); with `manual_ack`
    the caller acknowledges each QoS 1 message itself (`client.ack`), once it has kept it."""
    client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
                         client_id=client_id, protocol=mqtt.MQTTv5, manual_ack=manual_ack)
    password = options.password
    if options.password_file:
        try:
            with open(options.password_file) as f:
                password = f.read().strip()
        except OSError as exc:
            raise MqttConfigError("cannot read MQTT password file %s: %s"
                                  % (options.password_file, exc.strerror))
    if options.user:
        client.username_pw_set(options.user, password)
    if options.tls:
        for path in (options.ca, options.cert, options.key):
            if path and not os.path.isfile(path):
                raise MqttConfigError("TLS file %s does not exist" % path)
        client.tls_set(ca_certs=options.ca, certfile=options.cert, keyfile=options.key,
                       cert_reqs=ssl.CERT_REQUIRED)
    return client


def session_properties(expiry_s, receive_maximum=None):
    """CONNECT properties asking the broker to keep the session (subscriptions, queued QoS 1) and,
    with `receive_maximum`, to send at most that many QoS 1 messages not yet acknowledged."""
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = expiry_s
    if receive_maximum is not None:
        props.ReceiveMaximum = receive_maximum
    return props
