"""Group commit against a real controller, real mosquitto and a real registry (SQLite and
PostgreSQL): a burst that waits behind a locked registry lands in far fewer transactions than
messages and loses none; messages not yet committed when the controller is killed come back from
the broker (acknowledged only after the commit); the queue holds at most its byte bound of large
payloads, the rest waiting at the broker; a message the database refuses alone is dropped without
taking its batch with it; /metrics passes promtool."""

import contextlib
import json
import signal
import subprocess
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from jetserve.fleet.ingest import BATCH_BYTES, QUEUE_BYTES
from jetserve.fleet.registry import Registry
from tests.agent.conftest import Process, controller_args, free_port, wait_for
from tests.fleet.test_poison import DEEP, alert, health, publish, publisher, raw, topic
from tests.tools import require_tool

BURST = 200  # messages: 20 devices x 10 health reports
DEVICES = ["burst-%02d" % i for i in range(20)]


@contextlib.contextmanager
def registry_locked(location):
    """Hold the registry's write lock from outside, as a long transaction of another writer would."""
    if "://" in location:
        import psycopg

        with psycopg.connect(location) as held:
            held.execute("LOCK TABLE devices IN SHARE MODE")  # no insert or update until we end
            yield
    else:
        import sqlite3

        held = sqlite3.connect(location, isolation_level=None)
        held.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            held.close()


def start(broker, location, tmp_path, name):
    """A controller with /metrics; its stall timeout is longer than a test holds the registry."""
    port = free_port()
    controller = Process(controller_args(broker, location, "--http", "127.0.0.1:%d" % port, "--silence-factor",
                                         "1000", "--stall-timeout", "600"), str(tmp_path / (name + ".log")))
    wait_for(lambda: "subscribed" in controller.output(), 30, what="the controller's subscription")
    controller.metrics_url = "http://127.0.0.1:%d/metrics" % port
    return controller


def scrape(controller):
    return urllib.request.urlopen(controller.metrics_url, timeout=10).read().decode()


def wait_received(controller, count=BURST):
    """Until the controller has taken `count` messages from the broker (queued, or in the batch
    the writer holds)."""
    wait_for(lambda: value(scrape(controller), "jetserve_fleet_received_total") >= count, 120,
             what="the burst received behind the lock")


def value(text, name, **labels):
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def counted(location):
    registry = Registry(location)
    try:
        return {d["device"]: d for d in registry.devices()}
    finally:
        registry.close()


def burst(client):
    """BURST health reports, interleaved across the devices, then each acknowledged by the broker."""
    sent = [client.publish(topic(device, "health"), raw(health(n=n)), qos=1)
            for n in range(1, BURST // len(DEVICES) + 1) for device in DEVICES]
    for info in sent:
        info.wait_for_publish(60)


def wait_counted(location, total, what):
    """The registry's devices once `total` messages are counted across them."""
    def devices():
        found = counted(location)
        return found if sum(d["received"] for d in found.values()) == total else None
    return wait_for(devices, 120, what=what)


def test_a_burst_lands_in_few_transactions_none_lost_and_metrics_pass_promtool(broker, registry_location, tmp_path):
    controller = start(broker, registry_location, tmp_path, "controller")
    client = publisher(broker.port)
    try:
        with registry_locked(registry_location):
            burst(client)
            wait_received(controller)
        devices = wait_counted(registry_location, BURST, "every message of the burst counted")
        assert all((d["received"], d["last_n"], d["gaps"], d["duplicates"]) == (10, 10, 0, 0)
                   for d in devices.values())
        text = scrape(controller)
        transactions = value(text, "jetserve_fleet_batch_messages_count")
        print("%d messages in %d transactions" % (BURST, transactions))
        assert transactions <= BURST / 4, "the queued burst is stored a batch per transaction"
        assert value(text, "jetserve_fleet_batch_messages_sum") == BURST
        assert value(text, "jetserve_fleet_messages_total", kind="health", outcome="new") == BURST
        assert value(text, "jetserve_fleet_registry_lag_seconds_count") == BURST
        promtool = require_tool("promtool", how="apt-get install prometheus")
        checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                                 timeout=60)
        assert checked.returncode == 0 and not (checked.stdout + checked.stderr).strip(), \
            checked.stdout + checked.stderr
    finally:
        client.disconnect()
        client.loop_stop()
        print(controller.output()[-3000:])  # shown when the test fails
        assert controller.stop() == 0, controller.output()[-3000:]


def test_messages_not_committed_when_the_controller_dies_come_back(broker, registry_location, tmp_path):
    """Killed (-9) while the burst waits behind a locked registry: nothing of it was acknowledged,
    so the broker hands all of it to the restarted controller; counted once each."""
    controller = start(broker, registry_location, tmp_path, "first")
    client = publisher(broker.port)
    try:
        with registry_locked(registry_location):
            burst(client)
            wait_received(controller)
            controller.stop(signal.SIGKILL)
        assert sum(d["received"] for d in counted(registry_location).values()) == 0
        controller = start(broker, registry_location, tmp_path, "second")
        devices = wait_counted(registry_location, BURST, "the burst delivered again and counted")
        assert all((d["received"], d["gaps"], d["duplicates"]) == (10, 0, 0) for d in devices.values())
    finally:
        client.disconnect()
        client.loop_stop()
        controller.stop()


def test_large_payloads_wait_at_the_broker_beyond_the_queues_byte_bound(broker, registry_location, tmp_path):
    """A device floods 200 kB payloads (under the broker's size limit) while the registry is
    locked: the controller takes in only what its byte bound holds (the queue, and the one batch
    the writer is stuck on) however many the broker has; every one is counted once it is free."""
    controller = start(broker, registry_location, tmp_path, "controller")
    client = publisher(broker.port)
    at_least = QUEUE_BYTES // len(DEEP) + 1  # a queue full, and the writer's batch (one or more)
    at_most = at_least + BATCH_BYTES // len(DEEP)  # the batch at its largest, and one in the MQTT thread's hands
    flood = 3 * at_most
    try:
        with registry_locked(registry_location):
            sent = [client.publish(topic("flood", "health"), DEEP, qos=1) for _ in range(flood)]
            for info in sent:
                info.wait_for_publish(120)  # the broker holds the whole flood
            wait_received(controller, at_least)
            time.sleep(1.0)  # time for the broker to push past the bound, were there none
            text = scrape(controller)
            assert value(text, "jetserve_fleet_received_total") <= at_most, "the byte bound held the flood back"
            assert 0 < value(text, "jetserve_fleet_queue_bytes") <= QUEUE_BYTES
            assert value(text, "jetserve_fleet_queue_capacity_bytes") == QUEUE_BYTES
        wait_for(lambda: value(scrape(controller), "jetserve_fleet_messages_total", kind="health",
                               outcome="rejected") == flood, 120, what="every large payload checked and counted")
        assert value(scrape(controller), "jetserve_fleet_queue_bytes") == 0
    finally:
        client.disconnect()
        client.loop_stop()
        assert controller.stop() == 0, controller.output()[-3000:]


def test_a_message_the_database_refuses_alone_costs_only_itself(broker, postgres_url, tmp_path):
    """An alert that passes the message checks but that the database refuses (here a CHECK
    constraint, as a schema migration or a stricter replica might hold): the batch it sits in is
    split until that one alert is found; it is dropped and counted, the rest of the batch is stored."""
    import psycopg

    controller = start(broker, postgres_url, tmp_path, "controller")
    client = publisher(broker.port)
    with psycopg.connect(postgres_url, autocommit=True) as db:
        db.execute("ALTER TABLE alerts ADD CONSTRAINT refuses_one_kind CHECK (kind <> 'refused-by-the-database')")
    try:
        with registry_locked(postgres_url):
            burst(client)
            publish(client, topic("nul", "alert"), json.dumps(alert(n=1, type="refused-by-the-database")))
            publish(client, topic("nul", "health"), raw(health(n=2)))
            wait_received(controller, BURST + 2)
        devices = wait_counted(postgres_url, BURST + 1, "everything but the refused alert counted")
        assert devices["nul"]["last_n"] == 2 and devices["nul"]["received"] == 1
        text = scrape(controller)
        assert value(text, "jetserve_fleet_messages_total", kind="alert", outcome="failed") == 1
        assert controller.proc.poll() is None
        assert "the registry refused lab/nul's alert message; dropped" in controller.output()
    finally:
        client.disconnect()
        client.loop_stop()
        assert controller.stop() == 0, controller.output()[-3000:]
