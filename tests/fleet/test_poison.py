"""A hostile device against a live controller over real mosquitto: every poison payload is refused,
counted and flagged, and the controller keeps ingesting; retained and stored poison survive a restart.

One broker and one controller serve the whole module (each case uses its own device), so 30 cases
cost seconds. After each poison message the same device sends a valid one: it must be stored.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import paho.mqtt.client as mqtt
import pytest

from jetserve.fleet.registry import Registry
from tests.agent.conftest import REPO, Broker, Process, controller_args, wait_for
from tests.tools import require_tool

EPOCH = "e1"


def health(n=1, **over):
    doc = {"schema": 1, "ts": time.time(), "status": "OK", "reasons": [], "probe": {"zones": []},
           "compat": {"status": "ok", "checks": []}, "service": {"health": "SERVING", "error": None},
           "thermal": {"level": "normal"}, "outbox": {"pending": 0}, "epoch": EPOCH, "n": n, "seq": 1}
    doc.update(over)
    return doc


def alert(n=1, **over):
    doc = {"type": "thermal", "old": "normal", "new": "shed", "zone": "cpu", "temp_c": 95.0, "ts": time.time(),
           "ok": True, "calls": ["SetLimits"], "epoch": EPOCH, "n": n, "seq": 1}
    doc.update(over)
    return doc


def birth(**over):
    doc = {"online": True, "bdSeq": 1, "seq": 0, "interval": 10.0, "keepalive": 30, "versions": {"jetpack": "6.2"},
           "compat": {"status": "ok", "checks": []}}
    doc.update(over)
    return doc


def raw(doc):
    return json.dumps(doc).encode()


DEEP = b"[" * 100000 + b"]" * 100000  # 200 kB, under the size limit
POISON = [  # (case, kind, payload)
    ("health n=2^70", "health", raw(health(n=2 ** 70))),
    ("health n a string", "health", raw(health(n="1"))),
    ("health n zero", "health", raw(health(n=0))),
    ("health seq 300", "health", raw(health(seq=300))),
    ("health epoch a list", "health", raw(health(epoch=["e", 1]))),
    ("health status an object", "health", raw(health(status={"OK": True}))),
    ("health status unknown", "health", raw(health(status="FINE"))),
    ("health compat a string", "health", raw(health(compat="ok"))),
    ("health compat check a string", "health", raw(health(compat={"status": "fail", "checks": ["x"]}))),
    ("health thermal a list", "health", raw(health(thermal=["normal"]))),
    ("health reasons a string", "health", raw(health(reasons="hot"))),
    ("health service an int", "health", raw(health(service=5))),
    ("health ts NaN", "health", raw(health(ts=math.nan))),
    ("health 100000-deep JSON", "health", DEEP),
    ("health deep inside probe", "health", raw(health()).replace(b'"probe": {', b'"probe": {"x": ' + b"[" * 40 + b"1"
                                                                   + b"]" * 40 + b', ')),
    ("health 20 MB", "health", raw(health(probe={"pad": "x" * (20 << 20)}))),
    ("health not JSON", "health", b"{not json"),
    ("health not UTF-8", "health", b'{"status": "\xff\xfe"}'),
    ("health a JSON list", "health", b"[1, 2, 3]"),
    ("alert 20 kB", "alert", raw(alert(note="x" * 20000))),  # 1000 kept a device: 256 kB each were 256 MB an API answer
    ("alert ts NaN", "alert", raw(alert(ts=math.nan))),
    ("alert ts a string", "alert", raw(alert(ts="yesterday"))),
    ("alert ts 1e300", "alert", raw(alert(ts=1e300))),
    ("alert ts Infinity", "alert", raw(alert(ts=math.inf))),
    ("alert temp a string", "alert", raw(alert(temp_c="hot"))),
    ("alert type with a NUL", "alert", raw(alert(type="x\u0000y"))),
    ("health NUL in a probe key", "health", raw(health(probe={"a\u0000": 1}))),
    # stored once (SQLite), it made the fleet's page and API fail for every device; PostgreSQL refused the row
    ("alert type a lone surrogate", "alert", raw(alert(type="x\ud800"))),
    ("health lone surrogate in a probe key", "health", raw(health(probe={"\udfff": 1}))),
    # JSON has no NaN or Infinity: stored, one in a free-form part made the fleet's API answer 500
    ("health NaN inside the probe", "health", raw(health(probe={"zones": [], "x": math.nan}))),
    ("health 1e999 inside the probe", "health", raw(health(probe={"zones": [], "x": 1.5})).replace(b"1.5", b"1e999")),
    ("alert -Infinity in an extra field", "alert", raw(alert(extra=-math.inf))),
    ("state bdSeq a list", "state", raw(birth(bdSeq=[1]))),
    ("state bdSeq 10^30", "state", raw(birth(bdSeq=10 ** 30))),
    ("state death bdSeq 10^30", "state", raw({"online": False, "bdSeq": 10 ** 30})),
    ("state interval '10'", "state", raw(birth(interval="10"))),
    ("state interval -1", "state", raw(birth(interval=-1))),
    ("state online 'yes'", "state", raw(birth(online="yes"))),
    ("state versions a list", "state", raw(birth(versions=["6.2"]))),
]


def publisher(port):
    client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id="hostile",
                         protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", port, keepalive=10)
    client.loop_start()
    return client


def publish(client, topic, payload, retain=False):
    client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(30)


def topic(device, kind):
    return "jetserve/v1/lab/%s/%s" % (device, kind)


def registry_view(db):
    registry = Registry(db)
    try:
        return ({d["device"]: d for d in registry.devices()},
                {(r["device"], r["kind"]): r for r in registry.rejections()}, registry.alerts(1000))
    finally:
        registry.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("poison")
    broker = Broker(tmp).start()
    db = str(tmp / "fleet.db")
    controller = Process(controller_args(broker, db, "--silence-factor", "1000"), str(tmp / "controller.log"))
    wait_for(lambda: "subscribed" in controller.output(), 20, what="the controller's subscription")
    client = publisher(broker.port)
    yield broker, db, controller, client
    client.disconnect()
    client.loop_stop()
    controller.stop()
    broker.stop()


@pytest.mark.parametrize("case, kind, payload", POISON, ids=[c for c, _, _ in POISON])
def test_poison_is_refused_counted_flagged_and_ingestion_goes_on(fleet, case, kind, payload):
    broker, db, controller, client = fleet
    device = "dev-%d" % [c for c, _, _ in POISON].index(case)
    publish(client, topic(device, kind), payload)
    publish(client, topic(device, "health"), raw(health(n=1)))  # then a good one from the same device
    devices, refused, alerts = wait_for(
        lambda: (lambda v: v if device in v[0] and v[0][device]["received"] == 1
                 and (device, kind) in v[1] else None)(registry_view(db)), 30, what="poison refused, good stored")
    assert controller.proc.poll() is None, controller.output()[-3000:]
    assert refused[(device, kind)]["count"] == 1, "counted once"
    assert devices[device]["health"]["n"] == 1 and devices[device]["status"] == "OK"
    flagged = [a for a in alerts if a["device"] == device and a["kind"] == "bad-message"]
    assert len(flagged) == 1 and kind in flagged[0]["message"], "the device is flagged with the reason"
    print("%s: %s" % (case, refused[(device, kind)]["last_error"]))


def test_the_same_bad_message_again_is_counted_not_alerted_again(fleet):
    broker, db, controller, client = fleet
    for n in range(3):
        publish(client, topic("repeat", "health"), raw(health(n=2 ** 70)))
    publish(client, topic("repeat", "health"), raw(health(n=1)))
    wait_for(lambda: ("repeat", "health") in registry_view(db)[1]
             and registry_view(db)[1][("repeat", "health")]["count"] == 3, 30, what="three refusals")
    assert len([a for a in registry_view(db)[2] if a["device"] == "repeat"]) == 1


def test_retained_poison_birth_and_stored_poison_survive_restarts(tmp_path):
    """A retained poison birth arrives again at every start; a birth stored before these checks
    (`interval: "10"`) is read at every sweep. Neither stops ingestion or makes a crash loop."""
    broker = Broker(tmp_path).start()
    db = str(tmp_path / "fleet.db")
    stored = Registry(db)
    stored.state("lab", "old", {"online": True, "bdSeq": 3, "interval": "10"})  # as an old controller kept it
    stored.close()
    client = publisher(broker.port)
    try:
        publish(client, topic("ghost", "state"), raw(birth(interval="10")), retain=True)
        publish(client, topic("ghost2", "state"), DEEP, retain=True)
        for start in range(3):
            controller = Process(controller_args(broker, db), str(tmp_path / ("controller-%d.log" % start)))
            try:
                wait_for(lambda: controller.output().count("refused") >= 2, 20, what="retained poison refused")
                publish(client, topic("canary", "health"), raw(health(n=start + 1)))
                wait_for(lambda: (registry_view(db)[0].get("canary") or {}).get("last_n") == start + 1, 20,
                         what="a good message after the poison")
                time.sleep(1.5)  # three sweeps over the stored poison
                assert controller.proc.poll() is None, controller.output()[-3000:]
            finally:
                assert controller.stop() == 0, controller.output()[-3000:]
        refused = registry_view(db)[1]
        assert refused[("ghost", "state")]["count"] == 3 and refused[("ghost2", "state")]["count"] == 3
        assert "Traceback" not in controller.output()
    finally:
        client.disconnect()
        client.loop_stop()
        broker.stop()


def test_a_stuck_ingest_step_makes_the_controller_exit_and_systemd_sees_the_watchdog(tmp_path):
    """Liveness is real: with the registry locked by someone else, the ingest step hangs; past
    --stall-timeout the controller stops pinging the watchdog and exits non-zero."""
    import socket
    import sqlite3

    broker = Broker(tmp_path).start()
    db = str(tmp_path / "fleet.db")
    Registry(db).close()
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(0.2)
    env = {"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": ""}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        controller = Process(controller_args(broker, db, "--stall-timeout", "2"), str(tmp_path / "controller.log"))
    finally:
        for key, value in old.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    client = publisher(broker.port)
    lock = sqlite3.connect(db, isolation_level=None)
    try:
        seen = []

        def notified(what):
            try:
                seen.extend(sock.recv(4096).decode().split("\n"))
            except socket.timeout:
                pass
            return what in seen

        wait_for(lambda: notified("READY=1"), 20, interval=0, what="READY=1")
        wait_for(lambda: notified("WATCHDOG=1"), 20, interval=0, what="WATCHDOG=1")
        wait_for(lambda: "subscribed" in controller.output(), 20, what="the subscription")
        lock.execute("BEGIN EXCLUSIVE")  # every registry write now waits (up to its 10 s timeout)
        publish(client, topic("dev", "health"), raw(health()))
        controller.proc.wait(60)
        assert controller.proc.returncode == 1, controller.output()[-3000:]
        assert "ingestion stopped: the" in controller.output() and "is stuck" in controller.output()
    finally:
        lock.close()
        sock.close()
        client.disconnect()
        client.loop_stop()
        controller.stop(signal.SIGKILL)
        broker.stop()


ODD_NAMES = ["%x" % (7 ** 40000), "ünï-dev", "x'; DROP TABLE devices;--", "a" * 65, "-lead", "a b"]


def test_a_topic_level_that_is_not_a_name_registers_nothing_and_holds_up_no_one(registry_location, tmp_path):
    """On a broker without deploy/'s ACL anyone may publish under any topic: levels no account could
    have (a 30,000-character one: PostgreSQL's index refused its row, as a retryable error, so the
    writer tried the batch again until the stall timeout, and again after every restart) are
    logged and ignored; the well-named device's message behind them is stored at once."""
    require_tool("mosquitto_pub")
    broker = Broker(tmp_path).start()
    controller = Process(controller_args(broker, registry_location, "--stall-timeout", "600"),
                         str(tmp_path / "controller.log"))
    try:
        wait_for(lambda: "subscribed" in controller.output(), 20, what="the controller's subscription")
        for device in ODD_NAMES + ["good"]:
            out = subprocess.run(["mosquitto_pub", "-p", str(broker.port), "-q", "1", "-i", "impostor",
                                  "-t", topic(device, "health"), "-m", raw(health(n=1)).decode()],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
            assert out.returncode == 0, out.stdout.decode()
        devices = wait_for(lambda: (lambda d: d if "good" in d else None)(registry_view(registry_location)[0]), 30,
                           what="the good device's message behind the odd ones")
        assert sorted(devices) == ["good"] and registry_view(registry_location)[1] == {}
        assert controller.output().count("is not a name") == len(ODD_NAMES), controller.output()[-3000:]
        assert max(map(len, controller.output().splitlines())) < 600, "a log line is bounded"
        assert controller.proc.poll() is None
    finally:
        assert controller.stop() == 0, controller.output()[-3000:]
        broker.stop()


def test_fleet_status_shows_what_devices_reported_without_obeying_it(tmp_path):
    """A device's reasons and versions reach the operator's terminal through `fleet status`: escape
    sequences (clear the screen, retitle the window), a newline forging a row of its own and a bidi
    override come out as visible escapes, one row per device."""
    db = str(tmp_path / "fleet.db")
    registry = Registry(db)
    hostile = ["\x1b[2J\x1b]0;pwned\x07cpu 95 C", "ok\nlab  forged  OK  6.2", "\u202edegrade"]
    registry.state("lab", "dev", {"online": True, "bdSeq": 1, "interval": 10.0, "keepalive": 30,
                                  "versions": {"jetpack": "6.2\x1b[8m"}})
    registry.data("lab", "dev", "health", health(n=1, status="DEGRADED", reasons=hostile))
    registry.reject("lab", "dev", "alert", "type=%s" % "\x1b[31m")
    registry.close()
    out = subprocess.run([sys.executable, "-m", "jetserve.cli", "fleet", "status", "--db", db], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    text = out.stdout.decode()
    assert out.returncode == 0, text
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, repr(text)
    assert "\\x1b[2J\\x1b]0;pwned\\x07cpu 95 C" in text and "\\u202edegrade" in text and "6.2\\x1b[8m" in text
    assert [line.split()[:2] for line in text.splitlines() if line.startswith("lab")] == [["lab", "dev"]]
