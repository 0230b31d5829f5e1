"""The sampler: seeded reproducibility, the sampled distribution, top-k / top-p, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdflow.engine.sampling_params import SamplingParams
from pdflow.worker.sampler import Sampler, make_generator, sampling_probs

LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.4, 1.0, -1.2])
CPU = torch.device("cpu")


def first_tokens(params: SamplingParams, seeds) -> list[int]:
    """The first token of one request per seed, all in one batch."""
    seeds = list(seeds)
    logits = LOGITS.expand(len(seeds), -1)
    gens = [make_generator(s, CPU) for s in seeds]
    tokens, _ = Sampler()(logits, [params] * len(seeds), gens)
    return tokens


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token the distribution excludes"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return stat, int(keep.sum()) - 1


# 99.9% quantiles of chi-square: a correct sampler fails one seed set in a thousand.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_first_token_follows_softmax_of_scaled_logits(temperature):
    params = SamplingParams(temperature=temperature)
    tokens = first_tokens(params, range(4000))
    stat, dof = chi_square(tokens, torch.softmax(LOGITS / temperature, -1))
    assert stat < CHI2_999[dof]
    # And the test has teeth: the same draws are far from the untempered distribution.
    if temperature != 1.0:
        assert chi_square(tokens, torch.softmax(LOGITS, -1))[0] > CHI2_999[dof]


def test_seeded_requests_reproduce_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=3)
    alone = first_tokens(params, [11])
    in_batch = first_tokens(params, [5, 11, 7])
    assert alone[0] == in_batch[1]
    assert first_tokens(params, range(40)) == first_tokens(params, range(40))
    assert len(set(first_tokens(params, range(40)))) > 1


def reference_truncation(probs: list[float], top_k: int, top_p: float) -> list[float]:
    """top-k then top-p by hand: keep the smallest head of the sorted list whose mass
    reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[i] for i in kept)
    nucleus, acc = [], 0.0
    for i in kept:
        nucleus.append(i)
        acc += probs[i] / mass
        if acc >= top_p:
            break
    total = sum(probs[i] for i in nucleus)
    return [probs[i] / total if i in nucleus else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (4, 1.0), (0, 0.6), (0, 0.9), (3, 0.8)])
def test_top_k_and_top_p_truncate_as_defined(top_k, top_p):
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    got = sampling_probs(LOGITS, params)
    want = reference_truncation(torch.softmax(LOGITS, -1).tolist(), top_k, top_p)
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    tokens = first_tokens(params, range(3000))
    stat, dof = chi_square(tokens, torch.tensor(want))
    assert dof == 0 or stat < CHI2_999[dof]


def test_greedy_and_logprob_of_the_chosen_token():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, seed=1)]
    tokens, logprobs = Sampler()(logits, params, [None, make_generator(1, CPU)])
    assert tokens[0] == int(LOGITS.argmax())
    for row, tok, lp in zip(logits, tokens, logprobs, strict=True):
        assert lp == pytest.approx(torch.log_softmax(row, -1)[tok].item(), abs=1e-6)
        assert lp < 0 and math.isfinite(lp)
