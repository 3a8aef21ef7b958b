"""The fleet registry (SQLite): one row per device and a log of alerts.

Session rules (Sparkplug-style): a birth sets the device's bdSeq; a death counts only when its
bdSeq is the current one, so a late death from an old session is ignored. Data messages carry
(epoch, n): n at or below the last seen for the same epoch is a replay and is dropped (counted as
a duplicate), a jump is a seq gap. Alerts the controller raises go to the same log as the
devices' own.
"""

import json
import sqlite3
import threading
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    fleet TEXT NOT NULL, device TEXT NOT NULL,
    online INTEGER NOT NULL DEFAULT 0, reason TEXT, bdseq INTEGER, last_seen REAL,
    birth TEXT, health TEXT, status TEXT, conditions TEXT NOT NULL DEFAULT '[]',
    epoch TEXT, last_n INTEGER NOT NULL DEFAULT 0, received INTEGER NOT NULL DEFAULT 0,
    duplicates INTEGER NOT NULL DEFAULT 0, gaps INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (fleet, device)
);
CREATE TABLE IF NOT EXISTS alerts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, fleet TEXT NOT NULL,
    device TEXT NOT NULL, source TEXT NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL,
    body TEXT
);
"""
COLUMNS = ("fleet", "device", "online", "reason", "bdseq", "last_seen", "birth", "health", "status",
           "conditions", "epoch", "last_n", "received", "duplicates", "gaps")
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
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
        except sqlite3.Error as exc:
            raise RegistryError("cannot open registry %s: %s" % (path, exc))

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
        with self._lock:
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
        """A health or alert message; returns "new", "duplicate" or "gap"."""
        now = now or time.time()
        with self._lock:
            current = self._device(fleet, device)
            epoch, n = doc.get("epoch"), doc.get("n")
            if not isinstance(n, int):
                return "invalid"
            last = current["last_n"] if epoch == current["epoch"] else 0
            if n <= last:
                self._update(fleet, device, duplicates=current["duplicates"] + 1)
                return "duplicate"
            outcome = "new"
            values = {"epoch": epoch, "last_n": n, "received": current["received"] + 1, "last_seen": now}
            if n > last + 1 and epoch == current["epoch"]:
                missing = n - last - 1
                values["gaps"] = current["gaps"] + missing
                self._alert(fleet, device, "controller", "seq-gap",
                            "%d message(s) missing before n=%d (seq %d)" % (missing, n, doc.get("seq", -1)), ts=now)
                outcome = "gap"
            if not current["online"] and current["reason"] == "silent":
                values.update(online=1, reason="heard again")
            if kind == "alert":
                self._alert(fleet, device, "device", doc.get("type", "alert"), _describe(doc), doc, ts=doc.get("ts"))
            else:
                values.update(health=doc, status=doc.get("status"))
                values["conditions"] = self._conditions(fleet, device, current["conditions"], conditions(doc), now)
            self._update(fleet, device, **values)
            return outcome

    def _conditions(self, fleet, device, before, found, now):
        """Alert on each condition when it appears; the list of active ones."""
        for kind in sorted(set(found) - set(before)):
            self._alert(fleet, device, "controller", kind, found[kind], ts=now)
        return sorted(found)

    def sweep(self, silence_factor, now=None):
        """Mark offline the online devices silent for `silence_factor` report intervals."""
        now = now or time.time()
        marked = []
        with self._lock:
            for fleet, device, last_seen, birth in self._db.execute(
                    "SELECT fleet, device, last_seen, birth FROM devices WHERE online = 1").fetchall():
                interval = (json.loads(birth or "{}")).get("interval") or 10.0
                if last_seen is not None and now - last_seen > silence_factor * interval:
                    self._update(fleet, device, online=0, reason="silent")
                    self._alert(fleet, device, "controller", "offline",
                                "offline: silent for %.1f s" % (now - last_seen), ts=now)
                    marked.append((fleet, device))
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
