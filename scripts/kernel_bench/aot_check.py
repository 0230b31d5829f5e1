"""Compile the kernels (and the experimental prefill variants) for sm_90 (H100/H200)
without a GPU, and check they pipeline.

``python scripts/kernel_bench/aot_check.py`` builds the decode, merge, prefill and
KV-write kernels at their Llama-like bf16 configs through triton's own compiler and
ptxas, as the JIT would on the GPU (integer strides marked divisible by 16, as the JIT
specialises them), and asserts that the K/V loads became async copies
(software-pipelined) and that shared memory fits. It catches GPU-only compile errors
before a GPU lease is spent.
"""

from __future__ import annotations

import os
import re
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("aot_check needs TRITON_INTERPRET unset (it compiles real GPU code)")

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "kernel_bench"  # noqa: A001
    import kernel_bench  # noqa: E402, F401  (maps pdflow.kernels without an install)

import triton  # noqa: E402
from pdflow.kernels import copy_runs as CR  # noqa: E402
from pdflow.kernels import decode_attention as DA  # noqa: E402
from pdflow.kernels import prefill_attention as PA  # noqa: E402
from pdflow.kernels import prefill_gluon as PG  # noqa: E402
from pdflow.kernels import prefill_gluon_kernel as PGK  # noqa: E402
from pdflow.kernels import prefill_tma as PT  # noqa: E402
from pdflow.kernels import store_kv as SK  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from . import prefill_variants as PV  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024
BF = "*bf16"


# The fp8 KV cache's per-(token, head) scale caches (e8m0 bytes) and the constexprs of the
# kernels that read or write them: a case that does not say compiles the unquantized path.
SCALE_PTRS = {"ks_ptr": "*u8", "vs_ptr": "*u8"}
QUANT_DEFAULTS = {"QUANT": False, "HEADROOM": SK.HEADROOM_BITS, "SW": 16, "F8_F16": False, "V_PAGES": False}
# Byte-wide global loads: a few of scales (4 at sm_90); triton 3.6 once read V a byte at a
# time (128 more, bench/KERNEL_NOTES.md row 46).
FP8_DECODE_BYTE_LOADS = 8


def compile_sm90(fn, consts: dict, ptrs: dict, floats=(), source=ASTSource, **opts):
    names = fn.arg_names
    consts = {**{k: v for k, v in QUANT_DEFAULTS.items() if k in names}, **consts}
    ptrs = {**{k: v for k, v in SCALE_PTRS.items() if k in names}, **ptrs}
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32")
           for n in names}
    cx = {(names.index(n),): v for n, v in consts.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.startswith("s_") or sig[n].startswith("*")}
    src = source(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=SM90, options=opts)


def gluon_case(page=128, ppb=1, d=128, consumers=2):
    """The Gluon prefill at its default settings (page 128, or a smaller page a tile loads
    as 128 / page TMA boxes; ``consumers`` warpgroups of 64 query rows), if this triton
    has Gluon."""
    if not PG.gluon_available():
        return
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    bm = PG.ROWS_PER_CONSUMER * consumers
    rows = PG.ROWS_PER_CONSUMER
    q_lay = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)
    lay = gl.NVMMASharedLayout.get_default_for([PG.BLOCK_N, d], gl.bfloat16)
    desc = f"tensordesc<bf16[{rows},{d}],{q_lay!r}>"
    kv_desc = f"tensordesc<bf16[{min(page, 128)},{d}],{lay!r}>"
    consts = dict(H_Q=32, H_KV=8, D=d, PAGE=page, PPB=ppb, BM=bm, BN=PG.BLOCK_N,
                  NS=PG.STAGES, PINGPONG=PG.PINGPONG and consumers == 2, NC=consumers,
                  CONSUMER_REGS=PG.CONSUMER_REGS[consumers])
    ptrs = dict(q_desc=desc, k_desc=kv_desc, v_desc=kv_desc, cu_ptr="*i32", lens_ptr="*i32",
                bt_ptr="*i32", o_ptr=BF)
    return compile_sm90(PGK._prefill_gluon_kernel, consts, ptrs, ("scale_log2",),
                        source=GluonASTSource, num_warps=4)


def cases():
    dec = dict(q_ptr=BF, kc_ptr=BF, vc_ptr=BF, kx_ptr=BF, vx_ptr=BF, lens_ptr="*i32",
               bt_ptr="*i32", o_ptr=BF, ml_ptr="*fp32")
    base = dict(H_KV=8, G=4, G_PAD=4, D=128, BLOCK_D=128, PAGE=16, PPB=8, DOT_PREC="tf32",
                UPCAST=False)
    yield ("decode", DA._paged_split_kernel,
           {**base, "NQ": 1, "NX": 0, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_X": 16, "SPLITS": 1}, dec,
           dict(num_warps=4, num_stages=4), True)
    yield ("decode split4 page128", DA._paged_split_kernel,
           {**base, "PAGE": 128, "PPB": 1, "NQ": 1, "NX": 0, "BLOCK_M": 16, "BLOCK_N": 64,
            "BLOCK_X": 16, "SPLITS": 4}, {**dec, "o_ptr": "*fp32"}, dict(num_warps=4, num_stages=3), True)
    yield ("decode fp32", DA._paged_split_kernel,
           {**base, "DOT_PREC": "ieee", "NQ": 1, "NX": 0, "BLOCK_M": 16, "BLOCK_N": 64,
            "BLOCK_X": 16, "SPLITS": 1},
           {k: "*fp32" if v == BF else v for k, v in dec.items()},
           dict(num_warps=4, num_stages=4), True)
    yield ("block K8", DA._paged_split_kernel,
           {**base, "NQ": 8, "NX": 8, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_X": 16, "SPLITS": 1}, dec,
           dict(num_warps=4, num_stages=3), True)
    yield ("merge", DA._merge_splits_kernel, dict(D=128, BLOCK_D=128, SPLITS=4, S_PAD=4),
           dict(part_ptr="*fp32", ml_ptr="*fp32", o_ptr=BF), dict(num_warps=4), False)
    pre = dict(q_ptr=BF, kc_ptr=BF, vc_ptr=BF, cu_ptr="*i32", lens_ptr="*i32",
               bt_ptr="*i32", o_ptr=BF)
    yield ("prefill", PA._prefill_kernel, {**base, "BLOCK_M": 128, "BLOCK_N": 128}, pre,
           dict(num_warps=8, num_stages=2), True)
    tma = {k: v for k, v in base.items() if k != "PAGE"}
    tma.update(BLOCK_M=PT.BLOCK_M, BLOCK_N=PT.BLOCK_N, LOOP_STAGES=PT.LOOP_STAGES)
    tptr = {k: v for k, v in pre.items() if k not in ("kc_ptr", "vc_ptr")}
    tma_opts = dict(num_warps=PT.NUM_WARPS, num_stages=PT.NUM_STAGES)
    pages = f"tensordesc<bf16[{PT.BLOCK_N // 16},1,16,128]>"
    yield ("prefill tma page16 (page boxes)", PT._prefill_tma_kernel,
           {**tma, "PAGE": 16, "KV_MODE": PT.PAGE_BOXES}, {**tptr, "k_src": pages, "v_src": pages},
           tma_opts, True)
    rows = f"tensordesc<bf16[{PT.BLOCK_N},128]>"
    yield ("prefill tma page128 (row boxes)", PT._prefill_tma_kernel,
           {**tma, "PAGE": 128, "PPB": 1, "KV_MODE": PT.ROW_BOXES},
           {**tptr, "k_src": rows, "v_src": rows}, tma_opts, True)
    var = {**base, "BLOCK_M": 128, "BLOCK_N": 128, "LOOP_STAGES": 0, "WS": False,
           "PERSISTENT": False, "PRESCALE": False, "SPLIT": 1, "EXP": 0}
    desc4 = "tensordesc<bf16[8,1,16,128]>"
    yield ("prefill variant tma page16", PV._prefill_variant_kernel,
           {**var, "KV_MODE": 1}, {**tptr, "k_src": desc4, "v_src": desc4},
           dict(num_warps=8, num_stages=2), True)
    desc2 = "tensordesc<bf16[128,128]>"
    yield ("prefill variant tma2d page128 persistent", PV._prefill_variant_kernel,
           {**var, "PAGE": 128, "PPB": 1, "KV_MODE": 2, "PERSISTENT": True},
           {**tptr, "k_src": desc2, "v_src": desc2}, dict(num_warps=8, num_stages=2), True)
    yield ("prefill variant tma2d loop_stages3 bf16x2", PV._prefill_variant_kernel,
           {**var, "PAGE": 128, "PPB": 1, "KV_MODE": 2, "LOOP_STAGES": 3, "EXP": 1},
           {**tptr, "k_src": desc2, "v_src": desc2}, dict(num_warps=8, num_stages=2), True)
    desc4h = "tensordesc<bf16[4,1,16,128]>"
    yield ("prefill variant tma page16 halves w4 bn64 bf16x2", PV._prefill_variant_kernel,
           {**var, "KV_MODE": 1, "BLOCK_N": 64, "LOOP_STAGES": 3, "SPLIT": 2, "EXP": 1},
           {**tptr, "k_src": desc4h, "v_src": desc4h}, dict(num_warps=4, num_stages=2), True)
    plan = dict(plan_ptr="*i64", ids_ptr="i64", k="i64", first="i64", shift="i64")
    yield ("copy_plan (pack, two groups)", CR._copy_plan_kernel, dict(GROUPS=2, BLOCK=2048, REVERSE=False), plan,
           dict(num_warps=4), False)
    yield ("copy_plan strided (scatter)", CR._copy_plan_strided_kernel, dict(GROUPS=1, BLOCK=2048, REVERSE=True),
           {**plan, "n_slices": "i64", "parts": "i64"}, dict(num_warps=4), False)
    yield ("store_kv", SK._store_kv_kernel,
           dict(H=8, D=128, PAGE=16, PPB=8, BLOCK_H=8, BLOCK_D=128),
           dict(k_ptr=BF, v_ptr=BF, kc_ptr=BF, vc_ptr=BF, slot_ptr="*i64"),
           dict(num_warps=4), False)
    # fp8 (e4m3) KV: the quantizing write and the dequantizing decode and pointer prefill.
    f8 = "*fp8e4nv"
    yield ("store_kv fp8", SK._store_kv_fp8_kernel,
           dict(D=128, PAGE=16, PPB=8, BLOCK_T=16, BLOCK_D=128),
           dict(k_ptr=BF, v_ptr=BF, kc_ptr=f8, vc_ptr=f8, slot_ptr="*i64"),
           dict(num_warps=4), False)
    # The fp8 decode at the tiles its launcher picks (pages read a page at a time), and
    # read as one [tokens, D] tile, K per token (``v_pages=False``). K and V must each be
    # pipelined ``num_stages - 1`` tiles ahead through async copies: fewer means a tile went
    # back to plain loads (V read a byte at a time ran 2.5-3x slower on the H200,
    # bench/KERNEL_NOTES.md row 46).
    for page, ppb, v_pages in ((16, 8, True), (16, 8, False), (128, 1, True), (128, 1, False)):
        t = DA.decode_tiles(quant=True, page=page, block_m=16, nx=0, itemsize=2, cuda=True, v_pages=v_pages)
        yield (f"decode fp8 page{page}{' v_pages' if t.v_pages else ''}", DA._paged_split_kernel,
               {**base, "PAGE": page, "PPB": ppb, "NQ": 1, "NX": 0, "BLOCK_M": 16, "BLOCK_N": t.block_n,
                "BLOCK_X": 16, "SPLITS": 1, "QUANT": True, "F8_F16": True, "SW": min(page, t.block_n),
                "V_PAGES": t.v_pages},
               {**dec, "kc_ptr": f8, "vc_ptr": f8}, dict(num_warps=t.num_warps, num_stages=t.num_stages),
               2 * (t.num_stages - 1))
    yield ("prefill fp8", PA._prefill_kernel, {**base, "BLOCK_M": 128, "BLOCK_N": 64, "QUANT": True},
           {**pre, "kc_ptr": f8, "vc_ptr": f8}, dict(num_warps=8, num_stages=2), False)


# (pointer type, itemsize, dot precision) of the dtypes the prefill launcher serves.
DTYPES = {"fp32": ("*fp32", 4, "ieee"), "bf16": (BF, 2, "tf32"), "fp16": ("*fp16", 2, "tf32")}


def picked_prefill_cases():
    """The pointer prefill at the tiles its launcher picks for sm_90, for the dtype and
    head_dim pairs whose default tiles would not fit; each must fit, and within the
    launcher's own shared-memory bound (else the pick could be wrong elsewhere)."""
    for dt, d in (("fp32", 128), ("fp32", 256), ("bf16", 256), ("fp16", 64)):
        ptr, itemsize, prec = DTYPES[dt]
        tiles = PA.prefill_tiles(itemsize, d, 4, SMEM_LIMIT)
        consts = dict(H_KV=8, G=4, G_PAD=4, D=d, BLOCK_D=d, PAGE=16, PPB=8, DOT_PREC=prec,
                      UPCAST=False, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)
        ptrs = dict(q_ptr=ptr, kc_ptr=ptr, vc_ptr=ptr, cu_ptr="*i32", lens_ptr="*i32",
                    bt_ptr="*i32", o_ptr=ptr)
        bound = PA.tile_shared_memory(tiles.block_m, tiles.block_n, d, tiles.num_stages, itemsize)
        yield (f"prefill {dt} d{d} (picked tiles)", consts, ptrs, bound,
               dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))


def main() -> int:
    bad = 0
    for name, consts, ptrs, bound, opts in picked_prefill_cases():
        k = compile_sm90(PA._prefill_kernel, consts, ptrs, ("scale_log2",), **opts)
        ok = k.metadata.shared <= min(SMEM_LIMIT, bound)
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: smem {k.metadata.shared} B (bound {bound}), "
              f"bm{consts['BLOCK_M']} bn{consts['BLOCK_N']} {opts}")
    for name, fn, consts, ptrs, opts, min_async in cases():  # min_async: True is one
        k = compile_sm90(fn, consts, ptrs, ("scale_log2",), **opts)
        n_async = k.asm["ttgir"].count("copy_global_to_local")  # cp.async or TMA
        ok = k.metadata.shared <= SMEM_LIMIT and n_async >= int(min_async)
        if name.startswith("decode fp8"):  # K and V through cp.async, not byte loads
            n_loads = len(re.findall(r"ld\.global[\w.]*\.[bu]8\b", k.asm["ptx"]))
            ok = ok and n_loads <= FP8_DECODE_BYTE_LOADS
            name += f" ({n_loads} byte loads)"
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: smem {k.metadata.shared} B, "
              f"async copies {n_async}, {opts}")
    for page, ppb, d, nc in ((128, 1, 128, 2), (16, 8, 128, 2), (128, 1, 64, 3), (16, 8, 64, 3)):
        k = gluon_case(page, ppb, d, nc)
        if k is None:
            break
        # warp-specialised: TMA loads, wgmma, register hand-off between partitions
        ptx = k.asm["ptx"]
        boxes = ptx.count("cp.async.bulk.tensor")
        ok = (k.metadata.shared <= SMEM_LIMIT and boxes > 0
              and "wgmma.mma_async" in ptx and "setmaxnreg" in ptx)
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} prefill gluon (FA3 schedule) d{d} x{nc} warpgroups page{page}: smem "
              f"{k.metadata.shared} B, {boxes} TMA copies in the PTX")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
