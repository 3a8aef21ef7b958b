"""What the benchmarks share: Qwen3 shapes, random checkpoints, timing helpers, results on disk.

Stdlib-only at module level (the bench modules are imported by `jetserve --help`); torch is
imported inside the helpers that need it."""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Real Qwen3 shapes (random weights: timing only) and the demo model's shape.
SHAPES = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "demo": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=64),
}


def random_checkpoint(shape: str, directory: Path, dtype: torch.dtype, device: torch.device):
    """Build a random Qwen3 of `shape` with transformers and save it as a checkpoint; returns the
    transformers model, so both engines run the same weights."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6,
                         max_position_embeddings=40960)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype).eval()
    model.save_pretrained(directory)
    return model


def load_hf(model_dir: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def read_bandwidth(device: torch.device) -> float:
    """Bytes per second a GPU reads (a large tensor summed), the decode roofline's denominator."""
    import torch

    x = torch.randn(2 * 2**30 // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        x.sum()
    sync(device)
    return 10 * x.numel() * 2 / (time.perf_counter() - start)


def peak_memory(device: torch.device) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def environment(device: torch.device) -> dict:
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
           "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def write_results(out: str | None, result: dict, figures: dict) -> None:
    """Print the result as JSON; with `out`, also write result.json, the figures (name →
    matplotlib Figure) as PNGs and COMMAND.md with the exact command into that folder."""
    if not out:
        print(json.dumps(result, indent=2))
        return
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, fig in figures.items():
        fig.savefig(path / f"{name}.png", dpi=120, bbox_inches="tight")
    command = "jetserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    (path / "COMMAND.md").write_text(f"# {path.name}\n\nMade by:\n\n```\n{command}\n```\n\non {result.get('env')}\n")
    print(json.dumps(result, indent=2))


def free_port() -> int:
    """A TCP port on loopback nobody listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_serving(target: str, server, deadline: float = float("inf")) -> float:
    """Poll `jetserve serve`'s gRPC health at `target` until SERVING (returns the monotonic time
    then); raises if `server` (a Popen) exits first or `deadline` (monotonic) passes."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while server.poll() is None and time.monotonic() < deadline:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic()
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise RuntimeError("the server did not serve (exit code %s)" % server.poll())


def stop_server(server, grace: float = 60.0) -> None:
    """SIGTERM (the drain), then SIGKILL after `grace` seconds."""
    import subprocess

    server.terminate()
    try:
        server.wait(grace)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
