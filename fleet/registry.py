"""The fleet registry (SQLite): one row per device and a log of alerts.

Session rules (Sparkplug-style): a birth sets the device's bdSeq; a death counts only when its
bdSeq is the current one, so a late death from an old session is ignored. Data messages carry
(epoch, n): an (epoch, n) seen before is a replay and is dropped (counted as a duplicate); a jump
past the highest n opens holes (`gaps`), which a late message fills. Messages can arrive out of
order when several controller replicas share one registry (`$share` splits the stream per
message), so a hole is alerted only once it has stayed open for a report interval, and a late
health document never overwrites a newer one. Every write is one IMMEDIATE transaction, so
replicas in other processes see each other's updates whole. Alerts the controller raises go to
the same log as the devices' own.
"""

import contextlib
import json
import sqlite3
import threading
import time

from jetserve.wire.messages import stored_interval

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    fleet TEXT NOT NULL, device TEXT NOT NULL,
    online INTEGER NOT NULL DEFAULT 0, reason TEXT, bdseq INTEGER, last_seen REAL,
    birth TEXT, health TEXT, status TEXT, conditions TEXT NOT NULL DEFAULT '[]',
    epoch TEXT, last_n INTEGER NOT NULL DEFAULT 0, received INTEGER NOT NULL DEFAULT 0,
    duplicates INTEGER NOT NULL DEFAULT 0, gaps INTEGER NOT NULL DEFAULT 0,
    gaps_alerted INTEGER NOT NULL DEFAULT 0, gap_since REAL,
    PRIMARY KEY (fleet, device)
);
CREATE TABLE IF NOT EXISTS seen (
    fleet TEXT NOT NULL, device TEXT NOT NULL, epoch TEXT, n INTEGER NOT NULL,
    PRIMARY KEY (fleet, device, epoch, n)
);
CREATE TABLE IF NOT EXISTS rejections (
    fleet TEXT NOT NULL, device TEXT NOT NULL, kind TEXT NOT NULL, count INTEGER NOT NULL,
    last_error TEXT NOT NULL, last_ts REAL NOT NULL,
    PRIMARY KEY (fleet, device, kind)
);
CREATE TABLE IF NOT EXISTS alerts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, fleet TEXT NOT NULL,
    device TEXT NOT NULL, source TEXT NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL,
    body TEXT
);
"""
COLUMNS = ("fleet", "device", "online", "reason", "bdseq", "last_seen", "birth", "health", "status",
           "conditions", "epoch", "last_n", "received", "duplicates", "gaps", "gaps_alerted", "gap_since")
SEEN_WINDOW = 4096  # how far below the highest n a replay is still recognised
JSON_COLUMNS = ("birth", "health", "conditions")


class RegistryError(RuntimeError):
    pass


def conditions(health):
    """What the controller alerts on in a health document: {kind: message}."""
    found = {}
    compat = health.get("compat") or {}
    if compat.get("status") == "fail":
        found["jetpack-too-old"] = "; ".join(c["detail"] for c in compat.get("checks", [])
                                             if c["status"] == "fail")
    level = (health.get("thermal") or {}).get("level", "normal")
    if level != "normal":
        found["throttling"] = "thermal level %s" % level
    service = health.get("service") or {}
    if service.get("health") == "UNREACHABLE":
        found["service-down"] = service.get("error") or "service unreachable"
    return found


class Registry:
    def __init__(self, path):
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
        except sqlite3.Error as exc:
            raise RegistryError("cannot open registry %s: %s" % (path, exc))

    @contextlib.contextmanager
    def _write(self):
        """One write transaction: this thread's lock, and the database's against other replicas."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _device(self, fleet, device):
        self._db.execute("INSERT OR IGNORE INTO devices (fleet, device) VALUES (?, ?)", (fleet, device))
        row = self._db.execute("SELECT %s FROM devices WHERE fleet = ? AND device = ?" % ", ".join(COLUMNS),
                               (fleet, device)).fetchone()
        return _decode(row)

    def _update(self, fleet, device, **values):
        values = {k: json.dumps(v) if k in JSON_COLUMNS else v for k, v in values.items()}
        self._db.execute("UPDATE devices SET %s WHERE fleet = ? AND device = ?"
                         % ", ".join("%s = ?" % k for k in values), list(values.values()) + [fleet, device])

    def _alert(self, fleet, device, source, kind, message, body=None, ts=None):
        self._db.execute("INSERT INTO alerts (ts, fleet, device, source, kind, message, body) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (ts or time.time(), fleet, device, source, kind, message,
                          json.dumps(body, sort_keys=True) if body is not None else None))

    def state(self, fleet, device, doc, now=None):
        """A birth or death certificate; returns what it did ("birth", "death", "stale-death")."""
        now = now or time.time()
        with self._write():
            current = self._device(fleet, device)
            if doc.get("online"):
                self._update(fleet, device, online=1, reason="birth", bdseq=doc.get("bdSeq"),
                             birth=doc, last_seen=now)
                return "birth"
            if doc.get("bdSeq") != current["bdseq"]:
                return "stale-death"
            if current["online"]:
                self._update(fleet, device, online=0, reason="death certificate", last_seen=now)
                self._alert(fleet, device, "controller", "offline",
                            "offline: death certificate (bdSeq %s)" % doc.get("bdSeq"), ts=now)
            return "death"

    def data(self, fleet, device, kind, doc, now=None):
        """A health or alert message; returns "new", "duplicate", "gap" (it opened holes) or
        "late" (it filled one)."""
        now = now or time.time()
        epoch, n = doc.get("epoch"), doc.get("n")
        if not isinstance(n, int):
            return "invalid"
        with self._write():
            current = self._device(fleet, device)
            if self._db.execute("INSERT OR IGNORE INTO seen (fleet, device, epoch, n) VALUES (?, ?, ?, ?)",
                                (fleet, device, epoch, n)).rowcount == 0:
                self._update(fleet, device, duplicates=current["duplicates"] + 1)
                return "duplicate"
            last = current["last_n"] if epoch == current["epoch"] else 0
            self._db.execute("DELETE FROM seen WHERE fleet = ? AND device = ? AND (epoch IS NOT ? OR n < ?)",
                             (fleet, device, epoch, max(n, last) - SEEN_WINDOW))
            values = {"received": current["received"] + 1, "last_seen": now}
            if n < last:  # a hole filled: out of order across replicas, never a replay (seen above)
                outcome = "late"
                values["gaps"] = max(current["gaps"] - 1, 0)
                values["gaps_alerted"] = min(current["gaps_alerted"], values["gaps"])
            else:
                outcome = "new"
                values.update(epoch=epoch, last_n=n)
                if n > last + 1 and epoch == current["epoch"]:
                    outcome = "gap"
                    values["gaps"] = current["gaps"] + n - last - 1
                    values["gap_since"] = current["gap_since"] or now
            if not current["online"] and current["reason"] == "silent":
                values.update(online=1, reason="heard again")
            if kind == "alert":
                self._alert(fleet, device, "device", doc.get("type", "alert"), _describe(doc), doc, ts=doc.get("ts"))
            elif outcome != "late":  # a late health document is older than the one shown
                values.update(health=doc, status=doc.get("status"))
                values["conditions"] = self._conditions(fleet, device, current["conditions"], conditions(doc), now)
            self._update(fleet, device, **values)
            return outcome

    def _conditions(self, fleet, device, before, found, now):
        """Alert on each condition when it appears; the list of active ones."""
        for kind in sorted(set(found) - set(before)):
            self._alert(fleet, device, "controller", kind, found[kind], ts=now)
        return sorted(found)

    def reject(self, fleet, device, kind, error, now=None):
        """Count a message that failed its checks and flag the device: an alert when the error is
        new for it (a device repeating one bad message does not flood the log)."""
        now = now or time.time()
        with self._write():
            row = self._db.execute("SELECT last_error FROM rejections WHERE fleet = ? AND device = ? AND kind = ?",
                                   (fleet, device, kind)).fetchone()
            self._db.execute("INSERT INTO rejections VALUES (?, ?, ?, 1, ?, ?) ON CONFLICT (fleet, device, kind) "
                             "DO UPDATE SET count = count + 1, last_error = excluded.last_error, "
                             "last_ts = excluded.last_ts", (fleet, device, kind, error, now))
            if row is None or row[0] != error:
                self._alert(fleet, device, "controller", "bad-message", "%s refused: %s" % (kind, error), ts=now)

    def rejections(self):
        """Refused messages per device and kind: {fleet, device, kind, count, last_error, last_ts}."""
        keys = ("fleet", "device", "kind", "count", "last_error", "last_ts")
        with self._lock:
            rows = self._db.execute("SELECT %s FROM rejections ORDER BY fleet, device, kind" % ", ".join(keys))
            return [dict(zip(keys, row)) for row in rows.fetchall()]

    def session(self, fleet, device):
        """The bdSeq of the device's current session, or None when no birth was ever seen."""
        with self._lock:
            row = self._db.execute("SELECT bdseq FROM devices WHERE fleet = ? AND device = ?",
                                   (fleet, device)).fetchone()
        return row[0] if row else None

    def sweep(self, silence_factor, now=None):
        """Mark offline the online devices silent for `silence_factor` report intervals, and alert
        on holes still open a report interval after they appeared; returns the devices marked."""
        now = now or time.time()
        marked = []
        with self._write():
            for fleet, device, online, last_seen, birth, gaps, alerted, since in self._db.execute(
                    "SELECT fleet, device, online, last_seen, birth, gaps, gaps_alerted, gap_since "
                    "FROM devices").fetchall():
                interval = stored_interval(json.loads(birth or "{}"))
                if online and last_seen is not None and now - last_seen > silence_factor * interval:
                    self._update(fleet, device, online=0, reason="silent")
                    self._alert(fleet, device, "controller", "offline",
                                "offline: silent for %.1f s" % (now - last_seen), ts=now)
                    marked.append((fleet, device))
                if gaps > alerted and since is not None and now - since >= interval:
                    self._update(fleet, device, gaps_alerted=gaps, gap_since=None)
                    self._alert(fleet, device, "controller", "seq-gap",
                                "%d message(s) missing (%d in all)" % (gaps - alerted, gaps), ts=now)
                elif gaps <= alerted and since is not None:
                    self._update(fleet, device, gap_since=None)  # the holes filled in time
        return marked

    def devices(self, fleet=None):
        with self._lock:
            rows = self._db.execute("SELECT %s FROM devices %s ORDER BY fleet, device"
                                    % (", ".join(COLUMNS), "WHERE fleet = ?" if fleet else ""),
                                    (fleet,) if fleet else ()).fetchall()
        return [_decode(row) for row in rows]

    def alerts(self, limit=100, fleet=None, device=None):
        """Most recent alerts first."""
        where, params = [], []
        for column, value in (("fleet", fleet), ("device", device)):
            if value:
                where.append("%s = ?" % column)
                params.append(value)
        with self._lock:
            rows = self._db.execute(
                "SELECT id, ts, fleet, device, source, kind, message, body FROM alerts %s "
                "ORDER BY id DESC LIMIT ?" % ("WHERE " + " AND ".join(where) if where else ""),
                params + [limit]).fetchall()
        keys = ("id", "ts", "fleet", "device", "source", "kind", "message", "body")
        return [dict(zip(keys, row[:-1] + (json.loads(row[-1]) if row[-1] else None,))) for row in rows]

    def close(self):
        with self._lock:
            self._db.close()


def _decode(row):
    device = dict(zip(COLUMNS, row))
    for key in JSON_COLUMNS:
        device[key] = json.loads(device[key]) if device[key] else ([] if key == "conditions" else None)
    device["online"] = bool(device["online"])
    return device


def _describe(alert):
    if alert.get("type") == "thermal":
        return "thermal %s -> %s (%s at %s C)%s" % (alert.get("old"), alert.get("new"), alert.get("zone"),
                                                   alert.get("temp_c"), "" if alert.get("ok") else
                                                   ": " + str(alert.get("error")))
    return json.dumps(alert, sort_keys=True)[:200]
