"""Bounded tuning sweep for scripts/bench_kernels.py (one short GPU lease).

Variants in priority order, stopping when the run's time budget is spent. Each
variant's output is compared with the default config's (a miscompiled variant would
show up as an error, not as a fast time). Failing variants (e.g. too much shared
memory for the stage count) are recorded and skipped.
"""

from __future__ import annotations

import itertools
from functools import partial

import torch

from . import testing as T
from .decode_attention import decode_attention
from .prefill_attention import prefill_attention

# (block_n, num_warps, num_stages)
DECODE_TILES = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (64, 8, 3),
                (128, 8, 2), (32, 2, 4)]
DECODE_SPLITS = [1, 2, 4, 8]
# (block_m, block_n, num_warps, num_stages)
PREFILL_TILES = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 3),
                 (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 4), (64, 128, 4, 3),
                 (128, 128, 8, 2)]


def _variant(run, kernel, shape, fn, default_out, nbytes=None, flops=None, cfg="", params=None):
    if run.over_budget():
        return None
    try:
        out = fn()
        err = T.rel_err(out, default_out)
    except Exception as exc:
        print(f"  {kernel} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        run.rows.append({"kernel": kernel, "shape": shape, "note": f"{cfg} failed"})
        return None
    if not err < 1e-2:
        print(f"  {kernel} {cfg}: differs from default (rel {err:.2e})", flush=True)
        run.rows.append({"kernel": kernel, "shape": shape, "note": f"{cfg} WRONG {err:.1e}"})
        return None
    ms = run.time_ms(fn)
    row = run.add(kernel, shape, ms, nbytes=nbytes, flops=flops, note=cfg)
    row["params"] = params
    return row


def _best(run, rows):
    rows = [r for r in rows if r]
    if rows:
        best = min(rows, key=lambda r: r["ms"])  # same shape in every row: fastest wins
        run.rows.append({**best, "note": "BEST " + best["note"]})
        print(f"  best: {best}", flush=True)


def sweep_decode(run, page, ppb, tiles, splits):
    hq, hkv, d = (4, 2, 64) if run.tiny else (32, 8, 128)
    b, ctx = (2, 40) if run.tiny else (64, 8192)
    kc, vc, cl, bt = T.random_paged(b, ctx, hkv, d, page, ppb, torch.bfloat16, run.dev)
    q = T.randn(b, hq, d, dtype=torch.bfloat16, device=run.dev)
    default = decode_attention(q, kc, vc, cl, bt, d**-0.5)
    nbytes = 2 * b * ctx * hkv * d * 2
    rows = []
    for (bn, w, st), s in itertools.product(tiles, splits):
        params = {"block_n": bn, "num_warps": w, "num_stages": st, "num_splits": s}
        fn = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, **params)
        rows.append(_variant(run, "sweep decode", f"B{b} ctx{ctx} page{page}", fn, default,
                             nbytes=nbytes, cfg=f"bn{bn} w{w} st{st} splits{s}",
                             params=params))
    _best(run, rows)
    return rows


def sweep_prefill(run, page, ppb, tiles):
    hq, hkv, d = (4, 2, 64) if run.tiny else (32, 8, 128)
    t = 48 if run.tiny else 8192
    kc, vc, cl, bt = T.random_paged(1, t, hkv, d, page, ppb, torch.bfloat16, run.dev)
    q = T.randn(t, hq, d, dtype=torch.bfloat16, device=run.dev)
    cu = torch.tensor([0, t], dtype=torch.int32, device=run.dev)
    default = prefill_attention(q, kc, vc, cu, cl, bt, d**-0.5, max_seqlen_q=t)
    flops = 4 * hq * d * t * (t + 1) // 2
    rows = []
    for bm, bn, w, st in tiles:
        params = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}
        fn = partial(prefill_attention, q, kc, vc, cu, cl, bt, d**-0.5, max_seqlen_q=t,
                     **params)
        rows.append(_variant(run, "sweep prefill", f"T{t} page{page}", fn, default,
                             flops=flops, cfg=f"bm{bm} bn{bn} w{w} st{st}", params=params))
    _best(run, rows)


def sweep_all(run) -> None:
    if run.tiny:
        sweep_decode(run, 16, 2, DECODE_TILES[:2], [1, 2])
        sweep_prefill(run, 16, 2, [(32, 16, 4, 1), (16, 16, 4, 1)])
        return
    rows = [r for r in sweep_decode(run, 16, 8, DECODE_TILES, DECODE_SPLITS) if r]
    sweep_prefill(run, 16, 8, PREFILL_TILES)
    # Page 128: only the three best page-16 decode configs.
    top = sorted(rows, key=lambda r: -r["TB/s"])[:3]
    for r in top:
        p = r["params"]
        sweep_decode(run, 128, 1, [(p["block_n"], p["num_warps"], p["num_stages"])],
                     [p["num_splits"]])
    sweep_prefill(run, 128, 1, PREFILL_TILES[:4])
