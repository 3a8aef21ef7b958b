"""Disk-backed store-and-forward queue for health and alerts (SQLite).

Every data message goes through here, connected or not, so one path keeps the order. A message's
identity is (epoch, n): `n` is the row id (AUTOINCREMENT never reuses one) and `epoch` is drawn
once when the file is created, so ids stay unique across agent restarts and the controller can
drop replays (Sparkplug's per-session `seq` is the publisher's business). When full, the oldest health goes
first and alerts only when nothing else is left; each drop is counted.
"""

import json
import os
import sqlite3
import threading
import time
import uuid

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    n INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    topic TEXT NOT NULL,
    body TEXT NOT NULL,
    created REAL NOT NULL
);
"""


class OutboxError(RuntimeError):
    pass


class Outbox:
    def __init__(self, path, limit=10000):
        if limit < 1:
            raise OutboxError("outbox limit must be at least 1")
        self.limit = limit
        self._lock = threading.Lock()
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('epoch', ?)", (uuid.uuid4().hex[:16],))
        except (OSError, sqlite3.Error) as exc:
            raise OutboxError("cannot open outbox %s: %s" % (path, exc))
        self.epoch = self._meta("epoch")

    def _meta(self, key, default=None):
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def _bump(self, key, step=1):
        self._db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE "
                         "SET value = CAST(value AS INTEGER) + ?", (key, str(step), step))

    def next_bdseq(self):
        """The birth/death sequence of a new MQTT session: +1 per connect, 0-255, kept on disk."""
        with self._lock:
            self._db.execute("INSERT INTO meta VALUES ('bdseq', '0') ON CONFLICT(key) DO UPDATE "
                             "SET value = (CAST(value AS INTEGER) + 1) % 256")
            return int(self._meta("bdseq"))

    def add(self, kind, topic, doc):
        """Queue a message; returns its n. Makes room first when the outbox is full."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                count = self._db.execute("SELECT count(*) FROM messages").fetchone()[0]
                for _ in range(count - self.limit + 1):
                    self._drop_one()
                cursor = self._db.execute(
                    "INSERT INTO messages (kind, topic, body, created) VALUES (?, ?, ?, ?)",
                    (kind, topic, json.dumps(doc, sort_keys=True), time.time()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return cursor.lastrowid

    def _drop_one(self):
        row = self._db.execute("SELECT n, kind FROM messages ORDER BY kind = 'alert', n LIMIT 1").fetchone()
        self._db.execute("DELETE FROM messages WHERE n = ?", (row[0],))
        self._bump("dropped_" + row[1])

    def pending(self, after=0, limit=100):
        """Queued messages with n > after, oldest first, as (n, topic, doc with epoch and n)."""
        with self._lock:
            rows = self._db.execute("SELECT n, topic, body FROM messages WHERE n > ? ORDER BY n LIMIT ?",
                                    (after, limit)).fetchall()
        return [(n, topic, dict(json.loads(body), epoch=self.epoch, n=n)) for n, topic, body in rows]

    def ack(self, n):
        """The broker has the message (PUBACK): forget it."""
        with self._lock:
            self._db.execute("DELETE FROM messages WHERE n = ?", (n,))

    def stats(self):
        with self._lock:
            pending = self._db.execute("SELECT count(*) FROM messages").fetchone()[0]
            return {"pending": pending, "limit": self.limit,
                    "dropped": {kind: int(self._meta("dropped_" + kind, 0)) for kind in ("health", "alert")}}

    def close(self):
        with self._lock:
            self._db.close()
