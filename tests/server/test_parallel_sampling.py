"""n completions, logprobs and prompt_logprobs through the engine-core process, gRPC and the
OpenAI HTTP API (the real `openai` SDK), checked against the offline `LLM` on the same model and
against transformers' log_softmax; an aborted n=3 request frees every KV block in the core."""

import random
import time

import grpc
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.sampling_params import MAX_LOGPROBS, MAX_N
from tests.server.conftest import greedy, wait_for_free_blocks
from tests.server.test_openai_api import client
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

PROMPT = "The kiosk"


@pytest.fixture(scope="module")
def sdk(live):
    with client(live) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(str(tiny_model), device="cpu", num_kv_blocks=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


def log_softmax(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def offline_outputs(offline, prompt, **fields):
    out = offline.generate(prompt, SamplingParams(**fields), use_tqdm=False)[0]
    return sorted(out.outputs, key=lambda o: o.index)


def fresh_prompt(live, length):
    """Token ids no other test has sent (so the prefix cache holds none of its blocks)."""
    return random.Random(time.time_ns()).sample(range(live.engine.model_info.vocab_size), length)


SEEDED = dict(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)


def test_completions_n2_streamed_and_not_are_the_offline_ones(sdk, live, offline):
    args = dict(model=live.server.model_name, prompt=PROMPT, n=2, max_tokens=6, temperature=1.0, seed=11,
                extra_body={"ignore_eos": True})
    done = sdk.completions.create(**args)
    expected = [o.text for o in offline_outputs(offline, PROMPT, n=2, **SEEDED)]
    assert [c.index for c in done.choices] == [0, 1]
    assert [c.text for c in done.choices] == expected and expected[0] != expected[1]
    assert done.usage.completion_tokens == 12 and [c.finish_reason for c in done.choices] == ["length"] * 2
    chunks = list(sdk.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    texts, finished = ["", ""], [None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert texts == expected and finished == ["length", "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_n2_streamed_and_not_are_the_offline_ones(sdk, live, offline):
    messages = [{"role": "user", "content": "Hours?"}]
    args = dict(model=live.server.model_name, messages=messages, n=2, max_tokens=6, temperature=1.0, seed=11,
                extra_body={"ignore_eos": True})
    done = sdk.chat.completions.create(**args)
    chat = offline.chat(messages, SamplingParams(n=2, **SEEDED), use_tqdm=False)[0]
    expected = [o.text for o in sorted(chat.outputs, key=lambda o: o.index)]
    assert [c.index for c in done.choices] == [0, 1]
    assert [c.message.content for c in done.choices] == expected and expected[0] != expected[1]
    assert done.usage.completion_tokens == 12
    texts, roles = ["", ""], [None, None]
    for chunk in sdk.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            roles[choice.index] = roles[choice.index] or choice.delta.role
            texts[choice.index] += choice.delta.content or ""
    assert texts == expected and roles == ["assistant", "assistant"]


def test_completion_logprobs_are_the_offline_ones_and_the_models(sdk, live, offline, reference):
    done = sdk.completions.create(model=live.server.model_name, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    ref = offline_outputs(offline, PROMPT, temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)[0]
    chosen = [entry[t] for t, entry in zip(ref.token_ids, ref.logprobs)]
    assert lp.tokens == [c.decoded_token for c in chosen] and len(lp.tokens) == 5
    assert lp.token_logprobs == pytest.approx([c.logprob for c in chosen], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for got, entry in zip(lp.top_logprobs, ref.logprobs):
        # vLLM's: the top 3 and the token taken, by text (tokens of one text, such as partial
        # UTF-8 shown as U+FFFD, share a key as in vLLM and OpenAI)
        want = {c.decoded_token: c.logprob for c in entry.values()}
        assert got == pytest.approx(want, abs=1e-4)
    ids = live.engine.tokenizer.encode(PROMPT)
    expected = log_softmax(reference, ids + ref.token_ids)[len(ids) - 1:-1]
    for position, (token, logprob) in enumerate(zip(ref.token_ids, lp.token_logprobs)):
        assert expected[position].argmax().item() == token  # greedy: the top token, its logprob the model's
        assert logprob == pytest.approx(expected[position, token].item(), abs=1e-3)


def test_chat_logprobs_and_top_logprobs_are_the_offline_ones(sdk, live, offline):
    messages = [{"role": "user", "content": "Hi"}]
    done = sdk.chat.completions.create(model=live.server.model_name, messages=messages, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    content = done.choices[0].logprobs.content
    assert len(content) == 4
    for got, token, entry in zip(content, ref.token_ids, ref.logprobs):
        assert got.token == entry[token].decoded_token and got.bytes == list(got.token.encode())
        assert got.logprob == pytest.approx(entry[token].logprob, abs=1e-4)
        ranked = sorted(entry.values(), key=lambda c: c.rank)[:2]
        assert [t.token for t in got.top_logprobs] == [c.decoded_token for c in ranked]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([c.logprob for c in ranked], abs=1e-4)
    streamed = [entry for chunk in sdk.chat.completions.create(
        model=live.server.model_name, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
        stream=True, extra_body={"ignore_eos": True}) for choice in chunk.choices if choice.logprobs
        for entry in choice.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_grpc_n2_deltas_carry_their_index(live, offline):
    sampling = pb.SamplingOptions(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, n=2, logprobs=1)
    with live.channel() as channel:
        messages = list(pb_grpc.InferenceServiceStub(channel).Generate(pb.GenerateRequest(text=PROMPT,
                                                                                            sampling=sampling)))
    expected = offline_outputs(offline, PROMPT, n=2, logprobs=1, **SEEDED)
    for index, want in enumerate(expected):
        mine = [m for m in messages if m.index == index]
        assert [t for m in mine for t in m.token_ids] == want.token_ids
        assert "".join(m.text for m in mine) == want.text
        assert [m.finish_reason for m in mine][-1] == pb.FINISH_REASON_LENGTH
        logprobs = [lp for m in mine for lp in m.logprobs]
        assert [lp.token_id for lp in logprobs] == want.token_ids
        assert [lp.logprob for lp in logprobs] == pytest.approx(
            [entry[t].logprob for t, entry in zip(want.token_ids, want.logprobs)], abs=1e-4)
    assert {m.index for m in messages} == {0, 1}
    assert messages[-1].usage.completion_tokens == 12


def test_prompt_logprobs_over_grpc_and_http_are_the_models(live, sdk, reference):
    ids = live.engine.tokenizer.encode("Jetson boards run robots")
    expected = log_softmax(reference, ids)
    with live.channel() as channel:
        messages = list(pb_grpc.InferenceServiceStub(channel).Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), sampling=greedy(2, prompt_logprobs=2))))
    got = messages[0].prompt_logprobs
    assert [lp.token_id for lp in got] == ids[1:] and not any(m.prompt_logprobs for m in messages[1:])
    for position, lp in enumerate(got, 1):
        row = expected[position - 1]
        assert lp.logprob == pytest.approx(row[ids[position]].item(), abs=1e-3)
        assert lp.rank == (row > row[ids[position]]).sum().item() + 1
        assert [t.token_id for t in lp.top_logprobs] == row.topk(2).indices.tolist()
    done = sdk.completions.create(model=live.server.model_name, prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    http = done.choices[0].model_extra["prompt_logprobs"]
    assert http[0] is None and len(http) == len(ids)
    for position, entry in enumerate(http[1:], 1):
        assert entry[str(ids[position])]["logprob"] == pytest.approx(expected[position - 1, ids[position]].item(),
                                                                      abs=1e-3)


@pytest.mark.parametrize("prompt_blocks", [0, 2])
def test_an_aborted_n3_request_frees_every_block_in_the_core(live, prompt_blocks):
    """Short prompt: the three go together; two blocks: the first alone, the others after it."""
    assert live.engine.core.process.poll() is None  # the engine core is its own process
    ids = fresh_prompt(live, prompt_blocks * live.engine.config.block_size + 3)
    with live.channel() as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingOptions(
            n=3, temperature=1.0, max_tokens=400, ignore_eos=True)))
        seen = set()
        for message in call:  # until every completion has streamed (all three hold blocks)
            seen.add(message.index)
            if seen == {0, 1, 2}:
                break
        assert live.engine.stats().kv_blocks_used > 0
        call.cancel()
    stats = wait_for_free_blocks(live.engine, timeout=30)
    assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)


def test_n_and_logprobs_above_their_bounds_are_refused(live, sdk):
    with live.channel() as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        for fields, name in (({"n": MAX_N + 1}, "n"), ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
                             ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs")):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(**fields))))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "SamplingParams.%s" % name in \
                err.value.details()
    for fields in ({"n": MAX_N + 1}, {"logprobs": MAX_LOGPROBS + 1}):
        with pytest.raises(openai.BadRequestError) as err:
            sdk.completions.create(model=live.server.model_name, prompt="hi", max_tokens=2, **fields)
        assert err.value.status_code == 400 and next(iter(fields)) in err.value.body["message"]


def test_n3_completions_share_the_prompts_kv_and_sample_as_offline(live, offline):
    """The first completion goes alone; the others follow once its prompt's full blocks are in
    the prefix cache, and read them: hits for two completions' worth of the prompt, and the same
    seeded tokens as the offline engine, which runs all three from scratch. Another stream keeps
    the core stepping, so the three would reach it together (and share nothing) if sent at once."""
    block = live.engine.config.block_size
    ids = fresh_prompt(live, 3 * block + 5)
    with live.channel() as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        busy = stub.Generate(pb.GenerateRequest(text="busy", sampling=greedy(400, ignore_eos=True)))
        next(busy)
        before = live.engine.stats().prefix_cache_hits
        messages = list(stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingOptions(n=3, temperature=1.0, seed=7, max_tokens=4,
                                                                        ignore_eos=True))))
        hits = live.engine.stats().prefix_cache_hits - before
        busy.cancel()
    assert hits == 2 * 3 * block
    expected = offline_outputs(offline, {"prompt_token_ids": ids}, n=3, temperature=1.0, seed=7, max_tokens=4,
                               ignore_eos=True)
    for index, want in enumerate(expected):
        assert [t for m in messages if m.index == index for t in m.token_ids] == want.token_ids
    wait_for_free_blocks(live.engine, timeout=30)
