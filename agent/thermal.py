"""Thermal load shedding with hysteresis, driven by each zone's own trip points.

Levels: normal → shed (fewer concurrent sequences, drafting off) when a zone comes within
`passive_margin` of its passive trip, → drain when within `critical_margin` of critical. Heating
escalates at once; cooling restores one level per decision and only once every zone is
`hysteresis` degrees below the threshold that raised the level, so a zone hovering at the
threshold does not flap the service.
"""

import collections
from dataclasses import dataclass, field

from jetserve.config import number_in, setting

NORMAL, SHED, DRAIN = 0, 1, 2
LEVELS = ("normal", "shed", "drain")

Transition = collections.namedtuple("Transition", "old new zone temp_c threshold_c")


def _trip(zone, kind):
    """The lowest trip of a kind; trips at or below 0 °C (x86_pkg_temp's) mean nothing."""
    temps = [t["temp_c"] for t in zone["trips"] if t["type"] == kind and t["temp_c"] > 0]
    return min(temps) if temps else None


@dataclass
class ThermalPolicy:
    """The margins are the agent's settings (flags `--passive-margin` ..., keys of `[agent]`)."""

    passive_margin: float = setting(5.0, "shed load this many degrees below a zone's passive trip",
                                    type=number_in(0, 100))
    critical_margin: float = setting(3.0, "drain this many degrees below a zone's critical trip",
                                     type=number_in(0, 100))
    hysteresis: float = setting(5.0, "degrees below a threshold before restoring a level", type=number_in(0, 100))
    level: int = field(default=NORMAL, init=False)

    def _thresholds(self, zone):
        """{level: temperature at which that level starts} for one zone."""
        passive, critical = _trip(zone, "passive"), _trip(zone, "critical")
        found = {}
        if passive is not None:
            found[SHED] = passive - self.passive_margin
        if critical is not None:
            found[DRAIN] = critical - self.critical_margin
        return found

    def decide(self, zones):
        """The transition the zones call for now, or None to stay; `commit` it once carried out."""
        hot = [(level, start, zone) for zone in zones if zone["online"]
               for level, start in self._thresholds(zone).items()]
        wanted = max([level for level, start, zone in hot if zone["temp_c"] >= start] or [NORMAL])
        if wanted > self.level:
            level, start, zone = max((h for h in hot if h[0] == wanted and h[2]["temp_c"] >= h[1]),
                                     key=lambda h: h[2]["temp_c"] - h[1])
            return self._transition(wanted, zone, start)
        if self.level == NORMAL:
            return None
        # Cooling: every zone must be `hysteresis` below the start of the current level.
        current = [(start, zone) for level, start, zone in hot if level == self.level]
        if all(zone["temp_c"] < start - self.hysteresis for start, zone in current):
            start, zone = max(current, key=lambda c: c[1]["temp_c"] - c[0]) if current else (None, None)
            return self._transition(self.level - 1, zone, start)
        return None

    def _transition(self, level, zone, threshold):
        return Transition(LEVELS[self.level], LEVELS[level], zone and zone["name"],
                          zone and zone["temp_c"], threshold)

    def commit(self, transition):
        self.level = LEVELS.index(transition.new)


class Shedder:
    """Carries out a level change on the service through Control; remembers the limits to restore."""

    def __init__(self, service):
        self.service = service
        self.baseline = None  # (max_num_seqs, num_speculative_tokens) before the first shed

    def apply(self, old, new):
        """Run the Control calls for old → new (level names); returns the calls made."""
        old, new = LEVELS.index(old), LEVELS.index(new)
        calls = []
        if old == NORMAL and new >= SHED:
            stats = self.service.stats()
            self.baseline = (stats["max_num_seqs"],
                             stats.get("speculative", {}).get("num_speculative_tokens", 0))
            shed_seqs = max(1, self.baseline[0] // 2)
            self.service.set_limits(max_num_seqs=shed_seqs, num_speculative_tokens=0)
            calls.append("SetLimits(max_num_seqs=%d, num_speculative_tokens=0)" % shed_seqs)
        if new == DRAIN:
            self.service.drain()
            calls.append("Drain")
        if old == DRAIN and new <= SHED:
            self.service.resume()
            calls.append("Resume")
        if new == NORMAL and self.baseline is not None:
            seqs, spec = self.baseline
            self.service.set_limits(max_num_seqs=seqs, num_speculative_tokens=spec)
            calls.append("SetLimits(max_num_seqs=%d, num_speculative_tokens=%d)" % (seqs, spec))
            self.baseline = None
        return calls
