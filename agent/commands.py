"""Commands from the controller: an allow-list, each answered on `/cmd/reply`.

A request is `{"id": ..., "command": ..., "args": {...}}`, checked by `jetserve.wire.messages`
(size, depth, allow-list, `set-limits` bounds); the reply echoes the id with `ok` and a `result`
or an `error`. Anything that fails the checks is refused with the reason, never executed.
"""

from jetserve.wire import messages


def execute(payload, actions):
    """Run an allowed command through `actions` ({command: callable(args) → result}); the reply."""
    try:
        request = messages.parse(messages.Command, payload, limit=messages.MAX_COMMAND)
    except messages.MessageError as exc:
        return refuse(payload, str(exc))
    reply = {"id": request.id, "command": request.command}
    try:
        reply.update(ok=True, error=None, result=actions[request.command](request.args))
    except Exception as exc:  # the service refused or is down: the operator needs to know
        reply.update(ok=False, error=str(exc))
    return reply


def refuse(payload, error):
    """The reply to a request that is not run: its id and command when they can be read at all."""
    try:
        doc = messages.decode(payload, messages.MAX_COMMAND)
    except messages.MessageError:
        doc = {}
    command = doc.get("command")
    return {"id": messages.request_id(doc), "command": command if isinstance(command, str) and len(command) <= 64
            else None, "ok": False, "error": error}
