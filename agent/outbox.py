"""Disk-backed store-and-forward queue for health and alerts (SQLite).

Every data message goes through here, connected or not, so one path keeps the order. A message's
identity is (epoch, n): `n` is the row id (AUTOINCREMENT never reuses one) and `epoch` is drawn
once when the file is created, so ids stay unique across agent restarts and the controller can
drop replays (Sparkplug's per-session `seq` is the publisher's business). When full, the oldest health goes
first and alerts only when nothing else is left; each drop is counted.

Crash safety: WAL with synchronous=FULL, so a message `add` returned survives kill -9 and a power
cut (one fsync per message: a handful a minute), and an acknowledged one never comes back after
kill -9 (after a power cut at worst once more, which the controller drops as a replay). A file
that is not a database, or fails SQLite's quick check at start, is set aside with a warning and a
new outbox (new epoch) started. A disk that refuses writes (full, or failing) costs no message and
stops nothing: messages get their ids and wait in memory (at most SPILL_LIMIT; the oldest health
goes first), acknowledgements too, all written at a later message or acknowledgement once it can
(tried every RETRY_S at most); an outbox that cannot be opened on a full disk (SQLite must make
its -shm file) lives in memory until the next start, and the agent runs (a crash loop would send
nothing at all). Each episode logs one line.
"""

import collections
import json
import logging
import os
import sqlite3
import threading
import time
import uuid

from jetserve import atomic

log = logging.getLogger(__name__)

SPILL_LIMIT = 1000  # messages held in memory while the disk refuses writes
RETRY_S = 5.0  # while it does, a write is tried again this often at most (each try rewrites the whole spill)

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
        self.path, self.limit = path, limit
        self._lock = threading.Lock()
        self._spill = collections.deque()  # (n, kind, topic, body, created) not yet on disk, oldest first
        self._forget = set()  # acknowledged, not yet deleted on disk
        self._dropped = {"health": 0, "alert": 0}  # dropped from the spill, not yet counted on disk
        self._failing = None  # the write error of the episode under way (logged once)
        self._retry_at = 0.0  # monotonic: no write is tried before, while failing
        self.retry_s = RETRY_S
        self._bdseq_unwritten = False
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._db = self._open(path)
        except (OSError, sqlite3.Error) as exc:
            directory = os.path.dirname(os.path.abspath(path))
            if not (atomic.no_space(exc) or _disk_full(exc) or atomic.disk_full(directory)):
                raise OutboxError("cannot open outbox %s: %s" % (path, exc))
            log.warning("outbox %s cannot be opened: no space left on its disk (%s); new messages are kept in "
                        "memory until the next start (those already on disk wait for it)", path, exc)
            self._db = self._connect(":memory:")
        self.epoch = self._meta("epoch")
        row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'messages'").fetchone()
        self._next_n = (row[0] if row else 0) + 1
        self._bdseq = int(self._meta("bdseq", -1))

    def _open(self, path):
        """The file's database; a corrupt one is set aside and a new one made."""
        try:
            return self._connect(path, check=True)
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError:  # its subclasses: locked, full, unreadable, not corrupt
                raise
            atomic.set_aside(path, "outbox: %s" % exc)
            return self._connect(path)

    @staticmethod
    def _connect(path, check=False):
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            if check:
                problem = db.execute("PRAGMA quick_check").fetchone()[0]  # small: it reads every page
                if problem != "ok":
                    raise sqlite3.DatabaseError(problem[:200])
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(SCHEMA)
            db.execute("INSERT OR IGNORE INTO meta VALUES ('epoch', ?)", (uuid.uuid4().hex[:16],))
        except BaseException:
            db.close()
            raise
        return db

    def _meta(self, key, default=None):
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def _bump(self, key, step=1):
        self._db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE "
                         "SET value = CAST(value AS INTEGER) + ?", (key, str(step), step))

    def next_bdseq(self):
        """The birth/death sequence of a new MQTT session: +1 per connect, 0-255, kept on disk
        (in memory while the disk refuses it)."""
        with self._lock:
            self._bdseq = (self._bdseq + 1) % 256
            self._bdseq_unwritten = True
            self._write()
            return self._bdseq

    def add(self, kind, topic, doc):
        """Queue a message; returns its n. Makes room first when the outbox is full."""
        with self._lock:
            n, self._next_n = self._next_n, self._next_n + 1
            self._spill.append((n, kind, topic, json.dumps(doc, sort_keys=True), time.time()))
            self._write()
            while len(self._spill) > min(self.limit, SPILL_LIMIT):
                self._drop_spilled()
            return n

    def _drop_spilled(self):
        victim = next((m for m in self._spill if m[1] != "alert"), self._spill[0])
        self._spill.remove(victim)
        self._dropped[victim[1]] += 1

    def _write(self):
        """One transaction: what waits in memory (acknowledgements, dropped counts, the bdSeq,
        messages). False, with one log line an episode, when the disk refuses it (all kept in
        memory) or refused it less than `retry_s` ago."""
        if self._failing is not None and time.monotonic() < self._retry_at:
            return False
        try:
            self._db.execute("BEGIN IMMEDIATE")
            if self._forget:
                self._db.executemany("DELETE FROM messages WHERE n = ?", [(n,) for n in self._forget])
            for kind, count in self._dropped.items():
                if count:
                    self._bump("dropped_" + kind, count)
            for message in self._spill:
                count = self._db.execute("SELECT count(*) FROM messages").fetchone()[0]
                for _ in range(count - self.limit + 1):
                    self._drop_one()
                self._db.execute("INSERT INTO messages (n, kind, topic, body, created) VALUES (?, ?, ?, ?, ?)",
                                 message)
            if self._bdseq_unwritten:
                self._db.execute("INSERT INTO meta VALUES ('bdseq', ?) ON CONFLICT(key) DO UPDATE "
                                 "SET value = excluded.value", (str(self._bdseq),))
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as exc:  # full, failing, or locked: the same work again at the next call
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            if self._failing is None:
                log.warning("outbox %s cannot be written (%s): messages wait in memory (at most %d) and are "
                            "written once it can", self.path, exc, min(self.limit, SPILL_LIMIT))
            self._failing = str(exc)
            self._retry_at = time.monotonic() + self.retry_s
            return False
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        if self._failing is not None:
            log.warning("outbox %s written again: %d message(s) kept in memory are on disk", self.path,
                        len(self._spill))
            self._failing = None
        self._spill.clear()
        self._forget.clear()
        self._bdseq_unwritten = False
        self._dropped = dict.fromkeys(self._dropped, 0)
        return True

    def _drop_one(self):
        row = self._db.execute("SELECT n, kind FROM messages ORDER BY kind = 'alert', n LIMIT 1").fetchone()
        self._db.execute("DELETE FROM messages WHERE n = ?", (row[0],))
        self._bump("dropped_" + row[1])

    def pending(self, after=0, limit=100):
        """Queued messages with n > after, oldest first, as (n, topic, doc with epoch and n).

        A row whose body no longer reads as a JSON object (damage inside a page, which the quick
        check at start does not read) is dropped and counted, with a warning naming it: kept, it
        would stop the flusher at the same row after every restart, and nothing after it would leave."""
        with self._lock:
            rows = [row for row in self._db.execute(
                "SELECT n, kind, topic, CAST(body AS BLOB) FROM messages WHERE n > ? ORDER BY n LIMIT ?",
                (after, limit + len(self._forget))).fetchall() if row[0] not in self._forget]
            rows += [(n, kind, topic, body) for n, kind, topic, body, _ in self._spill if n > after]  # newer
            found = []
            for n, kind, topic, body in rows[:limit]:
                try:
                    doc = json.loads(body)
                    if not isinstance(doc, dict):
                        raise ValueError("a JSON %s, not an object" % type(doc).__name__)
                except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError included
                    log.warning("outbox %s: message %d is damaged (%s); dropped", self.path, n, str(exc)[:200])
                    self._forget.add(n)
                    self._dropped["alert" if kind == "alert" else "health"] += 1
                    continue
                found.append((n, topic, dict(doc, epoch=self.epoch, n=n)))
            if len(found) < len(rows[:limit]):
                self._write()
        return found

    def ack(self, n):
        """The broker has the message (PUBACK): forget it."""
        with self._lock:
            spilled = next((m for m in self._spill if m[0] == n), None)
            if spilled is not None:
                self._spill.remove(spilled)
            else:
                self._forget.add(n)
            self._write()

    def stats(self):
        with self._lock:
            pending = self._db.execute("SELECT count(*) FROM messages").fetchone()[0]
            if self._forget:  # only while the disk refuses writes
                pending -= sum(row[0] in self._forget for row in self._db.execute("SELECT n FROM messages"))
            return {"pending": pending + len(self._spill), "limit": self.limit,
                    "dropped": {kind: int(self._meta("dropped_" + kind, 0)) + self._dropped[kind]
                                for kind in ("health", "alert")}}

    def close(self):
        with self._lock:
            self._db.close()


def _disk_full(exc):
    """SQLite's SQLITE_FULL (Python 3.8 has no error codes on its exceptions: the message)."""
    return getattr(exc, "sqlite_errorcode", None) == 13 or "disk is full" in str(exc)
