"""Where the registry keeps its rows: an embedded SQLite file (the default) or a PostgreSQL server
(controller replicas on several hosts, one store).

Both speak the same SQL to the registry (`?` placeholders, `ON CONFLICT DO NOTHING`, multi-row
VALUES, RETURNING); a store adds what differs: column types, how a write transaction takes its
lock, and how "is not the same value, NULL included" is spelled. Each store has a writer connection
and a reader connection, so a page view never waits behind ingestion and never holds it up.

`StoreError` means "the database could not do it now" (locked, unreachable, a deadlock broken):
trying the same work again later may succeed. Any other error is the work's own fault.
"""

import contextlib
import os
import sqlite3
import threading
import time

from jetserve import atomic

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    fleet TEXT NOT NULL, device TEXT NOT NULL,
    online INTEGER NOT NULL DEFAULT 0, reason TEXT, bdseq INTEGER, report_interval {real}, last_seen {real},
    birth TEXT, health TEXT, status TEXT, conditions TEXT NOT NULL DEFAULT '[]',
    epoch TEXT, last_n BIGINT NOT NULL DEFAULT 0, received BIGINT NOT NULL DEFAULT 0,
    duplicates BIGINT NOT NULL DEFAULT 0, gaps BIGINT NOT NULL DEFAULT 0,
    gaps_alerted BIGINT NOT NULL DEFAULT 0, gap_since {real},
    PRIMARY KEY (fleet, device)
);
CREATE TABLE IF NOT EXISTS seen (
    fleet TEXT NOT NULL, device TEXT NOT NULL, epoch TEXT NOT NULL, n BIGINT NOT NULL,
    PRIMARY KEY (fleet, device, epoch, n)
);
CREATE TABLE IF NOT EXISTS rejections (
    fleet TEXT NOT NULL, device TEXT NOT NULL, kind TEXT NOT NULL, count BIGINT NOT NULL,
    last_error TEXT NOT NULL, last_ts {real} NOT NULL,
    PRIMARY KEY (fleet, device, kind)
);
CREATE TABLE IF NOT EXISTS alerts (
    id {serial}, ts {real} NOT NULL, fleet TEXT NOT NULL,
    device TEXT NOT NULL, source TEXT NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL,
    body TEXT
);
CREATE INDEX IF NOT EXISTS alerts_by_device ON alerts (fleet, device, id);
"""


SCHEMA_LOCK = 0x6A657473  # PostgreSQL advisory lock key held while the schema is made ("jets")


class StoreError(RuntimeError):
    pass


def open_store(location):
    """`postgresql://…` (or `postgres://…`) → PostgreSQL; anything else is an SQLite file path."""
    if location.startswith(("postgresql://", "postgres://")):
        return PostgresStore(location)
    return SQLiteStore(location)


class SQLiteStore:
    """One file; a write takes the database's write lock (BEGIN IMMEDIATE), so replicas in other
    processes on the same host see each other's updates whole.

    WAL with synchronous=NORMAL: a kill -9 loses no commit, and a power cut loses at most the
    commits since the last checkpoint and corrupts nothing. FULL would add an fsync to every
    group commit for what the devices send again anyway (the next health, a birth on rebirth).
    A file that is not a database is set aside with a warning and a new registry started (the
    devices fill it again); a full disk fails each write with StoreError, retried until it fits."""

    name = "sqlite"
    row_lock = ""  # the whole database is locked for the transaction already
    is_not = "IS NOT"

    def __init__(self, path):
        self._locks = threading.Lock(), threading.Lock()
        try:
            try:
                self._open(path)
            except sqlite3.DatabaseError as exc:
                if type(exc) is not sqlite3.DatabaseError or path == ":memory:":  # subclasses: locked, full, …
                    raise
                atomic.set_aside(path, "registry: %s" % exc)
                self._open(path)
        except (sqlite3.Error, OSError) as exc:
            full = atomic.no_space(exc) or atomic.disk_full(os.path.dirname(os.path.abspath(path)))
            raise StoreError("cannot open registry %s: %s%s" % (path, exc, " (no space left on its disk)" if full else ""))

    def _open(self, path):
        connections = []
        try:
            connections += [self._connect(path), self._connect(path)]
            connections[0].executescript(SCHEMA.format(real="REAL", serial="INTEGER PRIMARY KEY AUTOINCREMENT"))
        except BaseException:
            for db in connections:
                db.close()
            raise
        self._writer, self._reader = connections

    @staticmethod
    def _connect(path, timeout=10.0):
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=timeout)
        # Switching a file to WAL needs a lock SQLite does not wait for (no busy handler there):
        # replicas opening one new database together take turns.
        deadline = time.monotonic() + timeout
        while True:
            try:
                db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    db.close()
                    raise
                time.sleep(0.05)
            except BaseException:  # not a database
                db.close()
                raise
        db.execute("PRAGMA synchronous=NORMAL")  # WAL's usual setting: a commit is one append, no fsync
        return db

    @contextlib.contextmanager
    def write(self):
        """One transaction on the writer connection (it has `execute` and `executemany`)."""
        with self._locks[0], _transient(sqlite3.OperationalError):
            self._writer.execute("BEGIN IMMEDIATE")
            try:
                yield self._writer
            except BaseException:
                self._writer.execute("ROLLBACK")
                raise
            self._writer.execute("COMMIT")

    @contextlib.contextmanager
    def read(self):
        with self._locks[1], _transient(sqlite3.OperationalError):
            yield self._reader

    def close(self):
        for lock, db in zip(self._locks, (self._writer, self._reader)):
            with lock:
                db.close()


class PostgresStore:
    """A PostgreSQL database shared by replicas anywhere: each write locks its device's row
    (SELECT … FOR UPDATE), so messages of one device are applied one at a time whichever
    replica holds them, and different devices proceed in parallel. A dropped connection is
    reopened at the next transaction."""

    name = "postgresql"
    row_lock = " FOR UPDATE"
    is_not = "IS DISTINCT FROM"

    def __init__(self, url):
        try:
            import psycopg
        except ImportError:
            raise StoreError("a PostgreSQL registry needs psycopg: pip install 'jetserve[fleet]'")
        self._psycopg, self._url = psycopg, url
        self._locks = threading.Lock(), threading.Lock()
        self._connections = [None, None]
        with self.write() as db:
            # Replicas starting together would race in CREATE TABLE IF NOT EXISTS: one at a time.
            db.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK,))
            for statement in filter(str.strip, SCHEMA.format(
                    real="DOUBLE PRECISION", serial="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY").split(";")):
                db.execute(statement)

    def _connection(self, which):
        connection = self._connections[which]
        if connection is None or connection.closed or connection.broken:
            try:
                connection = self._psycopg.connect(self._url, autocommit=True, connect_timeout=10)
            except self._psycopg.Error as exc:
                raise StoreError("cannot open registry %s: %s" % (_without_password(self._url), exc))
            self._connections[which] = connection
        return connection

    @contextlib.contextmanager
    def write(self):
        """One transaction; `executemany` sends its rows in one pipeline (one round trip)."""
        with self._locks[0], self._transient():
            connection = self._connection(0)
            with connection.transaction():
                yield _Postgres(connection)

    @contextlib.contextmanager
    def read(self):
        with self._locks[1], self._transient():
            yield _Postgres(self._connection(1))

    def _transient(self):
        """psycopg files a limit the content broke (SQLSTATE class 54: an index row or a string too
        long) under OperationalError with the server's real failures: that one is the batch's own
        fault, which ingest isolates and drops, where trying it again would stall every device."""
        errors = self._psycopg.errors
        return _transient(self._psycopg.OperationalError, permanent=(errors.ProgramLimitExceeded,))

    def close(self):
        for lock, connection in zip(self._locks, self._connections):
            with lock:
                if connection is not None:
                    connection.close()


class _Postgres:
    """A connection that takes the registry's `?` placeholders."""

    def __init__(self, connection):
        self._connection = connection

    def execute(self, sql, params=()):
        return self._connection.execute(sql.replace("?", "%s"), params)

    def executemany(self, sql, rows):
        self._connection.cursor().executemany(sql.replace("?", "%s"), rows)


@contextlib.contextmanager
def _transient(errors, permanent=()):
    """The database's own failures (locked, gone, full, a deadlock it broke) as StoreError, which
    ingest tries again; those in `permanent` pass as they are."""
    try:
        yield
    except permanent:
        raise
    except errors as exc:
        raise StoreError("registry database: %s" % exc) from exc


def _without_password(url):
    """The URL for a log line: the password (if any) replaced by ***."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if at and ":" in credentials:
        credentials = credentials.split(":", 1)[0] + ":***"
    return scheme + sep + credentials + at + host
