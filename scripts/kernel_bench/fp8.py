"""fp8 (e4m3) KV with per-(token, head) scales, for scripts/bench_kernels.py --fp8-kv.

Checks: the KV write stores the torch reference's bytes exactly (kernels/kv_quant.py:
the rounding is done on fp32 bits, the same on every device), and decode and DSpark block
attention over the fp8 cache equal the reference (which dequantizes exactly, so the same
tolerance as bf16). Timings: paged decode over the fp8 cache against the same run's
device copy, counting the bytes it must read (e4m3 K and V, one scale byte per token-head
each, plus q and out), and the bf16 decode of the same shape for the ratio the smaller
cache buys.
"""

from __future__ import annotations

from functools import partial

import torch
from pdflow.kernels import reference as ref
from pdflow.kernels.block_attention import block_attention
from pdflow.kernels.decode_attention import decode_attention
from pdflow.kernels.kv_quant import FP8
from pdflow.kernels.prefill_attention import prefill_attention as prefill_pointer
from pdflow.kernels.prefill_auto import prefill_attention as prefill_default
from pdflow.kernels.store_kv import store_kv

from . import paged_inputs as T
from .benchmarks import _record as check_close
from .benchmarks import with_same_copy
from .shapes import DT, PAGES, causal_flops, decode_bytes, heads, prefill_case


def fp8_paged(batch, ctx, h_kv, d, page, ppb, device, seed=0):
    """Random fp8 caches (written by the reference's quantizer) on shuffled blocks:
    (k, v, k_scale, v_scale, context_lens, block_tables)."""
    bs = page * ppb
    per_seq = -(-ctx // bs)
    nb = batch * per_seq
    gen = torch.Generator(device=device).manual_seed(seed)
    caches = [torch.empty(nb, ppb, h_kv, page, d, dtype=FP8, device=device) for _ in range(2)]
    scales = [torch.empty(nb, ppb, h_kv, page, 1, dtype=torch.uint8, device=device) for _ in range(2)]
    slots = torch.arange(nb * bs, device=device)
    for lo in range(0, nb * bs, 1 << 20):  # in slices: the reference's temporaries stay small
        s = slots[lo : lo + (1 << 20)]
        k = torch.randn(len(s), h_kv, d, device=device, generator=gen)
        v = torch.randn(len(s), h_kv, d, device=device, generator=gen)
        ref.store_kv(k, v, *caches, s, *scales)
    tables = torch.randperm(nb, device=device, generator=gen).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return (*caches, *scales, lens, tables)


def fp8_decode_bytes(b, ctx, hq, hkv, d):
    """e4m3 K and V, a scale byte per token-head each, q and out (bf16)."""
    return 2 * b * ctx * hkv * (d + 1) + 2 * b * hq * d * 2


def check_fp8(run) -> None:
    hq, hkv, d = heads(run)
    dev = run.dev
    n = 200 if run.tiny else 70_000
    for page, ppb in PAGES:
        nb = -(-n // (page * ppb)) + 2
        gen = torch.Generator().manual_seed(page)
        slots = torch.randperm(nb * page * ppb, generator=gen)[:n].to(dev)
        k = (torch.randn(n, hkv, d, generator=gen) * 4).to(dev, DT)
        v = (torch.randn(n, hkv, d, generator=gen) ** 3).to(dev, DT)
        want = [torch.zeros(nb, ppb, hkv, page, dd, dtype=t, device=dev)
                for t, dd in ((FP8, d), (FP8, d), (torch.uint8, 1), (torch.uint8, 1))]
        got = [c.clone() for c in want]
        ref.store_kv(k, v, *want[:2], slots, *want[2:])
        store_kv(k, v, *got[:2], slots, *got[2:])
        diff = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(got, want, strict=True))
        name = f"fp8 store_kv page{page} N{n} (bytes differing: {diff})"
        run.checks.append({"name": name, "err": float(diff), "tol": 0, "ok": diff == 0})
        print(f"  {'ok  ' if diff == 0 else 'FAIL'} {name}: rel err {diff:.2e} (tol 0e+00)", flush=True)
    lens = [40, 1, 33, 17] if run.tiny else [8192, 1, 4099, 777, 3000]
    for page, ppb in PAGES:
        for splits in (None, 4):
            kc, vc, ks, vs, cl, bt = fp8_paged(len(lens), max(lens), hkv, d, page, ppb, dev)
            cl = torch.tensor(lens, dtype=torch.int32, device=dev)
            q = T.randn(len(lens), hq, d, dtype=DT, device=dev)
            want = ref.decode_attention(q.double(), kc, vc, cl, bt, d**-0.5, ks, vs)
            got = decode_attention(q, kc, vc, cl, bt, d**-0.5, ks, vs, num_splits=splits)
            check_close(run, f"fp8 decode page{page} splits{splits}", got, want, DT)
        kb = 4
        qb = T.randn(len(lens), kb, hq, d, dtype=DT, device=dev)
        xk, xv = (T.randn(len(lens), kb, hkv, d, dtype=DT, device=dev) for _ in range(2))
        want = ref.block_attention(qb.double(), xk.double(), xv.double(), kc, vc, cl, bt, d**-0.5, ks, vs)
        got = block_attention(qb, xk, xv, kc, vc, cl, bt, d**-0.5, ks, vs)
        check_close(run, f"fp8 block page{page}", got, want, DT)


def bench_fp8_store(run) -> None:
    """The quantizing KV write (V into transposed head pages, a [D, tokens] tile a
    program) against the bf16 write of the same tokens."""
    _, hkv, d = heads(run)
    for n in ([64] if run.tiny else [8192, 65536]):
        k = T.randn(n, hkv, d, dtype=DT, device=run.dev)
        v = T.randn(n, hkv, d, dtype=DT, device=run.dev, seed=2)
        slots = torch.arange(n, device=run.dev)
        for page, ppb in PAGES:
            shape = (n // (page * ppb) + 1, ppb, hkv, page)
            kc, vc = (torch.empty((*shape, d), dtype=DT, device=run.dev) for _ in range(2))
            ms16 = run.time_ms(partial(store_kv, k, v, kc, vc, slots))
            k8, v8 = (torch.zeros((*shape, d), dtype=FP8, device=run.dev) for _ in range(2))
            ks, vs = (torch.zeros((*shape, 1), dtype=torch.uint8, device=run.dev) for _ in range(2))
            ms = run.time_ms(partial(store_kv, k, v, k8, v8, slots, ks, vs))
            nbytes = 2 * n * hkv * (2 * d + d + 1)
            run.add("store_kv triton fp8", f"N{n} page{page}", ms, nbytes=nbytes, baseline=ms16,
                    note="vs_baseline: the bf16 write of the same tokens")
            for tokens in (8, 32, 64):  # a tile past its page (32, 64 at page 16) is never a run
                alt = run.time_ms(partial(store_kv, k, v, k8, v8, slots, ks, vs, fp8_tokens=tokens))
                run.add(f"store_kv triton fp8 T{tokens}", f"N{n} page{page}", alt, nbytes=nbytes,
                        baseline=ms, note="vs_baseline: the default tokens a program")


def bench_fp8_prefill(run) -> None:
    """Prefill over an fp8 cache (the pointer kernel, dequantizing as it loads) against
    the bf16 cache's default prefill and the same pointer kernel in bf16."""
    hq, hkv, d = heads(run)
    for t in ([48] if run.tiny else [2048, 8192]):
        flops = causal_flops(t, hq, d)
        for page, ppb in PAGES:
            q, kc, vc, cu, cl, bt = prefill_case(run, t, page, ppb)
            base = run.time_ms(partial(prefill_default, q, kc, vc, cu, cl, bt, d**-0.5, max_seqlen_q=t))
            run.add("prefill default bf16 kv", f"T{t} page{page}", base, flops=flops)
            ptr = run.time_ms(partial(prefill_pointer, q, kc, vc, cu, cl, bt, d**-0.5, max_seqlen_q=t))
            run.add("prefill pointer bf16 kv", f"T{t} page{page}", ptr, flops=flops, baseline=base,
                    note="vs_baseline: the bf16 default prefill")
            k8, v8, ks, vs, cl8, bt8 = fp8_paged(1, t, hkv, d, page, ppb, run.dev)
            fn = partial(prefill_pointer, q, k8, v8, cu, cl8, bt8, d**-0.5, max_seqlen_q=t, k_scale=ks, v_scale=vs)
            run.add("prefill pointer fp8 kv", f"T{t} page{page}", run.time_ms(fn), flops=flops, baseline=base,
                    note="vs_baseline: the bf16 default prefill")


def bench_fp8(run) -> None:
    """fp8 decode vs copy of its bytes (the acceptance: >= 0.9x), beside bf16 decode."""
    bench_fp8_store(run)
    bench_fp8_prefill(run)
    hq, hkv, d = heads(run)
    b = 2 if run.tiny else 64
    decode_rows = []  # (context, the default fp8 decode's row): the summary's figures
    for ctx in ([40] if run.tiny else [2048, 8192, 32768]):
        for page, ppb in PAGES:
            kc, vc, ks, vs, cl, bt = fp8_paged(b, ctx, hkv, d, page, ppb, run.dev)
            q = T.randn(b, hq, d, dtype=DT, device=run.dev)
            ms = run.time_ms(partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs))
            k16, v16, cl16, bt16 = T.random_paged(b, ctx, hkv, d, page, ppb, DT, run.dev)
            ms16 = run.time_ms(partial(decode_attention, q, k16, v16, cl16, bt16, d**-0.5))
            run.add("decode triton bf16 kv", f"B{b} ctx{ctx} page{page}", ms16,
                    nbytes=decode_bytes(b, ctx, hq, hkv, d))
            row = run.add("decode triton fp8 kv", f"B{b} ctx{ctx} page{page}", ms,
                          nbytes=fp8_decode_bytes(b, ctx, hq, hkv, d), baseline=ms16,
                          note="vs_baseline: bf16-KV decode of the same shape")
            with_same_copy(run, row, fp8_decode_bytes(b, ctx, hq, hkv, d),
                           partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs))
            decode_rows.append((ctx, row))
            # the default reads K and V a page at a time: against K per token and V as one tile
            fn = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, v_pages=False)
            run.add("decode triton fp8 kv v_pages=False", f"B{b} ctx{ctx} page{page}", run.time_ms(fn),
                    nbytes=fp8_decode_bytes(b, ctx, hq, hkv, d), baseline=ms,
                    note="vs_baseline: the default (K and V read a page at a time)")
            if not run.tiny:  # half the bytes of a bf16 step: does a second wave of programs pay?
                for splits in (2, 4):
                    fn = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, num_splits=splits)
                    run.add(f"decode triton fp8 kv splits{splits}", f"B{b} ctx{ctx} page{page}",
                            run.time_ms(fn), nbytes=fp8_decode_bytes(b, ctx, hq, hkv, d), baseline=ms,
                            note="vs_baseline: the default splits")
            if ctx in (2048, 8192) and not run.tiny:  # the tiles a smaller cache may want (not the default)
                for block_n, warps, stages in ((64, 4, 4), (128, 4, 3), (256, 8, 3), (128, 8, 4)):
                    fn = partial(decode_attention, q, kc, vc, cl, bt, d**-0.5, ks, vs, block_n=block_n,
                                 num_warps=warps, num_stages=stages)
                    alt = run.time_ms(fn)
                    tile = f"bn{block_n} w{warps} st{stages}"
                    run.add(f"decode triton fp8 kv {tile}", f"B{b} ctx{ctx} page{page}", alt,
                            nbytes=fp8_decode_bytes(b, ctx, hq, hkv, d), baseline=ms,
                            note="vs_baseline: the default tiles")

    def worst(key, min_ctx=0):
        return min((r[key] for ctx, r in decode_rows if r.get(key) is not None and ctx >= min_ctx), default=None)

    print(f"  fp8 KV decode vs the 1 GiB copy's rate: worst {worst('vs_copy')}, ctx >= 8192 worst "
          f"{worst('vs_copy', 8192)} (acceptance: >= 0.9); against a copy of its bytes "
          f"(same traffic) worst {worst('vs_same_copy')}, both in CUDA graphs "
          f"worst {worst('graph_vs_copy')}", flush=True)
