"""What a queued request costs a live server: token ids are kept once, compactly, from the wire
to the engine core's sequence, so a request waiting its turn holds at most ~3x its wire size in
the server and in the engine core; and the queue's bytes are bounded as well as its requests.

A real `jetserve serve` process on the CPU, one sequence running (a long decode that holds the
others back), large token-id prompts queued behind it; RSS of both processes (psutil) per queued
request against the request's serialized size. The model has Qwen3's vocabulary (151,936 ids),
so the ids cost on the wire what they cost from a real client of the models this serves.
"""

import json
import os
import random
import shutil
import time

import grpc
import psutil
import pytest

from tests.server.conftest import free_port
from tests.server.test_serve import NotifySocket, jetserve
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

VOCAB = 151936  # Qwen3's
MAX_MODEL_LEN = 2**18
PROMPT_TOKENS = 200_000  # ~580 KB on the wire
QUEUED = 16  # requests measured: ~9 MB on the wire in all
WARM_UP = 2  # sent and cancelled first: gRPC's and the allocator's buffers exist before the baseline
MAX_RATIO = 3.0


@pytest.fixture(scope="module")
def wide_model(tiny_model, tmp_path_factory):
    """A 1-layer Qwen3 with Qwen3's vocabulary and a 256K context (the tiny model's tokenizer,
    which names the first 400 ids)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("wide-qwen3")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=True, eos_token_id=0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, path / name)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return path


def prompt(seed):
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]


def serve(model, tmp_path, *flags):
    notify = NotifySocket(tmp_path / "notify")
    port = free_port()
    env = dict(os.environ, NOTIFY_SOCKET=notify.address)
    server = jetserve("serve", str(model), "--device", "cpu", "--enforce-eager", "--port", str(port),
                      "--metrics-port", "0", "--openai-port", "0", "--max-num-seqs", "1", "--num-kv-blocks", str(MAX_MODEL_LEN // 16 + 1),
                      "--max-model-len", str(MAX_MODEL_LEN),
                      *flags, env=env)
    notify.wait_for("READY=1", server, timeout=180)
    notify.sock.close()
    return server, "127.0.0.1:%d" % port


def wait_for(condition, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def blocker(inference):
    """The one running sequence: a short prompt decoding far longer than the test runs, its
    tokens read and dropped."""
    call = inference.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        sampling=pb.SamplingOptions(temperature=0.0, max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True,
                                    allowed_token_ids=[5, 6, 7])))
    next(call)  # it runs
    return call


def rss(process):
    return process.memory_info().rss


def assert_queued_cost(server, target, requests, send, leave, wire_size):
    """Behind the one running sequence: WARM_UP requests sent and left, then QUEUED sent; what
    both processes' RSS gained for those, against their size on the wire, at most MAX_RATIO."""
    front = psutil.Process(server.pid)
    core = next(p for p in front.children() if "jetserve.engine.core" in " ".join(p.cmdline()))
    with grpc.insecure_channel(target) as channel:
        inference = pb_grpc.InferenceServiceStub(channel)
        running = blocker(inference)

        def waiting():
            return inference.GetStats(pb.GetStatsRequest(), timeout=30).num_waiting

        warm = [send(r) for r in requests[:WARM_UP]]
        wait_for(lambda: waiting() == WARM_UP, "the warm-up requests queue")
        for call in warm:
            leave(call)
        wait_for(lambda: waiting() == 0, "the warm-up requests leave the queue")
        time.sleep(0.5)
        before = rss(front), rss(core)
        queued = [send(r) for r in requests[WARM_UP:]]
        wait_for(lambda: waiting() == QUEUED, "the requests queue")
        time.sleep(0.5)
        after = rss(front), rss(core)
        for call in queued:
            leave(call)
        running.cancel()
    wire = sum(map(wire_size, requests[WARM_UP:]))
    ratios = [(a - b) / wire for a, b in zip(after, before)]
    print("wire %.1f MB for %d requests; server +%.1f MB (%.2fx), engine core +%.1f MB (%.2fx)" % (
        wire / 1e6, QUEUED, (after[0] - before[0]) / 1e6, ratios[0], (after[1] - before[1]) / 1e6, ratios[1]))
    assert ratios[0] <= MAX_RATIO, "the server holds %.2fx the wire size of its queued requests" % ratios[0]
    assert ratios[1] <= MAX_RATIO, "the engine core holds %.2fx the wire size of its queued requests" % ratios[1]


@pytest.mark.timeout(600)
def test_a_queued_token_id_request_costs_at_most_3x_its_wire_size(wide_model, tmp_path):
    server, target = serve(wide_model, tmp_path, "--max-waiting", str(QUEUED + WARM_UP))
    try:
        with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 8 * 2**20)]) as channel:
            inference = pb_grpc.InferenceServiceStub(channel)
            requests = [pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(i)), sampling=pb.SamplingOptions(
                max_tokens=8)) for i in range(WARM_UP + QUEUED)]
            assert_queued_cost(server, target, requests, inference.Generate, lambda call: call.cancel(),
                               lambda r: r.ByteSize())
    finally:
        server.terminate()
        server.wait(60)


@pytest.mark.timeout(600)
def test_a_queued_openai_token_prompt_costs_at_most_3x_its_wire_size(wide_model, tmp_path):
    """The same through the OpenAI API: /v1/completions with a token-id prompt, its JSON body
    sent and the response left unread while the request waits behind the running one, the
    connection closed to leave. JSON spends ~7 bytes an id, so the bound is against that body."""
    import http.client

    port = free_port()  # the last --openai-port given is the one taken
    server, target = serve(wide_model, tmp_path, "--max-waiting", str(QUEUED + WARM_UP), "--openai-port", str(port))

    def send(body):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        return connection  # its answer waits for the blocker

    try:
        bodies = [json.dumps({"prompt": prompt(i), "max_tokens": 8}).encode() for i in range(WARM_UP + QUEUED)]
        assert_queued_cost(server, target, bodies, send, lambda connection: connection.close(), len)
    finally:
        server.terminate()
        server.wait(60)


@pytest.mark.timeout(600)
def test_an_openai_client_that_leaves_frees_its_place_in_the_queue(wide_model, tmp_path):
    """A non-streamed and a streamed completion wait behind the running sequence; their clients
    hang up before any answer: both leave the engine's queue then, not when their turn would
    have come, and a third request still queues and is answered once the blocker ends."""
    import http.client

    port = free_port()
    server, target = serve(wide_model, tmp_path, "--max-waiting", "4", "--openai-port", str(port))
    try:
        with grpc.insecure_channel(target) as channel:
            inference = pb_grpc.InferenceServiceStub(channel)
            running = blocker(inference)

            def waiting():
                return inference.GetStats(pb.GetStatsRequest(), timeout=30).num_waiting

            def send(stream):
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                connection.request("POST", "/v1/completions", json.dumps(
                    {"prompt": [5, 6, 7], "max_tokens": 4, "stream": stream}), {"Content-Type": "application/json"})
                return connection

            leaving = [send(False), send(True)]
            wait_for(lambda: waiting() == 2, "both requests queue")
            for connection in leaving:
                connection.close()
            wait_for(lambda: waiting() == 0, "the requests of the clients that left leave the queue")
            staying = send(False)
            wait_for(lambda: waiting() == 1, "a third request queues")
            running.cancel()
            answer = staying.getresponse()
            assert answer.status == 200 and len(json.loads(answer.read())["choices"]) == 1
    finally:
        server.terminate()
        server.wait(60)


BUDGET = 64 * 1024  # --max-queued-bytes: two prompts of SMALL tokens and the blocker's fit, a third does not
SMALL = 3000  # tokens: 24,000 bytes in the engine (prompts.queued_bytes: 4 bytes a token, twice)


@pytest.mark.timeout(600)
def test_the_byte_budget_refuses_a_prompt_past_it_and_loses_nothing_for_the_others(wide_model, tmp_path):
    import openai

    openai_port = free_port()
    server, target = serve(wide_model, tmp_path, "--max-queued-bytes", "64K", "--openai-port", str(openai_port))
    try:
        with grpc.insecure_channel(target) as channel:
            inference = pb_grpc.InferenceServiceStub(channel)
            running = blocker(inference)
            ids = [prompt(i)[:SMALL] for i in range(3)]
            queued = [inference.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingOptions(
                temperature=0.0, max_tokens=2))) for p in ids[:2]]
            wait_for(lambda: inference.GetStats(pb.GetStatsRequest(), timeout=30).num_waiting == 2,
                     "two prompts queue within the budget")

            with pytest.raises(grpc.RpcError) as refused:
                next(inference.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids[2])), timeout=30))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_queued_bytes=%d" % BUDGET in refused.value.details() and "retry later" in refused.value.details()
            client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % openai_port, api_key="none", max_retries=0)
            with pytest.raises(openai.RateLimitError, match="max_queued_bytes"):
                client.completions.create(model=str(wide_model), prompt=ids[2], max_tokens=2)
            # One that no wait would let in is told so, not to retry.
            with pytest.raises(grpc.RpcError) as never:
                next(inference.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(9)[:3 * SMALL])), timeout=30))
            assert never.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "more than all of max_queued_bytes" in never.value.details()

            assert next(running).token_ids  # the running stream goes on
            running.cancel()
            for call in queued:  # and the queued ones run, in full
                replies = list(call)
                assert sum(len(r.token_ids) for r in replies) == 2 and replies[-1].finish_reason
            # Their bytes are given back: the refused prompt fits now.
            done = client.completions.create(model=str(wide_model), prompt=ids[2], max_tokens=2)
            assert done.usage.prompt_tokens == SMALL and done.usage.completion_tokens == 2
    finally:
        server.terminate()
        server.wait(60)
