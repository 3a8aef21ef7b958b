"""Every status code the service answers with, each with a message that names the field or cause."""

import asyncio
import logging
import time

import grpc
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server.conftest import LiveServer, engine_factory, greedy
from jetserve.server.errors import status_for
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

TOKEN = "open-sesame"
AUTH = (("authorization", "Bearer " + TOKEN),)
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture(scope="module")
def restricted(tiny_model_without_template):
    """No chat template, one sequence at a time with a one-request queue, and a bearer token."""
    server = LiveServer(engine_factory(tiny_model_without_template, max_num_seqs=1, max_waiting=1), api_key=TOKEN)
    server.wait_loaded()
    yield server
    server.stop()


def failure(call):
    """The status code and message of a call that must fail (streams are read to the end)."""
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if not isinstance(result, Message):  # a stream: the status comes at its end
            list(result)
    details = err.value.details()
    assert "Traceback" not in details
    return err.value.code(), details


def sampling(**fields):
    fields.setdefault("max_tokens", 4)
    return pb.SamplingOptions(**fields)


@pytest.mark.parametrize("request_, code, words", [
    (pb.GenerateRequest(text="hi", sampling=sampling(temperature=-1)), INVALID, "temperature"),
    (pb.GenerateRequest(text="hi", sampling=sampling(temperature=float("nan"))), INVALID,
     "temperature must be a number in [0, 100]"),
    (pb.GenerateRequest(text="hi", sampling=sampling(top_p=0)), INVALID, "top_p"),
    (pb.GenerateRequest(text="hi", sampling=sampling(top_k=-5)), INVALID, "top_k"),
    (pb.GenerateRequest(text="hi", sampling=sampling(min_p=2)), INVALID, "min_p"),
    (pb.GenerateRequest(text="hi", sampling=sampling(max_tokens=0)), INVALID, "max_tokens"),
    (pb.GenerateRequest(text="hi", sampling=sampling(stop=[""])), INVALID, "stop"),
    (pb.GenerateRequest(), INVALID, "prompt is not set"),
    (pb.GenerateRequest(text=""), INVALID, "prompt is empty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), INVALID, "prompt is empty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 400])), INVALID, "prompt_token_ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1])), INVALID, "prompt_token_ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 512)), PRECONDITION, "max_model_len"),
    (pb.GenerateRequest(text="robot " * 600), PRECONDITION, "max_model_len"),
])
def test_bad_generate_requests(stubs, request_, code, words):
    inference, _ = stubs
    got_code, details = failure(lambda: inference.Generate(request_))
    assert got_code == code and words in details


@pytest.mark.parametrize("messages, words", [
    ([], "messages"),
    ([pb.ChatMessage(role="", content="hi")], "messages[0].role"),
    ([pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(role="wizard", content="hi")], "messages[1].role"),
    ([pb.ChatMessage(role="user", content="")], "messages[0].content is empty"),
])
def test_bad_chat_messages(stubs, messages, words):
    inference, _ = stubs
    code, details = failure(lambda: inference.Chat(pb.ChatRequest(messages=messages)))
    assert code == INVALID and words in details


def test_a_request_id_already_streaming(stubs):
    inference, _ = stubs
    first = inference.Generate(pb.GenerateRequest(request_id="twice", text="hi", sampling=greedy(400, ignore_eos=True)))
    next(first)
    code, details = failure(lambda: inference.Generate(pb.GenerateRequest(request_id="twice", text="hi")))
    assert code == INVALID and "request_id 'twice'" in details
    first.cancel()


@pytest.mark.parametrize("request_, words", [
    (pb.SetLimitsRequest(max_num_seqs=0), "max_num_seqs"),
    (pb.SetLimitsRequest(num_speculative_tokens=2), "speculative_config"),
])
def test_bad_limits(stubs, request_, words):
    _, control = stubs
    with pytest.raises(grpc.RpcError) as err:
        control.SetLimits(request_)
    assert err.value.code() == INVALID and words in err.value.details()


def test_limits_change_while_serving(stubs, live):
    _, control = stubs
    try:
        assert control.SetLimits(pb.SetLimitsRequest(max_num_seqs=3)).max_num_seqs == 3
        deadline = time.monotonic() + 2  # the stats snapshot is refreshed on the engine's next turn
        while live.engine.stats().max_num_seqs != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.engine.stats().max_num_seqs == 3
    finally:
        control.SetLimits(pb.SetLimitsRequest(max_num_seqs=16))


def test_draining_refuses_new_streams_until_resumed(stubs):
    inference, control = stubs
    try:
        assert control.Drain(pb.DrainRequest()).draining
        code, details = failure(lambda: inference.Generate(pb.GenerateRequest(text="hi")))
        assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details
        assert inference.GetStats(pb.GetStatsRequest()).draining
    finally:
        assert not control.Resume(pb.ResumeRequest()).draining
    assert list(inference.Generate(pb.GenerateRequest(text="hi", sampling=greedy(2))))[-1].finish_reason


def test_chat_on_a_model_without_template(restricted):
    with restricted.channel() as channel:
        inference = pb_grpc.InferenceServiceStub(channel)
        assert not inference.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH).has_chat_template
        code, details = failure(lambda: inference.Chat(
            pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")]), metadata=AUTH))
    assert code == PRECONDITION and "chat template" in details


def test_a_full_queue_answers_resource_exhausted(restricted):
    async def run():
        async with grpc.aio.insecure_channel(restricted.target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)

            async def one(i):
                request = pb.GenerateRequest(text="robot %d" % i, sampling=greedy(150, ignore_eos=True))
                try:
                    return [m async for m in stub.Generate(request, metadata=AUTH)][-1]
                except grpc.aio.AioRpcError as exc:
                    return exc

            return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, grpc.RpcError)]
    done = [r for r in results if not isinstance(r, grpc.RpcError)]
    assert refused and done
    assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all("queue is full" in r.details() for r in refused)
    assert all(r.finish_reason == pb.FINISH_REASON_LENGTH and r.usage.completion_tokens == 150 for r in done)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)])
def test_a_missing_or_wrong_token_is_unauthenticated(restricted, metadata):
    with restricted.channel() as channel:
        inference, control = pb_grpc.InferenceServiceStub(channel), pb_grpc.ControlServiceStub(channel)
        for call in (lambda: inference.Generate(pb.GenerateRequest(text="hi"), metadata=metadata),
                     lambda: inference.GetStats(pb.GetStatsRequest(), metadata=metadata)):
            code, details = failure(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in details
        code, details = failure(lambda: control.Drain(pb.DrainRequest(), metadata=metadata))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "do not open it" in details  # not even TOKEN
        assert not inference.GetStats(pb.GetStatsRequest(), metadata=AUTH).draining


def test_health_needs_no_token(restricted):
    with restricted.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def test_unexpected_errors_are_internal_with_a_short_message_and_a_logged_traceback(caplog):
    try:
        {}["missing"]
    except KeyError as exc:
        with caplog.at_level(logging.ERROR, logger="jetserve.server.errors"):
            code, message = status_for(exc)
    assert code == grpc.StatusCode.INTERNAL
    assert message == "internal error: KeyError (details in the server log)"
    assert "Traceback" in caplog.text and "missing" in caplog.text
