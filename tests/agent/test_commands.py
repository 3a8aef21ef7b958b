"""Command requests: only the allow-list runs; every request gets a reply."""

import json

from jetserve.agent.commands import execute


def run(request, **actions):
    calls = []
    table = {name: (lambda name: lambda args: calls.append((name, args)) or "done")(name)
             for name in ("drain", "resume", "set-limits", "report-now")}
    payload = request if isinstance(request, bytes) else json.dumps(request).encode()
    return execute(payload, table), calls


def test_allowed_command_runs_and_echoes_the_id():
    reply, calls = run({"id": "r1", "command": "set-limits", "args": {"max_num_seqs": 2}})
    assert reply == {"id": "r1", "command": "set-limits", "ok": True, "error": None, "result": "done"}
    assert calls == [("set-limits", {"max_num_seqs": 2})]


def test_refusals_are_replies_not_executions():
    for request, error in ((b"not json", "not JSON"), ([1], "JSON object"),
                           ({"id": "x", "command": "rm -rf"}, "not allowed"),
                           ({"command": "drain", "args": {"now": 1}}, "takes no arguments"),
                           ({"command": "set-limits", "args": {"max_num_seqs": -1}}, "non-negative"),
                           ({"command": "set-limits", "args": {"max_num_seqs": True}}, "non-negative"),
                           ({"command": "set-limits"}, "set-limits takes")):
        reply, calls = run(request)
        assert reply["ok"] is False and error in reply["error"] and calls == []


def test_a_failing_action_is_reported():
    reply = execute(b'{"id": 7, "command": "drain"}', {"drain": lambda args: 1 / 0})
    assert reply["ok"] is False and "division" in reply["error"] and reply["id"] == 7
