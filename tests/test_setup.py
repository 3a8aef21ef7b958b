"""Running the tests after `pip install -e ".[serve]"` (no test extras) says what to install."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_missing_test_extra_is_one_clear_message(tmp_path):
    # Block one test-only module, as a `.[serve]` install lacks it.
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["transformers"] = None\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/engine/test_block_manager.py"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 4, out  # pytest's usage error, before any test file is imported
    assert 'pip install -e ".[test]"' in out and "missing: transformers" in out, out
