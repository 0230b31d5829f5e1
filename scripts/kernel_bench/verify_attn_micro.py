"""The fp32 verify's paged attention (8 query rows of batch 1 on the shipped model's
heads, a drafted step's shape) timed inside a CUDA graph for each (splits, block_n,
warps, stages), printed against the default choice, so a better default is measured.

  python scripts/kernel_bench/verify_attn_micro.py [--ctx 256 512 1024 2048]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
from pdflow.kernels.decode_attention import default_splits, paged_attention

sys.path.insert(0, str(Path(__file__).parent))
from paged_inputs import random_paged  # noqa: E402
from small_m_micro import graph_us  # noqa: E402


def sweep(ctx: int, nq: int, h_q: int, h_kv: int, d: int, page: int, ppb: int, grid) -> None:
    """``grid``: (splits, block_n, warps, stages) choices, every combination timed."""
    dev = torch.device("cuda")
    kc, vc, lens, bt = random_paged(1, ctx, h_kv, d, page, ppb, torch.float32, dev)
    q = torch.randn(1, nq, h_q, d, device=dev)
    out = torch.empty_like(q)
    scale = d ** -0.5

    def run(**tune):
        return graph_us(lambda: paged_attention(q, kc, vc, lens, bt, scale, out=out, **tune))

    default = run()
    auto = default_splits(1, h_kv, dev, None)
    want = paged_attention(q, kc, vc, lens, bt, scale).clone()
    rows = []
    for splits, bn, warps, stages in itertools.product(*grid):
        tune = dict(num_splits=splits, block_n=bn, num_warps=warps, num_stages=stages)
        got = paged_attention(q, kc, vc, lens, bt, scale, **tune)
        err = float((got - want).abs().max())
        rows.append((run(**tune), splits, bn, warps, stages, err))
    rows.sort()
    print(f"ctx {ctx} nq {nq} heads {h_q}/{h_kv} d {d}: default (splits {auto}) {default:.1f} us", flush=True)
    for us, splits, bn, warps, stages, err in rows[:6]:
        print(f"  splits {splits:2d} bn {bn:2d} warps {warps} stages {stages}: {us:.1f} us "
              f"({default / us:.2f}x the default, max diff {err:.1e})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--nq", type=int, default=8)
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()
    for ctx in args.ctx:
        sweep(ctx, args.nq, 8, 4, 64, 16, 8,
              (args.splits, (16, 32, 64), args.warps, args.stages))


if __name__ == "__main__":
    main()
