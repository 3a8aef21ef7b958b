"""The OpenAI-compatible HTTP API, through the real `openai` SDK, against the live server that also
answers gRPC: the same engine, so greedy text must match what gRPC streams for the same prompt."""

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.server.conftest import LiveServer, engine_factory, free_port, greedy, wait_for_free_blocks
from jetserve.v1 import inference_pb2 as pb

TOKEN = "open-sesame"


def client(server, api_key="unused", **kwargs):
    return openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % server.server.openai_port, api_key=api_key,
                         max_retries=0, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def sdk(live):
    with client(live) as c:
        yield c


def grpc_text(stubs, text=None, messages=None, max_tokens=8):
    inference, _ = stubs
    if messages is not None:
        request = pb.ChatRequest(messages=[pb.ChatMessage(**m) for m in messages], sampling=greedy(max_tokens))
        return "".join(m.text for m in inference.Chat(request))
    return "".join(m.text for m in inference.Generate(pb.GenerateRequest(text=text, sampling=greedy(max_tokens))))


def test_models_lists_the_served_model(sdk, live):
    models = sdk.models.list().data
    assert [m.id for m in models] == [live.server.model_name]
    assert sdk.models.retrieve(live.server.model_name).id == live.server.model_name


def test_completion_matches_grpc(sdk, live, stubs):
    done = sdk.completions.create(model=live.server.model_name, prompt="The kiosk", max_tokens=8, temperature=0)
    choice = done.choices[0]
    assert choice.text == grpc_text(stubs, "The kiosk") and choice.text
    assert done.object == "text_completion" and done.model == live.server.model_name
    assert done.usage.completion_tokens <= 8 and done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")
    same = sdk.completions.create(model=live.server.model_name, prompt="The kiosk", max_tokens=8, temperature=0,
                                  n=2, best_of=2)  # best_of equal to n asks for what n returns
    assert [c.text for c in same.choices] == [choice.text] * 2


def test_completion_streams_the_same_text(sdk, live):
    args = dict(model=live.server.model_name, prompt="Jetson boards", max_tokens=12, temperature=0)
    whole = sdk.completions.create(**args).choices[0].text
    chunks = list(sdk.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12 or \
        chunks[-1].usage.completion_tokens <= 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_token_id_prompts_and_several_prompts(sdk, live):
    ids = live.engine.tokenizer.encode("The kiosk")
    by_text = sdk.completions.create(model=live.server.model_name, prompt="The kiosk", max_tokens=6, temperature=0)
    by_ids = sdk.completions.create(model=live.server.model_name, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = sdk.completions.create(model=live.server.model_name, prompt=["The kiosk", "A robot"], max_tokens=6,
                                  temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text


def test_chat_matches_grpc_streamed_and_not(sdk, live, stubs):
    messages = [{"role": "system", "content": "You are the kiosk."}, {"role": "user", "content": "Hours?"}]
    done = sdk.chat.completions.create(model=live.server.model_name, messages=messages, max_tokens=8,
                                       temperature=0)
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == grpc_text(stubs, messages=messages)
    chunks = list(sdk.chat.completions.create(model=live.server.model_name, messages=messages,
                                              max_completion_tokens=8, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == done.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_stop_strings_and_max_tokens(sdk, live):
    args = dict(model=live.server.model_name, prompt="The kiosk", temperature=0)
    full = sdk.completions.create(max_tokens=16, **args).choices[0].text
    assert len(full) > 4
    cut = full[2:4]
    stopped = sdk.completions.create(max_tokens=16, stop=[cut], **args).choices[0]
    assert stopped.text == full[:full.index(cut)] and stopped.finish_reason == "stop"
    short = sdk.completions.create(max_tokens=2, **args)
    assert short.usage.completion_tokens == 2 and short.choices[0].finish_reason == "length"


def test_seed_makes_sampling_repeatable(sdk, live):
    args = dict(model=live.server.model_name, prompt="A robot", max_tokens=12, temperature=1.0)
    first = sdk.completions.create(seed=7, **args).choices[0].text
    assert sdk.completions.create(seed=7, **args).choices[0].text == first
    others = {sdk.completions.create(seed=s, **args).choices[0].text for s in (8, 9, 10)}
    assert others - {first}


@pytest.mark.parametrize("fields, status, words", [
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"model": "gpt-4"}, 404, "gpt-4"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": "robot " * 600}, 400, "max_model_len"),
    ({"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"n": 1000}, 400, "n"),
    ({"echo": True}, 400, "echo"),
    ({"best_of": 3}, 400, "best_of=3 is not supported"),
    # integers past what crosses to the engine core (once a 500, and a queue slot lost for good)
    ({"seed": 2**64}, 400, "seed must be an integer in"),
    ({"logit_bias": {str(2**70): 1}}, 400, "logit_bias"),
    ({"extra_body": {"top_k": 2**64}}, 400, "top_k"),
    # past float32 the sampler divided by inf: allowed_token_ids' mask became NaN
    ({"temperature": 1e300, "extra_body": {"allowed_token_ids": [5, 6]}}, 400, "temperature"),
    # wrong types are not coerced: true is no count, "2" no number, [true, false] no token ids
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"max_tokens": "2"}, 400, "max_tokens"),
    ({"prompt": [True, False]}, 400, "prompt"),
    # a union's failure names its every shape, not the first branch pydantic tried ("prompt.str")
    ({"prompt": 5}, 400, "prompt: must be a string, a list of strings, a list of token ids or a list of such lists"),
    # bounded as stop strings: the engine core tokenizes every word in its step loop
    ({"extra_body": {"bad_words": ["x" * 300]}}, 400, "bad_words"),
    ({"extra_body": {"allowed_token_ids": [-1] * 4096}}, 400, "allowed_token_ids"),
])
def test_errors_have_openai_shape_and_status(sdk, live, fields, status, words):
    args = {"model": live.server.model_name, "prompt": "hi", "max_tokens": 4, **fields}
    with pytest.raises(openai.APIStatusError) as err:
        sdk.completions.create(**args)
    assert err.value.status_code == status
    body = err.value.body
    assert set(body) >= {"message", "type", "code"} and words in body["message"], body
    assert "Traceback" not in body["message"] and len(body["message"]) < 1000  # a refused list is not echoed


@pytest.mark.parametrize("messages, words", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": ""}], "messages[0].content is empty"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
     "messages.0.content: must be a string or a list of text parts"),
])
def test_bad_chat_messages_are_a_400(sdk, live, messages, words):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=live.server.model_name, messages=messages, max_tokens=2)
    assert words in err.value.body["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_token_count_below_one_names_the_field_sent(sdk, live, field):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=live.server.model_name, messages=[{"role": "user", "content": "hi"}],
                                    **{field: 0})
    assert err.value.body["param"] == field, err.value.body


TOOLS = [{"type": "function", "function": {"name": "lights", "parameters": {}}}]
FUNCTIONS = [{"name": "lights", "parameters": {}}]


@pytest.mark.parametrize("fields, words, allowed", [
    ({"response_format": {"type": "json_object"}}, "response_format 'json_object' is not supported",
     {"response_format": {"type": "text"}}),
    ({"tools": TOOLS}, "tools are not supported", {"tools": TOOLS, "tool_choice": "none"}),
    ({"tool_choice": "required"}, "tool_choice 'required' asks for a tool call", {"tool_choice": "none"}),
    ({"functions": FUNCTIONS}, "functions are not supported", {"functions": FUNCTIONS, "function_call": "none"}),
    ({"function_call": {"name": "lights"}}, "function_call {'name': 'lights'} asks for a tool call",
     {"function_call": "none"}),
    ({"echo": True}, "echo is not supported", {"echo": False}),
])
def test_chat_refuses_what_it_would_otherwise_ignore(sdk, live, fields, words, allowed):
    """A JSON answer, a tool call or an echo asked for and not made would be ignored silently: a
    400 names the field. Asked for text, or with tool_choice 'none', the same request is answered."""
    args = dict(model=live.server.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)

    def sent(extra):  # echo is vLLM's field, which the SDK passes only in the body's extras
        return {"extra_body": extra} if "echo" in extra else extra
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(**args, **sent(fields))
    assert words in err.value.body["message"] and err.value.body["param"] == words.split()[0]
    assert sdk.chat.completions.create(**args, **sent(allowed)).choices[0].finish_reason in ("stop", "length")


def test_bad_json_body_is_a_400(live):
    request = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % live.server.openai_port,
                                     data=b'{"messages": 7}', headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 400
    assert "messages" in json.loads(err.value.read())["error"]["message"]


def test_draining_answers_503_and_health_follows(sdk, live, stubs):
    _, control = stubs
    health = "http://127.0.0.1:%d/health" % live.server.openai_port
    assert urllib.request.urlopen(health, timeout=10).status == 200
    try:
        control.Drain(pb.DrainRequest())
        with pytest.raises(openai.InternalServerError) as err:
            sdk.completions.create(model=live.server.model_name, prompt="hi", max_tokens=2)
        assert err.value.status_code == 503 and "draining" in err.value.body["message"]
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(health, timeout=10)
        assert err.value.code == 503
    finally:
        control.Resume(pb.ResumeRequest())


def test_a_client_that_leaves_a_stream_aborts_it(sdk, live):
    """The request ends as aborted. Its 400 tokens take the tiny model well under a second, so on
    a busy machine it may finish before the server sees the client gone: then it is sent again
    (at most three times), each try waiting for the request to end one way or the other."""
    ended = {reason: live.server.metrics.request_success.labels(live.server.model_name, reason)
             for reason in ("abort", "length")}
    for _ in range(3):
        before = {reason: counter._value.get() for reason, counter in ended.items()}
        stream = sdk.completions.create(model=live.server.model_name, prompt="The kiosk", max_tokens=400,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 60
        while all(c._value.get() == before[r] for r, c in ended.items()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if ended["abort"]._value.get() == before["abort"] + 1:
            break
    assert ended["abort"]._value.get() == before["abort"] + 1
    assert wait_for_free_blocks(live.engine).kv_blocks_used == 0


@pytest.fixture(scope="module")
def guarded(tiny_model):
    server = LiveServer(engine_factory(tiny_model), api_key=TOKEN, openai_port=free_port())
    server.wait_loaded()
    yield server
    server.stop()


def test_the_bearer_token_guards_everything_but_health(guarded):
    with client(guarded, api_key="wrong") as sdk:
        with pytest.raises(openai.AuthenticationError) as err:
            sdk.models.list()
        assert err.value.status_code == 401 and "bearer token" in err.value.body["message"]
    with client(guarded, api_key=TOKEN) as sdk:
        done = sdk.chat.completions.create(model=guarded.server.model_name, max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
        assert done.usage.completion_tokens <= 3
    health = "http://127.0.0.1:%d/health" % guarded.server.openai_port
    assert json.loads(urllib.request.urlopen(health, timeout=10).read()) == {"status": "SERVING"}


def test_penalties_reach_the_engine_over_http(sdk, live):
    args = dict(model=live.server.model_name, prompt="The kiosk", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    plain = sdk.completions.create(**args).choices[0].text
    penalised = sdk.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **args).choices[0].text
    assert penalised != plain


@pytest.fixture(scope="module")
def small_queue(tiny_model):
    """Room for three requests in all (two running, one waiting)."""
    server = LiveServer(engine_factory(tiny_model, max_num_seqs=2, max_waiting=1), openai_port=free_port())
    server.wait_loaded()
    yield server
    server.stop()


def test_refused_requests_hold_no_place_in_the_queue(small_queue):
    """A seed past 64 bits once failed as the request crossed to the engine core, after it had
    taken its place in the queue, which it then kept: more such requests than the queue holds
    left every later one a 429. Now each is a 400 and the queue is as empty as before."""
    with client(small_queue) as sdk:
        for _ in range(4):
            with pytest.raises(openai.BadRequestError) as err:
                sdk.completions.create(model=small_queue.server.model_name, prompt="hi", max_tokens=2, seed=2**64)
            assert err.value.body["param"] == "seed"
        with pytest.raises(openai.BadRequestError) as err:  # more than the whole queue holds: never a 429
            sdk.completions.create(model=small_queue.server.model_name, prompt="hi", max_tokens=2, n=4)
        assert err.value.body["param"] == "n" and "at most 3" in err.value.body["message"]
        done = sdk.completions.create(model=small_queue.server.model_name, prompt="hi", max_tokens=2)
        assert done.choices[0].finish_reason in ("stop", "length")
