"""Command requests: only the allow-list runs; every request gets a reply."""

import json

import pytest

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


REFUSED = [
    (b"not json", "not JSON"), ([1], "JSON object"), (b"\xff\xfe", "not UTF-8"),
    (b"[" * 100000 + b"]" * 100000, "over the"),  # 200 kB: over the 16 kB command limit
    (b"[" * 8000 + b"]" * 8000, "deeper than"),  # under the limit, far too deep
    ({"id": "x", "command": "rm -rf"}, "not allowed"),
    ({"id": {"a": 1}, "command": "drain"}, "id must be"),
    ({"command": "drain", "args": {"now": 1}}, "takes no arguments"),
    ({"command": "drain", "args": [1]}, "args must be an object"),
    ({"command": "set-limits", "args": {"max_num_seqs": -1}}, "outside 1..256"),
    ({"command": "set-limits", "args": {"max_num_seqs": True}}, "must be an integer"),
    ({"command": "set-limits", "args": {"max_num_seqs": "4"}}, "must be an integer"),
    ({"command": "set-limits", "args": {"num_speculative_tokens": 100000}}, "outside 0..8"),
    ({"command": "set-limits", "args": {"max_num_seqs": 2 ** 70}}, "outside 1..256"),
    ({"command": "set-limits"}, "set-limits takes"),
    ({"command": "set-limits", "args": {"max_num_seqs": None}}, "set-limits takes"),  # nothing to set
]


@pytest.mark.parametrize("request_, error", REFUSED, ids=[e for _, e in REFUSED])
def test_refusals_are_replies_not_executions(request_, error):
    reply, calls = run(request_)
    assert reply["ok"] is False and error in reply["error"] and calls == []


def test_a_failing_action_is_reported():
    reply = execute(b'{"id": 7, "command": "drain"}', {"drain": lambda args: 1 / 0})
    assert reply["ok"] is False and "division" in reply["error"] and reply["id"] == 7
