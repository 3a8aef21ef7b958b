"""Agent ↔ broker ↔ controller end to end: real mosquitto, real processes, real gRPC service."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request

import paho.mqtt.client as mqtt

from jetserve.fleet.registry import Registry
from tests.agent.conftest import (REPO, SYSROOTS, agent_args, controller_args, copy_sysroot, free_port,
                                  set_zone_temp, wait_for)

KEEPALIVE = 2


def device(db, name="dev1"):
    if "://" not in db and not os.path.exists(db):  # a PostgreSQL URL exists from the start
        return None
    registry = Registry(db)
    try:
        return next((d for d in registry.devices() if d["device"] == name), None)
    finally:
        registry.close()


def alerts(db, source=None):
    registry = Registry(db)
    try:
        return [a for a in reversed(registry.alerts(1000)) if source is None or a["source"] == source]
    finally:
        registry.close()


def start_controller(spawn, broker, db, *extra):
    controller = spawn("controller", *controller_args(broker, db, *extra))
    wait_for(lambda: "subscribed" in controller.output(), 20, what="the controller's subscription")
    return controller


def last_n(state_dir, name="dev1"):
    """The last message id the agent's outbox ever assigned."""
    db = sqlite3.connect(os.path.join(state_dir, "outbox-lab-%s.db" % name))
    try:
        return db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'messages'").fetchone()[0]
    finally:
        db.close()


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "jetserve.cli"] + [str(a) for a in args], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


def test_once_publishes_a_health_document_the_controller_stores(broker, spawn, service, tmp_path):
    db, http_port = str(tmp_path / "fleet.db"), free_port()
    start_controller(spawn, broker, db, "--http", "127.0.0.1:%d" % http_port)
    out = cli(*agent_args(broker, os.path.join(SYSROOTS, "agx-orin-jp62"), tmp_path / "state", "dev1",
                          service.address, "--once"))
    assert out.returncode == 0, out.stdout.decode()
    stored = wait_for(lambda: (device(db) or {}).get("health"), 10, what="the stored health")
    assert stored["schema"] == 1 and stored["status"] == "OK" and stored["reasons"] == []
    assert stored["probe"]["l4t"] == "36.4.3" and stored["probe"]["jetpack"] == "6.2"
    assert stored["service"]["health"] == "SERVING" and stored["service"]["stats"]["max_num_seqs"] == 8
    assert stored["compat"]["cuda_graphs_allowed"] is True
    assert (stored["n"], stored["seq"]) == (1, 1)
    record = wait_for(lambda: (lambda d: d if not d["online"] else None)(device(db)), 10,
                      what="the clean stop's offline state")
    assert record["reason"] == "death certificate" and record["birth"]["versions"]["jetpack"] == "6.2"
    table = cli("fleet", "status", "--db", db).stdout.decode()
    assert "dev1" in table and "OFFLINE" in table and "6.2" in table
    api = json.loads(urllib.request.urlopen("http://127.0.0.1:%d/api/devices" % http_port, timeout=5).read())
    assert [(d["device"], d["state"], d["jetpack"]) for d in api["devices"]] == [("dev1", "OFFLINE", "6.2")]
    one = json.loads(urllib.request.urlopen("http://127.0.0.1:%d/api/devices/lab/dev1" % http_port, timeout=5).read())
    assert one["health"]["probe"]["model"] == "NVIDIA Jetson AGX Orin Developer Kit"
    page = urllib.request.urlopen("http://127.0.0.1:%d/" % http_port, timeout=5).read().decode()
    assert "<td>dev1</td>" in page and "OFFLINE" in page


def test_kill9_marks_offline_within_1_5_keepalive_and_restart_is_a_new_session(broker, spawn, service, tmp_path):
    db, state = str(tmp_path / "fleet.db"), tmp_path / "state"
    start_controller(spawn, broker, db, "--silence-factor", "1000")  # only the death certificate counts
    args = agent_args(broker, os.path.join(SYSROOTS, "orin-nano-jp512"), state, "dev1", service.address,
                      "--keepalive", KEEPALIVE, "--interval", "0.5")
    agent = spawn("agent", *args)
    first = wait_for(lambda: (lambda d: d if d and d["online"] and d["health"] else None)(device(db)), 20,
                     what="the agent online")
    agent.proc.kill()  # kill -9: no clean disconnect, only the broker's Will can tell
    killed = time.monotonic()
    wait_for(lambda: not device(db)["online"], 3 * KEEPALIVE, interval=0.02, what="offline")
    detected = time.monotonic() - killed
    print("offline detected %.2f s after kill -9 (keepalive %d s)" % (detected, KEEPALIVE))
    assert detected <= 1.5 * KEEPALIVE + 0.5  # the broker's timer ticks; allow its granularity
    assert device(db)["reason"] == "death certificate"

    spawn("agent", *args)
    second = wait_for(lambda: (lambda d: d if d["online"] else None)(device(db)), 20, what="back online")
    assert second["bdseq"] == (first["bdseq"] + 1) % 256
    # The old session's death, arriving late, is not taken for the new session's.
    late = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    late.connect("127.0.0.1", broker.port)
    late.loop_start()
    late.publish("jetserve/v1/lab/dev1/state", json.dumps({"online": False, "bdSeq": first["bdseq"]}),
                 qos=1).wait_for_publish(5)
    late.disconnect()
    late.loop_stop()
    time.sleep(1.0)
    assert device(db)["online"] and device(db)["bdseq"] == second["bdseq"]


def test_kill9_and_immediate_restart_ends_online_with_the_new_session(broker, spawn, service, tmp_path):
    db, state = str(tmp_path / "fleet.db"), tmp_path / "state"
    start_controller(spawn, broker, db, "--silence-factor", "1000")
    args = agent_args(broker, os.path.join(SYSROOTS, "orin-nano-jp512"), state, "dev1", service.address,
                      "--keepalive", KEEPALIVE, "--interval", "0.5")
    agent = spawn("agent", *args)
    first = wait_for(lambda: (lambda d: d if d and d["online"] else None)(device(db)), 20, what="online")
    agent.proc.kill()
    spawn("agent", *args)  # takes over the client id before the broker noticed the death
    wait_for(lambda: device(db)["bdseq"] == (first["bdseq"] + 1) % 256, 20, what="the new birth")
    time.sleep(2 * KEEPALIVE)  # any death of the old session has arrived by now
    assert device(db)["online"] and device(db)["bdseq"] == (first["bdseq"] + 1) % 256


def test_broker_down_then_up_nothing_lost_in_order_nothing_duplicated(broker, spawn, service, tmp_path):
    db, state = str(tmp_path / "fleet.db"), str(tmp_path / "state")
    root = copy_sysroot("agx-orin-jp62", tmp_path)
    start_controller(spawn, broker, db, "--silence-factor", "1000")
    agent = spawn("agent", *agent_args(broker, root, state, "dev1", service.address, "--interval", "0.2",
                                       "--keepalive", KEEPALIVE))
    wait_for(lambda: (device(db) or {}).get("received", 0) >= 3, 20, what="first reports")
    broker.stop()
    before = device(db)["last_n"]
    down = time.time()
    set_zone_temp(root, "cpu-thermal", 96000)  # hot while the broker is away: shed, an alert
    wait_for(lambda: any(c[0] == "SetLimits" for c in service.control_calls()), 10, what="shedding")
    time.sleep(1.0)
    set_zone_temp(root, "cpu-thermal", 40000)  # cooled: restore, another alert
    wait_for(lambda: len(service.control_calls()) >= 2, 10, what="restoring")
    time.sleep(1.0)
    broker.start()
    up = time.time()
    time.sleep(1.0)
    assert agent.stop() == 0
    final = last_n(state)
    record = wait_for(lambda: (lambda d: d if d["last_n"] == final else None)(device(db)), 20,
                      what="every message at the controller")
    print("last n %d, %d produced while the broker was down or reconnecting, received %d, duplicates dropped %d"
          % (final, final - before, record["received"], record["duplicates"]))
    assert final - before >= 8  # ~3 s down at one report per 0.2 s, plus the two alerts
    assert record["received"] == final and record["gaps"] == 0  # each of 1..final once, as new
    thermal = [a for a in alerts(db, "device") if a["kind"] == "thermal"]
    assert [(a["body"]["old"], a["body"]["new"]) for a in thermal] == [("normal", "shed"), ("shed", "normal")]
    assert all(down < a["ts"] < up for a in thermal)  # produced while the broker was down
    assert thermal[0]["body"]["n"] < thermal[1]["body"]["n"]
    assert record["health"]["outbox"]["dropped"] == {"health": 0, "alert": 0}
    assert "disconnected from the broker" in agent.output()


def test_two_replicas_split_the_stream_and_count_each_message_once(broker, spawn, service, tmp_path):
    """`$share`: the broker hands each message to one replica; both write one registry."""
    db, state = str(tmp_path / "fleet.db"), str(tmp_path / "state")
    replicas = [start_controller(spawn, broker, db, "--share", "ctl", "--client-id", "replica-%d" % i,
                                 "--silence-factor", "1000", "--log-level", "DEBUG") for i in range(2)]
    agent = spawn("agent", *agent_args(broker, os.path.join(SYSROOTS, "agx-orin-jp62"), state, "dev1",
                                       service.address, "--interval", "0.1"))
    wait_for(lambda: (device(db) or {}).get("received", 0) >= 30, 30, what="30 reports")
    assert agent.stop() == 0
    final = last_n(state)
    record = wait_for(lambda: (lambda d: d if d["received"] == final else None)(device(db)), 20,
                      what="every message at one replica or the other")
    handled = [r.output().count("lab/dev1 health n=") for r in replicas]
    print("last n %d, handled per replica %s, duplicates %d" % (final, handled, record["duplicates"]))
    assert all(handled) and sum(handled) == final, "both replicas took part, each message once"
    assert (record["last_n"], record["gaps"], record["duplicates"]) == (final, 0, 0)
    assert not [a for a in alerts(db) if a["kind"] == "seq-gap"]


def test_once_with_the_broker_down_keeps_the_report_for_later(broker, spawn, service, tmp_path):
    db, state = str(tmp_path / "fleet.db"), tmp_path / "state"
    port = free_port()  # nothing listens here
    args = agent_args(broker, os.path.join(SYSROOTS, "thor-jp70"), state, "dev1", service.address, "--once",
                      "--once-timeout", "1")
    args[args.index("--mqtt-port") + 1] = port
    out = cli(*args)
    assert out.returncode == 3 and b"not reachable" in out.stdout and b"Traceback" not in out.stdout
    start_controller(spawn, broker, db)
    out = cli(*agent_args(broker, os.path.join(SYSROOTS, "thor-jp70"), state, "dev1", service.address, "--once"))
    assert out.returncode == 0, out.stdout.decode()
    record = wait_for(lambda: (lambda d: d if d and d["last_n"] == 2 else None)(device(db)), 10,
                      what="both reports")
    assert record["received"] == 2 and record["gaps"] == 0


def test_command_round_trip_and_unknown_command_refused(broker, spawn, service, tmp_path):
    agent = spawn("agent", *agent_args(broker, os.path.join(SYSROOTS, "agx-orin-jp62"), tmp_path / "state",
                                       "dev1", service.address, "--interval", "30"))
    wait_for(lambda: "listening for commands" in agent.output(), 20, what="the agent's subscription")

    def send(*args):
        out = cli("fleet", "send", "lab/dev1", *args, "--mqtt-port", broker.port, "--timeout", "10")
        return out.returncode, json.loads(out.stdout.decode())

    rc, reply = send("drain")
    assert rc == 0 and reply["ok"] and reply["result"]["draining"] is True
    assert service.control_calls()[-1] == ("Drain", {})
    rc, reply = send("set-limits", "--set", "max_num_seqs=2")
    assert rc == 0 and reply["result"]["max_num_seqs"] == 2
    assert service.control_calls()[-1] == ("SetLimits", {"max_num_seqs": 2})
    calls = len(service.control_calls())
    rc, reply = send("reboot")
    assert rc == 1 and reply["ok"] is False and "not allowed" in reply["error"]
    rc, reply = send("set-limits", "--set", "kv_blocks=1")
    assert rc == 1 and reply["ok"] is False and "set-limits takes" in reply["error"]
    assert len(service.control_calls()) == calls  # refused, not executed
    rc, reply = send("report-now")
    assert rc == 0 and reply["result"]["n"] >= 2
    rc, reply = send("resume")
    assert rc == 0 and reply["result"]["draining"] is False


def test_thermal_shedding_on_a_live_service_and_recovery(broker, spawn, service, tmp_path):
    db = str(tmp_path / "fleet.db")
    root = copy_sysroot("agx-orin-jp62", tmp_path)
    start_controller(spawn, broker, db, "--silence-factor", "1000")
    spawn("agent", *agent_args(broker, root, tmp_path / "state", "dev1", service.address, "--interval", "0.2"))
    wait_for(lambda: (device(db) or {}).get("status") == "OK", 20, what="a first OK report")

    set_zone_temp(root, "cpu-thermal", 95000)  # passive 99 - margin 5 = 94: shed
    wait_for(lambda: service.control_calls(), 10, what="SetLimits")
    assert service.control_calls() == [("SetLimits", {"max_num_seqs": 4, "num_speculative_tokens": 0})]
    wait_for(lambda: device(db)["status"] == "DEGRADED", 10, what="DEGRADED")

    set_zone_temp(root, "cpu-thermal", 102000)  # critical 104.5 - margin 3 = 101.5: drain
    wait_for(lambda: len(service.control_calls()) == 2, 10, what="Drain")
    assert service.control_calls()[1] == ("Drain", {}) and service.draining
    wait_for(lambda: device(db)["status"] == "CRITICAL", 10, what="CRITICAL")

    set_zone_temp(root, "cpu-thermal", 45000)  # cooled: resume, then the old limits, one step each
    wait_for(lambda: len(service.control_calls()) == 4, 10, what="restore")
    assert service.control_calls()[2:] == [("Resume", {}),
                                           ("SetLimits", {"max_num_seqs": 8, "num_speculative_tokens": 3})]
    assert (service.max_num_seqs, service.num_speculative_tokens, service.draining) == (8, 3, False)
    wait_for(lambda: device(db)["status"] == "OK", 10, what="OK again")
    moves = [(a["body"]["old"], a["body"]["new"], a["body"]["ok"]) for a in alerts(db, "device")]
    assert moves == [("normal", "shed", True), ("shed", "drain", True), ("drain", "shed", True),
                     ("shed", "normal", True)]
    assert "throttling" in [a["kind"] for a in alerts(db, "controller")]


def test_frozen_agent_is_marked_offline_within_1_5_keepalive(broker, spawn, service, tmp_path):
    """kill -9 closes the socket (the broker sees it at once); a hung device or a cut cable does
    not. mosquitto's keepalive timer ticks in whole seconds (measured: ~4 s for keepalive 2), so
    the controller's own silence rule (3 report intervals, inside 1.5 x keepalive) is what keeps
    the bound; the broker's Will follows and is consistent with it."""
    db = str(tmp_path / "fleet.db")
    start_controller(spawn, broker, db)  # default --silence-factor 3
    agent = spawn("agent", *agent_args(broker, os.path.join(SYSROOTS, "orin-nano-jp512"), tmp_path / "state",
                                       "dev1", service.address, "--keepalive", KEEPALIVE, "--interval", "0.5"))
    wait_for(lambda: (lambda d: d and d["online"] and d["received"] >= 2)(device(db)), 20, what="online")
    seen = device(db)["received"]
    wait_for(lambda: device(db)["received"] > seen, 5, interval=0.01, what="a fresh report")
    agent.proc.send_signal(signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        wait_for(lambda: not device(db)["online"], 4 * KEEPALIVE, interval=0.02, what="offline")
        detected = time.monotonic() - frozen
        wait_for(lambda: "Client jetserve-lab-dev1 has exceeded timeout" in broker.log(), 4 * KEEPALIVE,
                 what="the broker's keepalive timeout")
        will = time.monotonic() - frozen
    finally:
        agent.proc.send_signal(signal.SIGCONT)
    print("frozen agent: controller offline after %.2f s, broker Will after %.2f s (keepalive %d s)"
          % (detected, will, KEEPALIVE))
    assert detected <= 1.5 * KEEPALIVE
    assert device(db)["reason"] == "silent"
    assert [a["kind"] for a in alerts(db, "controller")] == ["offline"]  # the Will adds no second one


def test_a_thermal_alert_with_a_long_error_and_zone_name_reaches_the_registry(broker, spawn, tmp_path):
    """The service is down at a unix socket (gRPC names the path twice in its error) and a sysfs
    zone names itself at length: the agent's alert keeps within what the controller accepts, so the
    thermal alert is stored (before: refused whole as a bad message, and the operator lost it)."""
    db = str(tmp_path / "fleet.db")
    root = copy_sysroot("agx-orin-jp62", tmp_path)
    long_type = "c" * 300 + "-thermal"
    zones = os.path.join(root, "sys/devices/virtual/thermal")
    for zone in os.listdir(zones):
        with open(os.path.join(zones, zone, "type")) as f:
            if f.read().strip() == "cpu-thermal":
                with open(os.path.join(zones, zone, "type"), "w") as f:
                    f.write(long_type + "\n")
    set_zone_temp(root, long_type, 95000)  # passive 99 - margin 5 = 94: shed, which fails
    socket_path = str(tmp_path / ("s" * 60) / "grpc.sock")  # nothing listens there
    start_controller(spawn, broker, db, "--silence-factor", "1000")
    out = cli(*agent_args(broker, root, tmp_path / "state", "dev1", "unix://" + socket_path, "--once"))
    assert out.returncode == 0, out.stdout.decode()
    stored = wait_for(lambda: [a for a in alerts(db) if a["source"] == "device" or a["kind"] == "bad-message"], 20,
                      what="the device's thermal alert, stored or refused")
    assert [a["source"] for a in stored] == ["device"], stored
    body = stored[0]["body"]
    assert (stored[0]["kind"], body["old"], body["new"], body["ok"]) == ("thermal", "normal", "shed", False)
    assert body["error"].startswith("unix://" + socket_path) and body["error"].endswith("…")
    assert len(body["error"]) <= 256 and body["zone"] == "c" * 255 + "…"


def test_a_birth_from_odd_device_files_keeps_to_the_wire_and_is_stored(broker, spawn, service, tmp_path):
    """The birth carries what the device tree and the CUDA install say: a model longer than a birth
    may say and a version.json whose version is not a string are cut and left out, so the birth is
    stored (before: refused whole at every rebirth, and the device never had one on record)."""
    db = str(tmp_path / "fleet.db")
    root = copy_sysroot("agx-orin-jp62", tmp_path)
    with open(os.path.join(root, "sys/firmware/devicetree/base/model"), "wb") as f:
        f.write(b"NVIDIA Jetson " + b"M" * 400 + b"\0")
    with open(os.path.join(root, "usr/local/cuda/version.json"), "w") as f:
        json.dump({"cuda": {"name": "CUDA SDK", "version": {"major": 12, "minor": 6}}}, f)
    start_controller(spawn, broker, db, "--silence-factor", "1000")
    out = cli(*agent_args(broker, root, tmp_path / "state", "dev1", service.address, "--once"))
    assert out.returncode == 0, out.stdout.decode()
    wait_for(lambda: (device(db) or {}).get("birth") or [a for a in alerts(db) if a["kind"] == "bad-message"], 20,
             what="the birth, stored or refused")
    assert [a["message"] for a in alerts(db) if a["kind"] == "bad-message"] == []
    birth = device(db)["birth"]
    assert birth["model"] == ("NVIDIA Jetson " + "M" * 400)[:255] + "…" and birth["versions"]["cuda"] is None
    assert birth["versions"]["jetpack"] == "6.2" and birth["soc"] == "nvidia,tegra234"
