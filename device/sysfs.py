"""Tolerant readers for files under a sysroot: a missing or unreadable file is None, not a crash.

Every path the agent reads is taken under a `Root`, so the same code reads a live Jetson (`/`)
or a fixture tree in the tests.
"""

import glob
import os
import re


class Root:
    def __init__(self, path="/"):
        self.path = os.path.abspath(path)

    def join(self, *parts):
        return os.path.join(self.path, *(p.lstrip("/") for p in parts))

    def glob(self, pattern):
        return natural_glob(self.join(pattern))


def natural_glob(pattern):
    """Matching paths, sorted naturally (thermal_zone2 before thermal_zone10)."""
    return sorted(glob.glob(pattern), key=_natural_key)


def read_text(path):
    """File contents with device-tree NULs turned into newlines and ends stripped, or None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data.replace(b"\0", b"\n").decode("utf-8", "replace").strip()


def read_int(path):
    """An integer sysfs file, or None when absent, unreadable or not a number."""
    value = read_text(path)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _natural_key(path):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]
