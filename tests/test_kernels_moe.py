"""The fused MoE kernel against its torch reference, on CPU under TRITON_INTERPRET (small
shapes) and on CUDA when there is one: routed pairs sorted and padded per expert, gate/up
with SiLU-and-mul, down with the routing weight, the picks combined. A kernel that loses a
pair's weight or reads another expert's rows is caught."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton kernel decoration
    os.environ["TRITON_INTERPRET"] = "1"

from pdflow.kernels.fused_moe import align_pairs, fused_moe  # noqa: E402
from pdflow.kernels.reference_moe import fused_moe_reference, route  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(tokens, hidden, inter, experts, top_k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    weights, ids = route(torch.randn(tokens, experts, generator=gen).to(dtype), top_k, True)
    return [t.to(DEV, dtype) if t.is_floating_point() else t.to(DEV) for t in (x, w13, w2, weights, ids)]


@pytest.mark.parametrize("tokens, hidden, inter, experts, top_k", [
    (1, 32, 16, 4, 1),     # one decode row
    (9, 48, 40, 6, 2),     # odd sizes: masked rows and columns
    (33, 64, 24, 8, 8),    # every expert picked by every token
    (70, 32, 32, 16, 2),   # experts nobody picks (empty runs)
])
def test_fused_moe_equals_its_reference_fp32(tokens, hidden, inter, experts, top_k):
    x, w13, w2, weights, ids = _case(tokens, hidden, inter, experts, top_k, torch.float32)
    got = fused_moe(x, w13, w2, weights, ids)
    want = fused_moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_moe_bf16_is_close_to_its_reference():
    x, w13, w2, weights, ids = _case(12, 64, 32, 8, 2, torch.bfloat16, seed=1)
    got = fused_moe(x, w13, w2, weights, ids).float()
    want = fused_moe_reference(x, w13, w2, weights, ids).float()
    # interpreter truncates fp32 -> bf16; the GPU rounds: a few bf16 ulps of the output scale
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_a_wrong_routing_is_caught_by_the_reference():
    """The reference is sensitive to what the kernel must get right: another expert's
    weights (ids shifted) or unweighted picks give a different output."""
    x, w13, w2, weights, ids = _case(9, 48, 40, 6, 2, torch.float32)
    want = fused_moe_reference(x, w13, w2, weights, ids)
    shifted = fused_moe(x, w13, w2, weights, (ids + 1) % 6)
    unweighted = fused_moe(x, w13, w2, torch.ones_like(weights), ids)
    for wrong in (shifted, unweighted):
        assert not torch.allclose(wrong, want, rtol=1e-3, atol=1e-3)


def test_align_pairs_puts_every_pair_once_in_its_experts_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]])
    rows, block_expert = align_pairs(ids, 5, 4)
    pairs = ids.numel()
    flat = ids.reshape(-1)
    real = rows[rows < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    for i, row in enumerate(rows.tolist()):
        if row < pairs:
            assert block_expert[i // 4].item() == flat[row].item()
    # experts 0..3 hold 2, 1, 1, 4 pairs: one block each; the rest of the buffer unused
    assert block_expert.tolist()[:4] == [0, 1, 2, 3] and set(block_expert.tolist()[4:]) <= {-1}
