"""The probe reads each fixture sysroot (real Jetson file formats) right."""

import os
import subprocess
import sys

import pytest

from jetserve.device.probe import ProbeError, probe
from jetserve.device.release import parse_nv_tegra_release
from tests.agent.conftest import REPO, SYSROOTS, copy_sysroot
from tests.tools import require_module


def fixture(name):
    return probe(os.path.join(SYSROOTS, name))


def zones(result):
    return {z["name"]: z for z in result["zones"]}


def trips(zone):
    return {t["type"]: t["temp_c"] for t in zone["trips"]}


def test_agx_orin_jetpack_62():
    r = fixture("agx-orin-jp62")
    assert (r["l4t"], r["l4t_source"], r["jetpack"]) == ("36.4.3", "nv_tegra_release", "6.2")
    assert (r["model"], r["soc"], r["serial"]) == ("NVIDIA Jetson AGX Orin Developer Kit", "nvidia,tegra234",
                                                   "1421023012345")
    z = zones(r)
    assert list(z) == ["cpu", "gpu", "cv0", "cv1", "cv2", "soc0", "soc1", "soc2", "tj"]
    assert z["cpu"]["temp_c"] == 48.312 and z["cpu"]["online"]
    assert trips(z["cpu"]) == {"passive": 99.0, "critical": 104.5}
    assert trips(z["tj"]) == {"critical": 104.5}
    for gated in ("cv0", "cv1", "cv2"):  # -256000: offline, never a temperature
        assert z[gated]["online"] is False and z[gated]["temp_c"] is None
    rails = {rail["name"]: rail for rail in r["rails"]}
    assert sorted(rails) == ["VDDQ_VDD2_1V8AO", "VDD_CPU_CV", "VDD_GPU_SOC", "VIN_SYS_5V0"]  # NC, ch 7 skipped
    assert rails["VDD_GPU_SOC"] == {"name": "VDD_GPU_SOC", "voltage_mv": 5072, "current_ma": 1598,
                                    "power_mw": 5072 * 1598 // 1000, "current_crit_ma": 12000}
    assert r["power_total_mw"] == sum(rail["power_mw"] for rail in rails.values())  # no VDD_IN here
    assert r["gpu"] == {"name": "gpu", "load_pct": 14.3, "freq_hz": 306000000}
    assert r["fan"] == {"pwm": 96, "speed_pct": 37.6, "rpm": 2105}
    assert r["power_mode"] == "MAXN" and r["cuda"] == "12.6.68" and r["jetson"]


def test_orin_nano_jetpack_512_with_jp5_zone_names_and_gated_zones():
    r = fixture("orin-nano-jp512")
    assert (r["l4t"], r["jetpack"], r["soc"]) == ("35.4.1", "5.1.2", "nvidia,tegra234")
    assert r["model"] == "NVIDIA Orin Nano Developer Kit"
    z = zones(r)
    assert [zone["type"] for zone in r["zones"]] == ["CPU-therm", "GPU-therm", "CV0-therm", "SOC0-therm",
                                                     "SOC1-therm", "SOC2-therm", "tj-therm"]  # PMIC skipped
    assert z["cpu"]["temp_c"] == 51.5 and trips(z["cpu"]) == {"passive": 99.0, "critical": 104.5}
    assert z["gpu"]["online"] is False and z["gpu"]["temp_c"] is None  # reads -256000
    assert z["cv0"]["online"] is False and z["cv0"]["temp_c"] is None  # read fails
    assert [rail["name"] for rail in r["rails"]] == ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"]
    assert r["power_total_mw"] == 5016 * 1248 // 1000  # VDD_IN is the module total
    assert r["gpu"]["name"] == "ga10b" and r["gpu"]["load_pct"] == 0.0
    assert r["power_mode"] == "15W" and r["cuda"] == "11.4.315"


def test_thor_jetpack_70():
    r = fixture("thor-jp70")
    assert (r["l4t"], r["jetpack"], r["soc"]) == ("38.2.0", "7.0", "nvidia,tegra264")
    assert r["model"] == "NVIDIA Jetson AGX Thor Developer Kit"
    assert r["gpu"]["name"] == "gb10b" and r["gpu"]["load_pct"] == 3.5
    assert r["rails"] == [] and r["power_total_mw"] is None and r["fan"] is None
    assert sorted(zones(r)) == ["cpu", "gpu", "soc0", "tj"]


def test_l4t_missing_from_table_found_through_dpkg():
    r = fixture("unknown-l4t")
    assert (r["l4t"], r["l4t_source"]) == ("36.2.0", "dpkg")
    assert r["jetpack"] is None and r["jetson"]  # said so, not guessed


def test_non_jetson_host():
    r = fixture("x86-host")
    assert r["jetson"] is False
    assert (r["l4t"], r["jetpack"], r["model"], r["soc"], r["gpu"], r["rails"]) == (None,) * 5 + ([],)
    assert [z["type"] for z in r["zones"]] == ["acpitz", "x86_pkg_temp"]
    for key in ("cpu_pct", "ram", "swap", "disk"):
        assert key in r["host"]


def test_release_line_parsing():
    assert parse_nv_tegra_release("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, "
                                  "EABI: aarch64, DATE: Tue Aug  1 19:57:35 UTC 2023") == "35.4.1"
    assert parse_nv_tegra_release("garbage") is None
    assert parse_nv_tegra_release(None) is None


def test_a_zone_going_offline_is_reported_offline(tmp_path):
    root = copy_sysroot("agx-orin-jp62", tmp_path)
    with open(os.path.join(root, "sys/devices/virtual/thermal/thermal_zone1/temp"), "w") as f:
        f.write("-256000\n")
    gpu = zones(probe(root))["gpu"]
    assert gpu["online"] is False and gpu["temp_c"] is None


def test_bad_sysroot_is_a_clear_error(tmp_path):
    with pytest.raises(ProbeError, match="not a directory"):
        probe(str(tmp_path / "missing"))
    out = subprocess.run([sys.executable, "-m", "jetserve.cli", "doctor", "--sysroot", str(tmp_path / "missing")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, timeout=60)
    assert out.returncode == 1
    assert b"jetserve doctor: sysroot" in out.stdout and b"Traceback" not in out.stdout


def test_jetson_stats_without_its_service_falls_back_with_the_reason():
    """The real jetson-stats client, no jtop.service on this host: the agent's readers take over."""
    require_module("jtop")
    from jetserve.device.probe import JtopReader

    reader = JtopReader()
    assert reader.handle is None and reader.read() is None
    assert reader.reason.startswith("jtop service unavailable") and "jtop.service" in reader.reason
