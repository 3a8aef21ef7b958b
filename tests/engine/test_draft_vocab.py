"""The draft vocabulary: its ranking rules (engine/draft_vocab.py), and an engine whose draft heads
follow what it emits while its tokens stay plain greedy's."""

import numpy as np
import pytest
import torch

from jetserve.engine import draft_vocab
from jetserve.engine.draft_vocab import DraftVocabulary
from tests.engine.builders import build_drafting_model
from tests.engine.test_spec_decode import GREEDY, PROMPTS, engine, model, reference, token_ids  # noqa: F401


def emit(vocab: DraftVocabulary, counts: dict[int, int]) -> np.ndarray | None:
    vocab.observe([t for t, n in counts.items() for _ in range(n)])
    return vocab.rank()


def test_the_set_is_the_most_emitted_ids_ties_and_the_unseen_in_id_order(monkeypatch):
    monkeypatch.setattr(draft_vocab, "REFRESH", 10)
    v = DraftVocabulary(50, 4)
    assert v.ids.tolist() == [0, 1, 2, 3] and v.coverage == 1.0  # before anything is emitted: the first ids
    v.observe([40] * 9)
    assert not v.due()
    # 40 and 30 lead; 45, 9 and 7 tie for the last two places: the lower ids win (out-of-range ids are dropped).
    assert emit(v, {40: 3, 45: 2, 30: 5, 9: 2, 7: 2, 99: 1, -1: 1}).tolist() == [7, 9, 30, 40] and v.rankings == 1
    assert v.coverage == 0.0  # the tokens met the first ids, none of which they hold
    assert emit(v, {30: 1, 40: 1}) is None and v.rankings == 1  # the same set: nothing to rewrite
    assert v.coverage == 1.0
    assert emit(v, {}) is None  # nothing emitted: nothing changes
    fresh = DraftVocabulary(50, 4)  # two ids emitted: the places left go to the lowest ids never emitted
    assert emit(fresh, {40: 3, 30: 1}).tolist() == [0, 1, 30, 40]


def test_counts_halve_past_the_horizon_so_a_new_workload_takes_over(monkeypatch):
    monkeypatch.setattr(draft_vocab, "HORIZON", 1000)
    v = DraftVocabulary(100, 2)
    assert emit(v, {10: 600, 11: 300}).tolist() == [10, 11]
    for _ in range(3):  # a new workload: ids 20 and 21 only, 300 tokens each time
        emit(v, {20: 150, 21: 150})
    # Without halving 10 (600) would still lead 20 (450); halved at each pass of 1,000 it does not.
    assert v.ids.tolist() == [20, 21]
    assert v.counts.sum() <= 1000


def test_an_engine_drafts_from_the_ids_it_emits_and_stays_lossless(model, reference, monkeypatch):  # noqa: F811
    """A draft vocabulary of 8 of the 64 ids, ranked every 32 emitted tokens: the tokens are plain
    greedy's; the device's draft rows are the vocab projection's rows of the ranked ids; drafts
    come from them; and ranked drafting accepts more than drafting from the first 8 ids."""
    accepted = {}
    for refresh in (32, 10**9):
        monkeypatch.setattr(draft_vocab, "REFRESH", refresh)
        llm = engine(model, 3, spec={"draft_vocab_size": 8})
        core = llm.engine.core
        drafted, update = [], core.scheduler.update

        def record(batch, sampled, drafts, update=update, drafted=drafted):
            drafted.append({t for d in drafts for t in d})
            return update(batch, sampled, drafts)
        core.scheduler.update = record
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
        m = core.runner.model
        ids = core.draft_vocab.ids
        assert m.draft_ids.tolist() == ids.tolist() and len(ids) == 8
        assert torch.equal(m.draft_head, m.lm_head.weight[m.draft_ids])
        stats = llm.engine.stats()
        assert stats.draft_vocab_size == 8 and 0.0 <= stats.draft_vocab_coverage <= 1.0
        accepted[refresh] = stats.num_accepted_tokens
        if refresh == 32:
            assert core.draft_vocab.rankings >= 1 and ids.tolist() != list(range(8))
            assert set().union(*drafted[-3:]) <= set(ids.tolist())  # the last steps drafted from the ranked set
        else:
            assert ids.tolist() == list(range(8)) and set().union(*drafted) <= set(range(8))
    assert accepted[32] > accepted[10**9], accepted


def test_a_quantized_vocab_projection_drafts_from_its_ranked_rows(tmp_path, monkeypatch):
    """--quantization int8 quantizes the vocab projection too: the draft rows gathered from it and
    ranked anew are its integer rows and scales at the ranked ids (torch's INT8 CPU layout here,
    quant.py's on a GPU), and drafting from them leaves
    the tokens plain (INT8) greedy's. The base's drafting twin here is untied; the demo's tied
    one is test_quant's."""
    monkeypatch.setattr(draft_vocab, "REFRESH", 32)
    path = build_drafting_model(tmp_path, hidden=64)  # every input dim a whole span of INT8 words
    fp32 = dict(quantization="int8", dtype="float32")  # as the other drafting tests: bf16 could round a verify row apart
    plain = token_ids(engine(path, **fp32).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = engine(path, 3, spec={"draft_vocab_size": 8}, **fp32)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    core = llm.engine.core
    m, ids = core.runner.model, core.draft_vocab.ids
    assert core.draft_vocab.rankings >= 1 and ids.tolist() != list(range(8))
    head, rows = m.lm_head.weight, m.draft_head
    assert head.bits == 8 and type(rows) is type(head) and all(torch.equal(r, h[m.draft_ids]) for r, h in zip(rows, head))
    assert llm.engine.stats().num_accepted_tokens > 0


@pytest.mark.parametrize("size, whole", [(None, True), (10**6, True), (63, False)])
def test_the_default_is_the_whole_vocabulary_of_a_small_model(model, size, whole):  # noqa: F811
    """The default (at most DRAFT_VOCAB_SIZE ids) and any size past the vocabulary project onto the
    vocab projection itself: no rows gathered, no ids mapped."""
    spec = {} if size is None else {"draft_vocab_size": size}
    llm = engine(model, 2, spec=spec)
    core = llm.engine.core
    assert (core.runner.model.draft_ids is None) is whole and (core.draft_vocab is None) is whole
    assert llm.engine.stats().draft_vocab_size == min(size or 64, 64)
