"""Registry rules: sessions by bdSeq, replays by (epoch, n), gaps, silence, controller alerts; each
on SQLite and on a real PostgreSQL server."""

from jetserve.fleet.registry import Registry


def health(n, epoch="e1", **extra):
    doc = {"epoch": epoch, "n": n, "seq": n % 256, "status": "OK", "thermal": {"level": "normal"},
           "service": {"health": "SERVING"}, "compat": {"status": "ok", "checks": []}}
    doc.update(extra)
    return doc


def test_stale_death_is_ignored(registry_location):
    r = Registry(registry_location)
    assert r.state("lab", "d", {"online": True, "bdSeq": 4}) == "birth"
    assert r.state("lab", "d", {"online": False, "bdSeq": 3}) == "stale-death"
    assert r.devices()[0]["online"]
    assert r.state("lab", "d", {"online": False, "bdSeq": 4}) == "death"
    assert not r.devices()[0]["online"]
    assert [a["kind"] for a in r.alerts()] == ["offline"]


def test_replays_are_dropped_and_holes_alerted_unless_filled_in_time(registry_location):
    r = Registry(registry_location)
    r.state("lab", "d", {"online": True, "bdSeq": 0, "interval": 2.0}, now=100.0)
    assert [r.data("lab", "d", "health", health(n), now=100.0) for n in (1, 2, 2, 1, 3)] == [
        "new", "new", "duplicate", "duplicate", "new"]
    assert r.data("lab", "d", "health", health(6), now=101.0) == "gap"  # 4 and 5 missing
    assert r.data("lab", "d", "health", health(4), now=101.5) == "late"  # another replica had it
    r.sweep(1000, now=102.9)
    assert r.alerts() == [], "a hole gets one report interval to fill"
    r.sweep(1000, now=103.1)
    d = r.devices()[0]
    assert (d["received"], d["duplicates"], d["gaps"], d["last_n"]) == (5, 2, 1, 6)
    assert r.alerts()[0]["kind"] == "seq-gap" and "1 message(s) missing" in r.alerts()[0]["message"]
    assert r.data("lab", "d", "health", health(5, status="DEGRADED"), now=104.0) == "late"
    assert r.data("lab", "d", "health", health(4), now=104.0) == "duplicate"
    d = r.devices()[0]
    assert (d["gaps"], d["duplicates"]) == (0, 3)
    assert d["health"]["n"] == 6 and d["status"] == "OK", "a late health document never overwrites a newer one"
    # a new outbox (epoch) starts over without a gap
    assert r.data("lab", "d", "health", health(1, epoch="e2"), now=105.0) == "new"
    assert r.devices()[0]["gaps"] == 0 and len(r.alerts()) == 1


def test_a_count_that_went_back_is_shown_not_frozen_and_its_ids_are_new_again(registry_location):
    """An outbox restored from an older copy (same epoch, ids far below the top), or one id far
    ahead (2^53, the wire's bound) and the count going on after it: the health shown follows the
    device again at once, the holes the jump opened are gone, one alert says so, and the ids the
    device gives again are new messages, not replays of the ones it gave before."""
    from jetserve.fleet.registry import SEEN_WINDOW
    from jetserve.wire.messages import MAX_N

    r = Registry(registry_location)
    r.state("lab", "d", {"online": True, "bdSeq": 0, "interval": 2.0}, now=100.0)
    top = 3 * SEEN_WINDOW
    assert [r.data("lab", "d", "health", health(n), now=100.0) for n in (top - 1, top)] == ["new", "new"]
    assert r.data("lab", "d", "health", health(top - SEEN_WINDOW + 1), now=100.5) == "late", "within the window"
    assert r.data("lab", "d", "health", health(5, status="DEGRADED"), now=101.0) == "new"
    d = r.devices()[0]
    assert (d["last_n"], d["gaps"], d["status"], d["health"]["n"]) == (5, 0, "DEGRADED", 5)
    assert [a["kind"] for a in r.alerts()] == ["seq-rewind"] and "from %d to 5" % top in r.alerts()[0]["message"]
    assert [r.data("lab", "d", "health", health(n), now=102.0) for n in (6, top - 1, top, top - 1)] == [
        "new", "gap", "new", "duplicate"], "ids given before the rewind are new again, and then replays"
    assert r.data("lab", "d", "health", health(MAX_N), now=103.0) == "gap"
    assert r.data("lab", "d", "health", health(top + 1, status="OK"), now=104.0) == "new"
    d = r.devices()[0]
    assert (d["last_n"], d["gaps"], d["status"]) == (top + 1, 0, "OK")
    r.sweep(1000, now=200.0)
    assert [a["kind"] for a in r.alerts()] == ["seq-rewind"] * 2, "no gap of 2^53 messages is alerted"


def test_replicas_in_other_processes_share_one_registry(registry_location):
    """Two writers on one file, messages split between them out of order: each counted once."""
    a, b = Registry(registry_location), Registry(registry_location)
    outcomes = [(a if n % 2 else b).data("lab", "d", "health", health(n), now=100.0) for n in (2, 1, 4, 3, 3, 5)]
    assert outcomes == ["new", "late", "gap", "late", "duplicate", "new"]
    d = a.devices()[0]
    assert (d["received"], d["duplicates"], d["gaps"], d["last_n"]) == (5, 1, 0, 5)


def test_conditions_alert_once_when_they_appear(registry_location):
    r = Registry(registry_location)
    hot = {"thermal": {"level": "shed"}, "service": {"health": "UNREACHABLE", "error": "x: UNAVAILABLE"},
           "compat": {"status": "fail", "checks": [{"name": "jetpack", "status": "fail", "detail": "too old"}]}}
    r.data("lab", "d", "health", health(1, **hot))
    r.data("lab", "d", "health", health(2, **hot))
    assert sorted(a["kind"] for a in r.alerts()) == ["jetpack-too-old", "service-down", "throttling"]
    assert r.devices()[0]["conditions"] == ["jetpack-too-old", "service-down", "throttling"]
    r.data("lab", "d", "health", health(3))
    assert r.devices()[0]["conditions"] == [] and len(r.alerts()) == 3


def test_silence_marks_offline_and_a_message_brings_it_back(registry_location):
    r = Registry(registry_location)
    r.state("lab", "d", {"online": True, "bdSeq": 0, "interval": 2.0}, now=100.0)
    r.data("lab", "d", "health", health(1), now=101.0)
    assert r.sweep(3, now=106.9) == []
    assert r.sweep(3, now=107.1) == [("lab", "d")]
    assert r.devices()[0]["reason"] == "silent"
    r.data("lab", "d", "health", health(2), now=108.0)
    assert r.devices()[0]["online"]



def test_sqlite_memory_stays_bounded_whatever_batch_sizes_the_load_brings(tmp_path):
    """Batches come in every size up to MAX_BATCH, and each size used to be new statement texts
    (multi-row VALUES lists), which SQLite prepares and Python's sqlite3 keeps, 128 a connection:
    a controller's memory grew with the sizes its load had brought (found in the hour-long fleet
    soak). SQLite's own count of the memory it holds (sqlite3_memory_used) grows by less than
    6 MB over 171 batch sizes, its page cache included."""
    import _sqlite3
    import ctypes

    from jetserve.fleet.ingest import MAX_BATCH
    from jetserve.fleet.registry import Message

    memory_used = ctypes.CDLL(_sqlite3.__file__).sqlite3_memory_used  # the library _sqlite3 links
    memory_used.restype = ctypes.c_int64
    r = Registry(str(tmp_path / "fleet.db"))
    before, n = memory_used(), 0
    for size in range(1, MAX_BATCH + 1, 3):
        # message m is device m % 2000's report number m // 2000 + 1: every one new, no gap
        outcomes, _ = r.apply([Message("lab", "d%04d" % (m % 2000), "health", health(m // 2000 + 1))
                               for m in range(n, n + size)], now=100.0)
        assert outcomes == ["new"] * size
        n += size
    assert memory_used() - before < 6 * 2**20, (memory_used() - before) / 2**20
    assert r.counts()["devices"] == 2000 and sum(d["received"] for d in r.devices()) == n
    r.close()


def test_the_alert_log_keeps_each_devices_newest_and_no_more(registry_location):
    """A device can send alerts as fast as it can publish, and nothing deleted any: the log grew
    without bound. Each device keeps its newest ALERTS_KEPT; a quiet neighbour loses none of its own."""
    from jetserve.fleet.registry import ALERTS_KEPT, Message

    r = Registry(registry_location)
    r.state("lab", "quiet", {"online": True, "bdSeq": 0, "interval": 1.0}, now=100.0)
    r.state("lab", "quiet", {"online": False, "bdSeq": 0}, now=101.0)  # its one alert: offline
    alert = {"type": "custom", "ts": 102.0, "epoch": "e1", "seq": 1}
    sent = ALERTS_KEPT + 300
    for start in range(1, sent + 1, 512):  # as the controller stores them: batches of up to 512
        r.apply([Message("lab", "noisy", "alert", dict(alert, n=n, i=n)) for n in range(start, min(start + 512,
                                                                                                sent + 1))], now=102.0)
    noisy = r.alerts(ALERTS_KEPT + 1, device="noisy")
    assert len(noisy) == ALERTS_KEPT and noisy[0]["body"]["i"] == sent and noisy[-1]["body"]["i"] == sent - ALERTS_KEPT + 1
    assert [a["kind"] for a in r.alerts(10, device="quiet")] == ["offline"]
    r.state("lab", "noisy", {"online": True, "bdSeq": 0, "interval": 1.0}, now=103.0)
    r.sweep(3.0, now=200.0)  # the controller's own alerts go to the same log: offline, silent
    noisy = r.alerts(ALERTS_KEPT + 1, device="noisy")
    assert len(noisy) == ALERTS_KEPT and noisy[0]["kind"] == "offline"
    r.close()


def test_a_limit_the_content_breaks_is_the_batchs_fault_and_a_lost_server_is_transient(registry_location):
    """Ingest tries a StoreError again (the database may come back) and splits any other failure
    down to the message at fault. SQLite and PostgreSQL both say "too big" as the content's fault;
    psycopg files PostgreSQL's under OperationalError, beside a server that is gone."""
    import pytest

    from jetserve.fleet.stores import StoreError, open_store

    store = open_store(registry_location)
    too_big = "SELECT repeat('x', 1100000000)" if store.name == "postgresql" else "SELECT zeroblob(2000000000)"
    with pytest.raises(Exception) as refused, store.write() as db:
        db.execute(too_big)
    assert not isinstance(refused.value, StoreError) and "too" in str(refused.value)
    with store.write() as db:  # the connection is still good afterwards
        assert list(db.execute("SELECT 1")) == [(1,)]
    if store.name == "postgresql":
        with store.read() as db:
            pid = list(db.execute("SELECT pg_backend_pid()"))[0][0]
        with store.write() as db:
            db.execute("SELECT pg_terminate_backend(?, 30000)", (pid,))  # returns once it has gone
        with pytest.raises(StoreError), store.read() as db:
            db.execute("SELECT 1")
        with store.read() as db:  # reopened at the next transaction
            assert list(db.execute("SELECT 1")) == [(1,)]
    store.close()
