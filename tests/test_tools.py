"""tests/tools.py: a missing tool fails the test where CI runs, and skips it elsewhere."""

import shutil

import pytest

from tests import tools


def test_a_missing_tool_fails_under_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setattr(tools, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="CI=true: no-such-jetserve-tool is not available"):
        tools.require_tool("no-such-jetserve-tool")
    with pytest.raises(pytest.fail.Exception, match="Python module 'no_such_jetserve_module'"):
        tools.require_module("no_such_jetserve_module")
    monkeypatch.setattr(tools, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception, match="no-such-jetserve-tool is not available"):
        tools.require_tool("sh", "no-such-jetserve-tool")
    assert tools.require_tool("sh") == shutil.which("sh")
    assert tools.require_module("json").dumps([]) == "[]"
