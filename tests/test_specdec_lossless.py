"""A whole speculative decode over a paged target, driven the way a worker will drive it
(write context after every target forward, propose, verify, commit): greedy output
equals the target's own greedy output, for each drafter, with drafts that are all
wrong (random drafters) and with drafts that are mostly right (oracle drafts with
corruptions), so every accept/reject path of the step runs."""

from __future__ import annotations

import pytest
import torch
from specdec_helpers import TargetRunner, block_table, small_drafter, small_graph, small_target

from pdflow.spec_decode import AcceptanceStats, ProposeBatch, verify

BLOCKS = [5, 0, 9, 2, 14, 6]
PROMPT, NEW, K = 37, 40, 4


def _greedy_reference(graph, seed: int, prompt: torch.Tensor) -> list[int]:
    cfg, target = small_target(graph, seed=seed)
    runner = TargetRunner(target, cfg, taps=(), blocks=BLOCKS)
    _, _, logits = runner.forward(prompt, 0)
    out = [int(logits[-1].argmax())]
    while len(out) < NEW:
        _, _, logits = runner.forward(torch.tensor(out[-1:]), PROMPT + len(out) - 1)
        out.append(int(logits[-1].argmax()))
    return out


def _trusting(logits: torch.Tensor, drafts: torch.Tensor):
    """A wrong verifier: takes every draft as if the target had agreed."""
    forged = logits.clone()
    forged[:, :-1] = torch.nn.functional.one_hot(drafts, logits.shape[-1]).float() * 100
    return verify(forged, drafts)


def _speculative(graph, seed: int, prompt: torch.Tensor, oracle: list[int] | None, corrupt: float,
                 verifier=verify):
    """Greedy spec decode; with ``oracle`` the drafter's proposals are replaced by the
    true continuation with a fraction ``corrupt`` of tokens changed."""
    cfg, target = small_target(graph, seed=seed)
    drafter, _ = small_drafter(graph, cfg, target, seed=seed + 1)
    runner = TargetRunner(target, cfg, taps=drafter.tap_layers, blocks=BLOCKS)
    pick = lambda hidden, taps: taps if drafter.tap_layers else hidden
    gen = torch.Generator().manual_seed(seed)
    stats = AcceptanceStats()
    for start, stop in ((0, 20), (20, PROMPT)):  # a chunked prefill
        hidden, taps, logits = runner.forward(prompt[start:stop], start)
        nxt = int(prompt[stop]) if stop < PROMPT else -1
        drafter.write_context_kv(runner.context("r", prompt[start:stop], start, pick(hidden, taps), nxt))
        drafter.commit(["r"], [stop])
    out = [int(logits[-1].argmax())]
    anchor_feature = pick(hidden, taps)[-1:]
    pos = PROMPT
    while len(out) < NEW:
        prop = drafter.propose(ProposeBatch(
            seq_ids=["r"], anchor_ids=torch.tensor(out[-1:]), anchor_positions=[pos],
            block_tables=block_table(BLOCKS), num_drafts=K, anchor_features=anchor_feature,
        ))
        drafts = prop.tokens
        if oracle is not None:
            truth = torch.tensor((oracle + [0] * K)[len(out):len(out) + K])
            noise = torch.randint(0, cfg.vocab_size, (K,), generator=gen)
            drafts = torch.where(torch.rand(K, generator=gen) < corrupt, noise, truth)[None]
        ids = torch.cat([torch.tensor(out[-1:]), drafts[0]])
        hidden, taps, logits = runner.forward(ids, pos)
        result = verifier(logits[None], drafts)
        accepted = int(result.num_accepted[0])
        drafter.write_context_kv(runner.context("r", ids, pos, pick(hidden, taps)))
        drafter.commit(["r"], [pos + accepted + 1])
        stats.record(K, accepted)
        out += result.emitted()[0]
        anchor_feature = pick(hidden, taps)[accepted:accepted + 1]
        pos += accepted + 1
    return out[:NEW], stats


@pytest.mark.parametrize("kind", ["dspark", "eagle", "eagle3"])
def test_greedy_output_is_lossless(kind):
    graph = small_graph(kind)
    prompt = torch.randint(0, 48, (PROMPT,), generator=torch.Generator().manual_seed(11))
    want = _greedy_reference(graph, 21, prompt)
    got, _ = _speculative(graph, 21, prompt, None, 0.0)
    assert got == want
    got, stats = _speculative(graph, 21, prompt, want, 0.15)
    assert got == want
    assert 0.3 < stats.acceptance_rate < 1.0 and stats.tokens_per_forward > 2.0
    # The check can fail: a verifier that trusts the drafts emits the corruptions.
    wrong, _ = _speculative(graph, 21, prompt, want, 0.15, verifier=_trusting)
    assert wrong != want
