"""Identity bound to credentials, with the broker as deploy/ ships it: a device writes only under its
own fleet and id, cannot take another client's id (a device's or the controller's), and the broker
refuses oversized messages. Impostors use mosquitto's own clients as well as paho."""

import os
import re
import subprocess
import threading
import time

import paho.mqtt.client as mqtt

from tests.agent.conftest import REPO, controller_args, wait_for
from tests.fleet.conftest import add_user
from tests.tools import require_tool

NOT_AUTHORIZED, TOO_LARGE = 0x87, 0x95


def client(broker, user, client_id=None):
    c = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or user + "-test",
                    protocol=mqtt.MQTTv5)
    c.username_pw_set(user, "pw-" + user)
    c.received, c.acks, c.subscribed, c.drops = [], {}, [], []
    c.connected = threading.Event()
    c.on_subscribe = lambda cl, u, mid, rcs, p: c.subscribed.append(mid)

    c.on_connect = lambda cl, u, flags, rc, p: rc.is_failure or c.connected.set()
    c.on_disconnect = lambda cl, u, flags, rc, p: c.drops.append(str(rc))
    c.on_message = lambda cl, u, m: c.received.append((m.topic, m.payload))
    c.on_publish = lambda cl, u, mid, rc, p: c.acks.__setitem__(mid, rc)
    c.connect("127.0.0.1", broker.port, keepalive=10)
    c.loop_start()
    assert c.connected.wait(10), "%s could not log in" % user
    return c


def close(*clients):
    for c in clients:
        c.disconnect()
        c.loop_stop()


def publish_acked(c, topic, payload):
    info = c.publish(topic, payload, qos=1)
    wait_for(lambda: info.mid in c.acks, 10, what="PUBACK for %s" % topic)
    return c.acks[info.mid]


def test_a_device_writes_only_under_its_own_fleet_and_id(shipped_broker):
    fleet, dev_a = client(shipped_broker, "jetserve-fleet"), client(shipped_broker, "lab/dev-a")
    try:
        fleet.subscribe("jetserve/v1/#", qos=1)
        dev_a.subscribe([("jetserve/v1/lab/dev-b/cmd", 1), ("jetserve/v1/lab/dev-a/cmd", 1)])
        wait_for(lambda: fleet.subscribed and dev_a.subscribed, 10, what="SUBACKs")
        assert not publish_acked(dev_a, "jetserve/v1/lab/dev-a/health", b'{"n": 1}').is_failure
        forged = {topic: publish_acked(dev_a, topic, b'{"n": 666}').value for topic in (
            "jetserve/v1/other/dev-a/health",  # its own id, another fleet (it would register there)
            "jetserve/v1/lab/dev-b/health",  # another device of its fleet
            "jetserve/v1/lab/dev-b/state",  # a false birth or death for it
            "jetserve/v1/other/dev-c/alert",  # another fleet's device
            "jetserve/v1/lab/dev-b/cmd",  # a command to a peer
            "jetserve/v1/lab/dev-a/cmd",  # a command to itself
        )}
        assert forged == {topic: NOT_AUTHORIZED for topic in forged}
        fleet.publish("jetserve/v1/lab/dev-b/cmd", b'{"command": "drain"}', qos=1)
        fleet.publish("jetserve/v1/lab/dev-a/cmd", b'{"command": "resume"}', qos=1)
        wait_for(lambda: dev_a.received, 10, what="dev-a's own command")
        time.sleep(0.5)  # anything forged would have been delivered by now
        assert [t for t, _ in fleet.received] == ["jetserve/v1/lab/dev-a/health", "jetserve/v1/lab/dev-b/cmd",
                                                  "jetserve/v1/lab/dev-a/cmd"]
        assert dev_a.received == [("jetserve/v1/lab/dev-a/cmd", b'{"command": "resume"}')]  # not dev-b's
    finally:
        close(fleet, dev_a)


def test_a_device_cannot_take_another_devices_or_the_controllers_client_id(shipped_broker, spawn, tmp_path):
    """The broker names every connection by its username: asking for another's id changes nothing
    for the owner of that id (before: dev2 kicked offline 5 of 5 times, the controller 3 of 3)."""
    require_tool("mosquitto_pub")
    (tmp_path / "fleet-password").write_text("pw-jetserve-fleet\n")
    controller = spawn("controller", *controller_args(
        shipped_broker, str(tmp_path / "fleet.db"), "--mqtt-user", "jetserve-fleet",
        "--mqtt-password-file", tmp_path / "fleet-password"))
    wait_for(lambda: "subscribed" in controller.output(), 20, what="the controller's subscription")
    dev_b = client(shipped_broker, "lab/dev-b")
    try:
        attempts = []
        for target in ["lab/dev-b"] * 5 + ["jetserve-fleet", "controller-%d" % shipped_broker.port] * 3:
            out = subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-p", str(shipped_broker.port), "-i", target,
                                  "-u", "lab/dev-a", "-P", "pw-lab/dev-a", "-q", "1",
                                  "-t", "jetserve/v1/lab/dev-a/health", "-m", "{}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
            attempts.append(out.returncode)
        impostor = client(shipped_broker, "lab/dev-a", client_id="lab/dev-b")
        close(impostor)
        time.sleep(1.0)  # a takeover would have closed the owner's connection by now
        assert attempts == [0] * 11, "the impostor's own publishes go through, under its own name"
        assert dev_b.drops == [], "dev-b was never kicked off"
        assert "controller disconnected" not in controller.output()
        log = shipped_broker.log()
        assert "already connected" not in log and log.count(" as lab/dev-a (") == 12, log
    finally:
        close(dev_b)


def test_the_broker_refuses_oversized_messages(shipped_broker, tmp_path):
    """Sent with mosquitto's own client: over message_size_limit → PUBACK 0x95; a 20 MB packet
    (MQTT 3.1.1, which has no packet-size negotiation) → the connection is closed."""
    require_tool("mosquitto_pub")
    fleet = client(shipped_broker, "jetserve-fleet")

    def pub(payload, *version):
        path = tmp_path / "payload"
        path.write_bytes(payload)
        return subprocess.run(["mosquitto_pub", "-d", "-p", str(shipped_broker.port), "-u", "lab/dev-a",
                               "-P", "pw-lab/dev-a", "-q", "1", "-t", "jetserve/v1/lab/dev-a/health",
                               "-f", str(path)] + list(version),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60).stdout.decode()
    try:
        fleet.subscribe("jetserve/v1/#", qos=1)
        wait_for(lambda: fleet.subscribed, 10, what="SUBACK")
        assert "received PUBACK (Mid: 1, RC:149)" in pub(b"x" * 263000, "-V", "mqttv5")
        assert "The connection was lost" in pub(b"x" * (20 << 20), "-V", "mqttv311")
        assert "received PUBACK (Mid: 1, RC:0)" in pub(b'{"n": 1}', "-V", "mqttv5")
        wait_for(lambda: fleet.received, 10, what="the normal message")
        time.sleep(0.5)
        assert [len(p) for _, p in fleet.received] == [8], "neither large message reached the controller"
        assert "disconnected due to oversize packet" in shipped_broker.log()
    finally:
        close(fleet)


def test_the_shipped_broker_listens_where_the_config_says_and_nowhere_else(shipped_broker):
    """Per-listener settings above the first listener make mosquitto open a default 0.0.0.0:1883."""
    opened = sorted(set(re.findall(r"Opening ipv[46] listen socket on port (\d+)", shipped_broker.log())))
    assert opened == sorted({str(shipped_broker.port), str(shipped_broker.tls_port)})
    assert "use_username_as_clientid" not in shipped_settings_before_first_listener()


def shipped_settings_before_first_listener():
    with open(os.path.join(REPO, "deploy/mosquitto.conf")) as f:
        return f.read().split("\nlistener ")[0]


def test_add_user_makes_accounts_and_controller_acl_blocks(tmp_path):
    (tmp_path / "acl").write_text("user jetserve-fleet\n")
    assert add_user(tmp_path, "controller", "ops-alice", "pw").returncode == 0
    assert add_user(tmp_path, "controller", "ops-alice", "pw2").returncode == 0  # a new password, same block
    assert (tmp_path / "acl").read_text().count("user ops-alice\n") == 1
    out = add_user(tmp_path, "device", "lab", "orin-07")
    assert out.returncode == 0 and out.stdout.decode().startswith("lab/orin-07: ")  # a random password, shown once
    users = [line.split(":")[0] for line in (tmp_path / "passwd").read_text().splitlines()]
    assert users == ["ops-alice", "lab/orin-07"] and (tmp_path / "passwd").stat().st_mode & 0o777 == 0o600
    for bad in (("device", "lab", "a/b"), ("device", "+", "x"), ("device", "lab", "#"), ("controller", "-x"),
                ("device", "lab"), ("admin", "x")):
        assert add_user(tmp_path, *bad).returncode == 2, bad
