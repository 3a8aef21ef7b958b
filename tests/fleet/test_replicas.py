"""Replicas sharing one registry: concurrent writers (threads, each its own connection, as
replicas on different hosts would be) and two controllers over `$share` on a real PostgreSQL."""

import os
import random
import threading

from jetserve.fleet.registry import Registry
from tests.agent.conftest import SYSROOTS, agent_args, wait_for
from tests.fleet.test_flow import alerts, device, last_n, start_controller
from tests.fleet.test_registry import health


def test_concurrent_replicas_count_each_message_once_and_alert_once(registry_location):
    """Four writers take the messages of eight devices in a shuffled order, some twice, while
    each also sweeps: every message counted once, no hole left, one offline alert per device."""
    replicas = [Registry(registry_location) for _ in range(4)]
    rng = random.Random(7)
    devices, per_device = ["d%d" % i for i in range(8)], 40
    for name in devices:
        replicas[0].state("lab", name, {"online": True, "bdSeq": 1, "interval": 1.0}, now=100.0)
    work = [(name, n) for name in devices for n in range(1, per_device + 1)]
    work += rng.sample(work, 60)  # replays
    rng.shuffle(work)
    shares = [work[i::len(replicas)] for i in range(len(replicas))]
    errors = []

    def replica(registry, share):
        try:
            for name, n in share:
                registry.data("lab", name, "health", health(n), now=100.0 + n / 1000)
                registry.sweep(1000, now=100.5)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=pair) for pair in zip(replicas, shares)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for d in replicas[0].devices():
        assert (d["received"], d["last_n"], d["gaps"]) == (per_device, per_device, 0), d["device"]
    assert sum(d["duplicates"] for d in replicas[0].devices()) == 60
    sweepers = [threading.Thread(target=r.sweep, args=(3,), kwargs={"now": 200.0}) for r in replicas]
    for t in sweepers:
        t.start()
    for t in sweepers:
        t.join(60)
    offline = [a for a in replicas[0].alerts(1000) if a["kind"] == "offline"]
    assert sorted(a["device"] for a in offline) == devices, "one offline alert per device, whoever swept"
    assert not [a for a in replicas[0].alerts(1000) if a["kind"] == "seq-gap"]
    for r in replicas:
        r.close()


def test_replicas_starting_together_on_a_new_database(registry_location):
    """Each replica makes the schema if it is missing; started at once they must not collide."""
    opened, errors = [], []
    barrier = threading.Barrier(4)

    def start():
        barrier.wait()
        try:
            opened.append(Registry(registry_location))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(opened) == 4
    for r in opened:
        r.close()


def test_two_controllers_on_postgresql_split_the_stream(broker, spawn, service, postgres_url, tmp_path):
    """`$share` over MQTT, one PostgreSQL registry: each message at one replica, counted once."""
    state = str(tmp_path / "state")
    replicas = [start_controller(spawn, broker, postgres_url, "--share", "ctl", "--client-id", "replica-%d" % i,
                                 "--silence-factor", "1000", "--log-level", "DEBUG") for i in range(2)]
    agent = spawn("agent", *agent_args(broker, os.path.join(SYSROOTS, "agx-orin-jp62"), state, "dev1",
                                       service.address, "--interval", "0.1"))
    wait_for(lambda: (device(postgres_url) or {}).get("received", 0) >= 30, 30, what="30 reports")
    assert agent.stop() == 0
    final = last_n(state)
    record = wait_for(lambda: (lambda d: d if d["received"] == final else None)(device(postgres_url)), 20,
                      what="every message at one replica or the other")
    handled = [r.output().count("lab/dev1 health n=") for r in replicas]
    print("PostgreSQL: last n %d, handled per replica %s" % (final, handled))
    assert all(handled) and sum(handled) == final, "both replicas took part, each message once"
    assert (record["last_n"], record["gaps"], record["duplicates"]) == (final, 0, 0)
    assert not record["online"] and record["reason"] == "death certificate"
    assert not [a for a in alerts(postgres_url) if a["kind"] == "seq-gap"]
