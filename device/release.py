"""Which L4T (and so which JetPack) a device runs.

`/etc/nv_tegra_release` is authoritative; images that lack it still have the `nvidia-l4t-core`
package. The L4T → JetPack table is jetson-stats' `NVIDIA_JETPACK` (exact match): an L4T that is
not in it is reported as unknown rather than guessed.
"""

import re
import subprocess

from jetserve.device.sysfs import read_text

JETPACK = {
    "32.7.1": "4.6.1", "32.7.4": "4.6.4",
    "35.1.0": "5.0.2", "35.2.1": "5.1", "35.3.1": "5.1.1", "35.4.1": "5.1.2", "35.5.0": "5.1.3",
    "35.6.4": "5.1.6",
    "36.3.0": "6.0", "36.4.0": "6.1", "36.4.2": "6.1 (rev1)", "36.4.3": "6.2", "36.4.4": "6.2.1",
    "36.4.7": "6.2.1", "36.5.0": "6.2.2",
    "38.2.0": "7.0", "38.2.1": "7.0", "38.2.2": "7.0", "38.4.0": "7.1",
    "39.0.0": "7.2 EA", "39.2.0": "7.2 GA",
}

_RELEASE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)\.(\d+)")


def parse_nv_tegra_release(text):
    """`# R36 (release), REVISION: 4.3, ...` → "36.4.3"; None when the line is not recognised."""
    match = _RELEASE.search(text or "")
    return "%s.%s.%s" % match.groups() if match else None


def l4t_from_dpkg(sysroot):
    """The `nvidia-l4t-core` version ("36.4.3-2025...") → "36.4.3", or None."""
    command = ["dpkg-query", "--showformat=${Version}", "--show", "nvidia-l4t-core"]
    if sysroot.path != "/":
        command.insert(1, "--admindir=" + sysroot.join("var/lib/dpkg"))
    try:
        out = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             universal_newlines=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = out.stdout.strip().split("-", 1)[0]
    return version if out.returncode == 0 and re.match(r"^\d+\.\d+(\.\d+)?$", version) else None


def read_l4t(sysroot):
    """(l4t, source) with source "nv_tegra_release" or "dpkg"; (None, None) off a Jetson."""
    l4t = parse_nv_tegra_release(read_text(sysroot.join("etc/nv_tegra_release")))
    if l4t:
        return l4t, "nv_tegra_release"
    l4t = l4t_from_dpkg(sysroot)
    return (l4t, "dpkg") if l4t else (None, None)


def jetpack_for(l4t):
    """The JetPack release of an L4T version, or None when the table does not list it."""
    return JETPACK.get(l4t)


def version_tuple(text):
    """"6.1 (rev1)" → (6, 1); "7.2 GA" → (7, 2); None for None."""
    if not text:
        return None
    return tuple(int(x) for x in re.match(r"\d+(?:\.\d+)*", text).group(0).split("."))
