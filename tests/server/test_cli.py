"""`jetserve generate` / `chat` against a live server, `serve`'s flags, and the CLI's import rules."""

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import greedy
from tests.tools import require_tool
from jetserve.cli import build_parser
from jetserve.engine import EngineArgs
from jetserve.server.cli import apply_compat_gate
from jetserve.v1 import inference_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"^(\d+) tokens, finish_reason (\w+), TTFT \d+ ms, [\d.]+ tok/s$")


def jetserve(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "jetserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=60)


def test_generate_streams_the_text_then_ttft_and_speed(live, stubs):
    inference, _ = stubs
    expected = "".join(m.text for m in inference.Generate(
        pb.GenerateRequest(text="The kiosk", sampling=greedy(12, ignore_eos=True))))
    done = jetserve("generate", "The kiosk", "--target", live.target, "--temperature", "0",
                    "--max-tokens", "12", "--ignore-eos")
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    assert SUMMARY.match(done.stderr.strip()).groups() == ("12", "length")


def test_chat_reads_one_message_per_line_and_keeps_the_conversation(live):
    done = jetserve("chat", "--target", live.target, "--system", "Be brief.", "--temperature", "0",
                    "--max-tokens", "5", "--ignore-eos", stdin="Opening hours?\n\nAnd on Sunday?\n")
    assert done.returncode == 0, done.stderr
    summaries = done.stderr.strip().splitlines()
    assert len(summaries) == 2 and all(SUMMARY.match(line).groups() == ("5", "length") for line in summaries)
    # Piped, stdout is a transcript: each question above its reply, a blank line between turns.
    turns = done.stdout.split("\n\n")
    assert [t.splitlines()[0] for t in turns if t.strip()] == ["> Opening hours?", "> And on Sunday?"]


def test_client_errors_show_the_status_not_a_traceback(live):
    done = jetserve("generate", "hi", "--target", live.target, "--temperature", "-1")
    assert done.returncode == 1
    assert done.stderr.startswith("error: INVALID_ARGUMENT: SamplingParams.temperature")


def test_no_server_at_the_target_says_how_to_start_one(tmp_path):
    """Nothing listening: the next step, not only gRPC's list of addresses and errno text."""
    for command in (["generate", "hi"], ["chat", "hi"]):
        done = jetserve(*command, "--target", "unix:%s" % (tmp_path / "none.sock"))
        assert done.returncode == 1
        assert done.stderr.startswith("error: no server answers at unix:%s: start one with `jetserve serve`"
                                      % (tmp_path / "none.sock")), done.stderr


def test_serve_takes_vllms_flags_and_the_service_flags():
    args = build_parser().parse_args([
        "serve", "--model", "m", "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "256", "--no-enable-chunked-prefill", "--gpu-memory-utilization", "0.5",
        "--enforce-eager", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}',
        "--host", "0.0.0.0", "--port", "6000", "--unix-socket", "/run/jetserve/jetserve.sock",
        "--metrics-port", "0", "--api-key-file", "/etc/jetserve/token", "--drain-grace-period", "5"])
    engine = EngineArgs.from_cli_args(args)
    assert (engine.model, engine.dtype, engine.max_model_len, engine.max_num_seqs, engine.max_num_batched_tokens,
            engine.enable_chunked_prefill, engine.gpu_memory_utilization, engine.enforce_eager,
            engine.speculative_config) == ("m", "bfloat16", 2048, 4, 256, False, 0.5, True,
                                           {"method": "mtp", "num_speculative_tokens": 2})
    assert (args.host, args.port, args.metrics_port, args.drain_grace_period) == ("0.0.0.0", 6000, 0, 5.0)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.port, defaults.metrics_port, defaults.openai_port, defaults.host) == \
        (50051, 9400, 8000, "127.0.0.1")


def test_serve_settings_come_from_their_dataclasses(tmp_path):
    """The flags' defaults are ServeOptions' and EngineArgs' own, and [serve] of the TOML file takes
    exactly their fields."""
    from jetserve.config import from_args, set_defaults_from_file
    from jetserve.server.options import ServeOptions

    defaults = build_parser().parse_args(["serve"])
    assert from_args(ServeOptions, defaults) == ServeOptions() and EngineArgs.from_cli_args(defaults) == EngineArgs()
    argv = ["serve", "--config", str(tmp_path / "jetserve.toml"), "--port", "7000"]
    (tmp_path / "jetserve.toml").write_text("[serve]\nmax-num-seqs = 3\nport = 6000\nopenai_port = 0\n"
                                            "api-key-file = '/etc/jetserve/token'\nlog-level = 'debug'\n")
    parser = build_parser()
    args = parser.parse_args(argv)
    set_defaults_from_file(args.config_parser, args.config, args.config_table)
    args = parser.parse_args(argv)
    assert (args.max_num_seqs, args.port, args.openai_port, args.api_key_file, args.log_level) == \
        (3, 7000, 0, "/etc/jetserve/token", "DEBUG")
    (tmp_path / "jetserve.toml").write_text("[serve]\ncontrol-api-key = 'x'\nmodel-tag = 'm'\n")  # no flags
    with pytest.raises(ValueError, match=r"unknown key\(s\) in \[serve\]: control_api_key, model_tag"):
        set_defaults_from_file(args.config_parser, args.config, args.config_table)


@pytest.mark.parametrize("argv, expected", [
    (["serve", "some/model"], {"model": "some/model"}),
    (["serve", "m", "--dtype", "half"], {"dtype": "half"}),
    (["serve", "m", "--dtype", "float"], {"dtype": "float"}),
    (["serve", "m", "--max-model-len", "4k"], {"max_model_len": 4000}),
    (["serve", "m", "--max-model-len", "4K"], {"max_model_len": 4096}),
    (["serve", "m", "--served-model-name", "kiosk-llm", "alias"], {"served_model_name": "kiosk-llm"}),
    (["serve", "m", "--cudagraph-capture-sizes", "1", "2", "4"], {"cudagraph_capture_sizes": [1, 2, 4]}),
    (["serve", "m", "--cudagraph-capture-sizes", "1,2,8"], {"cudagraph_capture_sizes": [1, 2, 8]}),
])
def test_vllms_serve_spellings(argv, expected):
    engine = EngineArgs.from_cli_args(build_parser().parse_args(argv))
    assert {name: getattr(engine, name) for name in expected} == expected


def test_vllms_dtype_names_resolve_to_torch_dtypes(tiny_model):
    for name, torch_name in (("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")):
        assert EngineArgs(model=str(tiny_model), dtype=name, device="cpu").resolve().dtype == torch_name
    assert EngineArgs(model=str(tiny_model), device="cpu").resolve().served_model_name == str(tiny_model)
    assert EngineArgs(model="demo", device="cpu").resolve().served_model_name == "demo"  # not its directory


def test_a_positional_model_and_model_flag_must_agree():
    with pytest.raises(ValueError, match="disagree"):
        EngineArgs.from_cli_args(build_parser().parse_args(["serve", "a", "--model", "b"]))


def test_the_cli_module_stays_importable_on_python_38():
    vermin = require_tool("vermin")
    out = subprocess.run([vermin, "--no-tips", "--violations", "-t=3.8-", "server/cli.py", "server/options.py"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout
    imports = subprocess.run([sys.executable, "-c", "import sys, jetserve.server.cli; "
                              "print(sorted(m for m in ('torch', 'grpc', 'prometheus_client') if m in sys.modules))"],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert imports.stdout.strip() == "[]", imports.stderr


def _sysroot(path, nv_tegra_release=None):
    if nv_tegra_release:
        (path / "etc").mkdir(parents=True)
        (path / "etc/nv_tegra_release").write_text(nv_tegra_release)
        tree = path / "sys/firmware/devicetree/base"
        tree.mkdir(parents=True)
        (tree / "compatible").write_text("nvidia,p3768-0000+p3767-0005\0nvidia,tegra234\0")
    return str(path)


def test_the_compat_gate_forces_eager_below_jetpack_51(tmp_path, caplog):
    old = _sysroot(tmp_path, "# R35 (release), REVISION: 1.0, GCID: 1, BOARD: t186ref, EABI: aarch64, DATE: -\n")
    with caplog.at_level(logging.WARNING):
        assert apply_compat_gate(EngineArgs(model="m"), old).enforce_eager
    assert "CUDA graphs are not allowed" in caplog.text and "5.1" in caplog.text


def test_the_compat_gate_leaves_graphs_on_elsewhere(tmp_path):
    assert not apply_compat_gate(EngineArgs(model="m"), _sysroot(tmp_path)).enforce_eager


def test_the_readme_client_snippet_runs_as_written(live, monkeypatch, capsys):
    """The snippet, with only the address swapped for the test server's, and no token set."""
    readme = (ROOT / "README.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "InferenceServiceStub" in b)
    assert "127.0.0.1:50051" in snippet
    monkeypatch.delenv("JETSERVE_API_KEY", raising=False)
    exec(compile(snippet.replace("127.0.0.1:50051", live.target), "README.md", "exec"), {})
    # The streamed text, then (on the same line) completion tokens and TTFT.
    completion_tokens, ttft = re.search(r"(\d+) (\S+)\n$", capsys.readouterr().out).groups()
    assert int(completion_tokens) > 0 and float(ttft) > 0


def test_the_demo_model_is_named_demo_from_any_directory(tmp_path, monkeypatch):
    from jetserve import demo_model_dir

    monkeypatch.chdir(tmp_path)
    assert EngineArgs(model="demo", device="cpu").resolve().model == demo_model_dir()
