"""The fleet registry: one row per device and a log of alerts, in SQLite or PostgreSQL.

Session rules (Sparkplug-style): a birth sets the device's bdSeq; a death counts only when its
bdSeq is the current one, so a late death from an old session is ignored. Data messages carry
(epoch, n): an (epoch, n) seen before is a replay and is dropped (counted as a duplicate); a jump
past the highest n opens holes (`gaps`), which a late message fills; an n below the replay window
is a count that went back (a restored outbox), taken as the newest. Messages can arrive out of
order when several controller replicas share one registry (`$share` splits the stream per
message), so a hole is alerted only once it has stayed open for a report interval, and a late
health document never overwrites a newer one. Messages are applied in batches (group commit):
each batch is one transaction holding its devices' locks (stores.py says how each database takes
them) and costs the same few statements whatever its size, and the sweep changes a row only if it
still matches what it read, so replicas anywhere see each other's updates whole and never alert
twice. Alerts the controller raises go to the same log as the devices' own; it keeps each
device's newest ALERTS_KEPT.
"""

import json
import time
from typing import NamedTuple, Optional

from jetserve.fleet.stores import StoreError, open_store
from jetserve.wire.messages import stored_interval

COLUMNS = ("fleet", "device", "online", "reason", "bdseq", "report_interval", "last_seen", "birth", "health",
           "status", "conditions", "epoch", "last_n", "received", "duplicates", "gaps", "gaps_alerted",
           "gap_since")
SEEN_WINDOW = 4096  # how far below the highest n a replay is still recognised
JSON_COLUMNS = ("birth", "health", "conditions")
WRITE_COLUMNS = tuple(c for c in COLUMNS if c not in ("birth", "health"))  # what a write reads
DEFAULT_INTERVAL = 10.0  # s, for a device whose birth has not been seen (yet)
NO_LIMIT = 2 ** 62  # rows; LIMIT takes a number in both databases
INSERT_ALERT = "INSERT INTO alerts (ts, fleet, device, source, kind, message, body) VALUES (?, ?, ?, ?, ?, ?, ?)"
ALERTS_KEPT = 1000  # per device, the newest (what /api/alerts shows of one at most): the log stays bounded
PRUNE_ALERTS = ("DELETE FROM alerts WHERE fleet = ? AND device = ? AND id < (SELECT id FROM alerts WHERE fleet = ? "
                "AND device = ? ORDER BY id DESC LIMIT 1 OFFSET %d)" % (ALERTS_KEPT - 1))


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


class Message(NamedTuple):
    """One inbound message for `Registry.apply`: a checked document (`doc`) or, for one that failed
    its checks, the reason (`error`). `kind` is the topic's: state, health or alert."""
    fleet: str
    device: str
    kind: str
    doc: Optional[dict] = None
    error: Optional[str] = None


class Registry:
    def __init__(self, location):
        """`location`: an SQLite file path, or a `postgresql://` URL."""
        try:
            self._store = open_store(location)
        except StoreError as exc:
            raise RegistryError(str(exc))
        self.backend = self._store.name

    def state(self, fleet, device, doc, now=None):
        """A birth or death certificate; returns what it did ("birth", "death", "stale-death")."""
        return self.apply([Message(fleet, device, "state", doc)], now)[0][0]

    def data(self, fleet, device, kind, doc, now=None):
        """A health or alert message; returns "new", "duplicate", "gap" (it opened holes),
        "late" (it filled one) or "invalid" (no usable (epoch, n))."""
        return self.apply([Message(fleet, device, kind, doc)], now)[0][0]

    def reject(self, fleet, device, kind, error, now=None):
        """Count a message that failed its checks and flag the device: an alert when the error is
        new for it (a device repeating one bad message does not flood the log)."""
        self.apply([Message(fleet, device, kind, error=error)], now)

    def apply(self, batch, now=None):
        """Apply `batch` (Messages, in the order received) in one transaction, with the same
        statements whatever its size: the devices' rows are read and locked at once (in name
        order, so replicas never deadlock on each other), the rules run here on those rows, and
        what changed goes back in a few multi-row statements. Returns each message's outcome
        ("birth", "death", "stale-death", "new", "duplicate", "gap", "late", "invalid",
        "rejected") and the devices that sent data without a birth on record."""
        now = now or time.time()
        if not batch:
            return [], set()
        keys = sorted({(m.fleet, m.device) for m in batch})
        with self._store.write() as db:
            changes = _Changes(self._lock_devices(db, keys))
            fresh = self._record_seen(db, [m for m in batch if m.error is None and m.kind != "state"])
            refused = self._last_errors(db, sorted({(m.fleet, m.device) for m in batch if m.error is not None}))
            outcomes = []
            for m in batch:
                key = (m.fleet, m.device)
                if m.error is not None:
                    outcomes.append(changes.reject(key, m.kind, m.error, refused, now))
                elif m.kind == "state":
                    outcomes.append(changes.state(key, m.doc, now))
                else:
                    outcomes.append(changes.data(key, m.kind, m.doc, fresh, now))
            changes.write(db, self._store.is_not)
        unborn = {(m.fleet, m.device) for m in batch if m.kind != "state" and m.error is None
                  and changes.rows[(m.fleet, m.device)]["bdseq"] is None}
        return outcomes, unborn

    def _lock_devices(self, db, keys):
        """{(fleet, device): row without its documents}, rows made if new and locked for the
        transaction (a write never needs the stored birth or health, and decoding them is costly)."""
        padded = _bucketed(keys)
        db.execute("INSERT INTO devices (fleet, device) VALUES %s ON CONFLICT DO NOTHING" % _values(len(padded), 2),
                   _flat(padded))
        rows = db.execute("SELECT %s FROM devices WHERE (fleet, device) IN (VALUES %s) ORDER BY fleet, device%s"
                          % (", ".join(WRITE_COLUMNS), _values(len(padded), 2), self._store.row_lock),
                          _flat(padded)).fetchall()
        return {(row[0], row[1]): _decode(row, WRITE_COLUMNS) for row in rows}

    @staticmethod
    def _record_seen(db, data):
        """The (fleet, device, epoch, n) of `data` not seen before, now recorded."""
        ids = sorted({(m.fleet, m.device, m.doc.get("epoch"), m.doc.get("n")) for m in data
                      if isinstance(m.doc.get("epoch"), str) and isinstance(m.doc.get("n"), int)})
        if not ids:
            return set()
        ids = _bucketed(ids)
        return set(map(tuple, db.execute("INSERT INTO seen (fleet, device, epoch, n) VALUES %s ON CONFLICT DO NOTHING "
                                         "RETURNING fleet, device, epoch, n" % _values(len(ids), 4),
                                         _flat(ids)).fetchall()))

    @staticmethod
    def _last_errors(db, keys):
        """{(fleet, device, kind): last refusal's error} of these devices."""
        if not keys:
            return {}
        keys = _bucketed(keys)
        rows = db.execute("SELECT fleet, device, kind, last_error FROM rejections WHERE (fleet, device) IN "
                          "(VALUES %s)" % _values(len(keys), 2), _flat(keys)).fetchall()
        return {(f, d, k): error for f, d, k, error in rows}

    def rejections(self):
        """Refused messages per device and kind: {fleet, device, kind, count, last_error, last_ts}."""
        keys = ("fleet", "device", "kind", "count", "last_error", "last_ts")
        with self._store.read() as db:
            rows = db.execute("SELECT %s FROM rejections ORDER BY fleet, device, kind" % ", ".join(keys)).fetchall()
        return [dict(zip(keys, row)) for row in rows]

    def sweep(self, silence_factor, now=None):
        """Mark offline the online devices silent for `silence_factor` report intervals, and alert
        on holes still open a report interval after they appeared; returns the devices marked.
        Only the rows due are read, and each is changed only if it is still as read (another
        replica may have swept it meanwhile)."""
        now = now or time.time()
        interval = "COALESCE(report_interval, %r)" % DEFAULT_INTERVAL
        marked, alerts = [], []
        with self._store.write() as db:
            for fleet, device, last_seen in db.execute(
                    "SELECT fleet, device, last_seen FROM devices WHERE online = 1 AND last_seen < ? - ? * %s "
                    "ORDER BY fleet, device" % interval, (now, silence_factor)).fetchall():
                if db.execute("UPDATE devices SET online = 0, reason = 'silent' WHERE fleet = ? AND device = ? "
                              "AND online = 1 AND last_seen = ?", (fleet, device, last_seen)).rowcount:
                    alerts.append((now, fleet, device, "controller", "offline",
                                   "offline: silent for %.1f s" % (now - last_seen), None))
                    marked.append((fleet, device))
            for fleet, device, gaps, alerted, since, due in db.execute(
                    "SELECT fleet, device, gaps, gaps_alerted, gap_since, gap_since <= ? - %s FROM devices "
                    "WHERE gap_since IS NOT NULL ORDER BY fleet, device" % interval, (now,)).fetchall():
                if gaps <= alerted:  # the holes filled in time
                    db.execute("UPDATE devices SET gap_since = NULL WHERE fleet = ? AND device = ? AND gap_since = ?",
                               (fleet, device, since))
                elif due and db.execute("UPDATE devices SET gaps_alerted = gaps, gap_since = NULL WHERE fleet = ? "
                                        "AND device = ? AND gaps = ? AND gaps_alerted = ? AND gap_since = ?",
                                        (fleet, device, gaps, alerted, since)).rowcount:
                    alerts.append((now, fleet, device, "controller", "seq-gap",
                                   "%d message(s) missing (%d in all)" % (gaps - alerted, gaps), None))
            if alerts:
                db.executemany(INSERT_ALERT, alerts)
                _prune_alerts(db, alerts)
        return marked

    def devices(self, fleet=None, limit=None, offset=0, problems_first=False, device=None):
        """Devices by fleet and name, or with `problems_first` offline, CRITICAL then DEGRADED first."""
        where, params = _where(fleet=fleet, device=device)
        order = "online, CASE status WHEN 'CRITICAL' THEN 0 WHEN 'DEGRADED' THEN 1 ELSE 2 END, " \
            if problems_first else ""
        with self._store.read() as db:
            rows = db.execute("SELECT %s FROM devices %s ORDER BY %sfleet, device LIMIT ? OFFSET ?"
                              % (", ".join(COLUMNS), where, order),
                              params + [NO_LIMIT if limit is None else limit, offset]).fetchall()
        return [_decode(row) for row in rows]

    def progress(self, fleet=None):
        """{(fleet, device): (online, received)}: what an ingestion monitor polls, without documents."""
        where, params = _where(fleet=fleet)
        with self._store.read() as db:
            rows = db.execute("SELECT fleet, device, online, received FROM devices %s" % where, params).fetchall()
        return {(f, d): (bool(online), received) for f, d, online, received in rows}

    def counts(self, fleet=None):
        """{"devices", "online", "OK", "DEGRADED", "CRITICAL"}: the online ones by reported status."""
        with self._store.read() as db:
            where, params = _where(fleet=fleet)
            rows = db.execute("SELECT online, status, COUNT(*) FROM devices %s GROUP BY online, status" % where,
                              params).fetchall()
        counts = dict.fromkeys(("devices", "online", "OK", "DEGRADED", "CRITICAL"), 0)
        for online, status, count in rows:
            counts["devices"] += count
            if online:
                counts["online"] += count
                if status in counts:
                    counts[status] += count
        return counts

    def alerts(self, limit=100, fleet=None, device=None):
        """Most recent alerts first."""
        where, params = _where(fleet=fleet, device=device)
        with self._store.read() as db:
            rows = db.execute("SELECT id, ts, fleet, device, source, kind, message, body FROM alerts %s "
                              "ORDER BY id DESC LIMIT ?" % where, params + [limit]).fetchall()
        keys = ("id", "ts", "fleet", "device", "source", "kind", "message", "body")
        return [dict(zip(keys, tuple(row[:-1]) + (json.loads(row[-1]) if row[-1] else None,))) for row in rows]

    def close(self):
        self._store.close()


class _Changes:
    """The rules applied to a batch's rows in memory; `write` stores what changed."""

    def __init__(self, rows):
        self.rows = rows
        self.changed = {}  # key → {column: value}
        self.alerts = []
        self.refusals = {}  # (fleet, device, kind) → [count, last error]
        self.seen_top = {}  # key → its (epoch, last_n) after the batch, to prune `seen` below

    def _set(self, key, **values):
        self.rows[key].update(values)
        self.changed.setdefault(key, {}).update(values)

    def _alert(self, key, source, kind, message, ts, body=None):
        self.alerts.append((ts, key[0], key[1], source, kind, message,
                            json.dumps(body, sort_keys=True) if body is not None else None))

    def state(self, key, doc, now):
        current = self.rows[key]
        if doc.get("online"):
            self._set(key, online=1, reason="birth", bdseq=doc.get("bdSeq"),
                      report_interval=stored_interval(doc, None), birth=doc, last_seen=now)
            return "birth"
        if doc.get("bdSeq") != current["bdseq"]:
            return "stale-death"
        if current["online"]:
            self._set(key, online=0, reason="death certificate", last_seen=now)
            self._alert(key, "controller", "offline", "offline: death certificate (bdSeq %s)" % doc.get("bdSeq"), now)
        return "death"

    def data(self, key, kind, doc, fresh, now):
        current = self.rows[key]
        epoch, n = doc.get("epoch"), doc.get("n")
        if not isinstance(epoch, str) or not isinstance(n, int):  # checked upstream (wire.messages)
            return "invalid"
        if (key + (epoch, n)) not in fresh:
            self._set(key, duplicates=current["duplicates"] + 1)
            return "duplicate"
        fresh.discard(key + (epoch, n))  # a second copy in this batch is a duplicate
        last = current["last_n"] if epoch == current["epoch"] else 0
        values = {"received": current["received"] + 1, "last_seen": now}
        if n < last - SEEN_WINDOW:
            # Below anything still told apart from a replay: no late message, but the device's count
            # went back (an outbox restored from an older copy, or one far jump ahead before it).
            # Taken as its newest, or its health would stay frozen until n passed the old top.
            self._alert(key, "controller", "seq-rewind", "message ids went back from %d to %d: counting "
                        "again from there" % (last, n), now)
            values.update(last_n=n, gaps=0, gaps_alerted=0, gap_since=None)
            last = n
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
            self._alert(key, "device", str(doc.get("type", "alert")), _describe(doc), doc.get("ts") or now, doc)
        elif outcome != "late":  # a late health document is older than the one shown
            found = conditions(doc)
            for condition in sorted(set(found) - set(current["conditions"])):
                self._alert(key, "controller", condition, found[condition], now)
            values.update(health=doc, status=doc.get("status"), conditions=sorted(found))
        self._set(key, **values)
        self.seen_top[key] = (self.rows[key]["epoch"], max(n, self.rows[key]["last_n"]))
        return outcome

    def reject(self, key, kind, error, last_errors, now):
        count = self.refusals.get(key + (kind,), (0,))[0]
        self.refusals[key + (kind,)] = (count + 1, error, now)
        if last_errors.get(key + (kind,)) != error:
            self._alert(key, "controller", "bad-message", "%s refused: %s" % (kind, error), now)
        last_errors[key + (kind,)] = error
        return "rejected"

    def write(self, db, is_not):
        """What changed, in one statement per shape: the rows, the pruned replay window, the
        alerts, the refusal counts."""
        shapes = {}
        for key, values in self.changed.items():
            columns = tuple(sorted(values))
            shapes.setdefault(columns, []).append(
                [json.dumps(values[c]) if c in JSON_COLUMNS else values[c] for c in columns] + list(key))
        for columns, rows in shapes.items():
            db.executemany("UPDATE devices SET %s WHERE fleet = ? AND device = ?" % ", ".join("%s = ?" % c
                                                                                             for c in columns), rows)
        if self.seen_top:
            # Above the top too: ids a rewound count (above) will give again, to new messages.
            db.executemany("DELETE FROM seen WHERE fleet = ? AND device = ? AND (epoch %s ? OR n < ? OR n > ?)"
                           % is_not, [key + (epoch, top - SEEN_WINDOW, top)
                                      for key, (epoch, top) in sorted(self.seen_top.items())])
        if self.alerts:
            db.executemany(INSERT_ALERT, self.alerts)
            _prune_alerts(db, self.alerts)
        if self.refusals:
            db.executemany("INSERT INTO rejections VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (fleet, device, kind) "
                           "DO UPDATE SET count = rejections.count + excluded.count, last_error = excluded.last_error, "
                           "last_ts = excluded.last_ts",
                           [key + refusal for key, refusal in sorted(self.refusals.items())])


def _prune_alerts(db, alerts):
    """Keep the newest ALERTS_KEPT alerts of each device that just got one: a device may raise
    alerts as fast as it can publish, and nothing else would ever delete them."""
    keys = sorted({(fleet, device) for _, fleet, device, *_ in alerts})
    db.executemany(PRUNE_ALERTS, [key + key for key in keys])


def _bucketed(rows):
    """`rows` (not empty) padded to a power of two by repeating the last, for the statements where
    a repeated row changes nothing (INSERT … DO NOTHING, IN lists). Each statement text is a
    prepared statement that SQLite's and psycopg's caches keep (up to a hundred or so): with one
    text per batch size, a controller kept hundreds of large ones alive, and its memory grew with
    the sizes its load had brought. Bucketed, a statement has at most log2(MAX_BATCH) + 1 texts."""
    return list(rows) + [rows[-1]] * ((1 << (len(rows) - 1).bit_length()) - len(rows))


def _values(rows, width):
    """`(?, ?), (?, ?)`: a multi-row VALUES list."""
    return ", ".join(["(%s)" % ", ".join("?" * width)] * rows)


def _flat(rows):
    return [value for row in rows for value in row]


def _where(**equal):
    """`WHERE a = ? AND b = ?` for the given values that are set, and their parameters."""
    columns = [column for column, value in equal.items() if value]
    return ("WHERE " + " AND ".join("%s = ?" % c for c in columns) if columns else ""), [equal[c] for c in columns]


def _decode(row, columns=COLUMNS):
    device = dict(zip(columns, row))
    for key in set(JSON_COLUMNS) & set(columns):
        device[key] = json.loads(device[key]) if device[key] else ([] if key == "conditions" else None)
    device["online"] = bool(device["online"])
    return device


def _describe(alert):
    if alert.get("type") == "thermal":
        return "thermal %s -> %s (%s at %s C)%s" % (alert.get("old"), alert.get("new"), alert.get("zone"),
                                                   alert.get("temp_c"), "" if alert.get("ok") else
                                                   ": " + str(alert.get("error")))
    return json.dumps(alert, sort_keys=True)[:200]
