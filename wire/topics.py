"""MQTT topic layout shared by the agent and the fleet controller.

`jetserve/v1/<fleet>/<device>/{state,health,alert,cmd,cmd/reply[/<request>]}`: one prefix per device, so the
broker's ACL can confine a device to its own subtree.
"""

import re

ROOT = "jetserve/v1"
STATE, HEALTH, ALERT, CMD, REPLY = "state", "health", "alert", "cmd", "cmd/reply"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(kind, name):
    """Fleet and device names become topic levels: no `/`, `+`, `#` or empty names."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError("invalid %s name %r: use letters, digits, '.', '_' or '-' (max 64)"
                         % (kind, name))
    return name


def topic(fleet, device, kind):
    return "%s/%s/%s/%s" % (ROOT, fleet, device, kind)


def subscription(fleet, kind, share=None):
    """Filter for one kind from every device of a fleet (`+` for all fleets), maybe `$share`d."""
    filt = "%s/%s/+/%s" % (ROOT, fleet or "+", kind)
    return "$share/%s/%s" % (share, filt) if share else filt


def parse(name):
    """`jetserve/v1/lab/dev1/cmd/reply` → ("lab", "dev1", "cmd/reply"); None if not ours."""
    parts = name.split("/")
    if len(parts) < 5 or "/".join(parts[:2]) != ROOT:
        return None
    kind = "/".join(parts[4:])
    if kind not in (STATE, HEALTH, ALERT, CMD, REPLY):
        return None
    return parts[2], parts[3], kind
