"""The messages on the wire, checked: nothing inbound is used before it passes through here.

Each kind is a dataclass built by `parse(payload)`, which refuses (`MessageError`, naming the
field) a payload that is too large, not UTF-8 JSON, nested too deep, or has a field of the wrong
type, out of range or too long. The fields a receiver acts on become attributes; the whole checked
document stays in `doc` for storage (its size and depth are bounded, so free-form parts such as
the probe are safe to keep and show). Unknown keys are allowed, so a newer agent can add fields.
"""

import dataclasses
import json
import math
import re
from typing import Any, Dict, Optional

MAX_PAYLOAD = 256 * 1024  # bytes; deploy/mosquitto.conf refuses larger ones at the broker too
MAX_COMMAND = 16 * 1024
# An alert is a few fields; the controller keeps 1000 a device and `/api/alerts` answers as many
# at once, so each is bounded far below a health document.
MAX_ALERT = 16 * 1024
# A lone UTF-16 surrogate: JSON's "\ud800" reads as one in Python, and UTF-8 has no bytes for it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_DEPTH = 16  # a health document nests 5 deep
MAX_ITEMS = 256  # entries in any list we read
MAX_TEXT = 2048  # characters in any string we read
MAX_NAME, MAX_FIELD = 64, 256  # characters of a label (epoch, version, type) / of a named field (model, zone, error)
MAX_N = 2 ** 53  # message ids stay exact in every JSON reader
MAX_TS = 4102444800.0  # 2100-01-01: a clock can be wrong (no RTC boots at 1970), never absurd
STATUSES = ("OK", "DEGRADED", "CRITICAL")
LEVELS = ("normal", "shed", "drain")
COMPAT = ("ok", "warn", "fail")
COMMANDS = ("drain", "resume", "set-limits", "report-now", "rebirth")
# Upper bounds for set-limits until the service publishes its own: what a Jetson can run.
LIMITS = {"max_num_seqs": (1, 256), "num_speculative_tokens": (0, 8)}


class MessageError(ValueError):
    """A payload that breaks the contract; the text names the field and the rule."""


def _no_constant(name):
    raise ValueError("%s is not a JSON number" % name)


def _finite(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("%s is past a double's range" % text[:40])
    return value


def decode(payload, limit=MAX_PAYLOAD):
    """bytes → a JSON object, bounded in size and depth, its numbers finite: Python's reader would
    take NaN, Infinity and 1e999, which JSON has not, and a document holding one could be stored
    but never written out again as JSON (the fleet's API, a strict client)."""
    if len(payload) > limit:
        raise MessageError("payload of %d bytes is over the %d-byte limit" % (len(payload), limit))
    try:
        doc = json.loads(payload.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except UnicodeDecodeError:
        raise MessageError("payload is not UTF-8")
    except RecursionError:
        raise MessageError("payload nests deeper than %d levels" % MAX_DEPTH)
    except ValueError as exc:
        raise MessageError("payload is not JSON (%s)" % exc)
    if not isinstance(doc, dict):
        raise MessageError("payload must be a JSON object, not %s" % type(doc).__name__)
    _check_shape(doc)
    return doc


def _check_shape(doc):
    """Bounded depth, and no NUL character or lone surrogate in any key or string: PostgreSQL's
    text and jsonb refuse a NUL, and a surrogate cannot be written out as UTF-8 (the store, the
    fleet's page and API), so either would fail there instead of here, with a reason."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise MessageError("payload nests deeper than %d levels" % MAX_DEPTH)
        children = list(value.values()) if isinstance(value, dict) else value
        strings = [c for c in children if isinstance(c, str)] + (list(value) if isinstance(value, dict) else [])
        if any("\x00" in s for s in strings):
            raise MessageError("payload holds a NUL character")
        if any(LONE_SURROGATE.search(s) for s in strings):
            raise MessageError("payload holds a lone UTF-16 surrogate (\\ud800-\\udfff), which UTF-8 cannot carry")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


# Field readers: `where` is the field's path, for the error message.

def _get(doc, key, where, required):
    if key not in doc or doc[key] is None:
        if required:
            raise MessageError("%s%s is required" % (where, key))
        return None
    return doc[key]


def integer(doc, key, low, high, where="", required=True):
    value = _get(doc, key, where, required)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise MessageError("%s%s must be an integer, not %s" % (where, key, type(value).__name__))
    if not low <= value <= high:
        raise MessageError("%s%s=%d is outside %d..%d" % (where, key, value, low, high))
    return value


def number(doc, key, low, high, where="", required=True):
    value = _get(doc, key, where, required)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise MessageError("%s%s must be a number, not %s" % (where, key, type(value).__name__))
    if not math.isfinite(value) or not low <= value <= high:
        raise MessageError("%s%s=%r is outside %g..%g" % (where, key, value, low, high))
    return float(value)


def text(doc, key, where="", required=True, choices=None, limit=MAX_TEXT):
    value = _get(doc, key, where, required)
    if value is None:
        return None
    if not isinstance(value, str):
        raise MessageError("%s%s must be a string, not %s" % (where, key, type(value).__name__))
    if len(value) > limit:
        raise MessageError("%s%s is longer than %d characters" % (where, key, limit))
    if choices is not None and value not in choices:
        raise MessageError("%s%s=%r is not one of %s" % (where, key, value[:40], ", ".join(choices)))
    return value


def boolean(doc, key, where="", required=True):
    value = _get(doc, key, where, required)
    if value is not None and not isinstance(value, bool):
        raise MessageError("%s%s must be true or false, not %s" % (where, key, type(value).__name__))
    return value


def obj(doc, key, where="", required=True):
    value = _get(doc, key, where, required)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MessageError("%s%s must be an object, not %s" % (where, key, type(value).__name__))
    return value


def items(doc, key, where="", required=True):
    value = _get(doc, key, where, required)
    if value is None:
        return []
    if not isinstance(value, list):
        raise MessageError("%s%s must be a list, not %s" % (where, key, type(value).__name__))
    if len(value) > MAX_ITEMS:
        raise MessageError("%s%s has more than %d entries" % (where, key, MAX_ITEMS))
    return value


def _texts(doc, key, where, required=True):
    values = items(doc, key, where, required)
    for i, value in enumerate(values):
        text({"v": value}, "v", "%s%s[%d]." % (where, key, i))
    return values


def _compat(doc, where):
    compat = obj(doc, "compat", where)
    text(compat, "status", where + "compat.", choices=COMPAT)
    for i, check in enumerate(items(compat, "checks", where + "compat.")):
        at = "%scompat.checks[%d]." % (where, i)
        if not isinstance(check, dict):
            raise MessageError("%s must be an object" % at[:-1])
        text(check, "name", at)
        text(check, "status", at, choices=COMPAT)
        text(check, "detail", at)
    return compat


def _data_id(doc):
    """(epoch, n, seq): the outbox identity every data message carries."""
    return text(doc, "epoch", limit=MAX_NAME), integer(doc, "n", 1, MAX_N), integer(doc, "seq", 0, 255)


@dataclasses.dataclass(frozen=True)
class Birth:
    """`state` with online true: a session starts (Sparkplug NBIRTH: seq 0, the session's bdSeq)."""
    bd_seq: int
    seq: int
    interval: float
    keepalive: int
    doc: Dict[str, Any]

    @classmethod
    def check(cls, doc):
        versions = obj(doc, "versions")
        for key in ("jetserve", "python", "l4t", "jetpack", "cuda"):
            text(versions, key, "versions.", required=False, limit=MAX_NAME)
        for key in ("model", "soc", "serial", "service"):
            text(doc, key, required=False, limit=MAX_FIELD)
        _compat(doc, "")
        seq = integer(doc, "seq", 0, 0, required=False) or 0  # agents before 0.2 sent none
        return cls(integer(doc, "bdSeq", 0, 255), seq,
                   number(doc, "interval", 0.05, 86400.0), integer(doc, "keepalive", 1, 65535), doc)


@dataclasses.dataclass(frozen=True)
class Death:
    """`state` with online false (Sparkplug NDEATH): the Will, or a clean stop stamped `ts`."""
    bd_seq: int
    ts: Optional[float]
    doc: Dict[str, Any]

    @classmethod
    def check(cls, doc):
        return cls(integer(doc, "bdSeq", 0, 255), number(doc, "ts", 0, MAX_TS, required=False), doc)


@dataclasses.dataclass(frozen=True)
class Health:
    epoch: str
    n: int
    seq: int
    status: str
    doc: Dict[str, Any]

    @classmethod
    def check(cls, doc):
        epoch, n, seq = _data_id(doc)
        integer(doc, "schema", 1, 1)
        number(doc, "ts", 0, MAX_TS)
        _texts(doc, "reasons", "")
        obj(doc, "probe")
        _compat(doc, "")
        service = obj(doc, "service")
        text(service, "health", "service.", limit=MAX_NAME)
        text(service, "error", "service.", required=False)
        text(obj(doc, "thermal"), "level", "thermal.", choices=LEVELS)
        outbox = obj(doc, "outbox", required=False)
        integer(outbox, "pending", 0, MAX_N, "outbox.", required=False)
        return cls(epoch, n, seq, text(doc, "status", choices=STATUSES), doc)


@dataclasses.dataclass(frozen=True)
class Alert:
    epoch: str
    n: int
    seq: int
    ts: float
    doc: Dict[str, Any]

    @classmethod
    def check(cls, doc):
        epoch, n, seq = _data_id(doc)
        text(doc, "type", limit=MAX_NAME)
        for key in ("old", "new", "zone", "error"):
            text(doc, key, required=False, limit=MAX_FIELD)
        for key in ("temp_c", "threshold_c"):
            number(doc, key, -300.0, 1000.0, required=False)
        boolean(doc, "ok", required=False)
        _texts(doc, "calls", "", required=False)
        return cls(epoch, n, seq, number(doc, "ts", 0, MAX_TS), doc)


@dataclasses.dataclass(frozen=True)
class Command:
    """A request on `cmd`; `set-limits` values are bounded by `LIMITS`."""
    id: Any
    command: str
    args: Dict[str, int]

    @classmethod
    def check(cls, doc):
        if doc.get("id") is not None and request_id(doc) is None:
            raise MessageError("id must be a string or an integer (at most 128 characters)")
        command = text(doc, "command", limit=MAX_NAME)
        if command not in COMMANDS:
            raise MessageError("command %r is not allowed (allowed: %s)" % (command, ", ".join(COMMANDS)))
        args = obj(doc, "args", required=False)
        if command == "set-limits":
            unknown = sorted(set(args) - set(LIMITS))
            if unknown or all(value is None for value in args.values()):  # {} or only nulls: nothing to set
                raise MessageError("set-limits takes %s" % " and/or ".join(LIMITS))
            for key, (low, high) in LIMITS.items():
                integer(args, key, low, high, "args.", required=False)
        elif args:
            raise MessageError("%s takes no arguments" % command)
        return cls(request_id(doc), command, dict(args))


@dataclasses.dataclass(frozen=True)
class Reply:
    id: Any
    ok: bool
    doc: Dict[str, Any]

    @classmethod
    def check(cls, doc):
        return cls(doc.get("id"), boolean(doc, "ok"), doc)


def request_id(doc):
    """A request's id when it is a short string or an integer, else None."""
    value = doc.get("id")
    if isinstance(value, bool) or not isinstance(value, (str, int)) or len(str(value)) > 128:
        return None
    return value


def parse(cls, payload, limit=MAX_PAYLOAD):
    """Decode and check one payload as `cls` (Birth, Health, ...)."""
    return cls.check(decode(payload, limit))


def parse_state(payload):
    """A `state` payload is a Birth or a Death, told apart by `online`."""
    doc = decode(payload)
    online = boolean(doc, "online")
    return Birth.check(doc) if online else Death.check(doc)


def stored_interval(birth, default=10.0):
    """The report interval of a birth read back from storage, or `default` when the stored value
    does not pass (written before these checks): a restart must not trip over it."""
    try:
        return number(birth, "interval", 0.05, 86400.0) if isinstance(birth, dict) else default
    except MessageError:
        return default

