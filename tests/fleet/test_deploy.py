"""deploy/ and systemd/: the ACL confines a device to its own prefix; the units verify."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from tests.agent.conftest import REPO, Broker, wait_for


def client(broker, user, password):
    c = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=user + "-test",
                    protocol=mqtt.MQTTv5)
    c.username_pw_set(user, password)
    c.received, c.acks, c.subscribed, c.connected = [], {}, [], threading.Event()
    c.on_subscribe = lambda cl, u, mid, rcs, p: c.subscribed.append(mid)
    c.on_connect = lambda cl, u, f, rc, p: rc.is_failure or c.connected.set()
    c.on_message = lambda cl, u, m: c.received.append((m.topic, m.payload))
    c.on_publish = lambda cl, u, mid, rc, p: c.acks.__setitem__(mid, rc)
    c.connect("127.0.0.1", broker.port, keepalive=5)
    c.loop_start()
    assert c.connected.wait(5), "%s could not log in" % user
    return c


@pytest.fixture
def secured_broker(tmp_path):
    """mosquitto with the deploy/ ACL and a password file made by deploy/add-user.sh."""
    if not shutil.which("mosquitto_passwd"):
        pytest.skip("mosquitto_passwd is not installed")
    passwd = str(tmp_path / "passwd")
    for user in ("jetserve-fleet", "dev-a", "dev-b"):
        subprocess.run(["sh", os.path.join(REPO, "deploy/add-user.sh"), passwd, user, "pw-" + user],
                       check=True, timeout=30)
    b = Broker(tmp_path, "allow_anonymous false\npassword_file %s\nacl_file %s\n"
               % (passwd, os.path.join(REPO, "deploy/acl"))).start()
    yield b
    b.stop()


def test_acl_refuses_a_device_publishing_under_another_devices_prefix(secured_broker):
    fleet = client(secured_broker, "jetserve-fleet", "pw-jetserve-fleet")
    dev_a = client(secured_broker, "dev-a", "pw-dev-a")
    try:
        fleet.subscribe("jetserve/v1/#", qos=1)
        dev_a.subscribe([("jetserve/v1/lab/dev-b/cmd", 1), ("jetserve/v1/lab/dev-a/cmd", 1)])
        wait_for(lambda: fleet.subscribed and dev_a.subscribed, 5, what="SUBACKs")
        own = dev_a.publish("jetserve/v1/lab/dev-a/health", json.dumps({"n": 1}), qos=1)
        forged = dev_a.publish("jetserve/v1/lab/dev-b/health", json.dumps({"n": 666}), qos=1)
        wait_for(lambda: own.mid in dev_a.acks and forged.mid in dev_a.acks, 5, what="PUBACKs")
        assert dev_a.acks[forged.mid].is_failure and dev_a.acks[forged.mid].value == 0x87  # Not authorized
        wait_for(lambda: fleet.received, 5, what="the device's own message at the controller")
        fleet.publish("jetserve/v1/lab/dev-b/cmd", b'{"command": "drain"}', qos=1)
        fleet.publish("jetserve/v1/lab/dev-a/cmd", b'{"command": "resume"}', qos=1)
        wait_for(lambda: dev_a.received, 5, what="dev-a's own command")
        time.sleep(0.5)  # anything forged would have been delivered by now
        assert [t for t, _ in fleet.received if t.endswith("/health")] == [
            "jetserve/v1/lab/dev-a/health"]  # the forged one never arrived
        assert dev_a.received == [("jetserve/v1/lab/dev-a/cmd", b'{"command": "resume"}')]  # not dev-b's
    finally:
        for c in (fleet, dev_a):
            c.disconnect()
            c.loop_stop()


@pytest.mark.parametrize("unit", ["jetserve-agent.service", "jetserve-fleet.service"])
def test_systemd_units_verify(unit, tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    with open(os.path.join(REPO, "systemd", unit)) as f:
        text = f.read()
    assert re.search(r"^ExecStart=/usr/local/bin/jetserve ", text, re.M)
    # verify insists that ExecStart's binary exists: point a copy at this machine's jetserve.
    binary = shutil.which("jetserve") or sys.executable + " -m jetserve.cli"
    (tmp_path / unit).write_text(text.replace("/usr/local/bin/jetserve", binary))
    out = subprocess.run([analyze, "verify", str(tmp_path / unit)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=60)
    assert out.returncode == 0, out.stdout.decode()
    assert unit.encode() not in out.stdout, out.stdout.decode()  # no warnings about our unit


def test_systemd_verify_catches_a_broken_unit(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    (tmp_path / "broken.service").write_text("[Service]\nExecStart=relative/path\n")
    out = subprocess.run([analyze, "verify", str(tmp_path / "broken.service")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, timeout=60)
    assert out.returncode != 0 or b"broken.service" in out.stdout
