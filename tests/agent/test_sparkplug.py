"""Sparkplug B session rules and MQTT v5 request/response, watched by a third-party client
(mosquitto_sub -V mqttv5) rather than by our own controller."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.agent.conftest import REPO, SYSROOTS, agent_args, controller_args, wait_for
from tests.tools import require_tool



@pytest.fixture(autouse=True)
def mosquitto_sub():
    return require_tool("mosquitto_sub", how="apt-get install mosquitto-clients")


PROBE = "watcher-probe"


class Watcher:
    """mosquitto_sub printing retain flag, QoS, topic, correlation data and payload per message."""

    def __init__(self, broker, tmp_path, topic_filter, *extra):
        self.path = str(tmp_path / ("sub-%d.out" % time.monotonic_ns()))
        self._out = open(self.path, "wb")
        self.proc = subprocess.Popen(["mosquitto_sub", "-V", "mqttv5", "-p", str(broker.port), "-q", "1",
                                      "-t", topic_filter, "-F", "%r %q %t %D|%p"] + list(extra),
                                     stdout=self._out, stderr=subprocess.STDOUT)
        # mosquitto_sub says nothing once subscribed: publish probes until one comes through
        probe = topic_filter.rstrip("#") + PROBE
        wait_for(lambda: subprocess.run(["mosquitto_pub", "-p", str(broker.port), "-t", probe, "-m", "{}"],
                                        timeout=30) and any(PROBE in line for line in self.lines()), 20,
                 interval=0.2, what="mosquitto_sub's subscription")

    def lines(self):
        """Whole lines only: a message longer than mosquitto_sub's stdio buffer reaches the file in pieces."""
        with open(self.path, "rb") as f:
            written = f.read()
        return [line.decode() for line in written[:written.rfind(b"\n") + 1].splitlines()]

    def messages(self):
        """[(retain, qos, topic, correlation, doc)] for every JSON message so far."""
        found = []
        for line in self.lines():
            head, _, payload = line.partition("|")
            if PROBE in head:
                continue
            retain, qos, topic, *correlation = head.split(" ")
            found.append((int(retain), int(qos), topic, " ".join(correlation), json.loads(payload)))
        return found

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
        self._out.close()


def sessions(watched):
    """Split the device's messages at each birth: [(state doc, [data docs])]."""
    found = []
    for retain, qos, topic, _, doc in watched:
        if topic.endswith("/state") and doc["online"]:
            found.append((doc, []))
        elif topic.endswith(("/health", "/alert")) and found:
            found[-1][1].append(doc)
    return found


def send(broker, command):
    out = subprocess.run([sys.executable, "-m", "jetserve.cli", "fleet", "send", "lab/dev1", command,
                          "--mqtt-port", str(broker.port), "--timeout", "20"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    return out.returncode, json.loads(out.stdout.decode())


def test_birth_death_seq_and_rebirth_follow_sparkplug(broker, spawn, service, tmp_path):
    watcher = Watcher(broker, tmp_path, "jetserve/v1/lab/dev1/#")
    args = agent_args(broker, os.path.join(SYSROOTS, "agx-orin-jp62"), tmp_path / "state", "dev1", service.address,
                      "--interval", "0.2", "--keepalive", "2")
    try:
        first = spawn("agent", *args)
        wait_for(lambda: len(sessions(watcher.messages())) == 1 and len(sessions(watcher.messages())[0][1]) >= 5,
                 30, what="a birth and five reports")
        first.proc.send_signal(signal.SIGKILL)  # the broker publishes the Will
        first.proc.wait(10)
        wait_for(lambda: any(t.endswith("/state") and not d["online"] for _, _, t, _, d in watcher.messages()),
                 20, what="the Will")
        second = spawn("agent", *args)
        wait_for(lambda: len(sessions(watcher.messages())) == 2 and len(sessions(watcher.messages())[1][1]) >= 3,
                 30, what="a second birth and three reports")
        rc, reply = send(broker, "rebirth")
        assert rc == 0 and reply["ok"], reply
        wait_for(lambda: len(sessions(watcher.messages())) == 3 and len(sessions(watcher.messages())[2][1]) >= 3,
                 30, what="the rebirth and three reports")
        stopping = time.time()
        assert second.stop() == 0
        wait_for(lambda: watcher.messages()[-1][4].get("online") is False, 20, what="the clean stop's death")
    finally:
        watcher.stop()
    watched = watcher.messages()
    states = [(retain, qos, doc) for retain, qos, topic, _, doc in watched if topic.endswith("/state")]
    births, deaths = [d for _, _, d in states if d["online"]], [d for _, _, d in states if not d["online"]]
    assert {(retain, qos) for retain, qos, _ in states} == {(0, 1)}, "births and deaths: QoS 1, never retained"
    b0 = births[0]["bdSeq"]
    assert [(b["bdSeq"], b["seq"]) for b in births] == [(b0, 0), ((b0 + 1) % 256, 0), ((b0 + 1) % 256, 0)], \
        "bdSeq +1 per connect, the same on a rebirth; every birth is seq 0"
    assert reply["result"] == {"bdSeq": (b0 + 1) % 256}
    will, clean = deaths
    assert will == {"online": False, "bdSeq": b0}, "the Will: this session's bdSeq, no time (written at connect)"
    assert clean["bdSeq"] == (b0 + 1) % 256 and stopping <= clean["ts"] <= time.time(), "stamped at disconnect"
    for birth, data in sessions(watched):
        assert [d["seq"] for d in data] == [(i + 1) % 256 for i in range(len(data))], "seq +1 from the birth"
    ns = [d["n"] for _, data in sessions(watched) for d in data]
    assert ns == sorted(ns), "n (the outbox id) goes on across sessions, seq does not"
    # At least once: reports the killed agent had sent but not seen acknowledged go again, under
    # their n, first thing in the next session (the fleet controller keeps one of each n).
    before, after = ([d["n"] for d in data] for _, data in sessions(watched)[:2])
    again = [n for n in after if n in before]
    assert again == before[len(before) - len(again):] == after[:len(again)], (before, after)
    assert len(ns) - len(set(ns)) == len(again), "nothing else is sent twice"
    retained = subprocess.run(["mosquitto_sub", "-V", "mqttv5", "-p", str(broker.port), "-t", "jetserve/v1/#",
                               "--retained-only", "-W", "2", "-v"], stdout=subprocess.PIPE, timeout=30)
    assert retained.stdout == b"", "nothing is left retained at the broker"


def test_command_replies_honour_response_topic_and_correlation_data(broker, spawn, service, tmp_path):
    agent = spawn("agent", *agent_args(broker, os.path.join(SYSROOTS, "agx-orin-jp62"), tmp_path / "state", "dev1",
                                       service.address, "--interval", "30"))
    wait_for(lambda: "listening for commands" in agent.output(), 20, what="the agent's subscription")
    watcher = Watcher(broker, tmp_path, "jetserve/v1/lab/dev1/cmd/reply/#")

    def request(doc, response_topic, correlation):
        path = tmp_path / "request.json"
        path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
        subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-p", str(broker.port), "-q", "1",
                        "-t", "jetserve/v1/lab/dev1/cmd", "-f", str(path),
                        "-D", "PUBLISH", "response-topic", response_topic,
                        "-D", "PUBLISH", "correlation-data", correlation], check=True, timeout=30)
    try:
        # hostile commands first: the agent must answer them and live on
        request(b"[" * 100000 + b"]" * 100000, "jetserve/v1/lab/dev1/cmd/reply", "deep")
        request(b'{"command": "set-limits", "args": {"x": ' + b"[" * 8000 + b"]" * 8000 + b"}}",
                "jetserve/v1/lab/dev1/cmd/reply", "deep2")
        request({"id": "big", "command": "set-limits", "args": {"num_speculative_tokens": 100000}},
                "jetserve/v1/lab/dev1/cmd/reply", "big")
        request({"id": "r1", "command": "report-now"}, "jetserve/v1/lab/dev1/cmd/reply/op-7", "corr-42")
        request({"id": "r2", "command": "drain"}, "jetserve/v1/lab/dev2/cmd/reply", "corr-43")  # another's topic
        wait_for(lambda: len(watcher.messages()) >= 5, 20, what="five replies")
    finally:
        watcher.stop()
    hostile = {m[3]: m[4] for m in watcher.messages()[:3]}
    assert {k: (d["ok"], d["error"].split(" ")[0]) for k, d in hostile.items()} == {
        "deep": (False, "payload"), "deep2": (False, "payload"), "big": (False, "args.num_speculative_tokens=100000")}
    assert agent.proc.poll() is None
    (r1, r2) = sorted(watcher.messages()[3:], key=lambda m: m[4]["id"])
    assert r1[2:4] == ("jetserve/v1/lab/dev1/cmd/reply/op-7", "corr-42") and r1[4]["ok"] and r1[4]["result"]["n"] >= 2
    assert r2[2:4] == ("jetserve/v1/lab/dev1/cmd/reply", "corr-43"), "refused on its own reply topic, data kept"
    assert not r2[4]["ok"] and "response topic" in r2[4]["error"]
    assert service.control_calls() == [], "the refused drain never ran"


def test_a_controller_that_missed_the_birth_asks_for_a_rebirth(broker, spawn, service, tmp_path):
    """Births are not retained: a controller started after the device hears its health first, asks
    for a rebirth (Sparkplug's host rule) and then knows the session and the device's facts."""
    from jetserve.fleet.registry import Registry

    agent = spawn("agent", *agent_args(broker, os.path.join(SYSROOTS, "agx-orin-jp62"), tmp_path / "state", "dev1",
                                       service.address, "--interval", "0.3"))
    wait_for(lambda: "listening for commands" in agent.output(), 20, what="the birth, with nobody listening")
    db = str(tmp_path / "fleet.db")
    controller = spawn("controller", *controller_args(broker, db, "--silence-factor", "1000"))

    def device():
        registry = Registry(db)
        try:
            return next(iter(registry.devices()), None)
        finally:
            registry.close()
    record = wait_for(lambda: (lambda d: d if d and d["birth"] else None)(device()), 30, what="the rebirth")
    assert record["bdseq"] == record["birth"]["bdSeq"] and record["birth"]["versions"]["jetpack"] == "6.2"
    assert "asked for a rebirth" in controller.output()


def test_a_retained_command_is_refused_not_run_at_every_connect(broker, spawn, service, tmp_path):
    """A command published with retain (an operator's `mosquitto_pub -r`, anyone on an open broker)
    stays at the broker and reaches the agent again at every subscribe: each reconnect would drain
    the service anew, long after anyone meant it. It is refused with the reason, twice over two
    connects here; a live command still runs."""
    subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-p", str(broker.port), "-q", "1", "-r",
                    "-t", "jetserve/v1/lab/dev1/cmd", "-m", json.dumps({"id": "stale", "command": "drain"})],
                   check=True, timeout=30)
    watcher = Watcher(broker, tmp_path, "jetserve/v1/lab/dev1/cmd/reply/#")
    try:
        for start in range(2):
            agent = spawn("agent", *agent_args(broker, os.path.join(SYSROOTS, "agx-orin-jp62"), tmp_path / "state",
                                               "dev1", service.address, "--interval", "30"))
            wait_for(lambda: len(watcher.messages()) == start + 1, 20, what="the reply to the retained command")
            agent.stop()
        assert [(d["id"], d["ok"]) for _, _, _, _, d in watcher.messages()] == [("stale", False)] * 2
        assert "retained" in watcher.messages()[0][4]["error"]
        assert service.control_calls() == [], "the retained drain never ran"
        spawn("agent", *agent_args(broker, os.path.join(SYSROOTS, "agx-orin-jp62"), tmp_path / "state",
                                   "dev1", service.address, "--interval", "30"))
        wait_for(lambda: len(watcher.messages()) == 3, 20, what="the retained command refused again")
        subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-p", str(broker.port), "-q", "1",
                        "-t", "jetserve/v1/lab/dev1/cmd", "-m", json.dumps({"id": "live", "command": "drain"})],
                       check=True, timeout=30)
        wait_for(lambda: len(watcher.messages()) == 4, 20, what="the live command's reply")
        assert watcher.messages()[3][4]["id"] == "live" and watcher.messages()[3][4]["ok"]
        assert [name for name, _ in service.control_calls()] == ["Drain"]
    finally:
        watcher.stop()


def test_a_command_flood_waits_in_a_bounded_inbox_and_the_rest_are_refused_at_once(broker, spawn, tmp_path):
    """Commands run one at a time on the agent's thread, here a second each (the service never
    answers): 300 sent at once used to wait in memory without a bound, answered minutes later.
    At most INBOX_LIMIT wait; the others are refused at once, with the reason."""
    import socket

    from jetserve.agent.daemon import INBOX_LIMIT

    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(1024)
    agent = spawn("agent", *agent_args(broker, os.path.join(SYSROOTS, "agx-orin-jp62"), tmp_path / "state", "dev1",
                                       "127.0.0.1:%d" % silent.getsockname()[1], "--interval", "600"))
    wait_for(lambda: "listening for commands" in agent.output(), 20, what="the agent's subscription")
    watcher = Watcher(broker, tmp_path, "jetserve/v1/lab/dev1/cmd/reply/#")
    try:
        lines = "".join(json.dumps({"id": i, "command": "drain"}) + "\n" for i in range(300))
        subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-p", str(broker.port), "-q", "1", "-l",
                        "-t", "jetserve/v1/lab/dev1/cmd"], input=lines.encode(), check=True, timeout=60)
        busy = wait_for(lambda: (lambda b: b if len(b) >= 300 - INBOX_LIMIT - 20 else None)(
            [d for *_, d in watcher.messages() if "waiting already" in (d.get("error") or "")]), 30,
            what="the commands past the inbox's bound refused")
        assert all(d["ok"] is False and d["command"] == "drain" for d in busy)
        assert agent.proc.poll() is None
    finally:
        watcher.stop()
        silent.close()
