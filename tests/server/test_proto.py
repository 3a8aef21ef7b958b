"""The .proto passes buf's STANDARD lint and format, and the committed stubs in jetserve/v1 are
what grpcio-tools makes of it, byte for byte."""

import subprocess
import sys
from pathlib import Path

from tests.tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
PROTO = "proto/jetserve/v1/inference.proto"
STUBS = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")


def buf(*args):
    path = require_tool("buf", how="npm install -g @bufbuild/buf")
    return subprocess.run([path, *args], cwd=ROOT, capture_output=True, text=True)


def test_buf_lint_standard_is_clean():
    result = buf("lint")
    assert result.returncode == 0 and not result.stdout, result.stdout + result.stderr


def test_buf_format_leaves_nothing_to_change():
    result = buf("format", "-d", "--exit-code")
    assert result.returncode == 0 and not result.stdout, result.stdout + result.stderr


def test_committed_stubs_are_fresh(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", "proto", "--python_out=%s" % tmp_path,
                    "--pyi_out=%s" % tmp_path, "--grpc_python_out=%s" % tmp_path, PROTO],
                   cwd=ROOT, check=True)
    for name in STUBS:
        fresh = (tmp_path / "jetserve" / "v1" / name).read_bytes()
        committed = (ROOT / "jetserve" / "v1" / name).read_bytes()
        assert fresh == committed, (
            "jetserve/v1/%s is stale: run python3 -m grpc_tools.protoc -I proto --python_out=. "
            "--pyi_out=. --grpc_python_out=. %s" % (name, PROTO))
