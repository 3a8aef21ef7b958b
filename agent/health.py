"""The health document: probe + compatibility verdict + the service's health and stats, judged.

`status` is OK, DEGRADED or CRITICAL with the reasons, so the controller and an operator read the
same verdict the agent acted on. `schema` changes when a field changes meaning.
"""

import time

from jetserve.agent.thermal import DRAIN, LEVELS, SHED

SCHEMA = 1
OK, DEGRADED, CRITICAL = "OK", "DEGRADED", "CRITICAL"
RAM_LIMIT_PCT = DISK_LIMIT_PCT = 90.0


def assess(probe_result, verdict, service, thermal_level):
    """(status, reasons) from the parts of a health document."""
    critical, degraded = [], []
    if thermal_level == DRAIN:
        critical.append("thermal: near a critical trip point, service drained")
    elif thermal_level == SHED:
        degraded.append("thermal: near a passive trip point, load shed")
    if service["health"] == "UNREACHABLE":
        critical.append("service down: %s" % service["error"])
    elif service["health"] not in ("SERVING", "UNKNOWN"):
        degraded.append("service %s" % service["health"])
    if verdict.status != "ok":
        bad = [c.detail for c in verdict.checks if c.status != "ok" and c.name == "jetpack"]
        degraded.extend("compat: " + detail for detail in bad)
    host = probe_result["host"]
    if host["ram"]["used_pct"] >= RAM_LIMIT_PCT:
        degraded.append("memory: RAM %.0f%% used" % host["ram"]["used_pct"])
    if host["disk"]["used_pct"] >= DISK_LIMIT_PCT:
        degraded.append("disk: %.0f%% used" % host["disk"]["used_pct"])
    status = CRITICAL if critical else (DEGRADED if degraded else OK)
    return status, critical + degraded


def build(probe_result, verdict, service, thermal_level, outbox_stats):
    status, reasons = assess(probe_result, verdict, service, thermal_level)
    return {
        "schema": SCHEMA,
        "ts": time.time(),
        "status": status,
        "reasons": reasons,
        "probe": probe_result,
        "compat": verdict.to_dict(),
        "service": service,
        "thermal": {"level": LEVELS[thermal_level]},
        "outbox": outbox_stats,
    }
