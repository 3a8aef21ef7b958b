"""What this device is and how it is doing: one dict, read under a sysroot.

`probe(sysroot="/")` is also what the inference service calls at start (with
`jetserve.device.compat.check`) to learn whether CUDA graphs are allowed here.
"""

import json
import os
import platform

import psutil

from jetserve.device import sensors
from jetserve.device.release import jetpack_for, read_l4t
from jetserve.device.sysfs import Root, read_text


class ProbeError(ValueError):
    """The sysroot cannot be probed at all (e.g. it does not exist)."""


def identity(root):
    """Model, SoC (last `compatible` entry) and serial from the device tree; None off a Jetson."""
    def devicetree(name):
        return (read_text(root.join("proc/device-tree", name))
                or read_text(root.join("sys/firmware/devicetree/base", name)))
    compatible = (devicetree("compatible") or "").split()
    return {
        "model": devicetree("model"),
        "soc": compatible[-1] if compatible else None,
        "serial": read_text(root.join("sys/firmware/devicetree/base/serial-number")),
    }


def cuda_version(root):
    """The CUDA toolkit version from /usr/local/cuda/version.json (or version.txt), or None."""
    text = read_text(root.join("usr/local/cuda/version.json"))
    if text:
        try:
            return json.loads(text)["cuda"]["version"]
        except (ValueError, KeyError, TypeError):
            return None
    text = read_text(root.join("usr/local/cuda/version.txt")) or ""
    return text.split()[-1] if text.startswith("CUDA Version") else None


def nvidia_gpu(root):
    """Whether an NVIDIA driver sees a discrete GPU (its /proc entries or device nodes); no torch needed."""
    gpus = root.join("proc/driver/nvidia/gpus")
    return bool((os.path.isdir(gpus) and os.listdir(gpus)) or os.path.exists(root.join("dev/nvidia0")))


def host_stats(root):
    """CPU, RAM, swap (the running kernel's, via psutil) and the disk that holds the sysroot."""
    memory, swap, disk = psutil.virtual_memory(), psutil.swap_memory(), psutil.disk_usage(root.path)
    return {
        "cpu_pct": psutil.cpu_percent(interval=None),
        "cpu_count": psutil.cpu_count(),
        "load_avg": list(os.getloadavg()),
        "ram": {"total_mb": memory.total >> 20, "used_pct": memory.percent},
        "swap": {"total_mb": swap.total >> 20, "used_pct": swap.percent},
        "disk": {"total_mb": disk.total >> 20, "used_pct": disk.percent},
    }


def probe(sysroot="/", jtop=None):
    """Read everything under `sysroot`; `jtop` (a `JtopReader`) overrides power/GPU when live."""
    if not os.path.isdir(sysroot):
        raise ProbeError("sysroot %s is not a directory" % sysroot)
    root = Root(sysroot)
    l4t, l4t_source = read_l4t(root)
    rails = sensors.power_rails(root)
    result = {
        "sysroot": root.path,
        "source": "sysfs",
        "l4t": l4t,
        "l4t_source": l4t_source,
        "jetpack": jetpack_for(l4t) if l4t else None,
        "python": platform.python_version(),
        "cuda": cuda_version(root),
        "zones": sensors.thermal_zones(root),
        "rails": rails,
        "power_total_mw": sensors.total_power_mw(rails),
        "gpu": sensors.gpu_load(root),
        "fan": sensors.fan(root),
        "power_mode": sensors.power_mode(root),
        "host": host_stats(root),
    }
    result.update(identity(root))
    result["jetson"] = bool(l4t or (result["soc"] or "").startswith("nvidia,tegra"))
    result["nvidia_gpu"] = result["jetson"] or nvidia_gpu(root)  # a Jetson's GPU is on its SoC
    live = jtop.read() if jtop is not None and root.path == "/" else None
    if live:
        result.update(live, source="jtop")
    return result


class JtopReader:
    """jetson-stats' view of power rails, GPU load and power mode, when its service answers.

    jtop reads the real /sys through its root service (rails need root), so it is used only for
    sysroot `/`; otherwise, or when it is absent or down, `reason` says why and the agent's own
    readers are used.
    """

    def __init__(self):
        self.handle, self.reason = None, None
        try:
            from jtop import jtop
        except ImportError:
            self.reason = "jetson-stats (jtop) is not installed"
            return
        try:
            handle = jtop(interval=1.0)
            handle.start()
            self.handle = handle
        except Exception as exc:  # JtopException: service inactive or no permission on its socket
            self.reason = "jtop service unavailable: %s" % exc

    def read(self):
        if self.handle is None or not self.handle.ok():
            return None
        power, gpus = self.handle.power, self.handle.gpu
        rails = [{"name": name, "voltage_mv": r.get("volt"), "current_ma": r.get("curr"),
                  "power_mw": r.get("power"), "current_crit_ma": r.get("crit")}
                 for name, r in power.get("rail", {}).items()]
        gpu = next(({"name": name, "load_pct": g["status"]["load"], "freq_hz": None}
                    for name, g in gpus.items()), None)
        return {"rails": rails, "power_total_mw": power.get("tot", {}).get("power"),
                "gpu": gpu, "power_mode": str(self.handle.nvpmodel) if self.handle.nvpmodel else None}

    def close(self):
        if self.handle is not None:
            self.handle.close()
