"""Verification: greedy prefix acceptance, and speculative sampling that leaves the
target's distribution unchanged (checked statistically, with wrong versions caught)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from pdflow.parallel.messages import SamplingSpec
from pdflow.spec_decode.sampling import SamplingBatch, draft_tokens, filtered_probs, sample_with
from pdflow.worker.sampler import sampling_probs

# The module (the package exports its ``verify`` function under the same name).
V = importlib.import_module("pdflow.spec_decode.verify")


def _logits_with_argmax(argmax: list[list[int]], vocab: int, gen) -> torch.Tensor:
    logits = torch.randn(len(argmax), len(argmax[0]), vocab, generator=gen)
    for b, row in enumerate(argmax):
        for i, tok in enumerate(row):
            logits[b, i, tok] = 10.0
    return logits


def test_greedy_accepts_the_matching_prefix_and_adds_the_bonus():
    gen = torch.Generator().manual_seed(0)
    argmax = [[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9], [3, 1, 4, 1]]
    logits = _logits_with_argmax(argmax, 12, gen)
    drafts = torch.tensor([[5, 6, 0], [1, 2, 3], [9, 9, 9], [0, 1, 4]])
    # Row 2 offers only 1 draft: its matching padding must not count.
    result = V.verify(logits, drafts, num_drafts=torch.tensor([3, 3, 1, 3]))
    assert result.num_accepted.tolist() == [2, 3, 1, 0]
    assert result.emitted() == [[5, 6, 7], [1, 2, 3, 4], [9, 9], [3]]
    assert result.tokens[0].tolist() == [5, 6, 7, -1]
    want_lp = torch.log_softmax(logits[1], -1)[torch.arange(4), torch.tensor([1, 2, 3, 4])]
    torch.testing.assert_close(result.logprobs[1], want_lp)


def test_greedy_matches_a_per_row_loop_on_random_cases():
    gen = torch.Generator().manual_seed(1)
    b, k, vocab = 64, 5, 4  # tiny vocab: drafts match often
    logits = torch.randn(b, k + 1, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (b, k), generator=gen)
    num = torch.randint(0, k + 1, (b,), generator=gen)
    padded = torch.where(torch.arange(k) < num[:, None], drafts, -1)
    result = V.verify(logits, padded, num_drafts=num)
    argmax = logits.argmax(-1)
    for row in range(b):
        n = 0
        while n < num[row] and drafts[row, n] == argmax[row, n]:
            n += 1
        want = drafts[row, :n].tolist() + [int(argmax[row, n])]
        assert result.emitted()[row] == want


def test_zero_drafts_is_a_plain_step():
    logits = torch.randn(3, 1, 7, generator=torch.Generator().manual_seed(2))
    result = V.verify(logits, torch.empty(3, 0, dtype=torch.long))
    assert result.emitted() == [[t] for t in logits[:, 0].argmax(-1).tolist()]
    sampled = V.verify(logits, torch.empty(3, 0, dtype=torch.long),
                       sampling=SamplingBatch.from_lists([1.0, 0.0, 0.5]))
    assert sampled.num_accepted.tolist() == [0, 0, 0]


@pytest.mark.parametrize("settings", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.9, 5, 0.8)])
def test_filtering_is_the_target_samplers_rule(settings):
    temp, top_k, top_p = settings
    logits = torch.randn(16, 11, generator=torch.Generator().manual_seed(3)) * 3
    spec = SamplingSpec(temperature=temp, top_k=top_k, top_p=top_p)
    got = filtered_probs(logits, torch.full((16,), temp), torch.full((16,), top_k), torch.full((16,), top_p))
    want = torch.stack([sampling_probs(row, spec) for row in logits])
    torch.testing.assert_close(got, want)


def test_inverse_cdf_never_picks_a_zero_mass_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    picked = sample_with(probs, torch.tensor([0.0, 0.49, 0.5, 1.0 - 1e-17]))
    assert picked.tolist() == [1, 1, 3, 3]


# --- the statistical check ----------------------------------------------------------------

VOCAB, K, LENGTH = 5, 3, 3
GROUPS = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.75)]
ROWS_PER_GROUP = 12000


def _chains(seed: int):
    """A target Markov chain and a deliberately bad draft (anti-correlated with it)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    draft = -target + 0.3 * torch.randn(VOCAB, VOCAB, generator=gen)
    return target, draft


def _run_speculative(target: torch.Tensor, draft: torch.Tensor, *, one_hot: bool, seed: int) -> torch.Tensor:
    """Decode LENGTH tokens after token 0 for every row with speculative steps (variable
    draft lengths per row); return [rows, LENGTH]."""
    gen = torch.Generator().manual_seed(seed)
    settings = [s for s in GROUPS for _ in range(ROWS_PER_GROUP)]
    rows = len(settings)
    sampling = SamplingBatch.from_lists(*zip(*settings, strict=True))
    seqs = torch.zeros(rows, 1 + LENGTH + K + 1, dtype=torch.long)
    length = torch.ones(rows, dtype=torch.long)
    while bool((length < 1 + LENGTH).any()):
        last = seqs.gather(1, (length - 1)[:, None])[:, 0]
        prev, drafts, qs = last, [], []
        for _ in range(K):
            logits = draft[prev][:, None, :]
            if one_hot:  # deterministic drafts: the verifier treats q as one-hot
                tok, q = logits.argmax(-1), None
            else:
                tok, q = draft_tokens(logits, sampling, gen)
            drafts.append(tok[:, 0])
            qs.append(None if q is None else q[:, 0])
            prev = tok[:, 0]
        drafts = torch.stack(drafts, 1)
        q = None if one_hot else torch.stack(qs, 1)
        inputs = torch.cat([last[:, None], drafts], 1)
        num = torch.randint(0, K + 1, (rows,), generator=gen)
        result = V.verify(target[inputs], drafts, num_drafts=num, sampling=sampling, draft_probs=q,
                          generator=gen)
        emitted = result.tokens
        n = result.num_emitted
        idx = length[:, None] + torch.arange(K + 1)
        keep = torch.arange(K + 1)[None, :] < n[:, None]
        seqs.scatter_(1, idx.clamp(max=seqs.shape[1] - 1), torch.where(keep, emitted, seqs.gather(
            1, idx.clamp(max=seqs.shape[1] - 1))))
        length = (length + n).clamp(max=1 + LENGTH)
    return seqs[:, 1:1 + LENGTH]


def _chi2_threshold(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4)."""
    c = 2.0 / (9.0 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def _fits_target(samples: torch.Tensor, target: torch.Tensor) -> list[tuple[bool, float, float, float]]:
    """Per settings group: (fits, chi2, threshold, total variation) of the LENGTH-token
    sequences against the target chain under that group's filtering."""
    out = []
    for g, (temp, top_k, top_p) in enumerate(GROUPS):
        spec = SamplingSpec(temperature=temp, top_k=top_k, top_p=top_p)
        trans = torch.stack([sampling_probs(target[i], spec) for i in range(VOCAB)]).double()
        expected = _joint(trans)
        part = samples[g * ROWS_PER_GROUP:(g + 1) * ROWS_PER_GROUP]
        codes = (part * torch.tensor([VOCAB ** (LENGTH - 1 - i) for i in range(LENGTH)])).sum(1)
        observed = torch.bincount(codes, minlength=VOCAB ** LENGTH).double()
        n = ROWS_PER_GROUP
        impossible = expected == 0
        if observed[impossible].sum() > 0:  # a filtered-out token was emitted
            out.append((False, math.inf, 0.0, 1.0))
            continue
        e = expected[~impossible] * n
        chi2 = float(((observed[~impossible] - e) ** 2 / e).sum())
        threshold = _chi2_threshold(int((~impossible).sum()) - 1)
        tv = float(0.5 * (observed / n - expected).abs().sum())
        # E|obs/n - p| ~ sqrt(2 p (1 - p) / (pi n)) per cell under the null.
        tv_noise = float(0.5 * (2 * expected * (1 - expected) / (math.pi * n)).sqrt().sum())
        out.append((chi2 < threshold and tv < 2.5 * tv_noise, chi2, threshold, tv))
    return out


def _joint(trans: torch.Tensor) -> torch.Tensor:
    """P(x1..xL | x0 = 0), flattened with x1 most significant."""
    probs = trans[0]
    for _ in range(LENGTH - 1):
        probs = probs[..., None] * trans  # (..., a, b) = P(..., a) * P(b | a)
    return probs.reshape(-1)


@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled-drafts", "argmax-drafts"])
def test_speculative_sampling_keeps_the_target_distribution(one_hot):
    target, draft = _chains(seed=5)
    samples = _run_speculative(target, draft, one_hot=one_hot, seed=6)
    checks = _fits_target(samples, target)
    assert all(ok for ok, *_ in checks), checks


WRONG = {
    "always-accept": ("_accept", lambda p_x, q_x, u: torch.ones_like(p_x, dtype=torch.bool)),
    "residual-is-p": ("_residual", lambda p, q: p),
    "unfiltered-target": ("filtered_probs", lambda logits, t, k, p: torch.softmax(logits.float() / t[:, None], -1)),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_the_check_catches_a_wrong_verifier(monkeypatch, name):
    attr, wrong = WRONG[name]
    monkeypatch.setattr(V, attr, wrong)
    target, draft = _chains(seed=5)
    samples = _run_speculative(target, draft, one_hot=False, seed=6)
    checks = _fits_target(samples, target)
    assert not all(ok for ok, *_ in checks), checks


def test_flat_verify_rows_pad_per_request():
    flat = torch.arange(9.0)[:, None].expand(9, 3)  # rows 0..8: requests of 3, 1 and 5 rows
    padded = V.padded_rows(flat, torch.tensor([2, 0, 4]))
    assert padded.shape == (3, 5, 3)
    assert padded[:, :, 0].tolist() == [[0, 1, 2, 2, 2], [3, 3, 3, 3, 3], [4, 5, 6, 7, 8]]
