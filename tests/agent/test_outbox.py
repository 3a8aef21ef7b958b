"""The SQLite outbox: order, bounds, drop policy, ids that survive a restart."""

import pytest

from jetserve.agent.outbox import Outbox, OutboxError


def test_ids_order_and_persistence(tmp_path):
    box = Outbox(str(tmp_path / "o.db"))
    assert [box.add("health", "t/health", {"i": i}) for i in range(3)] == [1, 2, 3]
    epoch = box.epoch
    box.ack(1)
    box.close()
    box = Outbox(str(tmp_path / "o.db"))  # an agent restart
    assert box.epoch == epoch
    assert box.add("alert", "t/alert", {"i": 3}) == 4
    rows = box.pending()
    assert [n for n, _, _ in rows] == [2, 3, 4]
    doc = rows[0][2]
    assert (doc["epoch"], doc["n"], doc["i"]) == (epoch, 2, 1)
    assert [n for n, _, _ in box.pending(after=2, limit=1)] == [3]


def test_bounded_oldest_health_first_alerts_last(tmp_path):
    box = Outbox(str(tmp_path / "o.db"), limit=4)
    box.add("alert", "a", {"x": "a1"})
    box.add("health", "h", {"x": "h1"})
    box.add("health", "h", {"x": "h2"})
    box.add("alert", "a", {"x": "a2"})
    box.add("health", "h", {"x": "h3"})  # drops h1
    box.add("alert", "a", {"x": "a3"})  # drops h2
    assert [doc["x"] for _, _, doc in box.pending()] == ["a1", "a2", "h3", "a3"]
    box.add("alert", "a", {"x": "a4"})  # drops h3
    box.add("alert", "a", {"x": "a5"})  # only alerts left: the oldest goes
    assert [doc["x"] for _, _, doc in box.pending()] == ["a2", "a3", "a4", "a5"]
    assert box.stats() == {"pending": 4, "limit": 4, "dropped": {"health": 3, "alert": 1}}


def test_bdseq_is_per_connect_and_wraps(tmp_path):
    box = Outbox(str(tmp_path / "o.db"))
    seqs = [box.next_bdseq() for _ in range(257)]
    assert seqs[:3] == [0, 1, 2] and seqs[255] == 255 and seqs[256] == 0
    box.close()
    assert Outbox(str(tmp_path / "o.db")).next_bdseq() == 1


def test_unusable_path_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutboxError, match="cannot open outbox"):
        Outbox(str(tmp_path / "file" / "o.db"))
