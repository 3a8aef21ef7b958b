"""A first start on a CPU serves at once: `jetserve serve` (the demo, empty caches) answers over
the OpenAI API while its decode programs compile in a process of their own, then swaps them in
between steps; a prompt of a length the server never saw compiles nothing.

The one server this module starts compiles the demo's two CPU programs in the background (minutes
on a busy 2-core box): the wait for the swap is bounded by the compiler process's own end, not by
a clock, and the test fails if the compiled programs never take over."""

import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.server.conftest import free_port

FIRST_ANSWER_S = 30.0  # the bound for the first completion after launch, on a 2-core box
COMPILING = "in the background (once per model"
SWAPPED = "decode steps now run compiled"


class Server:
    """`jetserve serve` with its output read line by line into a queue (and kept)."""

    def __init__(self, env, port, grpc_port):
        self.launched = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jetserve.cli", "serve", "--openai-port", str(port), "--port", str(grpc_port),
             "--metrics-port", "0", "--log-level", "info"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines, self.log = queue.Queue(), []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str) -> str:
        """The first line holding `text`; fails if the server ends first."""
        while True:
            line = self.lines.get()
            assert line is not None, "the server ended:\n" + "".join(self.log[-40:])
            if text in line:
                return line

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.timeout(1200)  # the compile is bounded work; on a loaded box it can take minutes
def test_the_demo_answers_at_once_and_its_compiled_steps_take_over(tmp_path):
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_COMPILE_DISABLE", "XDG_CACHE_HOME")}
    env.update(JETSERVE_CACHE_DIR=str(cache), TORCHINDUCTOR_CACHE_DIR=str(cache / "torchinductor"),
               OMP_NUM_THREADS="1")
    port = free_port()
    server = Server(env, port, free_port())
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        while True:  # serving once /health answers 200 (503 while the model loads)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10):
                    break
            except (OSError, urllib.error.HTTPError):
                assert server.process.poll() is None, "".join(server.log)
                time.sleep(0.1)
        first = client.completions.create(model="demo", prompt="def main():", max_tokens=8, temperature=0)
        answered = time.monotonic() - server.launched
        assert first.choices[0].text and first.usage.completion_tokens == 8
        assert any(COMPILING in line for line in server.log)  # compiling, not compiled: it served first
        assert not any(SWAPPED in line for line in server.log), "the compile ended before the first answer"
        print(f"first completion {answered:.1f} s after launch")
        assert answered <= FIRST_ANSWER_S

        # The swap: the next steps after the compiler's end run the compiled programs.
        while not any(SWAPPED in line for line in server.log):
            client.completions.create(model="demo", prompt="x = ", max_tokens=1, temperature=0)
            if "failed" in "".join(line for line in server.log if "CPU decode steps" in line):
                raise AssertionError("".join(server.log[-20:]))
            time.sleep(1.0)
        again = client.completions.create(model="demo", prompt="def main():", max_tokens=8, temperature=0)
        assert again.choices[0].text == first.choices[0].text  # the compiled step decodes what the eager one did

        # Prompts of lengths never seen: no compile, no cache file, on the request's path.
        before = _files(cache)
        for length in (37, 211, 700):
            client.completions.create(model="demo", prompt=[(7 * i) % 4000 + 5 for i in range(length)], max_tokens=2,
                                      temperature=0)
        assert _files(cache) == before
    finally:
        server.stop()
