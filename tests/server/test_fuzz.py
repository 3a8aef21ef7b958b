"""Hypothesis throws ≥ 1000 random, mostly invalid requests at a live server: each one gets a proper
answer (a finished stream or a status with a message), and afterwards the server is healthy with
no KV block leaked."""

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import LiveServer, engine_factory, wait_for_free_blocks
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

EXAMPLES = 1000
# What a bad request may be answered with; INTERNAL or UNKNOWN would be a server bug.
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.RESOURCE_EXHAUSTED}

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # protobuf strings are UTF-8
floats = st.floats(0, 1, width=32) | st.floats(width=32)  # half in range, half anything (nan, inf, < 0)


@st.composite
def sampling(draw):
    stop = st.text(min_size=1, max_size=3, alphabet="ab \n") | st.just("")
    options = pb.SamplingOptions(stop=draw(st.lists(stop, max_size=2)),
                                 ignore_eos=draw(st.booleans()))
    for name, values in (("temperature", floats), ("top_p", floats), ("min_p", floats),
                         ("top_k", st.integers(-3, 500)), ("max_tokens", st.integers(-2, 6)),
                         ("seed", st.integers(-2 ** 63, 2 ** 63 - 1)), ("n", st.just(1)),
                         ("repetition_penalty", st.floats(0.5, 2, width=32)), ("min_tokens", st.integers(0, 2))):
        value = draw(st.none() | values)
        if value is not None:
            setattr(options, name, value)
    options.logit_bias.update(draw(st.dictionaries(st.integers(0, 399), st.floats(-5, 5, width=32), max_size=2)))
    if not options.HasField("max_tokens"):
        options.max_tokens = draw(st.integers(1, 6))  # keep the run bounded: the default would be 16
    return options


token_ids = (st.lists(st.integers(0, 399), max_size=24)  # the tiny model's vocabulary is 400
             | st.lists(st.integers(-5, 420), max_size=24) | st.lists(st.just(3), min_size=505, max_size=520))
generate = st.builds(
    lambda request_id, prompt, options: pb.GenerateRequest(request_id=request_id, sampling=options, **prompt),
    st.just("") | text,
    st.just({}) | text.map(lambda t: {"text": t}) | token_ids.map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
    sampling())
chat = st.builds(
    lambda messages, options: pb.ChatRequest(messages=messages, sampling=options),
    st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["user", "system", "assistant"]) | st.sampled_from(["user", "assistant"])
                       | st.sampled_from(["tool", "developer", "", "wizard"]) | text,
                       content=text.filter(bool) | text.filter(bool) | st.just("")), max_size=3),
    sampling())


@pytest.fixture(scope="module")
def target(tiny_model):
    """A server of its own: whatever the fuzz breaks, the other tests' server is not it."""
    server = LiveServer(engine_factory(tiny_model))
    server.wait_loaded()
    yield server
    server.stop()


def test_random_requests_all_get_a_proper_answer(target):
    channel = target.channel()
    inference = pb_grpc.InferenceServiceStub(channel)
    answers = {"finished": 0, "refused": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(generate, chat))
    def one_request(request):
        method = inference.Generate if isinstance(request, pb.GenerateRequest) else inference.Chat
        try:
            messages = list(method(request, timeout=30))
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details(), request)
            assert exc.details() and "Traceback" not in exc.details()
            answers["refused"] += 1
            return
        assert messages and messages[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert messages[-1].usage.completion_tokens == sum(len(m.token_ids) for m in messages)
        answers["finished"] += 1

    start = time.monotonic()
    one_request()
    elapsed = time.monotonic() - start
    total = answers["finished"] + answers["refused"]
    print("fuzz: %d requests (%d finished, %d refused) in %.1f s, %.0f requests/s"
          % (total, answers["finished"], answers["refused"], elapsed, total / elapsed))
    # Chat roles and content are checked (OpenAI's roles, non-empty), so most random chats are refused.
    assert total >= EXAMPLES and answers["finished"] > 50 and answers["refused"] > 100

    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    stats = wait_for_free_blocks(target.engine)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
