"""Sampling filters against a plain reference, and the seeded (counter-based) draw."""

import pytest
import torch

from jetserve.engine.sampler import exponential_noise, race, sample, sampling_rows, top_k_top_p_floor
from jetserve.engine.sampling_params import SamplingParams


def reference_probs(logits, p: SamplingParams):
    """One row, written the obvious way, in vLLM's order: top-k, renormalise, then the nucleus."""
    probs = (logits / p.temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()[:p.top_k or None]
    total = sum(probs[i].item() for i in order)
    mass, keep = 0.0, set()
    for i in order:
        if mass >= p.top_p:
            break
        keep.add(i)
        mass += probs[i].item() / total
    out = torch.tensor([probs[i].item() if i in keep else 0.0 for i in range(len(probs))])
    if p.min_p:
        out[out < p.min_p * out.max()] = 0
    return out / out.sum()


def kept_distribution(logits, params):
    """What the race draws from: softmax(l / T) over the tokens at or above the top-k/top-p floor
    and the min-p cut (sampler.race)."""
    temperature, min_p = sampling_rows(params, logits.device)
    cut = torch.maximum(top_k_top_p_floor(logits, params), logits.amax(-1) + temperature * torch.log(min_p))
    return (logits / temperature[:, None]).masked_fill(logits < cut[:, None], float("-inf")).softmax(-1)


def test_filters_match_the_reference():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.5),
              SamplingParams(temperature=1.3, min_p=0.1), SamplingParams(top_k=10, top_p=0.8, min_p=0.05),
              SamplingParams(top_k=10_000)]  # top_k beyond the vocabulary keeps everything
    got = kept_distribution(logits, params)
    for row, p in enumerate(params):
        torch.testing.assert_close(got[row], reference_probs(logits[row], p), rtol=1e-5, atol=1e-6)


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]]).repeat(20_000, 1)
    p = SamplingParams(temperature=0.8, top_k=3)
    n = len(logits)
    tokens = sample(logits, [p] * n, torch.arange(n), torch.zeros(n, dtype=torch.long))  # one seed a row
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    torch.testing.assert_close(freq, reference_probs(logits[0], p), atol=0.015, rtol=0)


def test_greedy_rows_take_the_argmax_and_seeds_repeat():
    logits = torch.randn(3, 30)
    logits[2] = logits[1]
    seeded = SamplingParams(temperature=1.0, seed=5)
    tokens = sample(logits.clone(), [SamplingParams(temperature=0), seeded, seeded], torch.tensor([0, 5, 5]),
                    torch.tensor([0, 9, 9]))
    assert tokens[0] == logits[0].argmax() and tokens[1] == tokens[2]
    again = sample(logits[1:2].clone(), [seeded], torch.tensor([5]), torch.tensor([9]))
    assert tokens[1] == again[0]


def test_noise_is_exponential_and_keyed_by_seed_and_position():
    """Exp(1) per entry (mean, variance, and uniform deciles of exp(-E)); entries of rows with
    neighbouring seeds or positions uncorrelated; the same key gives the same noise."""
    by_seed = exponential_noise(4096, torch.arange(512), torch.full((512,), 7))
    by_position = exponential_noise(4096, torch.full((512,), 7), torch.arange(512))
    for noise in (by_seed, by_position):
        assert abs(noise.mean() - 1) < 0.01 and abs(noise.var() - 1) < 0.02
        deciles = torch.histc(torch.exp(-noise), 10, 0, 1) / noise.numel()
        assert (deciles - 0.1).abs().max() < 0.002
        centred = noise - 1
        assert abs((centred[1:] * centred[:-1]).mean()) < 0.01  # neighbouring rows
        assert abs((centred[:, 1:] * centred[:, :-1]).mean()) < 0.01  # neighbouring vocabulary entries
    assert torch.equal(by_seed[7], by_position[7])  # seed 7 at position 7 in both
    assert not torch.equal(by_seed[6], by_position[6])


@pytest.mark.parametrize("vocab", [3000, 9000])
def test_race_kernel_draws_the_same_tokens_as_torch(vocab):
    """The Triton draw (in the CUDA graphs; here in Triton's interpreter) against the torch one:
    greedy rows, temperatures, min-p, a top-k/top-p floor, 63-bit seeds, parameters shared by a
    sequence's verify rows, positions offset by one as a graph reads them; a vocabulary in one
    chunk and in three (the race split over programs, then the best chunk picked)."""
    from jetserve.engine.model.sampling_kernels import race as race_kernel

    gen = torch.Generator().manual_seed(11)
    rows, q = 12, 3
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[1, [vocab - 3, 5]] = 100.0  # a greedy row whose largest logit ties across chunks: the first wins
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=2**62 + 5),
              SamplingParams(temperature=1.3, min_p=0.05, seed=3), SamplingParams(temperature=0.7, top_p=0.9)]
    per_row = [p for p in params for _ in range(q)]
    seeds = torch.tensor([(p.seed or 0) for p in per_row])
    positions = torch.randint(0, 4000, (rows,), generator=gen)
    temperature, min_p = sampling_rows(per_row, logits.device)
    floor = top_k_top_p_floor(logits, per_row)
    want = race(logits, temperature, min_p, floor, seeds, positions)
    on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    got = race_kernel(logits.to(on), temperature[::q].contiguous().to(on), min_p[::q].contiguous().to(on), floor.to(on),
                      seeds[::q].contiguous().to(on).view(torch.int32), (positions - 1).int().to(on), position_offset=1,
                      rows_per_param=q)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want[:q], logits[:q].argmax(-1)) and want[1] == 5
