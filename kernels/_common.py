"""Small pieces shared by the attention kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device, cpu: int) -> int:
    """Streaming multiprocessors of a CUDA device; ``cpu`` stands in for CPU tensors (the
    interpreter), so grid sizing stays testable there."""
    if device.type != "cuda":
        return cpu
    return torch.cuda.get_device_properties(device).multi_processor_count


# Shared memory one program may use when the device cannot be asked: sm_90 (H100/H200)
# opts in to 227 KiB; 99 KiB fits every other CUDA GPU triton targets.
SMEM_BYTES_SM90 = 227 * 1024
SMEM_BYTES_OTHER = 99 * 1024


@functools.lru_cache(maxsize=8)
def shared_memory_limit(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device``: triton's own device
    query, else the table above by compute capability (CPU tensors: sm_90's, so tile
    choices under the interpreter match the H200's)."""
    if device.type != "cuda":
        return SMEM_BYTES_SM90
    try:
        from triton.runtime import driver

        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # an older triton without the query: the conservative table
        return SMEM_BYTES_SM90 if torch.cuda.get_device_capability(device)[0] in (9, 10) \
            else SMEM_BYTES_OTHER


def interpreting(t: torch.Tensor) -> bool:
    """True when kernels run under TRITON_INTERPRET (CPU tensors)."""
    return not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def prefill_tile(tile, n_bh, n_m, cu_ptr, lens_ptr, H_KV: tl.constexpr, TOK: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Which (query tile, sequence, KV head) a prefill program serves, heaviest tiles
    first, and its key range: [0, full_end) needs no causal mask, [full_end, diag_end)
    is the diagonal. Returns (mt, b, kvh, q_start, q_len, base, full_end, diag_end)."""
    mt = n_m - 1 - tile // n_bh
    bh = tile % n_bh
    b = bh // H_KV
    kvh = bh % H_KV
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    ctx = tl.load(lens_ptr + b)
    base = ctx - q_len  # position of the chunk's first query
    live = mt * TOK < q_len
    full_end = tl.where(live, ((base + mt * TOK + 1) // BLOCK_N) * BLOCK_N, 0)
    diag_end = tl.where(live, tl.minimum(base + mt * TOK + TOK, ctx), 0)
    return mt, b, kvh, q_start, q_len, base, full_end, diag_end


def prefill_shapes(q, k_cache, v_cache, cu_seqlens_q, context_lens, max_seqlen_q):
    """Checks and sizes shared by the prefill launchers: (t, h_q, d, ppb, h_kv, page,
    batch, max_seqlen_q, group, padded group). ``max_seqlen_q`` given skips a host read."""
    t, h_q, d = q.shape
    _, ppb, h_kv, page, dc = k_cache.shape
    assert d == dc and h_q % h_kv == 0 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1
    bsz = context_lens.shape[0]
    if max_seqlen_q is None and t and bsz:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = h_q // h_kv
    return t, h_q, d, ppb, h_kv, page, bsz, max_seqlen_q, group, triton.next_power_of_2(group)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get an exact dot (tf32 would cost ~1e-3 relative); 16-bit ignore it."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


@triton.jit
def mma(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with fp32 accumulation. UPCAST feeds fp32 operands, for the CPU
    interpreter, whose 16-bit ``tl.dot`` returns garbage (seen with triton 3.9)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def page_offsets(bt_row_ptr, pos, valid, kvh, s_cb, s_cp, s_ch, s_ct,
                 PAGE: tl.constexpr, PPB: tl.constexpr):
    """Element offset of (token ``pos``, KV head ``kvh``) in a paged head-major cache,
    via the sequence's block table row: page ``block * PPB + off // PAGE``. ``valid``
    None: every ``pos`` is inside the context (an unmasked load)."""
    if valid is None:
        blk = tl.load(bt_row_ptr + pos // (PAGE * PPB)).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + pos // (PAGE * PPB), mask=valid, other=0).to(tl.int64)
    off = pos % (PAGE * PPB)
    return blk * s_cb + (off // PAGE) * s_cp + kvh * s_ch + (off % PAGE) * s_ct


@triton.jit
def exp2_biased(e):
    """fp32 2^(e - 127) of biased exponent bytes, from the float's bits (exact; the
    kernels' twin of ``kv_quant.exp2_biased``)."""
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def v_column(tok, t_in, s_ct):
    """Where token ``t_in`` of an fp8 V head page begins, the page stored [D, PAGE]
    (kernels/reference.py): ``tok`` is the token's offset in a [PAGE, D] page (``t_in *
    s_ct`` past the page's start), its element ``d`` is ``d * PAGE`` past the result."""
    return tok - t_in * s_ct + t_in


@triton.jit
def load_kv(c_ptr, s_ptr, tok, d, mask, row_ok, D: tl.constexpr, QUANT: tl.constexpr,
            DT: tl.constexpr, PAGE: tl.constexpr = 1, V_T: tl.constexpr = False):
    """[BLOCK_N, BLOCK_D] of K or V at element offsets ``tok`` (+ d), in ``DT``: dequantized
    with the token-head's power-of-two scale (``row_ok``: the rows to read) when the cache
    is fp8. ``V_T``: an fp8 V cache, whose head pages are stored [D, PAGE] (token ``t``'s
    element ``d`` at the page's ``d * PAGE + t``; ``tok`` stays the [PAGE, D] offset)."""
    if V_T:
        x = tl.load(c_ptr + v_column(tok, (tok // D) % PAGE, D)[:, None] + d[None, :] * PAGE,
                    mask=mask, other=0.0)
    else:
        x = tl.load(c_ptr + tok[:, None] + d[None, :], mask=mask, other=0.0)
    if QUANT:
        scale = exp2_biased(tl.load(s_ptr + tok // D, mask=row_ok, other=127))
        x = (x.to(tl.float32) * scale[:, None]).to(DT)  # one return: compiled Triton wants one type
    return x


@triton.jit
def scale_rows(bt_row_ptr, n0, end, PAGE: tl.constexpr, PPB: tl.constexpr, BLOCK_N: tl.constexpr,
               SW: tl.constexpr):
    """The blocks of the ``BLOCK_N // SW`` page rows of tokens ``n0..`` (a multiple of
    ``SW = min(PAGE, BLOCK_N)``) whose scale bytes ``row_scales`` reads; 0 (in bounds) for
    rows at or past ``end``."""
    row_pos = n0 + tl.arange(0, BLOCK_N // SW) * SW
    return tl.load(bt_row_ptr + row_pos // (PAGE * PPB), mask=row_pos < end, other=0).to(tl.int64)


@triton.jit
def row_scales(s_ptr, blk, n0, kvh, s_sb, s_sp, s_sh, PAGE: tl.constexpr, PPB: tl.constexpr,
               BLOCK_N: tl.constexpr, SW: tl.constexpr):
    """An fp8 cache's scale bytes (biased exponents) of tokens ``n0..`` of KV head ``kvh``,
    as [BLOCK_N // SW, SW]: one byte per token-head, contiguous along a page's tokens, so
    a tile's are read as rows of ``SW`` bytes (vectorized), not a byte per token
    (``load_kv``). Both stay synchronous loads (a tile's scales are too few bytes for
    ``cp.async``): the caller reads them a tile ahead."""
    row_pos = n0 + tl.arange(0, BLOCK_N // SW) * SW
    off = row_pos % (PAGE * PPB)
    base = tl.multiple_of(blk * s_sb + (off // PAGE) * s_sp + kvh * s_sh + off % PAGE, SW)
    return tl.load(s_ptr + base[:, None] + tl.arange(0, SW)[None, :])


@triton.jit
def scales_of(e, ok, BLOCK_N: tl.constexpr):
    """[BLOCK_N] fp32 2^(e - 127) of ``row_scales``' bytes, 1.0 where not ``ok``."""
    return tl.where(ok, tl.reshape(exp2_biased(e), [BLOCK_N]), 1.0)


def kv_scales(k_cache, k_scale, v_scale, placeholder):
    """(quant, k_scale, v_scale) for a launch: an fp8 cache's scale caches checked
    ([..., page, 1], contiguous like the cache), else ``placeholder`` for both pointers."""
    if k_scale is None:
        return False, placeholder, placeholder
    assert k_cache.is_contiguous() and k_scale.is_contiguous() and v_scale.is_contiguous()
    assert k_scale.shape == k_cache.shape[:4] + (1,) and v_scale.shape == k_scale.shape
    return True, k_scale, v_scale


EXP_MODES = {"exp2": 0, "bf16x2": 1, "f16x2": 2}


def exp_mode(exp: str, dtype: torch.dtype) -> int:
    """The EXP constexpr for ``exp2_as``: a packed form only for 16-bit q, and always the
    one of q's dtype (p feeds the PV dot in that dtype); fp32 keeps the exact exp2."""
    if EXP_MODES[exp] == 0 or dtype not in (torch.bfloat16, torch.float16):
        return 0
    return 2 if dtype == torch.float16 else 1


@triton.jit
def exp2_as(x, DT: tl.constexpr, EXP: tl.constexpr, UPCAST: tl.constexpr):
    """exp2(x) as the dot's dtype. EXP 1/2: packed 16-bit MUFU ex2, two per instruction
    (the interpreter runs the same rounding in torch: input and output 16 bits)."""
    if EXP == 0:
        return tl.exp2(x).to(DT)
    elif UPCAST:
        return tl.exp2(x.to(DT).to(tl.float32)).to(DT)
    elif EXP == 1:
        return tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r",
                                         [x.to(tl.bfloat16)], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r",
                                         [x.to(tl.float16)], dtype=tl.float16,
                                         is_pure=True, pack=2)
