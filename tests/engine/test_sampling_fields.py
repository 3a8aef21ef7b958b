"""vLLM's SamplingParams fields, each acting: greedy tokens equal transformers' `generate` with the
matching logits processor (where transformers has one), else a plain written-out reference."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.sampler import History, process_logits

PROMPT = [5, 17, 42, 9, 100, 7]
STEPS = 12


@pytest.fixture(scope="module")
def llm(tiny):
    path, _ = tiny
    return LLM(str(path), max_num_seqs=4, block_size=4)


def ours(llm, params, prompt=PROMPT):
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return out.outputs


def theirs(model, steps=STEPS, prompt=PROMPT, **kwargs):
    kwargs.setdefault("min_new_tokens", steps)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
                         eos_token_id=kwargs.pop("eos_token_id", None), **kwargs)
    return out[0, len(prompt):].tolist()


def greedy(**fields):
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **fields)


def test_the_reference_itself_differs_from_plain_greedy(llm, tiny):
    """Each comparison below must be able to fail: the processors change these tokens."""
    _, model = tiny
    plain = theirs(model)
    assert ours(llm, greedy())[0].token_ids == plain
    assert theirs(model, repetition_penalty=3.0) != plain
    assert theirs(model, sequence_bias={(plain[3],): -30.0}) != plain


def test_repetition_penalty_matches_transformers(llm, tiny):
    _, model = tiny
    for penalty in (3.0, 1.8, 0.5):
        assert ours(llm, greedy(repetition_penalty=penalty))[0].token_ids == theirs(model, repetition_penalty=penalty)


def test_logit_bias_matches_transformers_sequence_bias(llm, tiny):
    _, model = tiny
    plain = theirs(model)
    bias = {plain[2]: -20.0, 64: 3.5}
    expected = theirs(model, sequence_bias={(t,): b for t, b in bias.items()})
    assert ours(llm, greedy(logit_bias=bias))[0].token_ids == expected


def test_bad_words_match_transformers(llm, tiny):
    _, model = tiny
    varied = theirs(model, repetition_penalty=3.0)  # this tiny model repeats itself otherwise
    tokenizer = llm.get_tokenizer()

    def word_at(i, n):  # n tokens of that run whose text encodes back to the same tokens
        return next(varied[j:j + n] for j in range(i, STEPS) if tokenizer.encode(tokenizer.decode(varied[j:j + n]))
                    == varied[j:j + n])

    words = [word_at(1, 2), word_at(5, 1)]  # a two-token word and a one-token word the run emits
    params = greedy(repetition_penalty=3.0, bad_words=[tokenizer.decode(w) for w in words])
    got = ours(llm, params)[0].token_ids
    assert all(w in params.bad_words_token_ids for w in words)  # resolved by the engine's tokenizer
    expected = theirs(model, repetition_penalty=3.0, bad_words_ids=params.bad_words_token_ids)
    assert got == expected and got != varied
    for word in params.bad_words_token_ids:
        assert not any(got[i:i + len(word)] == word for i in range(len(got)))


def test_min_tokens_matches_transformers(llm, tiny):
    _, model = tiny
    eos = sorted(llm.get_tokenizer().eos_token_ids)[0]
    push_eos = {eos: 30.0}
    params = SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=5, logit_bias=push_eos)
    out = ours(llm, params)[0]
    expected = theirs(model, min_new_tokens=5, eos_token_id=eos, sequence_bias={(eos,): 30.0})
    assert out.token_ids == expected[:len(out.token_ids)]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    without = ours(llm, SamplingParams(temperature=0, max_tokens=STEPS, logit_bias=push_eos))[0]
    assert without.token_ids == [eos]


def test_allowed_token_ids_match_transformers(llm, tiny):
    _, model = tiny
    allowed = [3, 8, 64, 65, 200]
    got = ours(llm, greedy(allowed_token_ids=allowed))[0].token_ids
    assert set(got) <= set(allowed)
    assert got == theirs(model, prefix_allowed_tokens_fn=lambda batch, ids: allowed)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented formula, written out: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""

    def __init__(self, prompt_len, presence, frequency):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids.tolist()):
            for token in set(ids[self.prompt_len:]):
                count = ids[self.prompt_len:].count(token)
                scores[row, token] -= count * self.frequency + self.presence
        return scores


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.2), (-0.5, 0.8)])
def test_presence_and_frequency_penalties_follow_openais_formula(llm, tiny, presence, frequency):
    _, model = tiny
    reference = LogitsProcessorList([OpenAIPenalties(len(PROMPT), presence, frequency)])
    expected = theirs(model, logits_processor=reference)
    got = ours(llm, greedy(presence_penalty=presence, frequency_penalty=frequency))[0].token_ids
    assert got == expected and expected != theirs(model)


def test_processors_on_a_batch_touch_only_their_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0), SamplingParams(logit_bias={4: 5.0})]
    out = process_logits(logits, params, [History([1, 2], [3]), History([1, 2], [3]), History([], [])])
    torch.testing.assert_close(out[0], logits[0])
    assert not torch.equal(out[1], logits[1]) and out[2, 4] == logits[2, 4] + 5


def test_stop_token_ids_end_the_output(llm, tiny):
    plain = ours(llm, greedy())[0].token_ids
    out = ours(llm, SamplingParams(temperature=0, max_tokens=STEPS, stop_token_ids=[plain[3]]))[0]
    assert out.token_ids == plain[:plain.index(plain[3]) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", plain[3])


def test_include_stop_str_in_output(llm):
    full = ours(llm, greedy(), prompt=PROMPT)[0].text
    stop = full[3:5]
    cut = ours(llm, greedy(stop=[stop]))[0]
    kept = ours(llm, greedy(stop=[stop], include_stop_str_in_output=True))[0]
    assert cut.text == full[:full.index(stop)]
    assert kept.text == full[:full.index(stop)] + stop and kept.finish_reason == "stop"


def test_n_gives_n_completions_each_seeded_apart(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    outs = ours(llm, params)
    assert [o.index for o in outs] == [0, 1, 2] and all(len(o.token_ids) == 8 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert [o.token_ids for o in ours(llm, params)] == [o.token_ids for o in outs]  # seeds repeat
    second = ours(llm, SamplingParams(temperature=1.0, seed=12, max_tokens=8, ignore_eos=True))[0]
    assert second.token_ids == outs[1].token_ids  # completion i draws with seed + i, as vLLM


@pytest.mark.parametrize("fields, name", [
    ({"n": 0}, "n"), ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"logit_bias": {1: 500}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
])
def test_bad_values_name_the_field(fields, name):
    with pytest.raises(ValueError, match="SamplingParams." + name):
        SamplingParams(**fields)


def test_token_ids_beyond_the_vocabulary_are_refused(llm):
    for fields in ({"stop_token_ids": [10_000]}, {"allowed_token_ids": [10_000]}, {"logit_bias": {10_000: 1.0}}):
        with pytest.raises(ValueError, match="not a token id of this model"):
            ours(llm, SamplingParams(**fields))


@pytest.mark.parametrize("num", [0, 3])
def test_logprobs_are_the_models_log_softmax(llm, tiny, num):
    _, model = tiny
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=num,
                            repetition_penalty=2.0)  # raw logprobs: before penalties, as vLLM's default
    out = ours(llm, params)[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1:-1]
    expected = logits.log_softmax(-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ranked = expected[step].argsort(descending=True).tolist()
        assert set(entry) == set(ranked[:num]) | {token}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(expected[step, t].item(), abs=1e-4)
            assert lp.rank == ranked.index(t) + 1 and lp.decoded_token == llm.get_tokenizer().decode([t])


def test_llm_chat_renders_the_template_then_generates(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tokenizer = llm.get_tokenizer()
    _, ids = tokenizer.encode_chat(messages)
    chat = llm.chat(messages, greedy(), use_tqdm=False)[0]
    assert chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == ours(llm, greedy(), prompt=ids)[0].token_ids
    two = llm.chat([messages, messages[1:]], greedy(), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == chat.outputs[0].token_ids
    with pytest.raises(ValueError, match="messages\\[0\\].role"):
        llm.chat([{"role": "wizard", "content": "hi"}], greedy(), use_tqdm=False)


def _check_prompt_logprobs(got, prompt, model, num):
    """vLLM's prompt_logprobs: None for the first token, then each token's logprob under the
    model given the tokens before it, its rank, and the top `num` there."""
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert len(got) == len(prompt) and got[0] is None
    for position in range(1, len(prompt)):
        entry, row, token = got[position], expected[position - 1], prompt[position]
        ranked = row.argsort(descending=True).tolist()
        assert set(entry) == set(ranked[:num]) | {token}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)
            assert lp.rank == ranked.index(t) + 1


@pytest.mark.parametrize("chunk", [None, 4])
def test_prompt_logprobs_are_the_models_log_softmax(tiny, chunk):
    """Chunked prefill (4-token chunks of an 11-token prompt) gives each chunk's rows; a second
    request for the same prompt computes it again instead of reading the prefix cache."""
    path, model = tiny
    llm = LLM(str(path), max_num_seqs=2, block_size=4, enable_prefix_caching=True,
              **({"max_num_batched_tokens": chunk, "enable_chunked_prefill": True} if chunk else {}))
    prompt = PROMPT + [3, 88, 21, 64, 12]
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
        _check_prompt_logprobs(out.prompt_logprobs, prompt, model, 2)
    assert llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].prompt_logprobs is None


def test_async_scheduling_serves_n_and_logprobs_as_without_it(tiny):
    """n > 1 (sequences of their own) runs asynchronously, seeded as without it; logprobs need each
    step's logits on the host, so their steps run one at a time (test_async_scheduling.py)."""
    path, _ = tiny
    llm = LLM(str(path), max_num_seqs=4, block_size=4, async_scheduling=True)
    plain = LLM(str(path), max_num_seqs=4, block_size=4)
    for params in (SamplingParams(n=2, seed=4, temperature=1.0, max_tokens=5, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)):
        assert [(o.token_ids, o.logprobs) for o in ours(llm, params)] == \
            [(o.token_ids, o.logprobs) for o in ours(plain, params)]
