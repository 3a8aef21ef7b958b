"""Commands from the controller: an allow-list, each answered on `/cmd/reply`.

A request is `{"id": ..., "command": ..., "args": {...}}`; the reply echoes the id with `ok` and
a `result` or an `error`. Anything not on the list is refused, never executed.
"""

import json

ALLOWED = ("drain", "resume", "set-limits", "report-now")
LIMIT_ARGS = ("max_num_seqs", "num_speculative_tokens")


def parse(payload):
    """Decode a request; returns (request, error) with error a string for a bad one."""
    try:
        request = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}, "request is not JSON"
    if not isinstance(request, dict):
        return {}, "request must be a JSON object"
    command = request.get("command")
    if command not in ALLOWED:
        return request, "command %r is not allowed (allowed: %s)" % (command, ", ".join(ALLOWED))
    args = request.get("args") or {}
    if not isinstance(args, dict):
        return request, "args must be an object"
    if command == "set-limits":
        unknown = sorted(set(args) - set(LIMIT_ARGS))
        if unknown or not args:
            return request, "set-limits takes %s" % " and/or ".join(LIMIT_ARGS)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in args.values()):
            return request, "set-limits values must be non-negative integers"
    elif args:
        return request, "%s takes no arguments" % command
    return request, None


def execute(payload, actions):
    """Run an allowed command through `actions` ({command: callable(args) → result}); the reply."""
    request, error = parse(payload)
    reply = {"id": request.get("id"), "command": request.get("command")}
    if error is None:
        try:
            reply["result"] = actions[request["command"]](request.get("args") or {})
        except Exception as exc:  # the service refused or is down: the operator needs to know
            error = str(exc)
    reply.update(ok=error is None, error=error)
    return reply
