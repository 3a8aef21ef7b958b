"""fleet/heap.py: a burst's freed heap goes back to the system."""

import platform
import subprocess
import sys

import pytest

BURST = """
import os
from jetserve.fleet import heap

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

burst = [bytes(2048) for _ in range(50_000)]  # ~100 MB of message-sized blocks
kept = burst[::64]  # live blocks scattered through the heap: its top cannot shrink
del burst
before = rss_mb()
trimmed = heap.trim()
print(before, rss_mb(), trimmed, len(kept))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_a_burst_freed_between_live_blocks_goes_back_to_the_system():
    """What a broker restart's burst leaves (the fleet soak: the controller's RSS stepped up at
    each restart and stayed): blocks freed between blocks still alive. The allocator keeps them;
    trim hands back their pages."""
    out = subprocess.run([sys.executable, "-c", BURST], capture_output=True, text=True, check=True).stdout.split()
    before, after, trimmed = float(out[0]), float(out[1]), out[2]
    assert trimmed == "True" and before - after > 50, (before, after)
