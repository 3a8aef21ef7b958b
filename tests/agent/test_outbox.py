"""The SQLite outbox: order, bounds, drop policy, ids that survive a restart."""

import os
import sqlite3
import subprocess
import sys

import pytest

from jetserve.agent.outbox import Outbox, OutboxError
from tests.agent.conftest import REPO, SYSROOTS, agent_args


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


def test_a_damaged_row_is_dropped_and_counted_and_the_rest_still_leave(broker, service, tmp_path):
    """A body damaged inside its page (SQLite's quick check at start reads structure, not content):
    that one message is dropped with a warning naming it, and the agent still delivers the rest
    (before: the flusher thread died on it, after every restart, and nothing left again)."""
    state = tmp_path / "state"
    box = Outbox(str(state / "outbox-lab-dev1.db"))
    for i in range(3):
        box.add("health", "jetserve/v1/lab/dev1/health", {"i": i})
    box.close()
    db = sqlite3.connect(str(state / "outbox-lab-dev1.db"))
    db.execute("UPDATE messages SET body = '{\"i\": ' WHERE n = 1")  # cut short
    db.execute("UPDATE messages SET body = CAST(x'7b2269223a2022ff227d' AS TEXT) WHERE n = 2")  # not UTF-8
    db.commit()
    db.close()
    out = subprocess.run([sys.executable, "-m", "jetserve.cli"] + [str(a) for a in agent_args(
        broker, os.path.join(SYSROOTS, "agx-orin-jp62"), state, "dev1", service.address, "--once",
        "--once-timeout", "20")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    log = out.stdout.decode()
    assert out.returncode == 0, log
    assert "message 1 is damaged" in log and "message 2 is damaged" in log and "Traceback" not in log, log
    box = Outbox(str(state / "outbox-lab-dev1.db"))
    assert box.stats() == {"pending": 0, "limit": 10000, "dropped": {"health": 2, "alert": 0}}
