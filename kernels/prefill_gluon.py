"""Prefill attention in Gluon with FlashAttention-3's schedule, for Hopper.

Plain Triton tops out at 0.78x SDPA here (prefill_tma.py; bench/KERNEL_NOTES.md): Triton
always waits for the QK^T wgmma before the softmax, so the softmax never overlaps a
matmul. Gluon writes the schedule by hand:

- a 1-warp loader partition streams K and V tiles through TMA into a ring of ``STAGES``
  buffers and reads the block table itself; K and V have their own ready/empty mbarriers,
  so a K buffer refills as soon as its QK^T is done (the largest single gain measured);
- two consumer warpgroups (the default partition and one worker) each own 64 of the
  tile's 128 query rows (one query head; GQA reuse of K/V comes from L2, as FA3 does);
  at head dim 64, three own 192 rows (FA3's d64 tile): a K/V tile's wgmmas are half as
  long there, so a third warpgroup keeps the tensor cores fed while two run softmax;
- inside a warpgroup, FA3's intra-warpgroup overlap: issue S(j+1) = Q K(j+1)^T and
  O += P(j) V(j) back to back, wait only for S(j+1), run its softmax while the PV wgmma
  runs, then wait for O and rescale it. FA3's ping-pong between the two warpgroups
  and a persistent grid are knobs, off by default (neither is faster on the H200 at d128,
  bench/KERNEL_NOTES.md); ping-pong is on for short d64 prompts (``default_schedule``);
- the work order: heaviest query tiles first, in sections of whole KV heads once a step's
  K/V outgrow L2 (``default_head_group``; FA3's L2 swizzle): at 32K tokens, d128, two KV
  heads a section ran 1.024-1.046x SDPA against all heads' 0.997-1.011x (row 52 there).

K/V come from the cache viewed as rows ``[num_blocks * pages_per_block * H_kv * page, D]``:
a 128-token tile is one TMA box at page 128, and 128 / page boxes (one per page, H_kv
pages apart, each into its rows of the tile's buffer) at pages of 16-64 tokens. The tile that runs past the context is masked in
S and its V tail is zeroed in place (the cache tail may hold NaN, and 0 * NaN is NaN).
The host contract is ``prefill_attention``'s.
"""

import functools

import torch
import triton

from ._common import LOG2E, interpreting, prefill_shapes, sm_count
from .fast_launch import FastLaunch
from .prefill_gluon_kernel import GluonDescriptor, _prefill_gluon_kernel, gl, gluon

__all__ = ["gluon_available", "gluon_applies", "prefill_attention_gluon"]

ROWS_PER_CONSUMER = 64  # query rows per consumer warpgroup (one wgmma M)
BLOCK_N = 128  # keys per K/V tile
STAGES = 2
PINGPONG = False
PERSISTENT = False


def gluon_available() -> bool:
    return gluon is not None


@functools.lru_cache(maxsize=16)
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


# Registers a consumer warpgroup's thread asks for (setmaxnreg): two consumers and a 1-warp
# loader fit 240; three fit 160 (FA3's split for three MMA warpgroups).
CONSUMER_REGS = {2: 240, 3: 160}
D64_LONG = 4096  # head dim 64: prompts from this many tokens take three warpgroups


def default_schedule(d: int, max_seqlen_q: int) -> tuple[int, bool]:
    """(consumer warpgroups, ping-pong) for a launch. Head dim 64, in CUDA graphs on the
    H200 against SDPA causal: three warpgroups (192 rows) 1.01-1.02x at 8K and 1.03-1.04x
    at 32K tokens against two's 0.95-0.98x, but 0.94-0.96x at 2K, where two with ping-pong
    give 1.03-1.04x (bench/RESULTS.md); the crossover between 2K and 8K is not measured."""
    if d <= 64:
        return (3, False) if max_seqlen_q >= D64_LONG else (2, True)
    return 2, PINGPONG


L2_KV_BYTES = 32 * 2**20  # K/V a section of heads may stream (FA3's figure; the H200 has 50 MB of L2)


def default_head_group(h_q: int, h_kv: int, d: int, tokens: int) -> int:
    """Query heads per section of the work order (``_work``): whole KV heads, the most
    (a power of two) whose K/V over ``tokens`` (the step's new tokens, a lower bound of its
    context) fit ``L2_KV_BYTES``, so the programs running at once re-read K/V from L2 and
    not memory; all heads (one section, the plain heaviest-first order) when they all fit."""
    per_kv = max(1, tokens) * 2 * d * 2  # K and V, bf16
    if h_kv * per_kv <= L2_KV_BYTES:
        return h_q
    n_kv = 1
    while h_kv % (n_kv * 2) == 0 and n_kv * 2 * per_kv <= L2_KV_BYTES:
        n_kv *= 2
    return n_kv * (h_q // h_kv)


def gluon_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when this kernel can run these tensors: Hopper, bf16, head_dim 64 or 128,
    blocks a multiple of the 128-token tile whose pages are 16, 32 or 64 tokens (a tile
    is that many TMA boxes) or a multiple of 128, heads of q contiguous."""
    if gluon is None or interpreting(q) or not _is_hopper(q.device):
        return False
    _, ppb, _, page, d = k_cache.shape
    return (q.dtype == torch.bfloat16 and k_cache.dtype == q.dtype and d in (64, 128)
            and (page in (16, 32, 64) or page % BLOCK_N == 0) and (page * ppb) % BLOCK_N == 0
            and q.stride(-1) == 1 and q.stride(1) == d
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q.data_ptr() % 16 == 0 and (q.stride(0) * 2) % 16 == 0)


@functools.lru_cache(maxsize=8)
def _smem_layout(rows: int, d: int):
    return gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)


def _descriptors(q, k_cache, v_cache):
    t, h_q, d = q.shape
    nb, ppb, h_kv, page, _ = k_cache.shape
    lay = _smem_layout(BLOCK_N, d)
    rows = ROWS_PER_CONSUMER  # one Q box per consumer warpgroup (a 192-row box is no power of 2)
    q_desc = GluonDescriptor(q, [t, h_q * d], [q.stride(0), 1], [rows, d], _smem_layout(rows, d))
    rows = [nb * ppb * h_kv * page, d]
    box = [min(page, BLOCK_N), d]  # a tile's share of one page; 16 rows keep the swizzle's 8-row atom whole
    k_desc = GluonDescriptor(k_cache, rows, [d, 1], box, lay)
    v_desc = GluonDescriptor(v_cache, rows, [d, 1], box, lay)
    return q_desc, k_desc, v_desc


# The kernel without Triton's per-call binding (Gluon never runs under the interpreter).
_launch = FastLaunch(_prefill_gluon_kernel) if gluon is not None else None


def prefill_attention_gluon(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                            *, max_seqlen_q=None, out=None, stages=STAGES, pingpong=None,
                            persistent=PERSISTENT, consumers=None, head_group=None, checked=False):
    """Same contract as ``prefill_attention``; needs ``gluon_applies(q, k_cache, v_cache)``
    (``checked``: the caller just asked it). ``persistent``: one program per SM walks the
    work items (heaviest first) round robin, so a program's next Q and K/V load while it
    stores the last output. ``consumers``: warpgroups of 64 query rows a program (2 or 3);
    it and ``pingpong`` default to ``default_schedule`` (two with ``pingpong=True``).
    ``head_group``: query heads per section of the work order (a multiple of the GQA group
    dividing ``h_q``); default ``default_head_group``."""
    if not checked and not gluon_applies(q, k_cache, v_cache):
        raise ValueError("prefill_attention_gluon: needs Hopper, bf16, d64/d128, 128-token tiles of pages "
                         "(check gluon_applies first)")
    t, h_q, d, _, h_kv, page, bsz, max_seqlen_q, _, _ = prefill_shapes(
        q, k_cache, v_cache, cu_seqlens_q, context_lens, max_seqlen_q
    )
    ppb = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or bsz == 0:
        return out
    usual, usual_pingpong = default_schedule(d, max_seqlen_q)
    if consumers is None:  # ping-pong asked for: two warpgroups (it alternates a pair)
        consumers = 2 if pingpong else usual
    pingpong = (usual_pingpong and consumers == 2) if pingpong is None else pingpong
    if consumers not in (2, 3) or (pingpong and consumers != 2):
        raise ValueError(f"prefill_attention_gluon: consumers={consumers} (pingpong={pingpong}): "
                         "2 or 3 warpgroups, ping-pong only with 2")
    hg = default_head_group(h_q, h_kv, d, t) if head_group is None else head_group
    if h_q % hg or hg % (h_q // h_kv):
        raise ValueError(f"prefill_attention_gluon: head_group={hg} must be whole KV heads dividing {h_q}")
    block_m = ROWS_PER_CONSUMER * consumers
    n_m = triton.cdiv(max_seqlen_q, block_m)
    n_work = n_m * bsz * h_q
    nprog = min(n_work, sm_count(q.device, cpu=132)) if persistent else n_work
    q_desc, k_desc, v_desc = _descriptors(q, k_cache, v_cache)
    _launch(q.device.index, (nprog,), (
        q_desc, k_desc, v_desc, cu_seqlens_q, context_lens, block_tables, out,
        scale * LOG2E, bsz * h_q, n_m, hg, n_work, nprog, out.stride(0), out.stride(1),
        block_tables.stride(0), h_q, h_kv, d, page, ppb, block_m, BLOCK_N, stages, bool(pingpong),
        consumers, CONSUMER_REGS[consumers],
    ), {"num_warps": 4})
    return out
