"""MTP speculative decoding on tiny CPU models: lossless (greedy and sampled), stats, adaptive
draft length, abort/preemption, and `mtp fit`.

The models are random Qwen3s built with transformers offline, reshaped so drafting has
something to agree with: big embeddings and small attention/MLP outputs make the base mostly
a bigram model (next token ~ f(current token), `context` sets how much the rest of the
context moves it), and "agreeing" MTP heads pass the embedding of token t+1 straight through
(fc = [I | 0], zeroed block outputs), so they predict f(x_{t+1}) = the base's x_{t+2} guess.
"""

import math
from pathlib import Path

import pytest
import torch

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.sampler import sample
from jetserve.engine.config import SpeculativeConfig
from jetserve.engine.spec_decode import DraftLength, verify
from tests.engine.builders import build_drafting_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_drafting_model(tmp_path_factory.mktemp("agree"))


@pytest.fixture(scope="module")
def random_heads(tmp_path_factory):
    return build_drafting_model(tmp_path_factory.mktemp("random"), agree=False)


def engine(model_dir, k=None, **kwargs):
    kwargs = {"max_model_len": 128, "max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 200,
              "max_num_seqs": 8, **kwargs}
    if k is not None:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False,
                                        **kwargs.pop("spec", {})}
    return LLM(model_dir, **kwargs)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 64 for j in range(2 + 6 * i)]} for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model):
    return token_ids(engine(model).generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_is_token_identical_and_stats_add_up(model, reference, k):
    """Batched prompts of 2..32 tokens under a 16-token budget: chunked prefill, decodes with
    1+k verified tokens and prefill chunks share steps; the output is the plain greedy one."""
    llm = engine(model, k)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    s = llm.engine.stats()
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens <= k * s.num_drafts
    assert len(s.accepted_per_position) == k and sum(s.accepted_per_position) == s.num_accepted_tokens
    per_pos = s.accepted_per_position
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position j+1 needs position j accepted
    assert per_pos[0] <= s.num_drafts
    assert s.acceptance_rate == s.num_accepted_tokens / s.num_draft_tokens
    assert s.mean_accepted_length == 1 + s.num_accepted_tokens / s.num_drafts
    assert s.num_speculative_tokens == k and s.kv_blocks_used == 0


def test_greedy_with_two_mtp_layers_and_random_heads(tmp_path, model, reference):
    """Chaining past the MTP layers (step % n) and heads that never agree: still identical."""
    two = build_drafting_model(tmp_path / "two", mtp_layers=2)
    assert token_ids(engine(two, 3).generate(PROMPTS, GREEDY, use_tqdm=False)) == \
        token_ids(engine(two).generate(PROMPTS, GREEDY, use_tqdm=False))
    bad = build_drafting_model(tmp_path / "bad", agree=False)
    assert token_ids(engine(bad, 2).generate(PROMPTS, GREEDY, use_tqdm=False)) == \
        token_ids(engine(bad).generate(PROMPTS, GREEDY, use_tqdm=False))


# -- sampling: the output distribution is the model's ------------------------------------------

def chi2_critical(df: int, alpha_z: float = 3.09) -> float:
    """Chi-square critical value at alpha = 0.001 (z = 3.09), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3


def homogeneity_chi2(a: list[int], b: list[int]) -> tuple[float, int]:
    """Two-sample chi-square statistic over the values two samples take; rare values pooled."""
    values = sorted(set(a) | set(b))
    na, nb = len(a), len(b)
    counts = [(a.count(v), b.count(v)) for v in values]
    common = [c for c in counts if sum(c) * min(na, nb) / (na + nb) >= 5]
    rare = [c for c in counts if c not in common]
    if rare:
        common.append((sum(c[0] for c in rare), sum(c[1] for c in rare)))
    stat = 0.0
    for ca, cb in common:
        total = ca + cb
        for count, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    return stat, len(common) - 1


def resample_from_p(logits, drafts, params, generators):
    """A classic bug: on rejection draw from p itself instead of p with the draft removed."""
    out = verify(logits, drafts, params, generators)
    rows = [p for p, d in zip(params, drafts) for _ in range(len(d) + 1)]
    fresh = sample(logits, rows, [None] * len(rows)).tolist()
    start = 0
    for draft, tokens in zip(drafts, out):
        if len(tokens) - 1 < len(draft):
            tokens[-1] = fresh[start + len(tokens) - 1]
        start += len(draft) + 1
    return out


def test_verify_matches_target_distribution_and_catches_a_wrong_rule():
    """Many independent rows through the acceptance rule: the first emitted token must follow
    p (chi-square goodness of fit at alpha = 0.001); the resample-from-p bug must fail it."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    p = logits.softmax(-1)
    n = 20000
    params = [SamplingParams(temperature=1.0)] * n
    drafts = [[1, 3]] * n  # a plausible but not the likeliest token, then another draft
    rows = logits.repeat(3 * n, 1)

    def first_token_chi2(rule):
        counts = torch.bincount(torch.tensor([t[0] for t in rule(rows, drafts, params, [None] * n)]),
                                minlength=len(p)).float()
        return float(((counts - n * p) ** 2 / (n * p)).sum())

    critical = chi2_critical(len(p) - 1)
    assert first_token_chi2(verify) < critical
    assert first_token_chi2(resample_from_p) > critical
    # Greedy rows accept exactly while the draft is the argmax.
    greedy = verify(rows[:3], [[0, 1]], [SamplingParams(temperature=0)], [None])
    assert greedy == [[0, 0]]


def test_sampled_outputs_have_the_models_distribution(tmp_path):
    """Engine level, at temperature 1 on an 8-token vocabulary: tokens 2 and 3 (the drafted
    positions) with MTP k=2 against without, two-sample chi-square at alpha = 0.001 each; the
    same test fails when the engine's acceptance rule is the resample-from-p bug."""
    model_dir = build_drafting_model(tmp_path / "v8", vocab=8, context=2.0, sharpness=2.0)
    n = 2000
    prompts = [{"prompt_token_ids": [1, 5, 2]}] * n
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(n)]

    def positions(llm):
        outs = token_ids(llm.generate(prompts, params, use_tqdm=False))
        return [[o[i] for o in outs] for i in (1, 2)]

    kw = {"max_num_seqs": 256, "max_num_batched_tokens": 1024, "num_kv_blocks": 2048}
    plain = positions(engine(model_dir, **kw))
    spec_llm = engine(model_dir, 2, **kw)
    drafted = positions(spec_llm)
    assert spec_llm.engine.stats().num_accepted_tokens > n // 4  # the drafts do get accepted
    for a, b in zip(plain, drafted):
        stat, df = homogeneity_chi2(a, b)
        assert stat < chi2_critical(df), (stat, df)
    wrong = engine(model_dir, 2, **kw)
    wrong.engine.runner.proposer.verify = resample_from_p
    stats = [homogeneity_chi2(a, b) for a, b in zip(plain, positions(wrong))]
    assert any(stat > chi2_critical(df) for stat, df in stats), stats


# -- adaptive draft length ----------------------------------------------------------------------

ADAPTIVE = {"adaptive": True, "acceptance_window": 32, "min_samples": 8, "probe_interval": 4}


def test_adaptive_k_goes_down_on_random_heads_and_stays_up_on_agreeing_ones(model, random_heads):
    prompts = PROMPTS[:4]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    bad = engine(random_heads, 3, spec=ADAPTIVE)
    bad.generate(prompts, params, use_tqdm=False)
    assert bad.engine.stats().num_speculative_tokens == 0
    good = engine(model, 3, spec=ADAPTIVE)
    good.generate(prompts, params, use_tqdm=False)
    assert good.engine.stats().num_speculative_tokens == 3


def test_draft_length_recovers_through_probes():
    """At k = 0 every probe_interval-th step drafts one token; once those are accepted again,
    k climbs back, one position at a time."""
    lengths = DraftLength(SpeculativeConfig(num_speculative_tokens=2, **ADAPTIVE))
    for _ in range(40):  # nothing accepted: k falls to 0
        drafted = lengths.next()
        if drafted:
            lengths.record(drafted, 0)
        lengths.update()
    assert lengths.k == 0
    drafts = []
    for _ in range(400):  # the heads recover: everything drafted is accepted
        drafted = lengths.next()
        drafts.append(drafted)
        if drafted:
            lengths.record(drafted, drafted)
        lengths.update()
    assert lengths.k == 2
    assert drafts[:4] == [0, 0, 0, 1]  # while off, only probes draft


# -- abort, preemption, config -----------------------------------------------------------------

def test_abort_during_speculation_leaves_no_blocks(model):
    llm = engine(model, 3)
    for i, prompt in enumerate(PROMPTS):
        llm.engine.add_request(str(i), prompt, SamplingParams(temperature=0.8, max_tokens=50, seed=i))
    for _ in range(8):
        llm.engine.step()
    seqs = [r.seq for r in llm.engine.requests.values()]
    assert any(s.spec_token_ids for s in seqs)
    for i in range(len(PROMPTS)):
        llm.engine.abort(str(i))
    assert llm.engine.scheduler.blocks.num_used == 0 and not any(s.spec_token_ids for s in seqs)


def test_preemption_during_speculation_is_lossless(model, reference):
    """A KV pool too small for all six: sequences are preempted mid-speculation, their drafts
    dropped and recomputed later; the output is still the plain greedy one."""
    llm = engine(model, 3, num_kv_blocks=34, max_num_batched_tokens=64)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.stats().num_preemptions > 0 and llm.engine.scheduler.blocks.num_used == 0


def test_speculative_config_is_validated(model, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(model, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key"):
        LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": 1, "k": 2})
    plain = build_drafting_model(tmp_path / "plain", mtp_layers=0)
    with pytest.raises(ValueError, match="jetserve mtp merge.*jetserve mtp fit"):
        LLM(plain, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_live_draft_length_control(model):
    llm = engine(model, 3)
    llm.engine.set_num_speculative_tokens(1)
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    s = llm.engine.stats()
    assert s.num_speculative_tokens == 1 and s.num_draft_tokens == s.num_drafts
    with pytest.raises(ValueError, match="without speculative_config"):
        engine(model).engine.set_num_speculative_tokens(2)


# -- mtp fit ------------------------------------------------------------------------------------

def greedy_acceptance(model_dir) -> float:
    llm = engine(model_dir, 1, max_model_len=96)
    prompts = [{"prompt_token_ids": list(range(5 + 7 * i, 25 + 7 * i))} for i in range(12)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    return llm.engine.stats().acceptance_rate


def test_mtp_fit_raises_acceptance_above_random_heads(tmp_path):
    """`jetserve mtp fit` on a tiny CPU model (tokenizer trained here on a fixed synthetic corpus):
    heads trained by distillation agree with the base far more often than untrained ones."""
    import random

    from jetserve.cli import main
    from jetserve.engine.offline import demo

    rng = random.Random(0)
    words = ["def", "return", "self", "value", "for", "in", "if", "else", "import", "class", "None", "True",
             "list", "dict", "key", "item", "range", "len", "print", "name", "data", "path", "error", "result"]
    sources = []
    for i in range(4):
        lines = (" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(600))
        sources.append(tmp_path / f"corpus{i}.txt")
        sources[-1].write_text("\n".join(lines))
    base = tmp_path / "base"
    base.mkdir()
    tok = demo.train_tokenizer([f.read_text() for f in sources], 320, base)
    build_drafting_model(base, vocab=tok.get_vocab_size(), context=3.0, mtp_layers=0)
    common = ["mtp", "fit", "--model", str(base), "--data", *map(str, sources), "--seq-len", "64",
              "--batch-size", "8", "--device", "cpu"]
    assert main(common + ["--steps", "1", "--lr", "1e-9", "--out", str(tmp_path / "untrained")]) == 0
    assert main(common + ["--steps", "400", "--lr", "3e-3", "--out", str(tmp_path / "fitted")]) == 0
    before, after = greedy_acceptance(str(tmp_path / "untrained")), greedy_acceptance(str(tmp_path / "fitted"))
    assert after > before + 0.25 and after > 2 * before, (before, after)  # seen: 0.15 -> 0.59
