"""The fleet registry: one row per device and a log of alerts, in SQLite or PostgreSQL.

Session rules (Sparkplug-style): a birth sets the device's bdSeq; a death counts only when its
bdSeq is the current one, so a late death from an old session is ignored. Data messages carry
(epoch, n): an (epoch, n) seen before is a replay and is dropped (counted as a duplicate); a jump
past the highest n opens holes (`gaps`), which a late message fills. Messages can arrive out of
order when several controller replicas share one registry (`$share` splits the stream per
message), so a hole is alerted only once it has stayed open for a report interval, and a late
health document never overwrites a newer one. Every write is one transaction holding the
device's lock (stores.py says how each database takes it), and the sweep changes a row only if
it still matches what it read, so replicas anywhere see each other's updates whole and never
alert twice. Alerts the controller raises go to the same log as the devices' own.
"""

import json
import time

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
    def __init__(self, location):
        """`location`: an SQLite file path, or a `postgresql://` URL."""
        try:
            self._store = open_store(location)
        except StoreError as exc:
            raise RegistryError(str(exc))
        self.backend = self._store.name

    def _write(self):
        return self._store.write()

    def _device(self, execute, fleet, device):
        """The device's row, locked for this transaction (made if new), without its documents: a
        write never needs the stored birth or health, and decoding them each message is costly."""
        execute("INSERT INTO devices (fleet, device) VALUES (?, ?) ON CONFLICT DO NOTHING", (fleet, device))
        row = execute("SELECT %s FROM devices WHERE fleet = ? AND device = ?%s"
                      % (", ".join(WRITE_COLUMNS), self._store.row_lock), (fleet, device)).fetchone()
        return _decode(row, WRITE_COLUMNS)

    @staticmethod
    def _update(execute, fleet, device, **values):
        values = {k: json.dumps(v) if k in JSON_COLUMNS else v for k, v in values.items()}
        execute("UPDATE devices SET %s WHERE fleet = ? AND device = ?" % ", ".join("%s = ?" % k for k in values),
                list(values.values()) + [fleet, device])

    @staticmethod
    def _alert(execute, fleet, device, source, kind, message, body=None, ts=None):
        execute("INSERT INTO alerts (ts, fleet, device, source, kind, message, body) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (ts or time.time(), fleet, device, source, kind, message,
                 json.dumps(body, sort_keys=True) if body is not None else None))

    def state(self, fleet, device, doc, now=None):
        """A birth or death certificate; returns what it did ("birth", "death", "stale-death")."""
        now = now or time.time()
        with self._write() as execute:
            current = self._device(execute, fleet, device)
            if doc.get("online"):
                self._update(execute, fleet, device, online=1, reason="birth", bdseq=doc.get("bdSeq"),
                             report_interval=stored_interval(doc, None), birth=doc, last_seen=now)
                return "birth"
            if doc.get("bdSeq") != current["bdseq"]:
                return "stale-death"
            if current["online"]:
                self._update(execute, fleet, device, online=0, reason="death certificate", last_seen=now)
                self._alert(execute, fleet, device, "controller", "offline",
                            "offline: death certificate (bdSeq %s)" % doc.get("bdSeq"), ts=now)
            return "death"

    def data(self, fleet, device, kind, doc, now=None):
        """A health or alert message; returns "new", "duplicate", "gap" (it opened holes),
        "late" (it filled one) or "invalid" (no usable (epoch, n))."""
        now = now or time.time()
        epoch, n = doc.get("epoch"), doc.get("n")
        if not isinstance(epoch, str) or not isinstance(n, int):  # checked upstream (wire.messages)
            return "invalid"
        with self._write() as execute:
            current = self._device(execute, fleet, device)
            if execute("INSERT INTO seen (fleet, device, epoch, n) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                       (fleet, device, epoch, n)).rowcount == 0:
                self._update(execute, fleet, device, duplicates=current["duplicates"] + 1)
                return "duplicate"
            last = current["last_n"] if epoch == current["epoch"] else 0
            execute("DELETE FROM seen WHERE fleet = ? AND device = ? AND (epoch %s ? OR n < ?)" % self._store.is_not,
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
                self._alert(execute, fleet, device, "device", str(doc.get("type", "alert")), _describe(doc), doc,
                            ts=doc.get("ts") or now)
            elif outcome != "late":  # a late health document is older than the one shown
                values.update(health=doc, status=doc.get("status"))
                values["conditions"] = self._conditions(execute, fleet, device, current["conditions"],
                                                        conditions(doc), now)
            self._update(execute, fleet, device, **values)
            return outcome

    def _conditions(self, execute, fleet, device, before, found, now):
        """Alert on each condition when it appears; the list of active ones."""
        for kind in sorted(set(found) - set(before)):
            self._alert(execute, fleet, device, "controller", kind, found[kind], ts=now)
        return sorted(found)

    def reject(self, fleet, device, kind, error, now=None):
        """Count a message that failed its checks and flag the device: an alert when the error is
        new for it (a device repeating one bad message does not flood the log)."""
        now = now or time.time()
        with self._write() as execute:
            self._device(execute, fleet, device)  # the device's lock, as every write takes it
            row = execute("SELECT last_error FROM rejections WHERE fleet = ? AND device = ? AND kind = ?",
                          (fleet, device, kind)).fetchone()
            execute("INSERT INTO rejections VALUES (?, ?, ?, 1, ?, ?) ON CONFLICT (fleet, device, kind) "
                    "DO UPDATE SET count = rejections.count + 1, last_error = excluded.last_error, "
                    "last_ts = excluded.last_ts", (fleet, device, kind, error, now))
            if row is None or row[0] != error:
                self._alert(execute, fleet, device, "controller", "bad-message", "%s refused: %s" % (kind, error),
                            ts=now)

    def rejections(self):
        """Refused messages per device and kind: {fleet, device, kind, count, last_error, last_ts}."""
        keys = ("fleet", "device", "kind", "count", "last_error", "last_ts")
        with self._store.read() as execute:
            rows = execute("SELECT %s FROM rejections ORDER BY fleet, device, kind" % ", ".join(keys)).fetchall()
        return [dict(zip(keys, row)) for row in rows]

    def session(self, fleet, device):
        """The bdSeq of the device's current session, or None when no birth was ever seen."""
        with self._store.read() as execute:
            row = execute("SELECT bdseq FROM devices WHERE fleet = ? AND device = ?", (fleet, device)).fetchone()
        return row[0] if row else None

    def sweep(self, silence_factor, now=None):
        """Mark offline the online devices silent for `silence_factor` report intervals, and alert
        on holes still open a report interval after they appeared; returns the devices marked.
        Only the rows due are read, and each is changed only if it is still as read (another
        replica may have swept it meanwhile)."""
        now = now or time.time()
        interval = "COALESCE(report_interval, %r)" % DEFAULT_INTERVAL
        marked = []
        with self._write() as execute:
            for fleet, device, last_seen in execute(
                    "SELECT fleet, device, last_seen FROM devices WHERE online = 1 AND last_seen < ? - ? * %s "
                    "ORDER BY fleet, device" % interval, (now, silence_factor)).fetchall():
                if execute("UPDATE devices SET online = 0, reason = 'silent' WHERE fleet = ? AND device = ? "
                           "AND online = 1 AND last_seen = ?", (fleet, device, last_seen)).rowcount:
                    self._alert(execute, fleet, device, "controller", "offline",
                                "offline: silent for %.1f s" % (now - last_seen), ts=now)
                    marked.append((fleet, device))
            for fleet, device, gaps, alerted, since, due in execute(
                    "SELECT fleet, device, gaps, gaps_alerted, gap_since, gap_since <= ? - %s FROM devices "
                    "WHERE gap_since IS NOT NULL ORDER BY fleet, device" % interval, (now,)).fetchall():
                if gaps <= alerted:  # the holes filled in time
                    execute("UPDATE devices SET gap_since = NULL WHERE fleet = ? AND device = ? AND gap_since = ?",
                            (fleet, device, since))
                elif due and execute("UPDATE devices SET gaps_alerted = gaps, gap_since = NULL WHERE fleet = ? "
                                     "AND device = ? AND gaps = ? AND gaps_alerted = ? AND gap_since = ?",
                                     (fleet, device, gaps, alerted, since)).rowcount:
                    self._alert(execute, fleet, device, "controller", "seq-gap",
                                "%d message(s) missing (%d in all)" % (gaps - alerted, gaps), ts=now)
        return marked

    def devices(self, fleet=None, limit=None, offset=0, problems_first=False, device=None):
        """Devices by fleet and name, or with `problems_first` offline, CRITICAL then DEGRADED first."""
        where, params = _where(fleet=fleet, device=device)
        order = "online, CASE status WHEN 'CRITICAL' THEN 0 WHEN 'DEGRADED' THEN 1 ELSE 2 END, " \
            if problems_first else ""
        with self._store.read() as execute:
            rows = execute("SELECT %s FROM devices %s ORDER BY %sfleet, device LIMIT ? OFFSET ?"
                           % (", ".join(COLUMNS), where, order),
                           params + [NO_LIMIT if limit is None else limit, offset]).fetchall()
        return [_decode(row) for row in rows]

    def progress(self, fleet=None):
        """{(fleet, device): (online, received)}: what an ingestion monitor polls, without documents."""
        where, params = _where(fleet=fleet)
        with self._store.read() as execute:
            rows = execute("SELECT fleet, device, online, received FROM devices %s" % where, params).fetchall()
        return {(f, d): (bool(online), received) for f, d, online, received in rows}

    def counts(self, fleet=None):
        """{"devices", "online", "OK", "DEGRADED", "CRITICAL"}: the online ones by reported status."""
        with self._store.read() as execute:
            where, params = _where(fleet=fleet)
            rows = execute("SELECT online, status, COUNT(*) FROM devices %s GROUP BY online, status" % where,
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
        with self._store.read() as execute:
            rows = execute("SELECT id, ts, fleet, device, source, kind, message, body FROM alerts %s "
                           "ORDER BY id DESC LIMIT ?" % where, params + [limit]).fetchall()
        keys = ("id", "ts", "fleet", "device", "source", "kind", "message", "body")
        return [dict(zip(keys, tuple(row[:-1]) + (json.loads(row[-1]) if row[-1] else None,))) for row in rows]

    def close(self):
        self._store.close()


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
