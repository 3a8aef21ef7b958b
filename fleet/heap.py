"""Give the C heap's free pages back to the system after a burst.

A broker restart brings the whole fleet back at once (sessions, births, the messages its queues
kept), and the controller's heap grows to hold that burst. Freed, those pages stay with glibc's
allocator, scattered among live blocks where it cannot shrink the heap's top, so the process's
RSS keeps each burst's high-water mark. `malloc_trim(0)` hands back every whole free page inside
the heap; it walks the heap once, so the controller calls it every TRIM_EVERY_S, not per message.
Elsewhere than glibc (musl, macOS) there is no such call and `trim` does nothing.
"""

import ctypes
import ctypes.util

TRIM_EVERY_S = 30.0


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def trim() -> bool:
    """Return the heap's free pages to the system; True if any were (False where there is no malloc_trim)."""
    return bool(_TRIM and _TRIM(0))
