"""The Gluon (FA3-schedule) prefill kernel against the float64 reference on the H200:
mixed lengths, prefix hits, lengths that do not fill the last page, a NaN-poisoned cache
(every slot no sequence owns is NaN, so a read past the context or a V tail that is not
zeroed shows up as NaN), several GQA ratios. GPU only (Gluon has no interpreter)."""

from __future__ import annotations

import pytest
import torch
from kernel_bench import paged_inputs as T
from pdflow.kernels import prefill_gluon as PG
from pdflow.kernels import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9
    or not PG.gluon_available(), reason="needs a Hopper GPU and a triton with Gluon")]


def _inputs(lens, qlens, h_q, h_kv, seed=0, d=128, page=128, ppb=1):
    kc, vc, cl, bt = T.make_paged(lens, h_kv, d, page, ppb, torch.bfloat16, "cuda", seed=seed)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q = T.randn(sum(qlens), h_q, d, dtype=torch.bfloat16, device="cuda", seed=seed + 1)
    return q, kc, vc, cu, cl, bt


@pytest.mark.parametrize("lens,qlens,h_q,h_kv,d", [
    ([1000, 300, 129], [1000, 44, 1], 32, 8, 128),  # full prompt, prefix hit, one verify row
    ([128, 256, 77], [128, 100, 77], 8, 8, 128),    # GQA 1, exact pages, short prompt
    ([2049, 640], [2049, 8], 16, 2, 128),           # GQA 8, 8-token verify rows after a prefix
    ([1, 130, 4000], [1, 2, 1500], 8, 4, 128),      # 1-token context, chunked prefill
    ([700, 333], [700, 20], 8, 4, 64),              # the shipped model's heads (d64)
    ([4200, 300], [4200, 44], 8, 4, 64),            # d64 from 4096 tokens: three warpgroups
])
@pytest.mark.parametrize("knobs", [{}, dict(persistent=True), dict(stages=3, pingpong=True),
                                   dict(consumers=3), dict(consumers=3, persistent=True),
                                   dict(head_group="kv"), dict(head_group="kv", persistent=True)])
def test_matches_reference(lens, qlens, h_q, h_kv, d, knobs):
    """``head_group="kv"``: the work order in sections of one KV head's query heads."""
    if knobs.get("head_group") == "kv":
        knobs = {**knobs, "head_group": h_q // h_kv}
    args = _inputs(lens, qlens, h_q, h_kv, d=d)
    assert PG.gluon_applies(*args[:3])
    got = PG.prefill_attention_gluon(*args, d**-0.5, out=torch.full_like(args[0], float("nan")),
                                     **knobs)
    want = ref.prefill_attention(*T.as64(*args[:3]), *args[3:], d**-0.5)
    assert torch.isfinite(got).all()
    assert T.rel_err(got, want) < 1e-2


@pytest.mark.parametrize("page,ppb", [(16, 8), (32, 4), (64, 2), (16, 16)])
@pytest.mark.parametrize("lens,qlens,h_q,h_kv,d,consumers", [
    ([1000, 300, 129], [1000, 44, 1], 32, 8, 128, 2),
    ([2049, 640], [2049, 8], 16, 2, 128, 2),
    ([700, 333], [700, 20], 8, 4, 64, 2),
    ([700, 333], [700, 20], 8, 4, 64, 3),  # FA3's d64 tile: 192 query rows, three warpgroups
])
def test_small_pages_match_reference(page, ppb, lens, qlens, h_q, h_kv, d, consumers):
    """Pages below the 128-token tile: a tile is 128 // page TMA boxes, one per page, each
    from its own place in the cache (the block's pages are head-major, so a head's pages
    are H_kv pages apart); a box landing in the wrong rows of the tile is far off."""
    args = _inputs(lens, qlens, h_q, h_kv, d=d, page=page, ppb=ppb)
    assert PG.gluon_applies(*args[:3])
    got = PG.prefill_attention_gluon(*args, d**-0.5, out=torch.full_like(args[0], float("nan")),
                                     consumers=consumers)
    want = ref.prefill_attention(*T.as64(*args[:3]), *args[3:], d**-0.5)
    assert torch.isfinite(got).all()
    assert T.rel_err(got, want) < 1e-2


def test_a_wrong_head_is_caught():
    """The check above can fail: the same call with K/V heads swapped is far off."""
    args = list(_inputs([300], [300], 8, 2))
    want = ref.prefill_attention(*T.as64(*args[:3]), *args[3:], 128**-0.5)
    args[1], args[2] = args[1].flip(2).contiguous(), args[2].flip(2).contiguous()
    got = PG.prefill_attention_gluon(*args, 128**-0.5)
    assert T.rel_err(got, want) > 0.1


def test_refuses_what_it_cannot_run():
    q, kc, vc, *_ = _inputs([20], [20], 8, 2)
    assert not PG.gluon_applies(q.float(), kc.float(), vc.float())
    kc16, vc16, _, _ = T.make_paged([20], 2, 128, 16, 4, torch.bfloat16, "cuda")
    assert not PG.gluon_applies(q, kc16, vc16)  # 64-token blocks: a tile would cross blocks
    kc8, vc8, _, _ = T.make_paged([20], 2, 128, 8, 16, torch.bfloat16, "cuda")
    assert not PG.gluon_applies(q, kc8, vc8)  # pages below 16 tokens
    q48, kc48, vc48, *_ = _inputs([20], [20], 8, 2, d=48)
    assert not PG.gluon_applies(q48, kc48, vc48)
    with pytest.raises(ValueError, match="128-token tiles"):
        PG.prefill_attention_gluon(q, kc16, vc16, None, None, None, 1.0)
    args = _inputs([20], [20], 8, 2)
    with pytest.raises(ValueError, match="ping-pong only with 2"):
        PG.prefill_attention_gluon(*args, 1.0, consumers=3, pingpong=True)
    with pytest.raises(ValueError, match="whole KV heads"):
        PG.prefill_attention_gluon(*args, 1.0, head_group=2)  # half of a KV head's 4 query heads


def test_launches_again_without_binding_and_stays_exact():
    """The kernel is launched through ``FastLaunch`` (kernels/fast_launch.py): shapes
    alternating between one query tile (n_m == 1, compiled in as a constant) and several
    must each get their own compiled kernel, and a shape seen before must not bind again."""
    cases = [([300, 40], [300, 40]), ([100], [100]), ([900, 7], [600, 7]), ([64, 64], [64, 64])]
    compiled = []
    for _ in range(2):
        for lens, qlens in cases:
            args = _inputs(lens, qlens, 16, 4, seed=len(lens))
            got = PG.prefill_attention_gluon(*args, 128**-0.5)
            want = ref.prefill_attention(*T.as64(*args[:3]), *args[3:], 128**-0.5)
            assert T.rel_err(got, want) < 1e-2, (lens, qlens)
        compiled.append(dict(PG._launch.compiled))
    assert compiled[0] == compiled[1] and len(compiled[0]) >= 2
