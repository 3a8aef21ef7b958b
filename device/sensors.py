"""The agent's own Jetson sensor readers (thermal zones, INA3221 rails, GPU load, fan, power mode).

They read sysfs under a sysroot, which jtop cannot do, so the tests run them on fixture trees.
A power-gated zone reads as an error or -256000, and a broken sensor as a value no chip reaches (a
driver's error code such as INT_MAX, garbage in its file): each is reported offline, never as a
temperature, so it neither drains the service nor raises an alert the controller would refuse.
"""

import os
import re

from jetserve.device.sysfs import natural_glob, read_int, read_text

OFFLINE_MILLIDEGREES = -256000
PLAUSIBLE_MILLIDEGREES = (-273150, 1000000)  # what a zone can read at all; the controller's alert bounds too
GPU_NODES = ("ga10b", "gv11b", "gp10b", "gb10b")


def zone_name(zone_type):
    """jtop's short name: `cpu-thermal` → `cpu`, `SOC0-therm` → `soc0`."""
    return re.split(r"[-_]", zone_type, 1)[0].lower()


def thermal_zones(root):
    """Every zone with its temperature (°C, None when offline) and trip points, PMIC skipped."""
    zones = []
    for path in root.glob("sys/devices/virtual/thermal/thermal_zone*"):
        zone_type = read_text(os.path.join(path, "type"))
        if not zone_type or "PMIC" in zone_type.upper():
            continue
        millideg = read_int(os.path.join(path, "temp"))
        online = (millideg is not None and millideg != OFFLINE_MILLIDEGREES
                  and PLAUSIBLE_MILLIDEGREES[0] <= millideg <= PLAUSIBLE_MILLIDEGREES[1])
        trips = []
        for trip_path in natural_glob(os.path.join(path, "trip_point_*_temp")):
            trip_type = read_text(trip_path[:-len("_temp")] + "_type")
            trip_temp = read_int(trip_path)
            if trip_type and trip_temp is not None:
                trips.append({"type": trip_type, "temp_c": trip_temp / 1000.0})
        zones.append({
            "zone": os.path.basename(path),
            "type": zone_type,
            "name": zone_name(zone_type),
            "online": online,
            "temp_c": millideg / 1000.0 if online else None,
            "trips": trips,
        })
    return zones


def power_rails(root):
    """INA3221 channels as {name, voltage_mv, current_ma, power_mw}; `NC` and channel 7 skipped."""
    rails = []
    for device in root.glob("sys/bus/i2c/devices/*"):
        if "ina3221" not in (read_text(os.path.join(device, "name")) or ""):
            continue
        for hwmon in natural_glob(os.path.join(device, "hwmon/hwmon*")):
            for label_path in natural_glob(os.path.join(hwmon, "in*_label")):
                channel = re.search(r"in(\d+)_label$", label_path).group(1)
                label = read_text(label_path)
                if not label or channel == "7" or "NC" in label:
                    continue
                mv = read_int(os.path.join(hwmon, "in%s_input" % channel))
                ma = read_int(os.path.join(hwmon, "curr%s_input" % channel))
                rails.append({
                    "name": label,
                    "voltage_mv": mv,
                    "current_ma": ma,
                    "power_mw": mv * ma // 1000 if mv is not None and ma is not None else None,
                    "current_crit_ma": read_int(os.path.join(hwmon, "curr%s_crit" % channel)),
                })
    return rails


def total_power_mw(rails):
    """`VDD_IN` is the whole module when present; otherwise the sum of the rails."""
    by_name = {rail["name"]: rail["power_mw"] for rail in rails}
    if "VDD_IN" in by_name:
        return by_name["VDD_IN"]
    values = [p for p in by_name.values() if p is not None]
    return sum(values) if values else None


def gpu_load(root):
    """{name, load_pct} from the GPU's devfreq node (load is per mille), or None."""
    for node in root.glob("sys/class/devfreq/*"):
        name = read_text(os.path.join(node, "device/of_node/name")) or ""
        if name in GPU_NODES or "gpu" in name:
            load = read_int(os.path.join(node, "device/load"))
            return {"name": name, "load_pct": load / 10.0 if load is not None else None,
                    "freq_hz": read_int(os.path.join(node, "cur_freq"))}
    return None


def fan(root):
    """{pwm (0-255), speed_pct, rpm} from hwmon, or None when the device has no fan."""
    result = {}
    for hwmon in root.glob("sys/class/hwmon/hwmon*"):
        pwm = read_int(os.path.join(hwmon, "pwm1"))
        if pwm is not None and "pwm" not in result:
            result.update(pwm=pwm, speed_pct=round(pwm * 100.0 / 255, 1))
        rpm = read_int(os.path.join(hwmon, "rpm"))
        if rpm is None:
            rpm = read_int(os.path.join(hwmon, "fan1_input"))
        if rpm is not None and "rpm" not in result:
            result["rpm"] = rpm
    return result or None


def power_mode(root):
    """The nvpmodel mode name: the id in /var/lib/nvpmodel/status, named by /etc/nvpmodel.conf."""
    status = read_text(root.join("var/lib/nvpmodel/status")) or ""
    match = re.search(r"pmode:(\d+)", status)
    if not match:
        return None
    mode = int(match.group(1))
    conf = read_text(root.join("etc/nvpmodel.conf")) or ""
    for mode_id, name in re.findall(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+?)\s*>", conf):
        if int(mode_id) == mode:
            return name
    return str(mode)
