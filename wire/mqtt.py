"""How a client reaches the broker: `MqttOptions` (one dataclass, the CLI flags made from it) and
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

from jetserve.config import from_args, int_in, read_secret, setting


class MqttConfigError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class MqttOptions:
    """The broker connection settings of every command that connects (flags `--mqtt-host`, ...)."""

    host: str = setting("127.0.0.1", name="mqtt_host")
    port: int = setting(1883, name="mqtt_port", type=int_in(1, 65535))
    user: Optional[str] = setting(None, "username (a device's is FLEET/DEVICE under the shipped ACL)",
                                  name="mqtt_user")
    password: Optional[str] = setting(None, "password (prefer --mqtt-password-file)", name="mqtt_password")
    password_file: Optional[str] = setting(None, "file holding the password", name="mqtt_password_file")
    tls: bool = setting(False, "TLS with the system CAs", name="mqtt_tls", action="store_true")
    ca: Optional[str] = setting(None, "CA bundle for TLS (implies --mqtt-tls)", name="mqtt_ca")
    cert: Optional[str] = setting(None, "client certificate for TLS", name="mqtt_cert")
    key: Optional[str] = setting(None, "client key for TLS", name="mqtt_key")
    keepalive: int = setting(30, "MQTT keepalive in seconds; the broker declares us dead after 1.5x",
                             name="keepalive", type=int)

    @classmethod
    def from_args(cls, args):
        """The options from a namespace filled by `add_flags(parser, MqttOptions)`."""
        options = from_args(cls, args)
        return dataclasses.replace(options, tls=options.tls or bool(options.ca))

    @property
    def address(self):
        return "%s:%s" % (self.host, self.port)


def new_client(client_id, options, manual_ack=False):
    """A client with the credentials and TLS of `options` (an `MqttOptions`); with `manual_ack`
    the caller acknowledges each QoS 1 message itself (`client.ack`), once it has kept it."""
    client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
                         client_id=client_id, protocol=mqtt.MQTTv5, manual_ack=manual_ack)
    password = options.password
    if options.password_file:
        try:
            password = read_secret(options.password_file, "--mqtt-password-file", private=False)
        except OSError as exc:
            raise MqttConfigError("cannot read MQTT password file %s: %s"
                                  % (options.password_file, exc.strerror))
        except ValueError as exc:
            raise MqttConfigError(str(exc))
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
