"""Tiny real models and live servers on loopback for the service tests.

The model is a random 2-layer Qwen3 built offline with transformers, with a byte-level BPE
tokenizer trained here and a ChatML template, so text prompts and Chat work end to end.
"""

import asyncio
import json
import shutil
import socket
import threading
import time

import grpc
import pytest

from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

CHATML = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = """A robot arm picks parts from a tray and places them on the line.
The kiosk greets visitors, answers questions about opening hours and prints tickets.
Jetson boards run small language models next to their cameras and motors.
Streaming tokens one by one keeps the first answer fast; the rest follows at a steady pace.
""" * 20


def _build_tiny_model(path):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    eos = tokenizer.token_to_id("<|im_end|>")

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2,
                         eos_token_id=eos)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    _build_tiny_model(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_without_template(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-no-template") / "model"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def tiny_long_model(tiny_model, tmp_path_factory):
    """The tiny model with a context long enough that no machine generates all of it in a test's
    wait: a test that needs a stream still running bounds the work (tokens), not the clock."""
    path = tmp_path_factory.mktemp("tiny-qwen3-long") / "model"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    return path


LONG_CONTEXT = 1 << 16


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_factory(model, **overrides):
    """`make_engine` for JetServer: the real AsyncLLM on the CPU with a small, fixed KV pool."""
    from jetserve.engine import AsyncLLM, EngineArgs

    config = EngineArgs(model=str(model), device="cpu", num_kv_blocks=256, **overrides).resolve()
    return lambda on_status: AsyncLLM(config, on_status=on_status)


class LiveServer:
    """A JetServer on its own event loop in a thread: what `jetserve serve` runs, minus signals."""

    def __init__(self, make_engine, **options):
        from jetserve.server.app import JetServer, ServeOptions

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self._thread.start()

        options = {"port": 0, "metrics_port": 0, "openai_port": 0, **options}

        async def create():
            return JetServer(make_engine, ServeOptions(**options))

        self.server = self.call(create())
        self.call(self.server.start())
        self.target = "127.0.0.1:%d" % self.server.port

    def call(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_loaded(self, timeout=60):
        async def loaded():
            await self.server.loading
        self.call(loaded(), timeout)

    @property
    def engine(self):
        return self.server.engine

    def channel(self, **kwargs):
        return grpc.insecure_channel(self.target, **kwargs)

    def stop(self):
        self.call(self.server.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="session")
def live(tiny_model):
    """The shared server most tests talk to; tests leave it as they found it (not draining)."""
    server = LiveServer(engine_factory(tiny_model, max_num_seqs=16), metrics_port=free_port(),
                        openai_port=free_port())
    server.wait_loaded()
    yield server
    server.stop()


@pytest.fixture
def stubs(live):
    with live.channel() as channel:
        yield pb_grpc.InferenceServiceStub(channel), pb_grpc.ControlServiceStub(channel)


def wait_for_free_blocks(engine, timeout=5.0):
    """The engine's stats once its blocks are all free (its snapshot trails the last step)."""
    deadline = time.monotonic() + timeout
    while engine.stats().kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.stats()


def greedy(max_tokens=8, **fields):
    return pb.SamplingOptions(temperature=0.0, max_tokens=max_tokens, **fields)
