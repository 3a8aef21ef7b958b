"""MTP speculative decoding on tiny CPU models: lossless (greedy and sampled), seeded tokens the
same for any k, stops inside accepted drafts, stats, abort/preemption, and `mtp fit` (the draft
policy: test_draft_policy.py).

The models are random Qwen3s built with transformers offline, reshaped so drafting has
something to agree with: big embeddings and small attention/MLP outputs make the base mostly
a bigram model (next token ~ f(current token), `context` sets how much the rest of the
context moves it), and "agreeing" MTP heads pass the embedding of token t+1 straight through
(fc = [I | 0], zeroed block outputs), so they predict f(x_{t+1}) = the base's x_{t+2} guess.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import json

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.spec_decode import verify
from tests.engine.builders import add_tokenizer, build_drafting_model
from tests.tools import compile_for_gpus, require_module


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_drafting_model(tmp_path_factory.mktemp("agree"))


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


def test_a_graphed_engine_verifies_as_many_drafts_in_every_sequence_of_a_step(model, reference):
    """Requests joining and ending among others (prompts of 2..32 tokens under a 16-token budget):
    with the rule a CUDA-graphed engine's scheduler follows (`uniform_drafts`), every step's
    sequences verify as many drafts — none beside a prefill chunk — and drafting still happens,
    with plain greedy's tokens; without it (an eager engine, as here on the CPU) the same
    workload brings steps whose sequences verify different numbers."""
    for uniform in (True, False):
        llm = engine(model, 3)
        scheduler = llm.engine.scheduler
        assert scheduler.uniform_drafts is False  # a CPU engine's speculative steps run eagerly
        scheduler.uniform_drafts = uniform
        steps, schedule = [], scheduler.schedule

        def spied(*args, schedule=schedule, steps=steps, **kwargs):
            batch = schedule(*args, **kwargs)
            # Per sequence: the drafts it verifies, or None for a prefill chunk.
            steps.append([len(seq.spec_token_ids) if n == 1 + len(seq.spec_token_ids) and seq.num_uncomputed_tokens == 1
                          else None for seq, n in zip(batch.seqs, batch.num_tokens)])
            return batch
        scheduler.schedule = spied
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
        mixed = [s for s in steps if len({0 if c is None else c for c in s}) > 1]
        assert any(c for s in steps for c in s if c), "nothing drafted"
        assert bool(mixed) is not uniform, mixed[:3]


def test_draft_vocab_size_drafts_from_the_first_ids_and_stays_lossless(model, reference):
    """draft_vocab_size N: every draft is an id below N (the argmax over those rows of the vocab
    projection); verification still sees every id, so the output is the plain greedy one."""
    llm = engine(model, 3, spec={"draft_vocab_size": 24})
    drafted = []
    schedule = llm.engine.scheduler.update

    def record(batch, sampled, drafts):  # observe the drafts each step proposes
        drafted.extend(t for d in drafts for t in d)
        return schedule(batch, sampled, drafts)
    llm.engine.scheduler.update = record
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert drafted and max(drafted) < 24 and llm.engine.stats().num_accepted_tokens > 0


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


def resample_from_p(logits, drafts, params, seeds, positions):
    """A classic bug: accept draft x with probability p(x), and on rejection draw from p itself
    instead of p with the draft removed."""
    probs = logits.softmax(-1)
    out, row = [], 0
    for draft in drafts:
        tokens = []
        for x in draft + [None]:
            p = probs[row]
            if x is not None and torch.rand(()) < p[x]:
                tokens.append(x)
                row += 1
                continue
            tokens.append(int(torch.multinomial(p, 1)))
            break
        out.append(tokens)
        row += len(draft) + 1 - len(tokens)
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
    seeds = torch.arange(n).repeat_interleave(3)  # one request a sequence
    positions = torch.tensor([10, 11, 12]).repeat(n)

    def first_token_chi2(rule):
        counts = torch.bincount(torch.tensor([t[0] for t in rule(rows, drafts, params, seeds, positions)]),
                                minlength=len(p)).float()
        return float(((counts - n * p) ** 2 / (n * p)).sum())

    critical = chi2_critical(len(p) - 1)
    assert first_token_chi2(verify) < critical
    assert first_token_chi2(resample_from_p) > critical
    # Greedy rows accept exactly while the draft is the argmax.
    greedy = verify(rows[:3], [[0, 1]], [SamplingParams(temperature=0)], seeds[:3], positions[:3])
    assert greedy == [[0, 0]]


def test_seeded_sampling_gives_the_same_tokens_for_any_k(model):
    """The noise of a token depends only on its request's seed and position: a seeded request
    samples the same tokens with drafting off and with k = 1..4, alone or beside other requests
    (lossless in distribution and reproducible)."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, seed=100 + i)
              for i in range(len(PROMPTS[:4]))]
    alone = [token_ids(engine(model).generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(PROMPTS[:2], params)]
    for k in (None, 1, 2, 3, 4):
        llm = engine(model, k)
        batched = token_ids(llm.generate(PROMPTS[:4], params, use_tqdm=False))
        assert batched[:2] == alone, k
        if k:
            assert llm.engine.stats().num_accepted_tokens > 0, k
            if k == 1:
                first = batched
            assert batched == first, k


# -- stops inside accepted drafts ---------------------------------------------------------------

@pytest.fixture(scope="module")
def model_with_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_drafting_model(path)
    add_tokenizer(path)  # byte-level: the model's 64 ids are specials and single bytes
    return path


STOP_PROMPTS = [{"prompt_token_ids": [(5 * i + 3 * j) % 61 + 3 for j in range(3 + 2 * i)]} for i in range(4)]


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_stops_inside_accepted_drafts_end_as_without_drafting(model_with_tokenizer, temperature):
    """A stop string, a stop token and EOS that land inside a run of accepted drafts end the
    output exactly where they end without drafting: same tokens, text, reason and count."""
    path = model_with_tokenizer
    free = [SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=i)
            for i in range(len(STOP_PROMPTS))]
    runs = engine(str(path)).generate(STOP_PROMPTS, free, use_tqdm=False)
    # Stops taken from the free runs' 8th token: each request would stop there.
    tokens = [o.outputs[0].token_ids for o in runs]
    stop_strings = [[o.outputs[0].text[-1]] for o in engine(str(path)).generate(
        STOP_PROMPTS, [SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=i)
                       for i in range(len(STOP_PROMPTS))], use_tqdm=False)]
    cases = {
        "stop": [SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=i, stop=stop)
                 for i, stop in enumerate(stop_strings)],
        "stop_token_ids": [SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=i,
                                          stop_token_ids=[t[7]]) for i, t in enumerate(tokens)],
    }
    for name, params in cases.items():
        plain = engine(str(path)).generate(STOP_PROMPTS, params, use_tqdm=False)
        llm = engine(str(path), 3)
        drafted = llm.generate(STOP_PROMPTS, params, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "stop" for o in plain), name
        assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                for o in drafted] == [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                                       o.outputs[0].stop_reason) for o in plain], name
        assert llm.engine.stats().num_accepted_tokens > 0 and llm.engine.scheduler.blocks.num_used == 0
    # EOS: the generation config names the first request's 8th token as end of sequence.
    config = path / "generation_config.json"
    saved = config.read_text()
    try:
        config.write_text(json.dumps({"eos_token_id": [tokens[0][7]]}))
        params = [SamplingParams(temperature=temperature, max_tokens=24, seed=i) for i in range(len(STOP_PROMPTS))]
        plain = token_ids(engine(str(path)).generate(STOP_PROMPTS, params, use_tqdm=False))
        assert len(plain[0]) <= 8
        assert token_ids(engine(str(path), 3).generate(STOP_PROMPTS, params, use_tqdm=False)) == plain
    finally:
        config.write_text(saved)


def test_issue_repro_stop_string_on_the_demo_model():
    """The bundled demo model, prompt "import os\n", stop at the next newline: k=3 used to
    return two tokens past the stop (and count them)."""
    from jetserve.server.cli import demo_model_dir

    params = SamplingParams(temperature=0, max_tokens=32, stop=["\n"])
    common = {"max_num_seqs": 2, "max_model_len": 256}
    plain = LLM(demo_model_dir(), **common).generate(["import os\n"], params, use_tqdm=False)[0].outputs[0]
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(demo_model_dir(), speculative_config=spec, **common)
    drafted = llm.generate(["import os\n"], params, use_tqdm=False)[0].outputs[0]
    assert plain.finish_reason == "stop" and "\n" not in plain.text
    assert (drafted.token_ids, drafted.text, drafted.finish_reason) == (plain.token_ids, plain.text, "stop")
    assert llm.engine.stats().num_accepted_tokens > 0


@pytest.mark.parametrize("q, steps", [(1, 2), (3, 2), (4, 3), (2, 0)])
def test_acceptance_kernel_matches_torch(q, steps):
    """The one-kernel acceptance and drafting inputs of a graphed step (Triton's interpreter on
    CPU) against the torch/host version: the packed tokens and accepted counts, the MTP output
    gathered at the last verified rows, and each drafting step's RoPE, slots and context lengths;
    a graph's padded sequence drafts into the scratch slot."""
    from jetserve.engine.model.attention import AttentionMetadata
    from jetserve.engine.model.qwen3 import RotaryEmbedding
    from jetserve.engine.spec_decode import device_acceptance, host_acceptance

    gen = torch.Generator().manual_seed(q * 10 + steps)
    batch, block_size, width, hidden = 5, 4, 8, 24
    rotary = RotaryEmbedding(16, 10000.0, 64)
    tables = [torch.randperm(40, generator=gen)[:width].tolist() for _ in range(batch)]
    starts = torch.randint(0, 16, (batch,), generator=gen).tolist()
    target = torch.randint(0, 3, (batch, q), generator=gen)
    ids = torch.cat([torch.randint(0, 3, (batch, 1), generator=gen), target[:, :-1].clone()], dim=1)
    ids[:, 1:][torch.rand(batch, q - 1, generator=gen) < 0.3] = 7  # some drafts rejected
    positions = torch.tensor([p for s in starts for p in range(s, s + q)])
    ctx = [s + q for s in starts]
    x, residual = torch.randn(2, batch * q, hidden, generator=gen).to(torch.bfloat16)
    packed_host = torch.full((batch, q + 1 + steps), -1)
    host = host_acceptance(tables, block_size, torch.device("cpu"), rotary)(
        ids.flatten(), target, positions, x, residual, steps, packed_host)
    on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = AttentionMetadata(slot_mapping=None, block_tables=torch.tensor(tables, dtype=torch.int32, device=on),
                             context_lens=torch.tensor(ctx, dtype=torch.int32, device=on), q_len=q,
                             block_size=block_size)
    rotary = rotary.to(on)
    packed = torch.full((batch, q + 1 + steps), -1, device=on)
    args = (ids.flatten().int().to(on), target.to(on), positions.int().to(on), x.to(on), residual.to(on), steps, packed)
    x_d, res_d, chain = device_acceptance(meta, q, rotary)(*args)
    assert torch.equal(packed.cpu(), packed_host) and len(chain) == steps
    assert torch.equal(x_d.cpu(), host[0]) and torch.equal(res_d.cpu(), host[1])
    last_positions = positions[torch.arange(batch) * q + packed_host[:, q]]
    for step, (((cos_d, sin_d), meta_d), ((cos_h, sin_h), meta_h)) in enumerate(zip(chain, host[2]), start=1):
        assert torch.equal(cos_d.cpu(), cos_h) and torch.equal(sin_d.cpu(), sin_h)
        assert torch.equal(meta_d.slot_mapping.long().cpu(), meta_h.slot_mapping.long())
        assert torch.equal(meta_d.context_lens.long().cpu(), last_positions + step + 1)
    if q > 1:  # a padded sequence: context length 1
        meta.context_lens[0] = 1
        _, _, chain = device_acceptance(meta, q, rotary, scratch_slot=999)(*args)
        assert all(m.slot_mapping[0] == 999 and m.context_lens[0] == 1 and torch.equal(cos[0], rotary.cos[0, None])
                   for (cos, _), m in chain)


@pytest.mark.parametrize("vocab", [300, 20000])
def test_draft_input_and_argmax_kernels_match_torch(vocab):
    """An MTP layer's fused input (embedding, both norms, the previous head's argmax and final
    norm) and the last draft's argmax (Triton's interpreter on CPU) against the torch modules:
    logits a kernel scans itself (300 ids) and logits past SCAN_MAX, whose argmax is split over
    programs first (20,000 ids, a tie across two splits); the argmax the first index of the
    largest logit, as torch's; and through a draft vocabulary's ids."""
    from jetserve.engine.model.qwen3 import RMSNorm
    from jetserve.engine.model.spec_kernels import argmax_into, draft_input

    gen = torch.Generator().manual_seed(3)
    rows, hidden = 6, 48
    on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    embed = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16).to(on)
    enorm, hnorm, prev = (RMSNorm(hidden, 1e-6).to(torch.bfloat16).to(on) for _ in range(3))
    for norm in (enorm, hnorm, prev):
        norm.weight.data = (1 + torch.randn(hidden, generator=gen) / 4).to(torch.bfloat16).to(on)
    h = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(on)
    logits = torch.randn(rows, vocab, generator=gen).to(torch.bfloat16).to(on)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index, as torch.argmax
    logits[4, vocab - 2] = logits[4, vocab // 2] = logits[4].max() + 1  # across splits where there are several
    tokens = logits.argmax(-1)
    assert tokens[2] == 7 and tokens[4] == vocab // 2
    out = torch.full((rows, 3), -1, device=on)
    got = draft_input(logits, h, embed, enorm, hnorm, prev, out[:, 1])
    want = torch.cat([enorm(embed[tokens]), hnorm(prev(h))], dim=-1)
    assert torch.equal(out[:, 1], tokens)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)  # bf16: a rounding step or two apart
    torch.testing.assert_close(draft_input(tokens, h, embed, enorm, hnorm), torch.cat([enorm(embed[tokens]), hnorm(h)], -1),
                               rtol=2e-2, atol=1e-2)
    argmax_into(logits, out[:, 2])
    assert torch.equal(out[:, 2], tokens)
    # Draft logits over a draft vocabulary: row i of the head is token ids[i].
    ids = torch.randperm(4 * vocab, generator=gen)[:vocab].sort().values.to(on)
    out.fill_(-1)
    draft_input(logits, h, embed.repeat(4, 1), enorm, hnorm, prev, out[:, 1], draft_ids=ids)
    argmax_into(logits, out[:, 2], draft_ids=ids)
    assert torch.equal(out[:, 1], ids[tokens]) and torch.equal(out[:, 2], ids[tokens])


@pytest.mark.parametrize("bits,group,sym", [(8, -1, True), (4, 128, False)])
def test_draft_input_reads_a_quantized_embedding(bits, group, sym):
    """The fused MTP input with the embedding a quantized table (quant.QuantEmbedding's: a
    quantized vocab projection tied to it), in Triton's interpreter on CPU: each token's row
    dequantized as quant.dequantize rounds it, then the same norms as the torch modules."""
    from jetserve.engine.model import quant
    from jetserve.engine.model.qwen3 import RMSNorm
    from jetserve.engine.model.spec_kernels import draft_input

    gen = torch.Generator().manual_seed(bits)
    rows, hidden, vocab = 5, 256, 70
    on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = quant.quantize(torch.randn(vocab, hidden, generator=gen).to(on), bits, group, sym)
    enorm, hnorm = (RMSNorm(hidden, 1e-6).to(torch.bfloat16).to(on) for _ in range(2))
    h = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(on)
    tokens = torch.tensor([69, 0, 3, 3, 41], device=on)
    want = torch.cat([enorm(quant.dequantize(table, torch.bfloat16)[tokens]), hnorm(h)], dim=-1)
    torch.testing.assert_close(draft_input(tokens, h, table, enorm, hnorm), want, rtol=2e-2, atol=1e-2)


def test_speculative_and_sampling_kernels_compile_for_hopper_and_orin():
    """Triton's compiler and ptxas (no GPU needed) take every kernel a speculative or decode graph
    adds, for sm_90 and for Jetson Orin's sm_87: the interpreter the other tests run them in is
    more lenient."""
    compile_for_gpus()


@torch.inference_mode()
def test_graphed_speculative_step_on_static_inputs_equals_the_general_path(tmp_path):
    """What a speculative graph records (the fused model, the one-kernel acceptance, the MTP
    layers' fused inputs and heads, the draw from the staged temperatures, min-p and seeds),
    run here over the static inputs in Triton's interpreter, against the general path (plain
    torch model, host acceptance, sampler.sample): the same tokens, accepted counts and drafts
    for greedy and sampled sequences, through two MTP layers in turn; the padded sequence
    touches no real one."""
    require_module("triton")
    from jetserve.engine.config import CUDAGraphConfig
    from jetserve.engine.cuda_graphs import CUDAGraphs
    from jetserve.engine.model.attention import AttentionMetadata
    from jetserve.engine.model.kernels import FusedKernels
    from jetserve.engine.model.loader import load_model
    from jetserve.engine.sampler import sample
    from jetserve.engine.spec_decode import host_acceptance, speculative_step

    path = build_drafting_model(tmp_path, mtp_layers=2)
    block_size, num_blocks, q, k = 16, 12, 4, 3
    fused, plain = load_model(path, torch.float32, torch.device("cpu"), 256), load_model(path, torch.float32,
                                                                                        torch.device("cpu"), 256)
    fused.use_kernels(FusedKernels(tile_timing=False))
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(fused.num_kv_layers, 2, (num_blocks + 1) * block_size, 2, 16, generator=gen)
    graphs = CUDAGraphs(fused, cache, CUDAGraphConfig((4,), ((k, q),), 0), 128, block_size, num_blocks)
    tables, ctx_lens = [[0, 1], [2], [3, 4, 5]], [20, 9, 40]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=1.2, min_p=0.1, seed=2**40 + 9)]
    positions = [p for c in ctx_lens for p in range(c - q, c)]
    draws = [(0.0, 0.0, 1), (0.8, 0.0, 5), (1.2, 0.1, 2**40 + 9)]
    meta = AttentionMetadata.build([q] * 3, ctx_lens, tables, block_size, torch.device("cpu"), False)
    positions_t = torch.tensor(positions)
    rows = [p for p in params for _ in range(q)]
    seeds = torch.tensor([seed for _, _, seed in draws for _ in range(q)])

    def general(ids):
        return speculative_step(plain, cache.clone(), ids.flatten(), positions_t, meta, q, k,
                                lambda logits: sample(logits.float(), rows, seeds, positions_t + 1),
                                host_acceptance(tables, block_size, torch.device("cpu"), plain.rotary))

    ids = torch.randint(0, 64, (3, q), generator=gen)
    for j in range(1, q):  # drafts the model accepts: each the token its row samples
        ids[:, j] = general(ids)[:, j - 1]
    ids[2, 2] = (ids[2, 2] + 1) % 64  # the third sequence's second draft is rejected
    want = general(ids)
    assert want[:, q].tolist() == [q - 1, q - 1, 1]
    graphs.stage((k, q, 4), ids.flatten().tolist(), positions, ctx_lens, tables, draws)
    before = cache.clone()
    packed = graphs._step(k, q, 4)[0]
    touched = (cache != before).any(dim=(0, 1, 3, 4))
    assert not touched[6 * block_size:num_blocks * block_size].any()  # blocks no sequence holds stay as they were
    assert torch.equal(packed[:3], want), (packed, want)
    # Chained (async scheduling): the next step verifies these drafts, its inputs written on the
    # device from this result; the host sends only flags, draws and tables.
    accepted = want[:, q]
    next_ids = torch.cat([want.gather(1, accepted[:, None]), want[:, q + 1:]], 1)
    ctx_lens = [c - q + n + 1 + q for c, n in zip(ctx_lens, accepted.tolist())]
    positions_t = torch.tensor([p for c in ctx_lens for p in range(c - q, c)])
    meta = AttentionMetadata.build([q] * 3, ctx_lens, tables, block_size, torch.device("cpu"), False)
    after = cache.clone()
    want = speculative_step(plain, after, next_ids.flatten(), positions_t, meta, q, k,
                            lambda logits: sample(logits.float(), rows, seeds, positions_t + 1),
                            host_acceptance(tables, block_size, torch.device("cpu"), plain.rotary))
    graphs.stage_chained((k, q, 4), q, tables, draws)
    packed = graphs._step(k, q, 4)[0]
    assert torch.equal(packed[:3], want), (packed, want)
    assert graphs.positions[:3 * q].tolist() == positions_t.tolist() and graphs.context_lens[:3].tolist() == ctx_lens
    assert graphs.context_lens[3] == 1 and (graphs.slots[3 * q:4 * q] == graphs.scratch_slot).all()


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


@torch.inference_mode()
def test_bench_profile_pieces_run_over_static_inputs(tmp_path):
    """`jetserve bench mtp`'s per-piece profile (each piece of a speculative step, captured and
    timed alone on the GPU) builds and runs its pieces over a graph family's static inputs (here
    eagerly, Triton's interpreter)."""
    require_module("triton")
    from jetserve.bench.mtp import step_pieces
    from jetserve.engine.config import CUDAGraphConfig
    from jetserve.engine.cuda_graphs import CUDAGraphs
    from jetserve.engine.model.kernels import FusedKernels
    from jetserve.engine.model.loader import load_model

    model = load_model(build_drafting_model(tmp_path, mtp_layers=1), torch.float32, torch.device("cpu"), 256)
    model.use_kernels(FusedKernels(tile_timing=False))
    cache = torch.zeros(model.num_kv_layers, 2, 5 * 16, 2, 16)
    k = 2
    graphs = CUDAGraphs(model, cache, CUDAGraphConfig((2,), ((k, k + 1),), 0), 48, 16, 4)
    graphs.stage((k, k + 1, 2), list(range(2 * (k + 1))), [*range(5, 6 + k), *range(9, 10 + k)], [6 + k, 10 + k],
                 [[0], [1]], [(0.0, 0.0, 1), (0.7, 0.1, 2)])
    pieces = step_pieces(graphs, k, 2)
    assert "drafting step (argmax + input + MTP layer), each" in pieces
    for fn in pieces.values():
        fn()


class _Launches(TorchDispatchMode):
    """Counts the kernels a step would launch on a GPU: Triton kernels (here run by the
    interpreter) and the torch ops outside them that launch one (not views or allocations)."""

    FREE = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "t", "expand", "alias",
            "as_strided", "empty", "empty_like", "empty_strided", "reshape", "detach", "split", "permute",
            "transpose", "unbind", "flatten", "unflatten"}

    def __enter__(self):
        import triton.runtime.interpreter as interpreter

        self.kernels, self._inside, run = [], False, interpreter.InterpretedFunction.run

        def counted(fn, *args, **kwargs):
            self.kernels.append(fn.fn.__name__)
            self._inside = True
            try:
                return run(fn, *args, **kwargs)
            finally:
                self._inside = False
        self._restore = lambda: setattr(interpreter.InterpretedFunction, "run", run)
        interpreter.InterpretedFunction.run = counted
        return super().__enter__()

    def __exit__(self, *exc):
        self._restore()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside and func.__name__.split(".")[0] not in self.FREE:
            self.kernels.append(func.__name__)
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_a_draft_costs_at_most_nine_launches(tmp_path):
    """A small model's speculative step costs launches, not arithmetic (the demo's MTP layer is a
    sixth of the model). Replayed as a graph, a step verifying and proposing k drafts launches
    at most 9k + 2 kernels more than a plain decode step: per draft its MTP layer (one input
    kernel, the fc, the block's six) and its head; plus acceptance, the last argmax and the
    kernel that chains the step's inputs from the step before (async scheduling), less the
    plain step's fp32 logits copy. (Before these kernels: about 19 a draft.)"""
    require_module("triton")
    from jetserve.engine.config import CUDAGraphConfig
    from jetserve.engine.cuda_graphs import CUDAGraphs
    from jetserve.engine.model.kernels import FusedKernels
    from jetserve.engine.model.loader import load_model

    model = load_model(build_drafting_model(tmp_path, mtp_layers=1), torch.float32, torch.device("cpu"), 256)
    model.use_kernels(FusedKernels(tile_timing=False))
    cache = torch.zeros(model.num_kv_layers, 2, 3 * 16, 2, 16)
    launches = {}
    for k in (None, 3):
        q = 1 if k is None else k + 1
        graphs = CUDAGraphs(model, cache, CUDAGraphConfig((1,), ((k, q),), 0), 32, 16, 2)
        graphs.stage((k, q, 1), list(range(q)), list(range(5, 5 + q)), [5 + q], [[0]], [(0.7, 0.0, 1)])
        graphs._step(k, q, 1)  # warm (a capture follows warm-up runs): one-time casts stay out
        with _Launches() as counter:
            graphs._step(k, q, 1)
        launches[k] = counter.kernels
    assert len(launches[3]) <= len(launches[None]) + 9 * 3 + 2, (launches[3], launches[None])


# -- async scheduling: speculative steps chained on the device ------------------------------------

@pytest.mark.parametrize("prev_q, q", [(4, 4), (1, 4), (3, 2)])
def test_chain_kernel_matches_torch(prev_q, q):
    """The kernel that starts a chained speculative graph (Triton's interpreter on CPU) writes
    the inputs `chained_inputs` computes from the previous step's result: the token after the
    accepted run, the new drafts, the positions after it, their slots through the block tables
    and the context lengths; a flag of 0 keeps the staged inputs, -1 pads into the scratch slot."""
    from jetserve.engine.model.spec_kernels import chain_inputs
    from jetserve.engine.spec_decode import chained_inputs

    gen = torch.Generator().manual_seed(prev_q * 10 + q)
    batch, block_size, width = 6, 4, 10
    tables = torch.stack([torch.randperm(60, generator=gen)[:width] for _ in range(batch)]).int()
    packed = torch.randint(0, 500, (batch, prev_q + q), generator=gen)
    packed[:, prev_q] = torch.randint(0, prev_q, (batch,), generator=gen)  # accepted counts
    prev_ctx = torch.randint(prev_q, 20, (batch,), generator=gen).int()
    ids, positions, slots, ctx = chained_inputs(packed, prev_ctx, prev_q, q, tables, block_size)
    start = prev_ctx.long() - prev_q + packed[:, prev_q] + 1
    assert torch.equal(ids.view(batch, q)[:, 0].long(), packed.gather(1, packed[:, prev_q:prev_q + 1])[:, 0])
    assert torch.equal(positions.view(batch, q)[:, 0].long(), start) and torch.equal(ctx.long(), start + q)
    flags = torch.tensor([prev_q] * 4 + [0, -1], dtype=torch.int32)
    staged = [torch.full((batch * q,), -5, dtype=torch.int32) for _ in range(3)] + [prev_ctx.clone()]
    chain_inputs(flags, packed.flatten(), *staged, tables, block_size, q, scratch_slot=999)
    rows = 4 * q
    for got, want in zip(staged[:3], (ids, positions, slots)):
        assert torch.equal(got[:rows], want[:rows]) and (got[rows:rows + q] == -5).all()
    assert torch.equal(staged[3][:4], ctx[:4]) and staged[3][4] == prev_ctx[4] and staged[3][5] == 1
    assert (staged[2][rows + q:] == 999).all() and (staged[1][rows + q:] == 0).all()


class _ChainSpy:
    """Counts the speculative steps an engine launched chained after an unread one (the runner's
    own method, wrapped: the path under test still runs)."""

    def __init__(self, llm):
        runner, self.chained = llm.engine.runner, 0
        launch = runner.launch_speculative

        def spied(batch, num_drafts, after=None):
            self.chained += after is not None
            return launch(batch, num_drafts, after)
        runner.launch_speculative = spied


def test_async_drafting_chains_steps_and_gives_the_sync_outputs(model, reference):
    """Async scheduling with drafting launches step N+1 before step N's tokens are read, its
    inputs chained from N's result: greedy and seeded-sampled outputs (stops by max_tokens in
    reach too) equal the synchronous engine's, the stats add up, and no KV block is left."""
    sampled = [SamplingParams(temperature=0.8, top_p=0.9 if i == 2 else 1.0, max_tokens=16 + 3 * i, ignore_eos=True,
                              seed=7 + i) for i in range(len(PROMPTS))]
    want = token_ids(engine(model, 3).generate(PROMPTS, sampled, use_tqdm=False))
    llm = engine(model, 3, async_scheduling=True)
    spy = _ChainSpy(llm)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    greedy_chained = spy.chained
    assert token_ids(llm.generate(PROMPTS, sampled, use_tqdm=False)) == want
    assert greedy_chained > 0 and spy.chained > greedy_chained, spy.chained
    s = llm.engine.stats()
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens and sum(s.accepted_per_position) == s.num_accepted_tokens
    assert s.kv_blocks_used == 0


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_async_drafting_stops_inside_accepted_runs_as_sync(model_with_tokenizer, temperature):
    """Stop strings and stop tokens that land inside an accepted run while the next step is
    already on the device end the output where the synchronous engine without drafting ends
    it; the step launched past the stop is dropped and frees its blocks."""
    path = str(model_with_tokenizer)
    free = engine(path).generate(STOP_PROMPTS, [SamplingParams(temperature=temperature, max_tokens=24,
                                                               ignore_eos=True, seed=i) for i in range(4)],
                                 use_tqdm=False)
    params = [SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=i,
                             stop_token_ids=[o.outputs[0].token_ids[9]], stop=[o.outputs[0].text[-3:]])
              for i, o in enumerate(free)]
    plain = engine(path).generate(STOP_PROMPTS, params, use_tqdm=False)
    llm = engine(path, 3, async_scheduling=True)
    spy = _ChainSpy(llm)
    drafted = llm.generate(STOP_PROMPTS, params, use_tqdm=False)
    assert spy.chained > 0
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in drafted] == \
        [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in plain]
    assert all(o.outputs[0].finish_reason == "stop" for o in plain)
    assert llm.engine.scheduler.blocks.num_used == 0


def test_async_drafting_admits_new_requests_and_aborts_mid_chain(model, reference):
    """A request that arrives while steps are chained joins at the next step (the chain waits
    for it); one aborted mid-chain frees its blocks; the others' tokens are the plain greedy ones."""
    llm = engine(model, 2, async_scheduling=True)
    spy = _ChainSpy(llm)
    core = llm.engine
    core.add_request("a", PROMPTS[3], GREEDY)
    core.add_request("gone", PROMPTS[4], GREEDY)
    got = {}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        steps += 1
        if steps == 8:
            core.add_request("b", PROMPTS[5], GREEDY)
            core.abort("gone")
    assert got["a"] == reference[3] and got["b"] == reference[5] and spy.chained > 0
    assert core.scheduler.blocks.num_used == 0
