"""Every file the device writes, under kill -9 at random moments of real writes and under a full
disk: the tile cache, the CPU program cache, the agent's outbox, the fleet registry.

A kill loop forks a child from this (warm) process that writes in a loop and reports each write
that returned; the parent kills it after a random 0-20 ms, then reads the file as the next start
would: it must hold the old or the new version (nothing a write reported lost, nothing torn), with
no warning. ENOSPC runs on a tmpfs of a few hundred KiB mounted by the test (root only; CI runs
as root): the write fails with one clear log line, nothing is lost or torn, and the next write
after space is freed succeeds.
"""

import errno
import logging
import os
import random
import select
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from jetserve import atomic
from jetserve.agent.outbox import SPILL_LIMIT, Outbox
from jetserve.engine.compile_cache import ProgramCache, file_digest
from jetserve.engine.model.kernels import Tile
from jetserve.engine.model.tile_cache import TileCache
from jetserve.fleet.registry import Message, Registry
from jetserve.fleet.stores import StoreError

KILLS = 100
FORK_START_S = 20  # a child only opens its file before it says it started: far longer means it hangs
MAX_STUCK_FORKS = 3
FP = {"format": 1, "device": {"name": "cpu"}, "kernels": "test"}
TILES = (None, Tile(4, 1024, 4), Tile(8, 256, 8, apart=True))


def kill_loop(child, check, seed, directory):
    """KILLS times: fork, run `child(report)` until killed (report(text) after each write that
    returned), kill -9 it at a random moment of its second write (timed by its first, as slow as
    the box is now), then `check(reports)` with all reports so far. Returns them, and how many
    kills left a temporary file in `directory` (landed between a write's start and its rename)."""
    rng = random.Random(seed)
    reports, torn, seen, stuck = [], 0, set(), 0
    began = time.perf_counter()
    kills = 0
    while kills < KILLS:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            try:
                os.close(r)
                logging.disable(logging.CRITICAL)
                child(lambda text: os.write(w, text.encode() + b"\n"))
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb", buffering=0) as pipe:
            # A fork copies only its own thread: a lock another thread of pytest held at that moment
            # (servers of earlier tests still winding down) stays held in the child forever. Such a
            # child never starts; it is killed and forked again, a few times at most.
            if not select.select([pipe], [], [], FORK_START_S)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                stuck += 1
                assert stuck <= MAX_STUCK_FORKS, "forked children keep hanging before they start"
                continue
            kills += 1
            lines = [pipe.readline()]  # the child has opened its file and starts writing
            started = time.perf_counter()
            lines.append(pipe.readline())  # its first write returned
            assert lines[0] == b"started\n" and lines[1], "the child failed: %r" % lines
            time.sleep(rng.uniform(0, 1.2 * (time.perf_counter() - started)))
            os.kill(pid, signal.SIGKILL)
            assert os.waitpid(pid, 0)[1] == signal.SIGKILL, "the child ended before it was killed"
            reports += (lines[1] + pipe.read()).decode().split()
        temporary = set(leftovers(directory)) - seen  # a killed writer's, until a later one clears it
        torn += bool(temporary)
        seen |= temporary
        check(reports)
    print("%d kills in %.1f s: %d mid-write, %d writes returned"
          % (KILLS, time.perf_counter() - began, torn, len(reports)))
    return reports, torn


def leftovers(directory):
    return sorted(p for p in os.listdir(directory) if p.startswith("."))


def age(directory):
    """Make the temporary files old enough for `clear_leftovers` (nobody holds them: their writers
    were killed)."""
    for name in leftovers(directory):
        os.utime(os.path.join(directory, name), (time.time() - 60, time.time() - 60))


# -- kill -9 loops --------------------------------------------------------------------------


def test_tile_cache_survives_kill_9_mid_write(tmp_path, caplog):
    from jetserve.engine.model.tile_cache import Entry

    # a file large enough that a write takes a while
    TileCache(tmp_path, FP)._write({str(i): Entry(TILES[i % 3], TILES, (1.0, 2.0, 3.0)) for i in range(20)})

    def child(report):
        cache = TileCache(tmp_path, FP)
        report("started")
        i = len(cache.shapes)
        while True:
            cache.store((i,), TILES, (1.0, 2.0, 3.0), TILES[i % 3])
            report(str(i))
            i += 1

    def check(reports):
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            shapes = TileCache(tmp_path, FP).shapes
            assert not caplog.records, caplog.text
        # the old version or the new: shapes 0..k whole, k at least the last stored
        assert sorted(int(k) for k in shapes) == list(range(len(shapes)))
        assert all(e.tile == TILES[int(k) % 3] for k, e in shapes.items())
        assert len(shapes) > max(map(int, [r for r in reports if r != "started"] or [0]))

    reports, torn = kill_loop(child, check, seed=1, directory=tmp_path)
    assert torn, "the kills missed the writes: nothing tested"
    age(tmp_path)
    TileCache(tmp_path, FP).store((10**6,), TILES, (1.0, 2.0, 3.0), None)
    assert leftovers(tmp_path) == [], "the killed writers' temporary files are removed"


def _entry_version(path):
    key, version = Path(path).read_bytes().split(b"\n", 1)[0].decode().split(":")
    return key, int(version)


def test_program_cache_survives_kill_9_mid_write(tmp_path, caplog):
    directory = tmp_path / "steps"
    keys = ["k%d" % i for i in range(4)]

    def writer(key, version):
        def write(path):
            with open(path, "wb") as f:  # a package's size, written in pieces as a compiler does
                f.write(("%s:%d\n" % (key, version)).encode())
                for _ in range(16):
                    f.write(os.urandom(16384))
        return write

    def child(report):
        cache = ProgramCache(directory)
        report("started")
        while True:
            for key in keys:
                version = time.monotonic_ns()  # increases across processes
                cache.store(key, writer(key, version))
                report("%s:%d" % (key, version))

    def check(reports):
        last = {}
        for r in reports:
            if r != "started":
                key, version = r.split(":")
                last[key] = int(version)
        cache = ProgramCache(directory)
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            for key in keys:
                for entry in sorted(directory.glob(key + ".*.pt2")):  # every entry whole, and its key's
                    assert file_digest(entry).startswith(entry.suffixes[-2][1:]), "%s is torn" % entry.name
                    assert _entry_version(entry)[0] == key
                    assert _entry_version(entry)[1] >= last.get(key, 0), "a stored version was lost"
                if key in last:
                    assert cache.load(key, lambda p: _entry_version(p)) is not None
            assert not caplog.records, caplog.text

    reports, torn = kill_loop(child, check, seed=2, directory=directory)
    assert torn, "the kills missed the writes: nothing tested"
    age(directory)
    ProgramCache(directory).store("k0", lambda path: open(path, "wb").write(b"k0:0\n"))
    assert leftovers(directory) == [], "the killed writers' temporary files are removed"


def test_outbox_loses_nothing_to_kill_9(tmp_path, caplog):
    path = str(tmp_path / "outbox.db")
    box = Outbox(path)
    epoch = box.epoch
    box.close()

    def child(report):
        box = Outbox(path, limit=10**6)
        report("started")
        i = 0
        while True:
            n = box.add("alert" if i % 5 == 0 else "health", "t", {"i": i, "pad": "x" * 500})
            report("a%d" % n)
            i += 1
            if i % 3 == 0:  # acknowledge the oldest, as the broker would
                oldest = box.pending(limit=1)[0][0]
                report("k%d" % oldest)  # may be forgotten from here on
                box.ack(oldest)
                report("K%d" % oldest)  # is forgotten

    def check(reports):
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            box = Outbox(path, limit=10**6)
            assert not caplog.records, caplog.text
        try:
            assert box.epoch == epoch
            assert box._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            queued = {n for n, _, _ in box.pending(limit=10**6)}
        finally:
            box.close()
        added = {int(r[1:]) for r in reports if r[0] == "a"}
        acking = {int(r[1:]) for r in reports if r[0] == "k"}
        acked = {int(r[1:]) for r in reports if r[0] == "K"}
        assert added - acking <= queued, "messages add() returned were lost: %s" % sorted(added - acking - queued)
        assert not acked & queued, "acknowledged messages came back: %s" % sorted(acked & queued)

    reports, _ = kill_loop(child, check, seed=3, directory=tmp_path)
    added = [int(r[1:]) for r in reports if r[0] == "a"]
    assert len(added) == len(set(added)), "an id was used twice across restarts"


def test_registry_applies_each_batch_whole_across_kill_9(tmp_path, caplog):
    path = str(tmp_path / "fleet.db")
    def health(n):
        return {"epoch": "e", "n": n, "seq": n % 256, "status": "OK", "thermal": {"level": "normal"},
                "service": {"health": "SERVING"}, "compat": {"status": "ok", "checks": []}}

    registry = Registry(path)
    registry.state("lab", "d", {"online": True, "bdSeq": 0, "interval": 5.0})
    registry.close()

    def child(report):
        registry = Registry(path)
        n = registry.devices()[0]["last_n"]
        report("started")
        while True:
            batch = [Message("lab", "d", "health", health(n + k)) for k in (1, 2, 3)]
            registry.apply(batch)
            n += 3
            report(str(n))

    def check(reports):
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            registry = Registry(path)
            assert not caplog.records, caplog.text
        try:
            d = registry.devices()[0]
        finally:
            registry.close()
        assert d["last_n"] % 3 == 0, "a batch was applied in part"
        assert (d["received"], d["gaps"], d["duplicates"]) == (d["last_n"], 0, 0)
        assert d["last_n"] >= max([int(r) for r in reports if r != "started"] or [0]), "a commit was lost"

    reports, _ = kill_loop(child, check, seed=4, directory=tmp_path)


# -- corrupt at start -------------------------------------------------------------------------


def test_a_corrupt_outbox_or_registry_is_set_aside_with_one_warning(tmp_path, caplog):
    for name in ("outbox.db", "fleet.db"):
        (tmp_path / name).write_bytes(b"SQLite format 3\0" + os.urandom(4096))
    with caplog.at_level(logging.WARNING):
        box = Outbox(str(tmp_path / "outbox.db"))
        assert box.add("health", "t", {}) == 1
        registry = Registry(str(tmp_path / "fleet.db"))
        assert registry.state("lab", "d", {"online": True, "bdSeq": 0}) == "birth"
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "%s is corrupt" % (tmp_path / "outbox.db"), "%s is corrupt" % (tmp_path / "fleet.db")]
    assert (tmp_path / "outbox.db.corrupt").exists() and (tmp_path / "fleet.db.corrupt").exists()
    box.close()
    registry.close()


# -- a full disk ----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs, and `fill()` / `free()` to use up and give back all of its space."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for ENOSPC needs root (CI runs as root)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
    if done.returncode:
        pytest.skip("mount -t tmpfs is not permitted here: %s" % done.stdout.decode().strip())

    class Disk:
        path = mount
        filler = mount / "filler"

        def fill(self):
            with open(self.filler, "ab", buffering=0) as f:
                for chunk in (65536, 4096, 1):
                    try:
                        while True:
                            f.write(b"\0" * chunk)
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC
            with pytest.raises(OSError):
                atomic.write_file(mount / "probe", b"x" * 4096)

        def free(self):
            self.filler.unlink()

    try:
        yield Disk()
    finally:
        subprocess.run(["umount", "-l", str(mount)], timeout=30)


def test_tile_cache_on_a_full_disk_keeps_its_file_and_writes_once_space_is_freed(small_disk, caplog):
    cache = TileCache(small_disk.path, FP)
    cache.store((0,), TILES, (1.0, 2.0, 3.0), None)
    small_disk.fill()
    with caplog.at_level(logging.INFO, logger="jetserve.engine.model.tile_cache"):
        for i in range(1, 50):
            cache.store((i,), TILES, (1.0, 2.0, 3.0), TILES[1])  # each rewrites more than the last
        assert [r.levelno for r in caplog.records] == [logging.WARNING], "one line for the episode"
        assert "no space left" in caplog.text
        assert list(TileCache(small_disk.path, FP).shapes) == ["0"], "the old file, whole"
        assert not [p for p in leftovers(small_disk.path) if p.endswith(".tmp")]
        small_disk.free()
        cache.store((50,), TILES, (1.0, 2.0, 3.0), None)
        assert "written again" in caplog.records[-1].getMessage()
    assert len(TileCache(small_disk.path, FP).shapes) == 51, "everything timed meanwhile is written"


def test_program_cache_on_a_full_disk_raises_enospc_and_keeps_its_entries(small_disk):
    cache = ProgramCache(small_disk.path / "steps")
    cache.store("k0", lambda path: open(path, "wb").write(b"k0:1\n"))
    small_disk.fill()
    with pytest.raises(OSError) as raised:
        cache.store("k0", lambda path: open(path, "wb").write(b"k0:2\n" + os.urandom(65536)))
    assert atomic.no_space(raised.value)
    assert cache.load("k0", _entry_version) == ("k0", 1) and leftovers(cache.directory) == []
    small_disk.free()
    cache.store("k0", lambda path: open(path, "wb").write(b"k0:3\n"))
    assert cache.load("k0", _entry_version) == ("k0", 3)


def test_outbox_on_a_full_disk_keeps_working_in_memory_and_writes_once_space_is_freed(small_disk, caplog):
    path = str(small_disk.path / "outbox.db")
    box = Outbox(path)
    box.retry_s = 0  # every call tries the disk again
    pad = "x" * 2000
    assert box.add("health", "t", {"i": 0, "pad": pad}) == 1
    small_disk.fill()
    with caplog.at_level(logging.WARNING, logger="jetserve.agent.outbox"):
        ns = [box.add("alert" if i % 4 == 0 else "health", "t", {"i": i, "pad": pad}) for i in range(1, 60)]
        assert ns == list(range(2, 61)), "ids given while the disk is full"
        assert len(caplog.records) == 1 and "cannot be written" in caplog.text and "full" in caplog.text
        assert [n for n, _, _ in box.pending(limit=1000)] == list(range(1, 61)), "all of them can be sent"
        for n in (1, 2, 3):  # acknowledged: one on disk, two in memory
            box.ack(n)
        assert box.stats()["pending"] == 57
        assert box.next_bdseq() == 0
        small_disk.free()
        assert box.add("health", "t", {"i": 60}) == 61
        assert "written again" in caplog.records[-1].getMessage() and len(caplog.records) == 2
    box.close()
    box = Outbox(path)  # a restart: everything unacknowledged is on disk
    assert [n for n, _, _ in box.pending(limit=1000)] == list(range(4, 62))
    assert box.next_bdseq() == 1, "the bdSeq given while full was written"
    box.close()


def test_outbox_spill_is_bounded_and_drops_health_first(small_disk):
    box = Outbox(str(small_disk.path / "outbox.db"))
    small_disk.fill()
    box.add("alert", "t", {"pad": "x" * 4096})
    for _ in range(SPILL_LIMIT + 10):
        box.add("health", "t", {})
    stats = box.stats()
    assert stats["pending"] == SPILL_LIMIT and stats["dropped"] == {"health": 11, "alert": 0}
    assert box.pending(limit=1)[0][2]["pad"], "the alert is kept"
    box.close()


def test_an_outbox_that_cannot_be_opened_on_a_full_disk_lives_in_memory(small_disk, caplog):
    """A new one, and an existing one (SQLite cannot make its -shm file): the agent runs, no crash loop."""
    old = Outbox(str(small_disk.path / "old.db"))
    old.add("health", "t", {"queued": "before"})
    old.close()
    small_disk.fill()
    for path in (small_disk.path / "state" / "new.db", small_disk.path / "old.db"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jetserve.agent.outbox"):
            box = Outbox(str(path))
        assert "no space left" in caplog.text and "kept in memory until the next start" in caplog.text
        assert box.add("health", "t", {}) == 1 and box.stats()["pending"] == 1
        box.close()
    small_disk.free()
    assert Outbox(str(small_disk.path / "old.db")).pending()[0][2]["queued"] == "before", "kept on disk"


def test_registry_on_a_full_disk_refuses_writes_as_retryable_and_recovers(small_disk):
    registry = Registry(str(small_disk.path / "fleet.db"))
    registry.state("lab", "d", {"online": True, "bdSeq": 0})
    small_disk.fill()
    body = {"epoch": "e", "n": 1, "seq": 1, "status": "OK", "pad": "x" * 300000}
    with pytest.raises(StoreError, match="full"):  # GroupCommit retries a StoreError until it fits
        registry.data("lab", "d", "health", body)
    assert registry.devices()[0]["online"], "what was there is still read"
    small_disk.free()
    assert registry.data("lab", "d", "health", body) == "new"
    registry.close()
    with sqlite3.connect(str(small_disk.path / "fleet.db")) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
