"""State files that a kill -9 or a power cut in the middle of a write leaves whole: the old
version or the new one, never a torn mix.

A file is written under a temporary name in its own directory, flushed to the disk (fsync),
renamed over the old one (os.replace: atomic on a POSIX file system), and then the directory is
flushed too, since the rename is only an entry in it until then. The writer holds an flock on its
temporary file for as long as it writes, so a temporary file that nobody holds is a dead writer's:
`clear_leftovers` removes those (a kill loop would otherwise fill the disk with them).

A full disk (ENOSPC, or a quota's EDQUOT) is the one failure a state file's owner retries by
itself later (`no_space` tells it apart): the temporary file is removed, the old version stays.

Python 3.8: the agent imports it.
"""

import errno
import fcntl
import logging
import os
import tempfile
import time

log = logging.getLogger(__name__)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
LEFTOVER_AGE_S = 10.0  # a temporary file is locked microseconds after it is made: older and unlocked, it is a leftover


def no_space(exc):
    """True when `exc`, or an error it was raised from, says the disk (or the quota) is full: worth
    retrying once space is freed."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full(path, margin=64 << 10):
    """True when the file system holding `path` has (about) no room left for us: fewer than
    `margin` bytes, or no inode. For errors that do not say ENOSPC themselves (SQLite's "disk I/O
    error" when it cannot make its -shm file)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    root = os.geteuid() == 0  # root may use the blocks reserved for it
    free = (st.f_bfree if root else st.f_bavail) * st.f_frsize
    inodes = st.f_ffree if root else st.f_favail
    return free < margin or (st.f_files > 0 and inodes == 0)


def fsync_directory(directory):
    """Make the directory's entries (a rename, a new or removed file) survive a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Staged:
    """A temporary file beside `path` (`.<name>.<random><suffix>`), locked while in use and removed
    on leaving unless `publish`ed. Write it through `fd` or by its name, `temp`."""

    def __init__(self, path, suffix=".tmp"):
        self.path = os.path.abspath(os.fspath(path))
        self.directory, name = os.path.split(self.path)
        self.fd, self.temp = tempfile.mkstemp(dir=self.directory, prefix="." + name + ".", suffix=suffix)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows the name yet
        except BaseException:
            self._discard()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._discard()

    def write(self, data):
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def publish(self, path=None):
        """Flush the temporary file, rename it to `path` (default: the one it was made beside, in
        the same directory), flush the directory."""
        fd = os.open(self.temp, os.O_RDONLY)  # by name: a writer that wrote through its own descriptor is flushed too
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self.temp, os.fspath(path) if path is not None else self.path)
        self.temp = None
        fsync_directory(self.directory)

    def _discard(self):
        try:
            if self.temp is not None:
                os.unlink(self.temp)
        except FileNotFoundError:
            pass
        finally:
            self.temp = None
            os.close(self.fd)


def write_file(path, data):
    """Replace `path` with `data` (bytes or str, UTF-8), whole: readers see the old or the new."""
    with Staged(path) as staged:
        staged.write(data.encode("utf-8") if isinstance(data, str) else data)
        staged.publish()


def clear_leftovers(directory, name="*", suffix=".tmp", min_age_s=LEFTOVER_AGE_S):
    """Remove the temporary files of dead writers (`Staged(<directory>/<name>, suffix)`): those
    no process holds. Returns how many were removed."""
    import glob

    removed = 0
    for temp in glob.glob(os.path.join(glob.escape(os.fspath(directory)), "." + name + ".*" + suffix)):
        try:
            if time.time() - os.lstat(temp).st_mtime < min_age_s:
                continue
            fd = os.open(temp, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its writer is alive
        else:
            try:
                os.unlink(temp)
                removed += 1
            except FileNotFoundError:  # another cleaner's
                pass
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d temporary file(s) in %s left by writers that were killed", removed, directory)
    return removed


def set_aside(path, why):
    """Move a corrupt state file (and an SQLite file's -wal and -shm) to `<path>.corrupt`, in place
    of the one set aside before (one kept, for a post-mortem: never a pile), with one warning; the
    owner then starts a new one."""
    path = os.fspath(path)
    for suffix in ("", "-wal", "-shm", "-journal"):
        if os.path.lexists(path + suffix):
            os.replace(path + suffix, path + ".corrupt" + suffix)
    fsync_directory(os.path.dirname(os.path.abspath(path)))
    log.warning("%s is corrupt (%s): moved to %s.corrupt and started anew", path, why, path)
