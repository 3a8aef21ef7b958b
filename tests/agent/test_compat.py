"""The compatibility gate and `jetserve doctor`."""

import json
import os
import subprocess
import sys

from jetserve.device.compat import check
from jetserve.device.probe import probe
from tests.agent.conftest import REPO, SYSROOTS, copy_sysroot


def verdict(name_or_path):
    return check(probe(name_or_path if os.path.isabs(name_or_path) else os.path.join(SYSROOTS, name_or_path)))


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "jetserve.cli", "doctor"] + list(args),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, timeout=60)


def test_verdict_per_fixture():
    agx, nano, thor = verdict("agx-orin-jp62"), verdict("orin-nano-jp512"), verdict("thor-jp70")
    assert agx.cuda_graphs_allowed and agx.backends == ("torch-eager", "torch-cuda-graphs") and agx.status == "ok"
    assert nano.cuda_graphs_allowed and "tensorrt-llm" not in nano.backends  # 5.1.2 >= 5.1
    assert thor.cuda_graphs_allowed and "tensorrt-llm" not in thor.backends
    assert "no tensorrt-llm on a Jetson" in agx.checks[-1].detail and "Edge-LLM" not in agx.checks[-1].detail
    assert "TensorRT Edge-LLM runs on this JetPack, but jetserve has no backend" in thor.checks[-1].detail
    unknown = verdict("unknown-l4t")
    assert unknown.status == "warn" and not unknown.cuda_graphs_allowed
    assert "not in the JetPack table" in unknown.checks[0].detail
    host = verdict("x86-host")
    # No NVIDIA GPU in this sysroot: the CPU's own programs, no CUDA graphs promised; the gate
    # itself stays open (nothing to forbid), so the service does not force eager.
    assert host.status == "ok" and host.cuda_graphs_allowed and host.backends == ("torch-cpu",)
    assert "no NVIDIA GPU" in host.checks[0].detail


def test_tensorrt_llm_backend_on_a_gpu_server(tmp_path):
    root = copy_sysroot("x86-host", tmp_path)
    os.makedirs(os.path.join(root, "proc/driver/nvidia/gpus/0000:01:00.0"))
    os.makedirs(os.path.join(root, "usr/local/cuda"))
    with open(os.path.join(root, "usr/local/cuda/version.json"), "w") as f:
        json.dump({"cuda": {"version": "12.9.1"}}, f)
    server = verdict(root)
    assert server.backends == ("torch-eager", "torch-cuda-graphs", "tensorrt-llm")
    assert "TensorRT-LLM >= 1.0" in server.checks[-1].detail


def test_below_jetpack_51_is_a_clear_too_old_verdict(tmp_path):
    root = copy_sysroot("orin-nano-jp512", tmp_path)
    with open(os.path.join(root, "etc/nv_tegra_release"), "w") as f:  # L4T 35.1.0 = JetPack 5.0.2
        f.write("# R35 (release), REVISION: 1.0, GCID: 31250864, BOARD: t186ref, EABI: aarch64, "
                "DATE: Thu Aug 11 03:40:29 UTC 2022\n")
    old = verdict(root)
    assert old.status == "fail" and not old.cuda_graphs_allowed and old.backends == ("torch-eager",)
    assert "too old" in old.checks[0].detail
    out = doctor("--sysroot", root)
    assert out.returncode == 1
    text = out.stdout.decode()
    assert "not allowed (eager)" in text and "verdict: FAIL" in text and "JetPack      5.0.2" in text


def test_doctor_table_and_json():
    out = doctor("--sysroot", os.path.join(SYSROOTS, "agx-orin-jp62"))
    assert out.returncode == 0
    text = out.stdout.decode()
    assert "JetPack      6.2" in text and "L4T          36.4.3" in text and "verdict: OK" in text
    out = doctor("--sysroot", os.path.join(SYSROOTS, "unknown-l4t"), "--json")
    doc = json.loads(out.stdout.decode())
    assert doc["status"] == "warn" and doc["cuda_graphs_allowed"] is False
    assert doc["facts"]["l4t"] == "36.2.0" and doc["facts"]["jetpack"] is None


def test_doctor_on_a_gpu_less_host_promises_no_cuda_graphs():
    out = doctor("--sysroot", os.path.join(SYSROOTS, "x86-host"))
    text = out.stdout.decode()
    assert out.returncode == 0 and "torch-cuda-graphs" not in text, text
    assert "CUDA graphs  no NVIDIA GPU here" in text and "allowed" not in text.split("backends")[0], text


def test_doctor_in_a_pipe_that_closes_early_is_quiet():
    """`jetserve doctor --json | head -1`: the reader leaves before the writer is done."""
    reader, writer = os.pipe()
    os.close(reader)  # every write now fails with EPIPE, as once `head` has exited
    try:
        done = subprocess.run([sys.executable, "-m", "jetserve.cli", "doctor", "--json",
                               "--sysroot", os.path.join(SYSROOTS, "agx-orin-jp62")],
                              stdout=writer, stderr=subprocess.PIPE, cwd=REPO, timeout=60)
    finally:
        os.close(writer)
    assert done.stderr.decode() == "" and done.returncode == 141, done.stderr.decode()
