"""Sweeps for issue 34's unmet kernel goals (``bench_kernels.py --goals``): DSpark block
attention (<= 1.1x a decode step), decode at 2K (>= 0.95x copy) and the KV write
(>= 0.9x copy). Each variant is compared with its default's output before it is timed
(sweep._variant); the best per shape is printed as a BEST row, its ratio to the goal's
baseline from this run beside it.
"""

from __future__ import annotations

import itertools
from functools import partial

import torch
from pdflow.kernels.block_attention import block_attention
from pdflow.kernels.decode_attention import decode_attention
from pdflow.kernels.store_kv import store_kv

from . import paged_inputs as T
from .shapes import DT, PAGES, decode_bytes, heads
from .sweep import _best, _variant

# (block_n, num_warps, num_stages) x splits; the default (64, 4, 4) x 1 is among them.
BLOCK_TILES = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
BLOCK_SPLITS = [1, 2]
DECODE_2K_TILES = [(64, 4, 4), (64, 4, 5), (64, 4, 6), (64, 8, 4), (128, 4, 3), (128, 8, 3),
                   (128, 8, 4), (32, 4, 6), (32, 2, 6), (64, 2, 2), (64, 2, 3), (64, 2, 4),
                   (128, 2, 2), (128, 2, 3), (128, 4, 2)]
DECODE_2K_SPLITS = [1, 2]
# num_warps of the KV write (one token a program: 2-8 a program gained nothing on the H200)
STORE_WARPS = (1, 2, 4, 8)


def _with_ratio(row, base_ms, label):
    if row and base_ms:
        row["vs_baseline"] = round(base_ms / row["ms"], 3)
        row["note"] += f" (vs_baseline: {label})"
    return row


def sweep_block(run, page, ppb, tiles=BLOCK_TILES, splits=BLOCK_SPLITS):
    hq, hkv, d = heads(run)
    b, kb, ctx = (2, 4, 40) if run.tiny else (64, 8, 8192)
    kc, vc, cl, bt = T.random_paged(b, ctx, hkv, d, page, ppb, DT, run.dev)
    q = T.randn(b, kb, hq, d, dtype=DT, device=run.dev)
    kx = T.randn(b, kb, hkv, d, dtype=DT, device=run.dev, seed=2)
    default = block_attention(q, kx, kx, kc, vc, cl, bt, d**-0.5)
    dec = getattr(run, "decode_ms", {}).get((ctx, page))
    rows = []
    for (bn, w, st), s in itertools.product(tiles, splits):
        params = {"block_n": bn, "num_warps": w, "num_stages": st, "num_splits": s}
        fn = partial(block_attention, q, kx, kx, kc, vc, cl, bt, d**-0.5, **params)
        row = _variant(run, "sweep block", f"B{b} K{kb} ctx{ctx} page{page}", fn, default,
                       nbytes=decode_bytes(b, ctx + kb, hq * kb, hkv, d),
                       cfg=f"bn{bn} w{w} st{st} splits{s}", params=params)
        rows.append(_with_ratio(row, dec, "decode step"))
    _best(run, rows)
    return [r for r in rows if r]


def sweep_decode_short(run, page, ppb, tiles=DECODE_2K_TILES, splits=DECODE_2K_SPLITS):
    hq, hkv, d = heads(run)
    b, ctx = (2, 40) if run.tiny else (64, 2048)
    kc, vc, cl, bt = T.random_paged(b, ctx, hkv, d, page, ppb, DT, run.dev)
    q = T.randn(b, hq, d, dtype=DT, device=run.dev)
    default = decode_attention(q, kc, vc, cl, bt, d**-0.5)
    rows = []
    for (bn, w, st), s in itertools.product(tiles, splits):
        params = {"block_n": bn, "num_warps": w, "num_stages": st, "num_splits": s}
        fn = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, **params)
        rows.append(_variant(run, "sweep decode", f"B{b} ctx{ctx} page{page}", fn, default,
                             nbytes=decode_bytes(b, ctx, hq, hkv, d),
                             cfg=f"bn{bn} w{w} st{st} splits{s}", params=params))
    _best(run, rows)
    return [r for r in rows if r]


def sweep_store(run, page, ppb, warps=STORE_WARPS):
    _, hkv, d = heads(run)
    n = 64 if run.tiny else 8192
    nb = n // (page * ppb) + 1
    kc = torch.zeros((nb, ppb, hkv, page, d), dtype=DT, device=run.dev)
    vc = torch.zeros_like(kc)
    k = T.randn(n, hkv, d, dtype=DT, device=run.dev)
    v = T.randn(n, hkv, d, dtype=DT, device=run.dev, seed=2)
    slots = torch.arange(n, device=run.dev)
    store_kv(k, v, kc, vc, slots)
    default = torch.cat([kc.flatten(), vc.flatten()]).clone()

    def write(**params):
        kc.zero_()
        vc.zero_()
        store_kv(k, v, kc, vc, slots, **params)
        return torch.cat([kc.flatten(), vc.flatten()])

    rows = []
    for w in warps:
        params = {"num_warps": w}
        check = _variant(run, "sweep store check", f"N{n} page{page}", partial(write, **params),
                         default, cfg=f"w{w}")
        if check is None:
            continue
        run.rows.remove(check)  # timed again below without the zeroing and the concat
        ms = run.time_ms(partial(store_kv, k, v, kc, vc, slots, **params))
        row = run.add("sweep store", f"N{n} page{page}", ms, nbytes=4 * n * hkv * d * 2,
                      note=f"w{w}")
        row["params"] = params
        rows.append(row)
    _best(run, rows)
    return rows


def sweep_goals(run) -> None:
    """Block attention and decode at 2K (page 16 in full, page 128 the three best), the
    KV write at both pages."""
    for page, ppb in PAGES:
        sweep_store(run, page, ppb)
        run.checkpoint()
    tiny = run.tiny
    for sweep_fn, tiles, splits in ((sweep_block, BLOCK_TILES, BLOCK_SPLITS),
                                    (sweep_decode_short, DECODE_2K_TILES, DECODE_2K_SPLITS)):
        rows = sweep_fn(run, *PAGES[0], tiles[:2] if tiny else tiles, splits)
        run.checkpoint()
        for r in sorted(rows, key=lambda r: r["ms"])[:3]:
            p = r["params"]
            sweep_fn(run, *PAGES[1], [(p["block_n"], p["num_warps"], p["num_stages"])],
                     [p["num_splits"]])
        run.checkpoint()
