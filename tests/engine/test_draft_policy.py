"""The draft policy (engine/draft_policy.py) on synthetic step-cost tables, and in the engine on
the CPU: its table measured at start-up, drafting off by its rule, greedy output unchanged."""

import logging
import math
import random

import pytest

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.config import cpu_capture_sizes
from jetserve.engine.draft_policy import MAX_PROBE_EVERY, MIN_PROBE_EVERY, PRIOR, PROBE_SHARE, DraftPolicy
from jetserve.engine.step_cost import DecodeCosts
from tests.engine.builders import build_drafting_model

# A GPU's graphed steps (the demo's shape on the H200: a k=3 step about 1.6 plain ones), and a
# CPU's: eager drafting steps beside a compiled plain one, 15 plain steps and more.
GPU = {0: 1.0, 1: 1.3, 2: 1.45, 3: 1.6}
CPU = {0: 1.0, 1: 15.0, 2: 16.0, 3: 17.0}


def costs(table: dict[int, float], buckets=(1,)) -> DecodeCosts:
    return DecodeCosts({(k, b): t * b ** 0.5 for k, t in table.items() for b in buckets})


def with_acceptance(alphas: list[float], table=GPU, n: int = 20000, seed: int = 0) -> DraftPolicy:
    """A policy that has seen n verifications of len(alphas) drafts, draft i accepted (once the
    ones before it were) with probability alphas[i]; a window long enough that its estimates are
    the sample means."""
    policy = DraftPolicy(len(alphas), costs=costs(table), acceptance_window=10**6)
    rng = random.Random(seed)
    for _ in range(n):
        accepted = 0
        while accepted < len(alphas) and rng.random() < alphas[accepted]:
            accepted += 1
        policy.record(len(alphas), accepted)
    return policy


def rates(policy: DraftPolicy, batch: int = 1) -> list[float]:
    return [policy.expected_tokens(k) / policy.costs.seconds(k, batch) for k in range(policy.k_max + 1)]


@pytest.mark.parametrize("alphas, expected", [
    ([0.8, 0.8, 0.8], 3),  # E = 1, 1.8, 2.44, 2.95 over 1, 1.3, 1.45, 1.6: k = 3 gives 1.85x
    ([0.5, 0.5, 0.5], 2),  # 1.15x, 1.21x, 1.17x
    ([0.8, 0.5, 0.1], 2),  # a third draft rarely accepted is not worth its step
    ([0.2, 0.2, 0.2], 0),  # 0.92x at best: off
])
def test_the_argmax_picks_the_k_that_acceptance_and_costs_imply(alphas, expected):
    policy = with_acceptance(alphas)
    assert [round(a, 1) for a in policy.alphas] == alphas
    product, want = 1.0, 1.0
    for j, alpha in enumerate(alphas):
        product *= alpha
        want += product
    assert policy.expected_tokens(len(alphas)) == pytest.approx(want, abs=0.05)
    assert policy.best(1) == expected and max(rates(policy)) == rates(policy)[expected]
    assert policy.next(1) == expected == policy.k


def test_acceptance_per_position_is_conditional_and_decays():
    """A verification is a trial of each position up to its first rejection (the position after
    it was never judged); a position's estimate forgets at 1 - 1/window a trial, so a shift from
    all accepted to none is halfway after window * ln 2 trials."""
    policy = DraftPolicy(3, acceptance_window=64)
    assert policy.alphas == [PRIOR] * 3 and policy.expected_tokens(0) == 1.0
    policy.record(3, 1)  # draft 1 accepted, draft 2 rejected, draft 3 not judged
    assert policy.trials[2] == 1.0 and policy.hits[2] == PRIOR
    assert policy.trials[0] == policy.trials[1] > 1 and policy.alphas[0] == PRIOR > policy.alphas[1]
    for _ in range(2000):
        policy.record(3, 3)
    assert min(policy.alphas) > 0.99
    for _ in range(round(64 * math.log(2))):
        policy.record(1, 0)
    assert policy.alphas[0] == pytest.approx(0.5, abs=0.02) and policy.alphas[1] > 0.99


def test_a_new_workload_drafts_from_its_first_step_and_learns_from_full_context_drafts():
    """Step costs of the demo's shape at a batch of 32 on a GPU and heads that mostly agree:
    drafting pays at k = 3. A policy that began
    at even odds found no k worth it and stayed off, its probes' drafts made without the context
    decoded while off. It starts on, at k_max, and stays on once its estimates are real ones."""
    table = DecodeCosts({(0, 32): 0.1069, (1, 32): 0.1694, (2, 32): 0.2110, (3, 32): 0.2424})
    policy = DraftPolicy(3, costs=table)
    assert policy.alphas == [1.0] * 3 and policy.next(32) == 3
    history = simulate(policy, 300, 0.85, random.Random(2), batch=32)
    assert set(history[-200:]) == {3}, history[::10]
    low = DraftPolicy(3, costs=table)  # heads that rarely agree: off on evidence, within a few steps
    assert simulate(low, 50, 0.3, random.Random(3), batch=32)[-1] == 0


def test_off_for_good_where_no_k_can_pay_even_if_every_draft_is_accepted():
    """A CPU-like table: a drafting step costs 15 plain ones, more than the k + 1 tokens it can
    emit, at every bucket: off, no probes, whatever acceptance says (and prompts skip the MTP pass:
    `hopeless`, read by the engine)."""
    policy = with_acceptance([1.0, 1.0, 1.0], table=CPU, n=100)
    assert policy.hopeless and not policy.costs.could_pay(3)
    assert [policy.next(b) for b in (1, 2, 4) for _ in range(3000)] == [0] * 9000
    assert policy.chosen == [9000, 0, 0, 0]
    # One bucket where drafting could pay is enough to keep the estimates fresh.
    assert not DraftPolicy(3, costs=DecodeCosts({**costs(CPU).table, (0, 2): 1.0, (1, 2): 1.5})).hopeless


def test_off_it_probes_one_draft_every_n_steps_by_the_stated_rule():
    """Off where drafting could pay: one step in N drafts one, N = 2 (T1 - T0) / (PROBE_SHARE T0)
    within its bounds, so probes cost at most PROBE_SHARE of the time; a k below the most probes k + 1."""
    policy = with_acceptance([0.1, 0.1, 0.1], table={**GPU, 1: 1.5})
    n = policy.probe_every(0, 1)
    assert n == math.ceil(2 * (1.5 - 1.0) / PROBE_SHARE) and MIN_PROBE_EVERY < n < MAX_PROBE_EVERY
    ks = [policy.next(1) for _ in range(10 * n)]
    assert policy.k == 0 and ks.count(1) == 10 and ks[n - 1] == 1 and set(ks) == {0, 1}
    assert DraftPolicy(1, costs=DecodeCosts({(0, 1): 1.0, (1, 1): 1.0001})).probe_every(0, 1) == MIN_PROBE_EVERY
    assert DraftPolicy(1, costs=DecodeCosts({(0, 1): 1.0, (1, 1): 1e6})).probe_every(0, 1) == MAX_PROBE_EVERY
    two = with_acceptance([0.8, 0.8, 0.02])
    ks = [two.next(1) for _ in range(4 * two.probe_every(2, 1))]
    assert two.k == 2 and ks.count(3) == 4 and set(ks) == {2, 3}


def simulate(policy: DraftPolicy, steps: int, acceptance: float, rng: random.Random, batch: int = 1) -> list[int]:
    """The engine's loop against a device: each step proposes next()'s k, the next step verifies
    them, each draft accepted with probability `acceptance`. Returns the policy's k after each."""
    history, verified = [], 0
    for _ in range(steps):
        proposed = policy.next(batch)
        for _ in range(batch if verified else 0):
            accepted = 0
            while accepted < verified and rng.random() < acceptance:
                accepted += 1
            policy.record(verified, accepted)
        history.append(policy.k)
        verified = proposed
    return history


def test_drafting_recovers_when_acceptance_rises_while_off():
    """Heads that stop agreeing turn drafting off; the probes see them agree again and drafting
    comes back on, all the way to the k the costs favour, within a bounded number of steps."""
    policy = DraftPolicy(3, costs=costs(GPU))
    rng = random.Random(1)
    assert simulate(policy, 2000, 0.0, rng)[-1] == 0
    history = simulate(policy, 4000, 0.9, rng)
    assert history[-1] == 3 and 0 < history.index(3) < 3000, history[::100]


def test_each_batch_reads_its_own_bucket():
    """k is chosen on the costs of the bucket the batch is padded to: drafting where it pays
    (batch 1), off where the step is compute-bound (batch 16), and past the largest bucket as there."""
    table = {**{(k, 1): GPU[k] for k in GPU}, **{(k, 16): 1.0 + k for k in GPU}}
    policy = with_acceptance([0.7, 0.7, 0.7])
    policy.costs = DecodeCosts(table)
    assert [policy.best(b) for b in (1, 2, 16, 64)] == [3, 0, 0, 0]
    assert policy.costs.seconds(1, 5) == 2.0 and policy.costs.seconds(3, 64) == 4.0
    assert DecodeCosts({(0, 1): 1.0}).seconds(2, 1) == math.inf  # a step not measured is never chosen


def test_fixed_k_and_the_live_cap():
    policy = DraftPolicy(3, adaptive=False, costs=costs(CPU))
    assert [policy.next(1) for _ in range(5)] == [3] * 5 and not policy.hopeless
    policy.set_max(1)
    assert policy.next(1) == 1 == policy.k
    policy.set_max(0)
    assert policy.next(1) == 0 and policy.hopeless
    adaptive = DraftPolicy(2, costs=costs(GPU))
    adaptive.set_max(0)
    assert [adaptive.next(1) for _ in range(100)] == [0] * 100


# -- in the engine, on the CPU ---------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_the_step_cost_table_is_measured_at_start_up(tmp_path, caplog):
    """Real timings, logged in one line: plain decoding at every batch bucket, drafting (each k
    up to num_speculative_tokens) from the smallest bucket up to the first where no k can pay
    even with every draft accepted; a fixed k measures nothing."""
    model = build_drafting_model(tmp_path / "m")
    common = dict(max_model_len=64, block_size=4, num_kv_blocks=64, max_num_seqs=4)
    with caplog.at_level(logging.INFO, logger="jetserve.engine.runner"):
        llm = LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **common)
    table = llm.engine.runner.decode_costs.table
    assert llm.engine.draft_policy.costs is llm.engine.runner.decode_costs
    buckets = cpu_capture_sizes(None, None, 4)
    assert buckets == [1, 2, 4]
    drafted = [b for b in buckets if (1, b) in table]
    assert drafted == buckets[:len(drafted)] and drafted  # batch 1 always
    assert {(0, b) for b in buckets} <= set(table) and all(0 < t < math.inf for t in table.values())
    for b in drafted:  # k rises from 1 until one cannot pay while its last draft cost a plain step more
        ks = sorted(k for k, bucket in table if bucket == b and k)
        assert ks == list(range(1, len(ks) + 1))
        if len(ks) < 2:
            j = ks[-1]
            assert table[j, b] >= (j + 1) * table[0, b] and table[j, b] - table[j - 1, b] >= table[0, b]
    assert not any((k, b) in table for k in (1, 2) for b in buckets if b not in drafted)

    def pays(b):
        return any((k + 1) * table[0, b] > table[k, b] for k in (1, 2) if (k, b) in table)
    assert all(pays(b) for b in drafted[:-1]) and (len(drafted) == len(buckets) or not pays(drafted[-1]))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode step costs")]
    assert len(lines) == 1 and "batch 4: k=0" in lines[0]
    fixed = LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}, **common)
    assert fixed.engine.runner.decode_costs is None and fixed.engine.draft_policy.next(1) == 2


@pytest.fixture(scope="module")
def demo_plain():
    from jetserve import demo_model_dir

    prompts = ["import os\n", "def parse(text):\n"]
    llm = LLM(demo_model_dir(), max_num_seqs=1, max_model_len=128)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def demo_drafting(table=None):
    from jetserve import demo_model_dir

    llm = LLM(demo_model_dir(), max_num_seqs=1, max_model_len=128,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    policy = llm.engine.draft_policy
    # Measured at start-up: plain and k=1 always; k=2 unless k=1 could not pay by a plain step's margin.
    assert {(0, 1), (1, 1)} <= set(policy.costs.table) <= {(0, 1), (1, 1), (2, 1)}
    if table is not None:
        policy.costs.update({(k, 1): t for k, t in table.items()})
    return llm, policy


def test_demo_drafting_off_by_the_rule_decodes_as_plain(demo_plain):
    """The demo with the default (adaptive) drafting, on a CPU-like cost table: the policy keeps
    drafting off by its rule (no draft, and no MTP pass, prompts included) and the greedy tokens
    are plain decoding's."""
    prompts, plain = demo_plain
    llm, policy = demo_drafting({0: 1e-3, 1: 15e-3, 2: 16e-3})
    calls = []
    llm.engine.runner.model.mtp[0].register_forward_hook(lambda module, args, out: calls.append(1))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
    assert policy.hopeless and policy.k == 0 and sum(policy.chosen[1:]) == 0 < policy.chosen[0]
    assert llm.engine.stats().num_drafts == 0 and not calls


def test_demo_drafting_on_by_the_rule_decodes_as_plain(demo_plain):
    """Where the table says drafting pays (a k = 2 step at 1.1 plain ones), the policy drafts and
    the greedy tokens are still plain decoding's; where its own measurements say otherwise, it
    follows them — whatever it chose, the output does not change."""
    prompts, plain = demo_plain
    llm, policy = demo_drafting({0: 1e-3, 1: 1.05e-3, 2: 1.1e-3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
    assert sum(policy.chosen[1:]) > 0 and llm.engine.stats().num_drafts > 0
    measured, policy = demo_drafting()
    assert [o.outputs[0].token_ids for o in measured.generate(prompts, GREEDY, use_tqdm=False)] == plain
    if policy.hopeless:
        assert policy.chosen[1:] == [0, 0]


def test_where_the_host_is_the_longer_a_draft_is_priced_by_it():
    """Many streams of a small model: the device's k=3 step costs 2.5 plain ones, but the host's
    bookkeeping of a step is longer than either, so a step lasts the host's time and drafting
    pays; the host's time is the median of the recent steps (one stalled step moves nothing); a
    k the host has not run costs it what the nearest smaller k did; rule 6 reads the device."""
    device = {(0, 32): 0.1e-3, (1, 32): 0.17e-3, (2, 32): 0.21e-3, (3, 32): 0.25e-3}
    policy = with_acceptance([0.6, 0.6, 0.6])  # E_k = 1, 1.6, 1.96, 2.18
    policy.costs = DecodeCosts(device)
    assert policy.best(32) == 0  # on the device's times no k pays
    for seconds in (0.7e-3, 0.71e-3, 0.69e-3, 50e-3, 0.7e-3):
        policy.costs.observe_host(0, 32, seconds)
    assert policy.costs.seconds(0, 32) == pytest.approx(0.7e-3)
    assert policy.costs.seconds(3, 32) == pytest.approx(0.7e-3)  # not run yet: plain's host time
    assert policy.best(32) == 3
    for _ in range(3):
        policy.costs.observe_host(3, 20, 0.9e-3)  # 20 sequences run in the bucket of 32
    assert policy.costs.seconds(3, 32) == pytest.approx(0.9e-3) and policy.costs.seconds(2, 32) == pytest.approx(0.7e-3)
    assert policy.best(32) == 2  # 1.96 tokens in 0.7 ms (k = 2 priced as plain) against 2.18 in 0.9
    policy.costs.observe_host(2, 32, 0.85e-3)
    assert policy.best(32) == 3  # 2.18 in 0.9 ms beats 1.96 in 0.85
    for _ in range(16):
        policy.costs.observe_host(3, 32, 2.0e-3)  # the last HOST_SAMPLES are all it keeps
    assert policy.costs.seconds(3, 32) == pytest.approx(2.0e-3) and policy.best(32) == 2
    cpu = DecodeCosts({(0, 1): 1e-3, (1, 1): 15e-3})
    cpu.observe_host(0, 1, 1.0)
    assert not cpu.could_pay(1)  # however slow the host


def test_async_steps_clock_the_hosts_time(tmp_path):
    """Async scheduling on the CPU, drafting adaptive: the overlapped decode steps give the table
    the host's time of each bucket they ran at, and the policy prices steps by it."""
    model = build_drafting_model(tmp_path / "m")
    llm = LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, max_model_len=64,
              block_size=4, num_kv_blocks=64, max_num_seqs=4, async_scheduling=True)
    costs = llm.engine.draft_policy.costs
    assert not costs.host
    prompts = [{"prompt_token_ids": [3 + i, 7, 11]} for i in range(4)]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert costs.host and all(b in costs.buckets for _, b in costs.host)
    for (k, b), seconds in costs.host.items():
        assert 0 < seconds < 1.0  # a CPU's step: its forward is the host's too
        assert costs.seconds(k, b) == max(costs.table[k, b], seconds)
