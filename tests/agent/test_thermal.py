"""Thermal policy: hysteresis and step-by-step restore, unit-level on zone dicts from a fixture."""

import copy
import os

from jetserve.device.probe import probe
from jetserve.agent.thermal import DRAIN, NORMAL, SHED, ThermalPolicy
from tests.agent.conftest import SYSROOTS, copy_sysroot, set_zone_temp

ZONES = probe(os.path.join(SYSROOTS, "agx-orin-jp62"))["zones"]  # passive 99, critical 104.5


def at(**temps):
    zones = copy.deepcopy(ZONES)
    for zone in zones:
        if zone["name"] in temps:
            zone["temp_c"] = temps[zone["name"]]
    return zones


def step(policy, zones):
    transition = policy.decide(zones)
    if transition:
        policy.commit(transition)
    return transition


def test_shed_near_passive_and_no_flapping_at_the_threshold():
    policy = ThermalPolicy(passive_margin=5, critical_margin=3, hysteresis=5)
    assert step(policy, at(cpu=93.9)) is None
    t = step(policy, at(cpu=94.0))
    assert (t.old, t.new, t.zone, t.threshold_c) == ("normal", "shed", "cpu", 94.0)
    for temp in (93.0, 94.5, 89.5, 92.0):  # within the hysteresis band: stays shed
        assert step(policy, at(cpu=temp)) is None and policy.level == SHED
    t = step(policy, at(cpu=88.9))
    assert (t.old, t.new) == ("shed", "normal") and policy.level == NORMAL


def test_drain_near_critical_then_restore_one_level_at_a_time():
    policy = ThermalPolicy(passive_margin=5, critical_margin=3, hysteresis=5)
    t = step(policy, at(gpu=102.0))  # straight to drain
    assert (t.old, t.new, t.zone) == ("normal", "drain", "gpu")
    assert step(policy, at(gpu=97.0)) is None  # not yet 5 °C under 101.5
    t = step(policy, at(gpu=40.0))
    assert (t.old, t.new) == ("drain", "shed")
    t = step(policy, at(gpu=40.0))
    assert (t.old, t.new) == ("shed", "normal")
    assert step(policy, at(gpu=40.0)) is None


def test_critical_only_zone_and_offline_zones():
    policy = ThermalPolicy()
    assert step(policy, at(tj=100.0)) is None  # tj has no passive trip
    assert step(policy, at(tj=101.6)).new == "drain" and policy.level == DRAIN
    policy = ThermalPolicy()
    zones = at(cpu=120.0)
    for zone in zones:
        zone["online"], zone["temp_c"] = False, None
    assert step(policy, zones) is None


def test_nonsense_trip_points_are_ignored():
    x86 = probe(os.path.join(SYSROOTS, "x86-host"))["zones"]  # x86_pkg_temp has a passive trip at 0
    assert ThermalPolicy().decide(x86) is None


def test_a_sensor_reading_no_temperature_at_all_is_offline(tmp_path):
    """A zone's file holding a driver's error value (INT_MAX millidegrees, or below absolute zero)
    is a broken sensor, not a hot chip: no shedding or draining for it (before: 2147483 °C drained
    the service, and the alert carrying it was refused by the controller), while a real reading
    of another zone still counts."""
    root = copy_sysroot("agx-orin-jp62", tmp_path)
    for garbage in (2147483647, -2147483648, 1000001):
        set_zone_temp(root, "gpu-thermal", garbage)
        assert ThermalPolicy().decide(probe(root)["zones"]) is None, garbage
    set_zone_temp(root, "cpu-thermal", 95000)
    transition = ThermalPolicy().decide(probe(root)["zones"])
    assert (transition.new, transition.zone, transition.temp_c) == ("shed", "cpu", 95.0)
