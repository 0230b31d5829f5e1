"""The device side of prefill_gluon.py: the loader and consumer partitions of the
FA3-schedule prefill (that module's docstring says how they work). Split off so the host
side (which schedule a launch takes, descriptors, the launch) reads on its own."""

try:  # Gluon (triton >= 3.5); absent on older tritons and never run by the interpreter
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.language.core import _aggregate as aggregate

    # triton 3.6 (the H200's) spells the TMA load async_copy_global_to_shared; 3.7+ async_load.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # pragma: no cover - older triton
    gluon = None

from ._common import prefill_tile

__all__ = ["gluon", "gl", "GluonDescriptor", "_prefill_gluon_kernel"]

if gluon is not None:

    @aggregate
    class _Barriers:
        """The program's mbarriers, each its own allocation: Triton's shared-memory hazard
        analysis then sees that an arrive on one and a wait on another do not conflict."""
        q_ready: gl.shared_memory_descriptor
        q_empty: gl.shared_memory_descriptor  # every consumer warpgroup is done with Q
        fix: gl.shared_memory_descriptor  # every warpgroup's part of a V tail is zeroed
        turn0: gl.shared_memory_descriptor  # warpgroup 0 may issue its wgmmas
        turn1: gl.shared_memory_descriptor
        k_ready: gl.shared_memory_descriptor  # [stages, 1] each
        v_ready: gl.shared_memory_descriptor
        k_empty: gl.shared_memory_descriptor
        v_empty: gl.shared_memory_descriptor

        @gluon.constexpr_function
        def __init__(self, q_ready, q_empty, fix, turn0, turn1, k_ready, v_ready, k_empty,
                     v_empty):
            self.q_ready = q_ready
            self.q_empty = q_empty
            self.fix = fix
            self.turn0 = turn0
            self.turn1 = turn1
            self.k_ready = k_ready
            self.v_ready = v_ready
            self.k_empty = k_empty
            self.v_empty = v_empty

    @gluon.jit
    def _barriers(NS: gl.constexpr, NC: gl.constexpr):
        lay: gl.constexpr = mbarrier.MBarrierLayout()
        one = gl.allocate_shared_memory(gl.int64, [1], lay)
        mbarrier.init(one, count=1)
        bars = _Barriers(one, gl.allocate_shared_memory(gl.int64, [1], lay),
                         gl.allocate_shared_memory(gl.int64, [1], lay),
                         gl.allocate_shared_memory(gl.int64, [1], lay),
                         gl.allocate_shared_memory(gl.int64, [1], lay),
                         gl.allocate_shared_memory(gl.int64, [NS, 1], lay),
                         gl.allocate_shared_memory(gl.int64, [NS, 1], lay),
                         gl.allocate_shared_memory(gl.int64, [NS, 1], lay),
                         gl.allocate_shared_memory(gl.int64, [NS, 1], lay))
        mbarrier.init(bars.q_empty, count=NC)
        mbarrier.init(bars.fix, count=NC)
        mbarrier.init(bars.turn0, count=1)
        mbarrier.init(bars.turn1, count=1)
        for i in gl.static_range(NS):
            mbarrier.init(bars.k_ready.index(i), count=1)
            mbarrier.init(bars.v_ready.index(i), count=1)
            mbarrier.init(bars.k_empty.index(i), count=NC)  # one arrival per warpgroup
            mbarrier.init(bars.v_empty.index(i), count=NC)
        fence_async_shared()
        return bars

    @gluon.jit
    def _work(tile, n_bh, n_m, hg, cu_ptr, lens_ptr, H_Q: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr):
        """Work item ``tile``: ``prefill_tile``'s mapping (heaviest causal tiles first) with
        one query head per item, within sections of ``hg`` query heads (whole KV heads) run
        one after another, so the programs on the chip at once read the K/V of a section
        only (FA3's L2 swizzle; ``hg == H_Q`` is one section); K/V tiles [0, n_full) need no
        mask, n_tiles in all (0 for a tile past the sequence's queries)."""
        n_bg = (n_bh // H_Q) * hg  # items of one query tile in a section (sequences x heads)
        sec = tile // (n_m * n_bg)
        r = tile % (n_m * n_bg)
        x = r % n_bg
        tile = (r // n_bg) * n_bh + (x // hg) * H_Q + sec * hg + x % hg  # prefill_tile's index
        mt, b, h, q_start, q_len, base, full_end, diag_end = prefill_tile(
            tile, n_bh, n_m, cu_ptr, lens_ptr, H_Q, BM, BN)
        return mt, b, h, q_start, q_len, base, base + q_len, full_end // BN, (diag_end + BN - 1) // BN

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, bt_ptr, s_bt, cu_ptr,
                lens_ptr, n_bh, n_m, hg, n_work, nprog, H_Q: gl.constexpr, H_KV: gl.constexpr,
                PAGE: gl.constexpr, PPB: gl.constexpr):
        NC: gl.constexpr = q_smem.shape[0]  # consumer warpgroups, one Q box of 64 rows each
        R: gl.constexpr = q_smem.shape[1]
        BM: gl.constexpr = NC * R
        BN: gl.constexpr = k_smem.shape[1]
        D: gl.constexpr = k_smem.shape[2]
        NS: gl.constexpr = k_smem.shape[0]
        ROWS: gl.constexpr = k_desc.block_type.shape[0]  # a page, or the tile if pages are larger
        NP: gl.constexpr = BN // ROWS  # TMA boxes per tile: the tile's pages, one head each
        it = 0  # K/V tiles loaded so far: the ring position runs on across work items
        n_done = 0
        for tile in range(gl.program_id(0), n_work, nprog):
            mt, b, h, q_start, q_len, base, ctx, n_full, n_tiles = _work(
                tile, n_bh, n_m, hg, cu_ptr, lens_ptr, H_Q, BM, BN)
            if n_tiles > 0:
                mbarrier.wait(bars.q_empty, (n_done & 1) ^ 1)
                mbarrier.expect(bars.q_ready, NC * q_desc.block_type.nbytes)
                for i in gl.static_range(NC):
                    _tma_load(q_desc, [q_start + mt * BM + i * R, h * D], bars.q_ready,
                              q_smem.index(i))
                kvh = h // (H_Q // H_KV)
                bt_row = bt_ptr + b.to(gl.int64) * s_bt
                for j in range(n_tiles):
                    s = (it + j) % NS
                    free = (((it + j) // NS) & 1) ^ 1  # the first pass waits for nothing
                    n0 = j * BN
                    blk = gl.load(bt_row + n0 // (PAGE * PPB))
                    page = blk * PPB + (n0 % (PAGE * PPB)) // PAGE
                    row = (page * H_KV + kvh) * PAGE + n0 % PAGE
                    # a tile's pages are consecutive in its block: NP boxes H_KV pages apart
                    mbarrier.wait(bars.k_empty.index(s), free)
                    mbarrier.expect(bars.k_ready.index(s), NP * k_desc.block_type.nbytes)
                    for i in gl.static_range(NP):
                        _tma_load(k_desc, [row + i * H_KV * PAGE, 0], bars.k_ready.index(s),
                                  k_smem.index(s).slice(i * ROWS, ROWS))
                    mbarrier.wait(bars.v_empty.index(s), free)
                    mbarrier.expect(bars.v_ready.index(s), NP * v_desc.block_type.nbytes)
                    for i in gl.static_range(NP):
                        _tma_load(v_desc, [row + i * H_KV * PAGE, 0], bars.v_ready.index(s),
                                  v_smem.index(s).slice(i * ROWS, ROWS))
                it += n_tiles
                n_done += 1

    @gluon.jit
    def _softmax(s, m_i, l_i, n0, qpos, ctx, scale_log2, MASKED: gl.constexpr,
                 s_layout: gl.constexpr):
        """One tile's online-softmax step on raw scores: (p as bf16, m, l, alpha)."""
        if MASKED:
            cols = n0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
            ok = (gl.expand_dims(cols, 0) <= gl.expand_dims(qpos, 1)) & gl.expand_dims(cols < ctx, 0)
            s = gl.where(ok, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2((m_i - m_new) * scale_log2)
        p = gl.exp2(s * scale_log2 - gl.expand_dims(m_new * scale_log2, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        return p.to(gl.bfloat16), m_new, l_i, alpha

    @gluon.jit
    def _zero_tail(v_tile, fix_bar, phase, n0, ctx, half: gl.constexpr, SHARE: gl.constexpr):
        """Zero the V rows at or past ``ctx`` of this warpgroup's ``SHARE`` rows of the tile
        (the first two warpgroups split it; a third only meets them), in place; the
        warpgroups meet at ``fix_bar`` before any PV wgmma reads it."""
        if half * SHARE < v_tile.shape[0]:
            blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            rows = half * SHARE + gl.arange(0, SHARE, layout=gl.SliceLayout(1, blk))
            part = v_tile.slice(half * SHARE, SHARE)
            v = part.load(blk)
            part.store(gl.where(gl.expand_dims(n0 + rows < ctx, 1), v, gl.zeros_like(v)))
            fence_async_shared()
        mbarrier.arrive(fix_bar, count=1)
        mbarrier.wait(fix_bar, phase)

    @gluon.jit
    def _my_turn(bars, k, half: gl.constexpr, PINGPONG: gl.constexpr):
        """FA3's warp scheduler barrier: warpgroup 0 issues first, then they alternate."""
        if PINGPONG:
            if half == 0:
                mbarrier.wait(bars.turn0, (k & 1) ^ 1)
            else:
                mbarrier.wait(bars.turn1, k & 1)

    @gluon.jit
    def _pass_turn(bars, half: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            if half == 0:
                mbarrier.arrive(bars.turn1, count=1)
            else:
                mbarrier.arrive(bars.turn0, count=1)

    @gluon.jit
    def _attend(q, k_smem, v_smem, bars, o_ptr, s_ot, s_oh, q_start, q_len, base, mt, h, ctx,
                n_full, n_tiles, scale_log2, it, turn, n_fix, n_done, half: gl.constexpr,
                PINGPONG: gl.constexpr, BM: gl.constexpr):
        """This warpgroup's 64 rows of one work item; ``it``/``turn``/``n_fix``: ring,
        turn and tail-fix counters so far. Returns the counters after this item."""
        HALF: gl.constexpr = q.shape[0]
        BN: gl.constexpr = k_smem.shape[1]
        D: gl.constexpr = k_smem.shape[2]
        NS: gl.constexpr = k_smem.shape[0]
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BN, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, D, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        orow_l: gl.constexpr = gl.SliceLayout(1, o_l)
        t0 = mt * BM + half * HALF
        qpos = base + t0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_l))
        m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([HALF, D], gl.float32, o_l)
        s_zero = gl.zeros([HALF, BN], gl.float32, s_l)

        mbarrier.wait(bars.q_ready, n_done & 1)
        mbarrier.wait(bars.k_ready.index(it % NS), (it // NS) & 1)
        _my_turn(bars, turn, half, PINGPONG)
        s_tok = warpgroup_mma(q, k_smem.index(it % NS).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        _pass_turn(bars, half, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        mbarrier.arrive(bars.k_empty.index(it % NS), count=1)
        mbarrier.arrive(bars.q_empty, count=1, pred=n_tiles == 1)
        if n_full > 0:
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, 0, qpos, ctx, scale_log2, False, s_l)
        else:
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, 0, qpos, ctx, scale_log2, True, s_l)
        for j in range(n_tiles - 1):
            nxt = (it + j + 1) % NS
            cur = (it + j) % NS
            mbarrier.wait(bars.k_ready.index(nxt), ((it + j + 1) // NS) & 1)
            mbarrier.wait(bars.v_ready.index(cur), ((it + j) // NS) & 1)
            _my_turn(bars, turn + j + 1, half, PINGPONG)
            s_tok = warpgroup_mma(q, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            o_tok = warpgroup_mma(gl.convert_layout(p, p_l), v_smem.index(cur), acc, is_async=True)
            _pass_turn(bars, half, PINGPONG)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            mbarrier.arrive(bars.k_empty.index(nxt), count=1)
            mbarrier.arrive(bars.q_empty, count=1, pred=j + 2 == n_tiles)
            if j + 1 < n_full:
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, (j + 1) * BN, qpos, ctx, scale_log2,
                                              False, s_l)
            else:
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, (j + 1) * BN, qpos, ctx, scale_log2,
                                              True, s_l)
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
            mbarrier.arrive(bars.v_empty.index(cur), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_l), 1)

        last = n_tiles - 1
        cur = (it + last) % NS
        mbarrier.wait(bars.v_ready.index(cur), ((it + last) // NS) & 1)
        if last * BN + BN > ctx:  # the context ends inside this tile: zero V's tail
            _zero_tail(v_smem.index(cur), bars.fix, n_fix & 1, last * BN, ctx, half,
                       BN // 2)
            n_fix += 1
        _my_turn(bars, turn + n_tiles, half, PINGPONG)
        o_tok = warpgroup_mma(gl.convert_layout(p, p_l), v_smem.index(cur), acc, is_async=True)
        _pass_turn(bars, half, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=(o_tok,))
        mbarrier.arrive(bars.v_empty.index(cur), count=1)

        l_o = gl.convert_layout(l_i, orow_l)
        out = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)
        t = t0 + gl.arange(0, HALF, layout=orow_l)
        d = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
        offs = gl.expand_dims((q_start + t).to(gl.int64) * s_ot + h * s_oh, 1) + gl.expand_dims(d, 0)
        gl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(t < q_len, 1))
        return it + n_tiles, turn + n_tiles + 1, n_fix

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, bars, o_ptr, s_ot, s_oh, cu_ptr, lens_ptr, n_bh, n_m,
                  hg, n_work, nprog, scale_log2, half: gl.constexpr, H_Q: gl.constexpr,
                  PINGPONG: gl.constexpr):
        BM: gl.constexpr = q_smem.shape[0] * q_smem.shape[1]
        BN: gl.constexpr = k_smem.shape[1]
        q = q_smem.index(half)
        it = 0
        turn = 0
        n_fix = 0
        n_done = 0
        for tile in range(gl.program_id(0), n_work, nprog):
            mt, b, h, q_start, q_len, base, ctx, n_full, n_tiles = _work(
                tile, n_bh, n_m, hg, cu_ptr, lens_ptr, H_Q, BM, BN)
            if n_tiles > 0:
                it, turn, n_fix = _attend(q, k_smem, v_smem, bars, o_ptr, s_ot, s_oh, q_start,
                                          q_len, base, mt, h, ctx, n_full, n_tiles, scale_log2,
                                          it, turn, n_fix, n_done, half, PINGPONG, BM)
                n_done += 1

    @gluon.jit(do_not_specialize=["hg"])  # the section size never makes another compile
    def _prefill_gluon_kernel(q_desc, k_desc, v_desc, cu_ptr, lens_ptr, bt_ptr, o_ptr,
                              scale_log2, n_bh, n_m, hg, n_work, nprog, s_ot, s_oh, s_bt,
                              H_Q: gl.constexpr, H_KV: gl.constexpr, D: gl.constexpr,
                              PAGE: gl.constexpr, PPB: gl.constexpr, BM: gl.constexpr,
                              BN: gl.constexpr, NS: gl.constexpr, PINGPONG: gl.constexpr,
                              NC: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        R: gl.constexpr = q_desc.block_type.shape[0]  # a consumer warpgroup's query rows
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [NC, R, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NS, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NS, BN, D], v_desc.layout)
        bars = _barriers(NS, NC)
        if NC == 2:
            gl.warp_specialize(
                [
                    (_consumer, (q_smem, k_smem, v_smem, bars, o_ptr, s_ot, s_oh, cu_ptr, lens_ptr,
                                 n_bh, n_m, hg, n_work, nprog, scale_log2, 0, H_Q,
                                 PINGPONG)),  # rows 0-63 of the tile
                    (_consumer, (q_smem, k_smem, v_smem, bars, o_ptr, s_ot, s_oh, cu_ptr, lens_ptr,
                                 n_bh, n_m, hg, n_work, nprog, scale_log2, 1, H_Q,
                                 PINGPONG)),  # rows 64-127
                    (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, bt_ptr, s_bt,
                               cu_ptr, lens_ptr, n_bh, n_m, hg, n_work, nprog, H_Q, H_KV, PAGE, PPB)),
                ],
                worker_num_warps=[4, 1],
                worker_num_regs=[CONSUMER_REGS, 24],
            )
        else:  # three consumer warpgroups (head dim 64), no ping-pong
            gl.warp_specialize(
                [
                    (_consumer, (q_smem, k_smem, v_smem, bars, o_ptr, s_ot, s_oh, cu_ptr, lens_ptr,
                                 n_bh, n_m, hg, n_work, nprog, scale_log2, 0, H_Q, False)),
                    (_consumer, (q_smem, k_smem, v_smem, bars, o_ptr, s_ot, s_oh, cu_ptr, lens_ptr,
                                 n_bh, n_m, hg, n_work, nprog, scale_log2, 1, H_Q, False)),
                    (_consumer, (q_smem, k_smem, v_smem, bars, o_ptr, s_ot, s_oh, cu_ptr, lens_ptr,
                                 n_bh, n_m, hg, n_work, nprog, scale_log2, 2, H_Q, False)),
                    (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, bt_ptr, s_bt,
                               cu_ptr, lens_ptr, n_bh, n_m, hg, n_work, nprog, H_Q, H_KV, PAGE, PPB)),
                ],
                worker_num_warps=[4, 4, 1],
                worker_num_regs=[CONSUMER_REGS, CONSUMER_REGS, 24],
            )
else:  # pragma: no cover - older triton
    GluonDescriptor = gl = _prefill_gluon_kernel = None
