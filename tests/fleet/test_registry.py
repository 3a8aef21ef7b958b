"""Registry rules: sessions by bdSeq, replays by (epoch, n), gaps, silence, controller alerts."""

from jetserve.fleet.registry import Registry


def health(n, epoch="e1", **extra):
    doc = {"epoch": epoch, "n": n, "seq": n % 256, "status": "OK", "thermal": {"level": "normal"},
           "service": {"health": "SERVING"}, "compat": {"status": "ok", "checks": []}}
    doc.update(extra)
    return doc


def test_stale_death_is_ignored(tmp_path):
    r = Registry(str(tmp_path / "f.db"))
    assert r.state("lab", "d", {"online": True, "bdSeq": 4}) == "birth"
    assert r.state("lab", "d", {"online": False, "bdSeq": 3}) == "stale-death"
    assert r.devices()[0]["online"]
    assert r.state("lab", "d", {"online": False, "bdSeq": 4}) == "death"
    assert not r.devices()[0]["online"]
    assert [a["kind"] for a in r.alerts()] == ["offline"]


def test_replays_are_dropped_and_gaps_counted(tmp_path):
    r = Registry(str(tmp_path / "f.db"))
    assert [r.data("lab", "d", "health", health(n)) for n in (1, 2, 2, 1, 3)] == [
        "new", "new", "duplicate", "duplicate", "new"]
    assert r.data("lab", "d", "health", health(6)) == "gap"
    d = r.devices()[0]
    assert (d["received"], d["duplicates"], d["gaps"], d["last_n"]) == (4, 2, 2, 6)
    assert r.alerts()[0]["kind"] == "seq-gap" and "2 message(s) missing before n=6" in r.alerts()[0]["message"]
    # a new outbox (epoch) starts over without a gap
    assert r.data("lab", "d", "health", health(1, epoch="e2")) == "new"
    assert r.devices()[0]["gaps"] == 2


def test_conditions_alert_once_when_they_appear(tmp_path):
    r = Registry(str(tmp_path / "f.db"))
    hot = {"thermal": {"level": "shed"}, "service": {"health": "UNREACHABLE", "error": "x: UNAVAILABLE"},
           "compat": {"status": "fail", "checks": [{"name": "jetpack", "status": "fail", "detail": "too old"}]}}
    r.data("lab", "d", "health", health(1, **hot))
    r.data("lab", "d", "health", health(2, **hot))
    assert sorted(a["kind"] for a in r.alerts()) == ["jetpack-too-old", "service-down", "throttling"]
    assert r.devices()[0]["conditions"] == ["jetpack-too-old", "service-down", "throttling"]
    r.data("lab", "d", "health", health(3))
    assert r.devices()[0]["conditions"] == [] and len(r.alerts()) == 3


def test_silence_marks_offline_and_a_message_brings_it_back(tmp_path):
    r = Registry(str(tmp_path / "f.db"))
    r.state("lab", "d", {"online": True, "bdSeq": 0, "interval": 2.0}, now=100.0)
    r.data("lab", "d", "health", health(1), now=101.0)
    assert r.sweep(3, now=106.9) == []
    assert r.sweep(3, now=107.1) == [("lab", "d")]
    assert r.devices()[0]["reason"] == "silent"
    r.data("lab", "d", "health", health(2), now=108.0)
    assert r.devices()[0]["online"]
