"""Streams against the real engine: same tokens as offline greedy, concurrency, cancel, deadline."""

import asyncio
import time

import grpc
import pytest

from tests.server.conftest import greedy, wait_for_free_blocks
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

PROMPTS = ["The kiosk greets", "A robot arm picks", "Jetson boards run", "Streaming tokens one by one",
           "opening hours", "motors and cameras", "prints tickets", "the first answer is fast"]


@pytest.fixture(scope="module")
def offline(tiny_model):
    """The offline LLM.generate reference, greedy, on its own engine."""
    from jetserve.engine import LLM, SamplingParams

    llm = LLM(model=str(tiny_model), device="cpu", num_kv_blocks=256)

    def generate(prompts, max_tokens):
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return [(out.outputs[0].token_ids, out.outputs[0].text) for out in outputs]

    return generate


def collect(replies):
    """(token ids, text, messages) of one stream."""
    messages = list(replies)
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages), messages


def test_streamed_generate_equals_offline_greedy(stubs, offline):
    inference, _ = stubs
    expected = offline(PROMPTS[:3], 24)
    for prompt, (want_tokens, want_text) in zip(PROMPTS[:3], expected):
        request = pb.GenerateRequest(request_id="eq-" + prompt, text=prompt, sampling=greedy(24, ignore_eos=True))
        tokens, text, messages = collect(inference.Generate(request))
        assert tokens == want_tokens and text == want_text
        # One message per step's delta (no drafting here); fewer when the stream writes slower than
        # the engine steps, and deltas waiting for it merge.
        assert 1 <= len(messages) <= 24
        assert {m.request_id for m in messages} == {"eq-" + prompt}
        last = messages[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 24 and last.usage.prompt_tokens > 0
        assert 0 < last.timing.time_to_first_token_s <= last.timing.total_s
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])


def test_token_id_prompts_stream_the_same_tokens(stubs, live, offline):
    inference, _ = stubs
    ids = live.engine.tokenizer.encode(PROMPTS[0])
    tokens, text, _ = collect(inference.Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=greedy(24, ignore_eos=True))))
    assert (tokens, text) == offline(PROMPTS[:1], 24)[0]


def test_chat_renders_the_template_then_generates(stubs, live):
    inference, _ = stubs
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Opening hours?"}]
    chat_tokens, _, _ = collect(inference.Chat(pb.ChatRequest(
        messages=[pb.ChatMessage(**m) for m in messages], sampling=greedy(12, ignore_eos=True))))
    rendered = live.engine.tokenizer.apply_chat_template(messages)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    generate_tokens, _, _ = collect(inference.Generate(
        pb.GenerateRequest(text=rendered, sampling=greedy(12, ignore_eos=True))))
    assert chat_tokens == generate_tokens and len(chat_tokens) == 12


def test_32_concurrent_streams_all_complete_correctly(live, offline):
    prompts = [PROMPTS[i % len(PROMPTS)] + " #%d" % i for i in range(32)]
    expected = offline(prompts, 16)

    async def run():
        async with grpc.aio.insecure_channel(live.target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)

            async def one(i):
                request = pb.GenerateRequest(request_id="c%d" % i, text=prompts[i],
                                             sampling=greedy(16, ignore_eos=True))
                return [m async for m in stub.Generate(request)]

            return await asyncio.gather(*(one(i) for i in range(32)))

    start = time.monotonic()
    results = asyncio.run(run())
    print("32 concurrent streams x 16 tokens: %.2f s" % (time.monotonic() - start))
    for i, messages in enumerate(results):
        assert [t for m in messages for t in m.token_ids] == expected[i][0], "stream %d" % i
        assert {m.request_id for m in messages} == {"c%d" % i}
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert wait_for_free_blocks(live.engine).kv_blocks_used == 0


def test_client_cancel_mid_stream_frees_the_blocks(stubs, live):
    inference, _ = stubs
    call = inference.Generate(pb.GenerateRequest(text=PROMPTS[1], sampling=greedy(480, ignore_eos=True)))
    for _ in range(3):
        next(call)
    assert live.engine.stats().kv_blocks_used > 0
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    # Freed well before the 480 tokens could have run out (that takes over a second here).
    stats = wait_for_free_blocks(live.engine, timeout=0.5)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


def test_deadline_mid_stream_frees_the_blocks(stubs, live):
    """The deadline is set from this machine's own pace (a whole stream timed first); a busy
    neighbour can change that pace between two calls, so the fraction adapts, a bounded number of
    times, until the deadline falls mid-stream."""
    inference, _ = stubs
    request = pb.GenerateRequest(text=PROMPTS[2], sampling=greedy(480, ignore_eos=True))
    start = time.monotonic()
    list(inference.Generate(request))
    whole = time.monotonic() - start
    fraction = 0.5
    for _ in range(8):
        received = []
        try:
            for message in inference.Generate(request, timeout=whole * fraction):
                received.append(message)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if 0 < len(received) < 480:
                break
            fraction *= 1.5 if not received else 0.5  # expired before the first token: later
        else:
            fraction *= 0.5  # the stream ran faster than the first: sooner
        wait_for_free_blocks(live.engine)
    assert 0 < len(received) < 480, "the deadline never fell mid-stream"
    stats = wait_for_free_blocks(live.engine)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


def test_new_sampling_fields_over_grpc(stubs):
    inference, _ = stubs
    plain = list(inference.Generate(pb.GenerateRequest(text="robot", sampling=greedy(6, ignore_eos=True))))
    first = plain[0].token_ids[0]
    sampling = greedy(6, ignore_eos=True, repetition_penalty=1.5, logit_bias={first: -100.0}, min_tokens=2)
    messages = list(inference.Generate(pb.GenerateRequest(text="robot", sampling=sampling)))
    tokens = [t for m in messages for t in m.token_ids]
    assert len(tokens) == 6 and first not in tokens
