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
from pdflow.kernels import prefill_gluon
from pdflow.kernels import reference as ref
from pdflow.kernels.decode_attention import decode_attention
from pdflow.kernels.prefill_attention import prefill_attention

from . import paged_inputs as T
from .prefill_variants import prefill_attention_variant, variant_kv_mode
from .shapes import causal_flops, heads, prefill_case, prefix_case

# (block_n, num_warps, num_stages)
# The first H200 run swept 8 tiles x 4 splits (bn64 w4 st4 splits1 won, 4.43 TB/s); keep
# the top few so the lease goes to the prefill variants.
DECODE_TILES = [(64, 4, 4), (64, 4, 3), (128, 4, 3), (32, 2, 4)]
DECODE_SPLITS = [1, 2]
# (block_m, block_n, num_warps, num_stages)
PREFILL_TILES = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3)]


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
    hq, hkv, d = heads(run)
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
    hq, hkv, d = heads(run)
    t = 48 if run.tiny else 8192
    q, kc, vc, cu, cl, bt = prefill_case(run, t, page, ppb)
    default = prefill_attention(q, kc, vc, cu, cl, bt, d**-0.5, max_seqlen_q=t)
    flops = causal_flops(t, hq, d)
    rows = []
    for bm, bn, w, st in tiles:
        params = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}
        fn = partial(prefill_attention, q, kc, vc, cu, cl, bt, d**-0.5, max_seqlen_q=t,
                     **params)
        rows.append(_variant(run, "sweep prefill", f"T{t} page{page}", fn, default,
                             flops=flops, cfg=f"bm{bm} bn{bn} w{w} st{st}", params=params))
    _best(run, rows)


# Prefill variants (prefill_variants.py), riskiest last: a compiler abort there loses
# only the rows after it (the script writes results after every step).
BIG = dict(block_m=128, block_n=128, num_warps=8, num_stages=2)
PREFILL_VARIANTS = [
    dict(kv="ptr"), dict(kv="tma"), dict(kv="tma2d"), dict(kv="tma2d", prescale=True),
    dict(kv="tma2d", persistent=True), dict(kv="tma2d", loop_stages=3),
    dict(kv="tma2d", block_n=64, num_stages=3), dict(kv="tma2d", num_warps=4),
    dict(kv="tma2d", prescale=True, persistent=True),
    dict(kv="tma2d", loop_stages=2, warp_specialize=True),
]


def _label(kw, mode):
    extra = [f"{k}={v}" for k, v in kw.items() if k != "kv" and BIG.get(k) != v]
    return " ".join([mode, *extra])


def sweep_prefill_variants(run, page, ppb, t=None):
    """Each variant vs SDPA causal timed in the same run (run.sdpa_ms); ``tma2d`` falls
    back to the 4D page boxes below page == block, so page 16 runs each as "tma"."""
    hq, hkv, d = heads(run)
    t = t or (48 if run.tiny else 8192)
    q, kc, vc, cu, cl, bt = prefill_case(run, t, page, ppb)
    default = prefill_attention(q, kc, vc, cu, cl, bt, d**-0.5, max_seqlen_q=t)
    flops = causal_flops(t, hq, d)
    base = getattr(run, "sdpa_ms", {}).get(t)
    rows, seen = [], set()
    for variant in PREFILL_VARIANTS:
        kw = {**BIG, **variant}
        if run.tiny:
            kw.update(block_m=32, block_n=16, num_warps=4, num_stages=1)
        mode = variant_kv_mode(kc, kw["kv"], kw["block_n"])
        cfg = _label({**kw, "kv": mode}, mode)
        if cfg in seen:
            continue
        seen.add(cfg)
        fn = partial(prefill_attention_variant, q, kc, vc, cu, cl, bt, d**-0.5, max_seqlen_q=t,
                     **kw)
        row = _variant(run, "variant prefill", f"T{t} page{page}", fn, default, flops=flops,
                       cfg=cfg, params=kw)
        if row and base:
            row["vs_baseline"] = round(base / row["ms"], 3)
        rows.append(row)
        run.checkpoint()
    _best(run, rows)


# Round 4 of bench/KERNEL_NOTES.md (the --prefill-only sweep): packed bf16x2 exp2 and two
# 64-row halves on the tma2d 3-stage loop, then the control, then the halves at 8 warps (AOT:
# 680 B spilled, expected to lose). Each entry overrides BIG.
R2_BEST = dict(kv="tma2d", loop_stages=3)
HALVES = dict(split=2, num_warps=4, block_n=64)
PREFILL_ROUND = [
    dict(R2_BEST, exp="bf16x2"),
    dict(R2_BEST, **HALVES, exp="bf16x2"),
    dict(R2_BEST, **HALVES),
    dict(R2_BEST),
    dict(R2_BEST, split=2, exp="bf16x2"),
]
TINY = dict(block_m=32, block_n=16, num_warps=4, num_stages=1)


def _round_call(kw, tiny):
    """The variant call with its label (tiny: the CPU tile shape, left out of the label)."""
    kw = {**BIG, **kw}
    if tiny:
        kw.update(TINY, loop_stages=1)
    skip = (*TINY, "loop_stages") if tiny else ()
    label = _label({k: v for k, v in kw.items() if k not in skip}, kw["kv"])
    return partial(prefill_attention_variant, **kw), label


def _round_inputs(run, page, ppb):
    """The realistic check case (prefix hits, a verify row; float64 reference) and the
    timing case (one 8K causal prompt) for one page size."""
    hq, hkv, d = heads(run)
    check = q, kc, vc, cu, cl, bt = prefix_case(run, page, ppb)
    want = ref.prefill_attention(*T.as64(q, kc, vc), cu, cl, bt, d**-0.5)
    t = 48 if run.tiny else 8192
    return check, want, prefill_case(run, t, page, ppb), t, causal_flops(t, hq, d), d**-0.5


# Round 5: the Gluon kernel (FA3 schedule, page 128 only), its measured knobs around the
# default (2 stages, no ping-pong, one program per work item).
GLUON_ROUND = [
    dict(),
    dict(stages=3, pingpong=True),
    dict(stages=3, pingpong=True, persistent=True),
    dict(stages=2, persistent=True),
    dict(stages=3),
]


def _round_entries(run):
    """(call, label, round, pages) of the --prefill-only sweep: round 5 then round 4."""
    entries = []
    if not run.tiny and prefill_gluon.gluon_available():
        for kw in GLUON_ROUND:
            full = {"stages": prefill_gluon.STAGES, "pingpong": prefill_gluon.PINGPONG,
                    "persistent": prefill_gluon.PERSISTENT, **kw}
            label = "gluon " + " ".join(f"{k}={v}" for k, v in full.items())
            entries.append((partial(prefill_gluon.prefill_attention_gluon, **full), label, "r5",
                            ((128, 1),)))
    for kw in PREFILL_ROUND:
        fn, label = _round_call(kw, run.tiny)
        entries.append((fn, label, "r4", None))
    return entries


def sweep_prefill_round(run, pages=((128, 1), (16, 8))):
    """Each variant: checked against the float64 reference on the prefix-hit case at
    both page sizes (the Gluon kernel: page 128), then timed on the 8K prompt vs SDPA
    causal from this run. A variant that raises or misses the tolerance is recorded
    and not timed."""
    if run.tiny:
        pages = ((16, 1), (8, 2))
    data = {pg: _round_inputs(run, *pg) for pg in pages}
    rows = {(rnd, pg): [] for rnd in ("r4", "r5") for pg in pages}
    for fn, label, rnd, only in _round_entries(run):
        if run.over_budget():
            print(f"  budget spent: prefill variants from {label} on skipped", flush=True)
            break
        for page, ppb in only or pages:
            check, want, timed, t, flops, scale = data[(page, ppb)]
            name = f"prefill {rnd} {label} page{page}"
            try:
                got = fn(*check, scale, out=torch.full_like(check[0], float("nan")))
                err = T.rel_err(got, want)
            except Exception as exc:
                print(f"  FAIL {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                run.checks.append({"name": name, "err": float("nan"), "tol": 1e-2, "ok": False})
                run.rows.append({"kernel": f"{rnd} prefill", "shape": f"T{t} page{page}",
                                 "note": f"{label} failed: {type(exc).__name__}"})
                continue
            ok = bool(err < 1e-2)
            run.checks.append({"name": name, "err": err, "tol": 1e-2, "ok": ok})
            print(f"  {'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e}", flush=True)
            if not ok:
                run.rows.append({"kernel": f"{rnd} prefill", "shape": f"T{t} page{page}",
                                 "note": f"{label} WRONG {err:.1e}"})
                continue
            ms = run.time_ms(partial(fn, *timed, scale, max_seqlen_q=t))
            row = run.add(f"{rnd} prefill", f"T{t} page{page}", ms, flops=flops, note=label)
            base = getattr(run, "sdpa_ms", {}).get(t)
            if base:
                row["vs_baseline"] = round(base / ms, 3)
            rows[(rnd, (page, ppb))].append(row)
        run.checkpoint()
    for key in rows:
        _best(run, rows[key])


def sweep(run) -> None:
    """The --prefill-only rounds, or every sweep."""
    if run.args.prefill_only:
        sweep_prefill_round(run)
    else:
        sweep_all(run)


def sweep_all(run) -> None:
    if run.tiny:
        sweep_decode(run, 16, 2, DECODE_TILES[:2], [1, 2])
        sweep_prefill(run, 16, 2, [(32, 16, 4, 1), (16, 16, 4, 1)])
        sweep_prefill_variants(run, 16, 1)
        return
    # The prefill variants first: they are the least settled.
    sweep_prefill_variants(run, 128, 1)
    sweep_prefill_variants(run, 16, 8)
    rows = [r for r in sweep_decode(run, 16, 8, DECODE_TILES, DECODE_SPLITS) if r]
    sweep_prefill(run, 16, 8, PREFILL_TILES)
    # Page 128: only the three best page-16 decode configs.
    top = sorted(rows, key=lambda r: -r["TB/s"])[:3]
    for r in top:
        p = r["params"]
        sweep_decode(run, 128, 1, [(p["block_n"], p["num_warps"], p["num_stages"])],
                     [p["num_splits"]])
    sweep_prefill(run, 128, 1, PREFILL_TILES[:2])
