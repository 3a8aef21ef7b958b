"""Every shell and Python block of README.md and docs/ runs as written, against a live demo server.

A block preceded by `<!-- no-test: why -->` is not run (it installs, needs root, a Jetson, a
broker, or is output). The server listens on free ports; the blocks' addresses
(127.0.0.1:50051 / :8000 / :9400, the defaults a reader's server has) are pointed at them. Each
block gets a bounded time, and the demo answers a handful of short requests, so the work is small.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.M | re.S)
SKIP = re.compile(r"<!--\s*no-test:[^>]*-->\s*$")
DEFAULTS = {"grpc": 50051, "openai": 8000, "metrics": 9400}


def blocks():
    for page in PAGES:
        text = page.read_text()
        for n, match in enumerate(BLOCK.finditer(text)):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            if SKIP.search(before):
                continue
            first = match.group(2).strip().splitlines()[0][:50]
            yield pytest.param(match.group(1), match.group(2), id="%s#%d %s" % (page.name, n, first))


def test_every_page_marks_what_it_does_not_run():
    """A skipped block says why; the README stays a short guide whose first screen has an answer."""
    for page in PAGES:
        for reason in re.findall(r"<!--\s*no-test:([^>]*)-->", page.read_text()):
            assert reason.strip(), page
    readme = (REPO / "README.md").read_bytes()
    assert len(readme) <= 15000, len(readme)
    first = "\n".join(readme.decode().splitlines()[:60])
    assert "curl" in first and '"choices"' in first, "the README's first 60 lines show a request and its answer"


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`jetserve serve` with no model, as the README's first command leaves it (eager, as the suite's
    engines run: TORCH_COMPILE_DISABLE from tests/conftest.py)."""
    ports = {name: _free_port() for name in DEFAULTS}
    log = tmp_path_factory.mktemp("demo") / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "jetserve.cli", "serve", "--port", str(ports["grpc"]),
                                   "--openai-port", str(ports["openai"]), "--metrics-port", str(ports["metrics"])],
                                  stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail("the demo server exited: %s" % log.read_text())
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % ports["openai"], timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("the demo server did not serve within 180 s: %s" % log.read_text())
        yield ports
    finally:
        server.terminate()
        server.wait(60)


def _pointed_at(code: str, ports: dict) -> str:
    for name, default in DEFAULTS.items():
        code = re.sub(r"(127\.0\.0\.1|localhost):%d\b" % default, "127.0.0.1:%d" % ports[name], code)
    return code


@pytest.mark.parametrize("language, code", list(blocks()))
def test_block_runs(demo, language, code, tmp_path):
    code = _pointed_at(code, demo)
    if language == "bash":
        for tool in ("buf", "curl"):
            if re.search(r"(^|[|;&(]\s*)%s\b" % tool, code, re.M) and shutil.which(tool) is None:
                pytest.skip("%s is not installed (bash .ci/run installs it)" % tool)
        command = ["bash", "-e", "-c", code]
    else:
        command = [sys.executable, "-c", code]
    # `jetserve` and `python3` are this interpreter's, as for a reader in their virtualenv.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PATH=path, OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and "Traceback" not in done.stderr, (
        "exit %d\n--- stdout\n%s\n--- stderr\n%s" % (done.returncode, done.stdout[-3000:], done.stderr[-3000:]))


def test_every_relative_link_resolves():
    for page in PAGES + sorted((REPO / "bench" / "results").glob("*/NOTES.md")):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), "%s links to %s, which does not exist" % (page, target)
