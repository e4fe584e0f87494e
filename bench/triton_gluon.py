"""A prototype (not shipped): W4A16 at M = 1-16 in Gluon (Triton's explicit-layout dialect) over the CUDA kernels'
fragment layout, timed beside the shipped Triton op, the sdquant CUDA op and cuBLAS bf16 (H200, one device call).
docs/benchmarks/pending.md, Pending 12 and 53.

    SDQUANT_COMMIT=<hash> python bench/triton_gluon.py --out $OUT [--ms 1,2,4,8,16] [--configs ...]
    python bench/triton_gluon.py --dry      # CPU: the kernel's index arithmetic emulated in torch, checks only
    python bench/triton_gluon.py --sass     # compile for sm_90 here (no GPU) and count the loop's SASS

On the GPU the sweep is preceded by ``diagnose``: every config on small layers (bf16, one form in fp16 and with one
split, act-order, FOLD's bits and counters) against x @ W.T, a wrong output summarized by which rows of the fragment
and which tokens are off.

Why. Issue 4 asks the Triton path for >= 75% of the CUDA op's speed at M <= 16; at M = 2-16 the shipped Triton op
reaches 0.52-0.70 on the five larger shapes (gemm run 29). Its tensor-core kernel dequantizes a tile, stores it to
shared memory and reads it back in the wgmma operand layout (ncu: the L1/shared pipe 77.5% busy). Plain Triton gives
no way to say that a loaded tensor already holds its wgmma fragment; Gluon does: layouts are explicit, and
``convert_layout(..., assert_trivial=True)`` fails the compile unless the conversion moves no data.

Layout: ``int4_layout.repack_cuda``'s, unchanged (qweight int32 [N/64, K/16, 32 lanes, 4 words]: word u of lane
4g + t at K step ks holds the m16k16 A fragment of features 16u..16u+15 of the 64-feature block). Gluon loads a CTA's
words as int32 [4 warps (block nb0 + v), 8 K steps, 32 lanes, 4 words] (16-byte loads), and by inline PTX turns nibble
i of each word into the bf16 pair (128 + c) of nibbles (i, i + 4) (a shift and a ``lop3``). ``join`` / ``reshape`` /
``permute`` / ``split`` put each word's four pairs at the rows (v, h, g) and K columns (kj, t4, e) of wgmma u's
[64, 16] A tile, and the conversion to the wgmma register-operand layout is checked trivial at compile time. So the
weights go global -> registers -> wgmma, with no shared memory and no bf16 tile.

Kernels: the CUDA wgmma kernel's raw form (csrc/w4a16_wgmma.cuh, RAW) in Gluon. A CTA of one warpgroup takes 256
features (4 blocks, one a warp) and a K range (split-K over the grid's second axis); an iteration is 128 K (one group
of 128 or a 128-K slice of a larger group): 8 K steps of 4 wgmmas m64 x NTOK x 16 on the raw codes into a group set
``g_u``, and a fifth wgmma with an all-ones A summing the activations into ``gx``; then in fp32
acc_u += s * g_u - s * (128 + z) * gx. NTOK = 8 (M <= 8) or 16.
- ``wg_raw_kernel``: the next iteration's words and activations are loaded into registers while this one computes;
  the activations go through one shared-memory tile (the wgmma B operand).
- ``wg_ring_kernel``: the CUDA kernel's pipeline, a cp.async ring of STAGES stages of words and activations, the
  words read back by 16-byte shared loads.
- ``wg_mma_kernel``: the same tiles on mma.sync m16n8k16 (as the CUDA tight kernel at M = 1-8), no shared memory: the
  next iteration's words in registers, each K step's activations loaded straight into the B-operand layout.
- PIPE: each K step's wgmmas stay in flight while the next step unpacks (``warpgroup_mma_wait(5)``); else each step
  waits for its own.
- Split-K partials: ``w4a16_proto.reduce_splits`` (a second kernel, fixed order), or with FOLD the tile's last CTA
  after a count-in on the layout's ``locks`` (``int4_triton_gemv._fold``'s protocol, the same bits).
- bf16 or fp16 activations (magic 128 / 1024; the device run times bf16), groups a multiple of 128 or per channel,
  act-order (x's columns gathered first, as the CUDA op does), N % 256 == 0, K % 128 == 0.

Timing: ``w4a16_proto``'s (bench/gemm.py's method); every timed config is first checked against x @ W.T in fp32.
Written against Triton 3.6 (the device) and compiled offline with 3.6 and 3.9 (this machine's; the CI test).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# kernel "raw": the next iteration's words in registers; "ring": a cp.async ring of STAGES stages; "mma": mma.sync,
# no shared memory. CTAs launched = waves x per_sm (CTAs resident an SM, by NTOK where it differs) x SMs, split-K making
# them (offline, Triton 3.6, NTOK = 8 / 16: raw with PIPE 208 / 247 registers, two CTAs an SM; ring 158-168 registers
# and 20 KB a stage: two CTAs an SM at 4 stages, three at 3; mma 128 / 168 registers: four / three)
CONFIGS = {
    "p1": {"kernel": "raw", "waves": 1.0, "per_sm": 2, "PIPE": True},
    "r4": {"kernel": "ring", "waves": 1.0, "per_sm": 2, "PIPE": False, "STAGES": 4},
    "r3": {"kernel": "ring", "waves": 1.0, "per_sm": 3, "PIPE": False, "STAGES": 3},
    "r3f": {"kernel": "ring", "waves": 1.0, "per_sm": 3, "PIPE": False, "STAGES": 3, "FOLD": True},
    "m4": {"kernel": "mma", "waves": 1.0, "per_sm": {8: 4, 16: 3}, "PIPE": False},
    "m4f": {"kernel": "mma", "waves": 1.0, "per_sm": {8: 4, 16: 3}, "PIPE": False, "FOLD": True},
}
MS = [1, 2, 4, 8, 16]
DRY_SHAPES = [(256, 256, 128, True), (512, 256, 256, False), (384, 512, -1, False), (1024, 512, 128, False)]
DRY_MS = (1, 2, 3, 16)

_KERN: dict = {}


def _kernels(f16: bool = False) -> dict:
    """The Gluon kernels for bf16 (magic 128) or fp16 (magic 1024) activations, built on first use: importing this
    module needs no Gluon."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import ampere, hopper

    bar = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier  # (their Triton 3.6 / 3.9 names)
    acp = hopper.async_copy
    cp_async = acp.async_load if hasattr(acp, "async_load") else acp.async_copy_global_to_shared
    cp_commit, cp_wait = acp.commit_group, acp.wait_group
    # nibble i of a word -> the pair (magic + nibble i, magic + nibble i + 4) as two 16-bit outputs
    rawi = "{ .reg .b32 t; shr.b32 t, $2, %d; lop3.b32 t, t, 0x000f000f, %s, 0xea; mov.b32 {$0, $1}, t; }"
    asm = [gl.constexpr(rawi % (4 * i, "0x64006400" if f16 else "0x43004300")) for i in range(4)]
    DT = gl.float16 if f16 else gl.bfloat16
    MAGIC = gl.constexpr(1024.0 if f16 else 128.0)
    # a CTA's words of one iteration: int32 [4 warps (blocks), 8 K steps, 32 lanes, 4 words], 16 bytes a thread and step
    WL = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8, 1, 4], threads_per_warp=[1, 1, 32, 1],
                                       warps_per_cta=[4, 1, 1, 1], order=[3, 2, 1, 0]))
    a0, a1, a2, a3 = asm

    @gluon.jit
    def raw(w, I: gl.constexpr):
        # int32 words -> their pairs of nibble I in the activation dtype, joined along a new last axis (e)
        if I == 0:
            lo, hi = gl.inline_asm_elementwise(a0, "=h,=h,r", [w], dtype=(DT, DT), is_pure=True, pack=1)
        elif I == 1:
            lo, hi = gl.inline_asm_elementwise(a1, "=h,=h,r", [w], dtype=(DT, DT), is_pure=True, pack=1)
        elif I == 2:
            lo, hi = gl.inline_asm_elementwise(a2, "=h,=h,r", [w], dtype=(DT, DT), is_pure=True, pack=1)
        else:
            lo, hi = gl.inline_asm_elementwise(a3, "=h,=h,r", [w], dtype=(DT, DT), is_pure=True, pack=1)
        return gl.join(lo, hi)

    @gluon.jit
    def a_tiles(t, dot_a: gl.constexpr):
        # t: int32 [4 v, 32 lanes, 4 u] (one K step) -> wgmma u's A tiles [64 rows (v, h, g), 16 K (kj, t4, e)]
        # (nibble i of a word: row half h = i // 2, K half kj = i % 2; its pair (i, i + 4): K offset e)
        j01 = gl.join(raw(t, 0), raw(t, 1))      # [v, lane, u, e, kj], h = 0
        j23 = gl.join(raw(t, 2), raw(t, 3))      # h = 1
        a = gl.join(j01, j23)                    # [v, lane, u, e, kj, h]
        a = a.reshape([4, 8, 4, 2, 2, 2, 2, 2])  # [v, g, t4, u1, u0, e, kj, h]  (lane = 4 g + t4, u = 2 u1 + u0)
        a = a.permute([0, 7, 1, 6, 2, 5, 3, 4])  # [v, h, g, kj, t4, e, u1, u0]
        a = a.reshape([64, 16, 2, 2])
        x0, x1 = gl.split(a)                     # u0
        t0, t2 = gl.split(x0)                    # u1
        t1, t3 = gl.split(x1)
        return (gl.convert_layout(t0, dot_a, assert_trivial=True), gl.convert_layout(t1, dot_a, assert_trivial=True),
                gl.convert_layout(t2, dot_a, assert_trivial=True), gl.convert_layout(t3, dot_a, assert_trivial=True))

    @gluon.jit
    def steps8(w):
        # [4 v, 8 K steps, 32 lanes, 4 u] -> the eight steps' [v, lane, u]
        w = w.permute([0, 2, 3, 1]).reshape([4, 32, 4, 2, 2, 2])  # step = 4 k2 + 2 k1 + k0
        y0, y1 = gl.split(w)
        y00, y01 = gl.split(y0)
        y10, y11 = gl.split(y1)
        s0, s4 = gl.split(y00)
        s2, s6 = gl.split(y01)
        s1, s5 = gl.split(y10)
        s3, s7 = gl.split(y11)
        return (s0, s1, s2, s3, s4, s5, s6, s7)

    @gluon.jit
    def k_steps(st, xa, xb, ones, zacc, dot_a: gl.constexpr, PIPE: gl.constexpr):
        # one 128-K iteration's wgmmas: the raw sums g0..g3 of its 8 K steps (words st) and the activation sums gx
        # (B: the two 64-K activation sub-tiles xa, xb)
        g0 = zacc
        g1 = zacc
        g2 = zacc
        g3 = zacc
        gx = zacc
        for ks in gl.static_range(8):
            t0, t1, t2, t3 = a_tiles(st[ks], dot_a)
            if ks < 4:
                b = xa.slice(16 * ks, 16, dim=1).permute([1, 0])
            else:
                b = xb.slice(16 * (ks - 4), 16, dim=1).permute([1, 0])
            g0 = hopper.warpgroup_mma(t0, b, g0, use_acc=ks > 0, is_async=True)
            g1 = hopper.warpgroup_mma(t1, b, g1, use_acc=ks > 0, is_async=True)
            g2 = hopper.warpgroup_mma(t2, b, g2, use_acc=ks > 0, is_async=True)
            g3 = hopper.warpgroup_mma(t3, b, g3, use_acc=ks > 0, is_async=True)
            gx = hopper.warpgroup_mma(ones, b, gx, use_acc=ks > 0, is_async=True)
            if PIPE:
                g0, g1, g2, g3, gx = hopper.warpgroup_mma_wait(num_outstanding=5, deps=(g0, g1, g2, g3, gx))
            else:
                g0, g1, g2, g3, gx = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(g0, g1, g2, g3, gx))
        if PIPE:
            g0, g1, g2, g3, gx = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(g0, g1, g2, g3, gx))
        return g0, g1, g2, g3, gx

    @gluon.jit
    def tile_range(K, ITS):
        # the CTA's 256 features (blocks nb0 .. nb0 + 3) and its split's iterations it0 .. it0 + nit - 1 (128 K each)
        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        it0 = pid_s * ITS
        return pid_n, pid_s, pid_n * 4, it0, gl.minimum(ITS, K // 128 - it0)

    @gluon.jit
    def word_offsets(nb0, KB, wl: gl.constexpr, row_l: gl.constexpr):
        # woff: the words of iteration 0 (8 K steps) of blocks nb0 .. nb0 + 3, int32 units (iteration it: + 1024 it);
        # r, soff: the m64 tile's row r = 16 v + 8 h + g is feature 64 (nb0 + v) + 16 u + 8 h + g of tile u, whose
        # scale is scales[grp, nb0 + v, g, 2 u + h]
        i_v = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, wl))))
        i_k = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, wl))))
        i_l = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, wl))))
        i_u = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, wl))))
        woff = ((nb0 + i_v[:, None, None, None]) * (KB * 128) + i_k[None, :, None, None] * 128
                + i_l[None, None, :, None] * 4 + i_u[None, None, None, :])
        r = gl.arange(0, 64, layout=row_l)
        soff = (r >> 4) * 64 + (r & 7) * 8 + ((r >> 3) & 1)
        return woff, r, soff

    @gluon.jit
    def x_offsets(K, M, NTOK: gl.constexpr, xl: gl.constexpr):
        # a 64-K activation sub-tile [NTOK, 64]: offsets from its first element, and the rows below M
        xr = gl.arange(0, NTOK, layout=gl.SliceLayout(1, xl))
        xc = gl.arange(0, 64, layout=gl.SliceLayout(0, xl))
        return xr[:, None] * K + xc[None, :], (xr[:, None] < M) & (xc[None, :] < 64)

    @gluon.jit
    def group_sz(s_ptr, z_ptr, sb):
        # the iteration's group: wgmma u's row scales s_u and -s_u (magic + z_u) (rows as ``soff``: sb = its base)
        s0 = gl.load(s_ptr + sb).to(gl.float32)
        s1 = gl.load(s_ptr + sb + 2).to(gl.float32)
        s2 = gl.load(s_ptr + sb + 4).to(gl.float32)
        s3 = gl.load(s_ptr + sb + 6).to(gl.float32)
        n0 = -s0 * (MAGIC + gl.load(z_ptr + sb).to(gl.float32))
        n1 = -s1 * (MAGIC + gl.load(z_ptr + sb + 2).to(gl.float32))
        n2 = -s2 * (MAGIC + gl.load(z_ptr + sb + 4).to(gl.float32))
        n3 = -s3 * (MAGIC + gl.load(z_ptr + sb + 6).to(gl.float32))
        return s0, s1, s2, s3, n0, n1, n2, n3

    @gluon.jit
    def fold(acc0, acc1, acc2, acc3, g0, g1, g2, g3, gx, sz):
        # acc_u += s_u g_u - s_u (magic + z_u) gx: the raw sums of one 128-K iteration, in fp32
        s0, s1, s2, s3, n0, n1, n2, n3 = sz
        return (acc0 + s0[:, None] * g0 + n0[:, None] * gx, acc1 + s1[:, None] * g1 + n1[:, None] * gx,
                acc2 + s2[:, None] * g2 + n2[:, None] * gx, acc3 + s3[:, None] * g3 + n3[:, None] * gx)

    @gluon.jit
    def store_tile(y_ptr, part_ptr, lock_ptr, acc0, acc1, acc2, acc3, r, nb0, pid_n, pid_s, M, N, SPLIT,
                   NTOK: gl.constexpr, mma: gl.constexpr, PARTIAL: gl.constexpr, FOLD: gl.constexpr):
        # one split: y itself; else the split's fp32 partial ([SPLIT, M, N]), and with FOLD the last CTA of the tile
        # to count in on lock_ptr[pid_n] sums the partials in split order from 0.0 (the second kernel's order and
        # start: the same bits), stores y and resets the counter (int4_triton_gemv._fold's protocol)
        feat = (nb0 + (r >> 4)) * 64 + ((r >> 3) & 1) * 8 + (r & 7)  # + 16 u
        tok = gl.arange(0, NTOK, layout=gl.SliceLayout(0, mma))
        omask = (tok[None, :] < M) & (feat[:, None] < N)
        yb = y_ptr + tok[None, :] * N + feat[:, None]
        if PARTIAL:
            pb = part_ptr + (pid_s * M + tok[None, :]) * N + feat[:, None]
            gl.store(pb, acc0, mask=omask)
            gl.store(pb + 16, acc1, mask=omask)
            gl.store(pb + 32, acc2, mask=omask)
            gl.store(pb + 48, acc3, mask=omask)
            if FOLD:
                bar()
                if gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                    p0 = part_ptr + tok[None, :] * N + feat[:, None]
                    zero = gl.zeros([64, NTOK], gl.float32, mma)
                    t0 = zero
                    t1 = zero
                    t2 = zero
                    t3 = zero
                    for q in range(SPLIT):
                        pq = p0 + q * M * N
                        t0 += gl.load(pq, mask=omask, other=0.0, cache_modifier=".cg")
                        t1 += gl.load(pq + 16, mask=omask, other=0.0, cache_modifier=".cg")
                        t2 += gl.load(pq + 32, mask=omask, other=0.0, cache_modifier=".cg")
                        t3 += gl.load(pq + 48, mask=omask, other=0.0, cache_modifier=".cg")
                    gl.store(yb, t0.to(DT), mask=omask)
                    gl.store(yb + 16, t1.to(DT), mask=omask)
                    gl.store(yb + 32, t2.to(DT), mask=omask)
                    gl.store(yb + 48, t3.to(DT), mask=omask)
                    gl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")
        else:
            gl.store(yb, acc0.to(DT), mask=omask)
            gl.store(yb + 16, acc1.to(DT), mask=omask)
            gl.store(yb + 32, acc2.to(DT), mask=omask)
            gl.store(yb + 48, acc3.to(DT), mask=omask)

    @gluon.jit
    def wg_raw_kernel(q_ptr, s_ptr, z_ptr, x_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, KB, NB, GSI, ITS, SPLIT,
                      NTOK: gl.constexpr, PARTIAL: gl.constexpr, PIPE: gl.constexpr, FOLD: gl.constexpr):
        pid_n, pid_s, nb0, it0, nit = tile_range(K, ITS)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, NTOK, 16])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        xl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, NTOK // 2], threads_per_warp=[NTOK // 4, 128 // NTOK],
                                            warps_per_cta=[4, 1], order=[1, 0])
        xs_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        xs0 = gl.allocate_shared_memory(DT, [NTOK, 64], xs_l)
        xs1 = gl.allocate_shared_memory(DT, [NTOK, 64], xs_l)

        woff, r, soff = word_offsets(nb0, KB, WL, row_l)
        xoff, xmask = x_offsets(K, M, NTOK, xl)

        ones = gl.full([64, 16], 1.0, DT, dot_a)
        zacc = gl.zeros([64, NTOK], gl.float32, mma)
        acc0 = zacc
        acc1 = zacc
        acc2 = zacc
        acc3 = zacc
        w_n = gl.load(q_ptr + woff + it0 * 1024)
        xa_n = gl.load(x_ptr + it0 * 128 + xoff, mask=xmask, other=0.0)
        xb_n = gl.load(x_ptr + it0 * 128 + 64 + xoff, mask=xmask, other=0.0)
        for i in range(nit):
            it = it0 + i
            w_c = w_n
            xa_c = xa_n
            xb_c = xb_n
            itn = gl.minimum(it + 1, it0 + nit - 1)
            w_n = gl.load(q_ptr + woff + itn * 1024)
            xa_n = gl.load(x_ptr + itn * 128 + xoff, mask=xmask, other=0.0)
            xb_n = gl.load(x_ptr + itn * 128 + 64 + xoff, mask=xmask, other=0.0)
            sb = ((it // GSI) * NB + nb0) * 64 + soff
            sz = group_sz(s_ptr, z_ptr, sb)

            bar()  # every wgmma of the last iteration read the tile (each waited for its own)
            xs0.store(xa_c)
            xs1.store(xb_c)
            hopper.fence_async_shared()
            bar()

            g0, g1, g2, g3, gx = k_steps(steps8(w_c), xs0, xs1, ones, zacc, dot_a, PIPE)
            acc0, acc1, acc2, acc3 = fold(acc0, acc1, acc2, acc3, g0, g1, g2, g3, gx, sz)

        store_tile(y_ptr, part_ptr, lock_ptr, acc0, acc1, acc2, acc3, r, nb0, pid_n, pid_s, M, N, SPLIT, NTOK, mma,
                   PARTIAL, FOLD)

    @gluon.jit
    def wg_ring_kernel(q_ptr, s_ptr, z_ptr, x_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, KB, NB, GSI, ITS, SPLIT,
                       NTOK: gl.constexpr, PARTIAL: gl.constexpr, PIPE: gl.constexpr, FOLD: gl.constexpr,
                       STAGES: gl.constexpr):
        # wg_raw_kernel's arithmetic with the CUDA kernel's pipeline: each iteration's words and activations copied
        # by cp.async into a ring of STAGES shared-memory stages, STAGES - 1 iterations ahead; the words read back
        # with 16-byte shared loads in the layout they were copied in (each thread its own 16 bytes)
        pid_n, pid_s, nb0, it0, nit = tile_range(K, ITS)
        last = it0 + nit - 1

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, NTOK, 16])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        xl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, NTOK // 2], threads_per_warp=[NTOK // 4, 128 // NTOK],
                                            warps_per_cta=[4, 1], order=[1, 0])
        ws_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[3, 2, 1, 0])
        xs_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        wring = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 32, 4], ws_l)
        xring = gl.allocate_shared_memory(DT, [2 * STAGES, NTOK, 64], xs_l)

        woff, r, soff = word_offsets(nb0, KB, WL, row_l)
        xoff, xmask = x_offsets(K, M, NTOK, xl)

        # prologue: iterations 0 .. STAGES - 2 (clamped to the last: every iteration commits one group)
        for j in gl.static_range(STAGES - 1):
            itj = gl.minimum(it0 + j, last)
            cp_async(wring.index(j), q_ptr + woff + itj * 1024)
            cp_async(xring.index(2 * j), x_ptr + itj * 128 + xoff, mask=xmask)
            cp_async(xring.index(2 * j + 1), x_ptr + itj * 128 + 64 + xoff,
                                                          mask=xmask)
            cp_commit()

        ones = gl.full([64, 16], 1.0, DT, dot_a)
        zacc = gl.zeros([64, NTOK], gl.float32, mma)
        acc0 = zacc
        acc1 = zacc
        acc2 = zacc
        acc3 = zacc
        for i in range(nit):
            it = it0 + i
            sb = ((it // GSI) * NB + nb0) * 64 + soff
            sz = group_sz(s_ptr, z_ptr, sb)
            cp_wait(STAGES - 2)   # this thread's copies of iteration i landed
            bar()                                      # everyone's; and iteration i - 1's slot is no longer read
            jn = i + STAGES - 1
            sn = jn % STAGES
            itn = gl.minimum(it0 + jn, last)
            cp_async(wring.index(sn), q_ptr + woff + itn * 1024)
            cp_async(xring.index(2 * sn), x_ptr + itn * 128 + xoff, mask=xmask)
            cp_async(xring.index(2 * sn + 1), x_ptr + itn * 128 + 64 + xoff,
                                                          mask=xmask)
            cp_commit()
            hopper.fence_async_shared()
            sc = i % STAGES
            st = steps8(wring.index(sc).load(WL))
            g0, g1, g2, g3, gx = k_steps(st, xring.index(2 * sc), xring.index(2 * sc + 1), ones, zacc, dot_a, PIPE)
            acc0, acc1, acc2, acc3 = fold(acc0, acc1, acc2, acc3, g0, g1, g2, g3, gx, sz)
        cp_wait(0)
        store_tile(y_ptr, part_ptr, lock_ptr, acc0, acc1, acc2, acc3, r, nb0, pid_n, pid_s, M, N, SPLIT, NTOK, mma,
                   PARTIAL, FOLD)

    @gluon.jit
    def wg_mma_kernel(q_ptr, s_ptr, z_ptr, x_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, KB, NB, GSI, ITS, SPLIT,
                      NTOK: gl.constexpr, PARTIAL: gl.constexpr, PIPE: gl.constexpr, FOLD: gl.constexpr):
        # the same tiles and arithmetic on mma.sync (m16n8k16, as the CUDA tight kernel at M = 1-8): every warp
        # streams its own block, the words of the next iteration in registers, the activations read per K step
        # straight into the B-operand layout (L1: every warp of the SM reads the same few KB); no shared memory
        pid_n, pid_s, nb0, it0, nit = tile_range(K, ITS)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        woff, r, soff = word_offsets(nb0, KB, WL, gl.SliceLayout(1, mma))
        bk = gl.arange(0, 16, layout=gl.SliceLayout(1, dot_b))
        bt = gl.arange(0, NTOK, layout=gl.SliceLayout(0, dot_b))
        boff = bt[None, :] * K + bk[:, None]                    # B [16 K, NTOK tokens] of one K step
        bmask = (bt[None, :] < M) & (bk[:, None] < 16)

        ones = gl.full([64, 16], 1.0, DT, dot_a)
        zacc = gl.zeros([64, NTOK], gl.float32, mma)
        acc0 = zacc
        acc1 = zacc
        acc2 = zacc
        acc3 = zacc
        w_n = gl.load(q_ptr + woff + it0 * 1024)
        for i in range(nit):
            it = it0 + i
            w_c = w_n
            itn = gl.minimum(it + 1, it0 + nit - 1)
            w_n = gl.load(q_ptr + woff + itn * 1024)
            sz = group_sz(s_ptr, z_ptr, ((it // GSI) * NB + nb0) * 64 + soff)
            st = steps8(w_c)
            g0 = zacc
            g1 = zacc
            g2 = zacc
            g3 = zacc
            gx = zacc
            for ks in gl.static_range(8):
                b = gl.load(x_ptr + it * 128 + 16 * ks + boff, mask=bmask, other=0.0)
                t0, t1, t2, t3 = a_tiles(st[ks], dot_a)
                g0 = ampere.mma_v2(t0, b, g0)
                g1 = ampere.mma_v2(t1, b, g1)
                g2 = ampere.mma_v2(t2, b, g2)
                g3 = ampere.mma_v2(t3, b, g3)
                gx = ampere.mma_v2(ones, b, gx)
            acc0, acc1, acc2, acc3 = fold(acc0, acc1, acc2, acc3, g0, g1, g2, g3, gx, sz)
        store_tile(y_ptr, part_ptr, lock_ptr, acc0, acc1, acc2, acc3, r, nb0, pid_n, pid_s, M, N, SPLIT, NTOK, mma,
                   PARTIAL, FOLD)

    return {"wg_raw": wg_raw_kernel, "wg_ring": wg_ring_kernel, "wg_mma": wg_mma_kernel}


def applies(k: int, n: int, m: int, gs: int) -> bool:
    return m <= 16 and n % 256 == 0 and k % 128 == 0 and (gs == -1 or gs % 128 == 0)


def plan(cfg: dict, m: int, n: int, k: int, sms: int) -> dict:
    """NTOK, the split count and the iterations (128 K) a split. The split count: cfg's "split" if set, else the one of
    1 .. 2 x waves x per_sm x SMs / tiles whose grid fills its last wave of resident CTAs best (the fewest splits on a
    tie): every CTA has the same work, so a part-filled last wave leaves SMs idle for a whole CTA's time."""
    iters, tiles = k // 128, n // 256
    if "split" in cfg:
        its = -(-iters // min(cfg["split"], iters))
    else:
        ntok = 8 if m <= 8 else 16
        slots = (cfg["per_sm"] if isinstance(cfg["per_sm"], int) else cfg["per_sm"][ntok]) * sms
        top = max(1, 2 * round(cfg["waves"] * slots / tiles))

        def fill(its):  # how full the grid's last wave is, and the split count
            split = -(-iters // its)
            return (round((tiles * split / slots) / -(-tiles * split // slots), 3), -split)
        its = max((i for i in range(1, iters + 1) if -(-iters // i) <= top), key=fill)
    return {"NTOK": 8 if m <= 8 else 16, "ITS": its, "SPLIT": -(-iters // its)}


def emulate(x, lay, gs: int, its: int):
    """The kernel's arithmetic in float64 on the CPU, index for index: which word, nibble and pair each wgmma row and
    K column read, the raw codes 128 + c, the per-iteration fold acc += s g - s (128 + z) gx, the split sums."""
    import torch
    q = lay["qweight"].to(torch.int64) & 0xFFFFFFFF          # [NB, KB, 32 lanes, 4 u]
    nb, kb = q.shape[0], q.shape[1]
    n, k, m = nb * 64, kb * 16, x.shape[0]
    nib = torch.stack([torch.stack([(q >> (4 * i)) & 0xF, (q >> (16 + 4 * i)) & 0xF], -1) for i in range(4)], -2)
    # nib: [NB, KB, lane, u, i, e]
    # nibble i of word u, lane 4 g + t4, pair e: feature 64 nb + 16 u + 8 (i // 2) + g, K 16 ks + 8 (i % 2) + 2 t4 + e
    g_, t4 = torch.arange(32) // 4, torch.arange(32) % 4
    feat = (torch.arange(nb).view(nb, 1, 1, 1, 1, 1) * 64 + torch.arange(4).view(1, 1, 1, 4, 1, 1) * 16
            + (torch.arange(4) // 2).view(1, 1, 1, 1, 4, 1) * 8 + g_.view(1, 1, 32, 1, 1, 1))
    kk = (torch.arange(kb).view(1, kb, 1, 1, 1, 1) * 16 + (torch.arange(4) % 2).view(1, 1, 1, 1, 4, 1) * 8
          + t4.view(1, 1, 32, 1, 1, 1) * 2 + torch.arange(2).view(1, 1, 1, 1, 1, 2))
    shape = nib.shape
    raw = torch.zeros(n, k, dtype=torch.float64)
    raw[feat.expand(shape).reshape(-1), kk.expand(shape).reshape(-1)] = nib.reshape(-1).double() + 128
    s = lay["scales"].double().permute(0, 1, 3, 2).reshape(lay["scales"].shape[0], n)  # [G, N] (j = 2 u + h)
    z = lay["zeros"].double().permute(0, 1, 3, 2).reshape(lay["zeros"].shape[0], n)
    gsi = (k if gs == -1 else gs) // 128
    xd = x.double()
    out = torch.zeros(m, n, dtype=torch.float64)
    for s0 in range(0, k // 128, its):                          # splits, summed in order
        part = torch.zeros(m, n, dtype=torch.float64)
        for it in range(s0, min(s0 + its, k // 128)):
            sl = slice(128 * it, 128 * it + 128)
            g = xd[:, sl] @ raw[:, sl].t()
            gx = xd[:, sl].sum(1, keepdim=True)
            part += s[it // gsi] * g - (s[it // gsi] * (128 + z[it // gsi])) * gx
        out += part
    return out.to(x.dtype)


def run(x, lay, gs: int, cfg: dict, sms: int):
    """y [M, N] = x [M, K] @ W.T through the prototype (a CPU x: its emulation)."""
    import torch
    m, k = x.shape
    nb, kb = lay["qweight"].shape[0], lay["qweight"].shape[1]
    n = nb * 64
    if not applies(k, n, m, gs):
        raise ValueError(f"triton_gluon: M={m} K={k} N={n} group {gs} is outside the prototype")
    c = plan(cfg, m, n, k, sms)
    if lay.get("perm") is not None:       # act-order: the layout's K is permuted, so gather x's columns (as the CUDA op)
        perm = lay["perm"]
        x = x.index_select(1, perm.long() if x.device.type == "cpu" else perm).contiguous()
    if x.device.type == "cpu":
        return emulate(x, lay, gs, c["ITS"])
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError("triton_gluon: bf16 or fp16 activations")
    f16 = x.dtype == torch.float16
    if f16 not in _KERN:
        _KERN[f16] = _kernels(f16)
    split = c["SPLIT"]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    gsi = (k if gs == -1 else gs) // 128
    extra = {"STAGES": cfg["STAGES"]} if cfg["kernel"] == "ring" else {}
    fold = split > 1 and bool(cfg.get("FOLD"))
    _KERN[f16]["wg_" + cfg["kernel"]][(n // 256, split)](
        lay["qweight"], lay["scales"], lay["zeros"], x, out, part, lay["locks"], m, n, k, kb, nb, gsi, c["ITS"], split,
        NTOK=c["NTOK"], PARTIAL=split > 1, PIPE=cfg["PIPE"], FOLD=fold, num_warps=4, **extra)
    if split > 1 and not fold:
        import w4a16_proto
        w4a16_proto.reduce_splits(part, out, m, n, split)
    return out


def sass(ntok: int = 16, pipe: bool = False, kernel: str = "raw", stages: int = 4, f16: bool = False,
         fold: bool = False) -> dict:
    """Compile a kernel for sm_90 here (no GPU) and return its cubin's SASS text, registers, local and shared bytes."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    fn = _kernels(f16)["wg_" + kernel]
    dt = "*fp16" if f16 else "*bf16"
    types = ["*i32", "*fp16", dt, dt, dt, "*fp32", "*i32"] + ["i32"] * 8
    consts = {"NTOK": ntok, "PARTIAL": True, "PIPE": pipe, "FOLD": fold,
              **({"STAGES": stages} if kernel == "ring" else {})}
    sig = dict(zip(fn.arg_names, types + ["constexpr"] * len(consts)))
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
    attrs.update({(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("N", "K", "KB")})
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()},
                         attrs=attrs)
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(kern.asm["cubin"])
        text = subprocess.run([str(tool), "-sass", str(p)], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([str(tool), "-res-usage", str(p)], capture_output=True, text=True, check=True).stdout
    regs = int(res.split("REG:")[1].split()[0])
    return {"sass": text, "regs": regs, "local": int(res.split("LOCAL:")[1].split()[0]),
            "shared": kern.metadata.shared}


def _sass_summary(argv) -> None:
    import collections
    import re
    for name, cfg in CONFIGS.items():
        for ntok in (8, 16):
            r = sass(ntok, cfg["PIPE"], cfg["kernel"], cfg.get("STAGES", 4), fold=bool(cfg.get("FOLD")))
            ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+([A-Z0-9]+)", r["sass"], re.M))
            top = ", ".join(f"{o} {c}" for o, c in ops.most_common(10))
            print(f"{name} NTOK {ntok}: {r['regs']} registers, {r['local']} B local, {r['shared']} B shared; {top}")


def _where_wrong(y, ref) -> dict:
    """A wrong output's signature: how many features are off, their positions in their 64-feature block (u = f % 64 //
    16, h = f % 16 // 8, g = f % 8) and the tokens that are off."""
    import torch
    col = (y - ref).norm(dim=0) / ref.norm(dim=0).clamp_min(1e-6)
    bad = torch.nonzero(col > 1e-2).flatten()
    if not len(bad):
        return {}
    f = bad % 64
    tok = (y - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-6)
    return {"bad_features": len(bad), "bad_u": torch.bincount(f // 16, minlength=4).tolist(),
            "bad_h": torch.bincount(f % 16 // 8, minlength=2).tolist(),
            "bad_g": torch.bincount(f % 8, minlength=8).tolist(),
            "bad_tokens": torch.nonzero(tok > 1e-2).flatten().tolist()[:16]}


def diagnose(sms: int, device: str = "cuda") -> list:
    """On the GPU, before the sweep, on small asymmetric layers (K 1024, N 512, group 128) against x @ W.T: every config
    in bf16 at M = 1 and 16 (the kernels the sweep compiles anyway), r3 with one split (y stored directly), r3 in fp16,
    every config on an act-order layer, and FOLD's bits and counters. A wrong output is summarized by where it is wrong
    (``_where_wrong``), so that a layout slip can be read from one call's log."""
    import json

    import torch

    import gemm
    from sdquant.kernels import int4_layout
    dev = torch.device(device)
    qw = gemm.random_int4(512, 1024, gs=128, symmetric=False, device=dev, seed=11)
    qa = gemm.random_int4(512, 1024, gs=128, symmetric=False, act_order=True, device=dev, seed=12)
    cases = [(name, cfg, torch.bfloat16, m, qw, "") for name, cfg in CONFIGS.items() for m in (1, 16)]
    cases += [("r3", dict(CONFIGS["r3"], split=1), torch.bfloat16, m, qw, "one_split") for m in (1, 16)]
    cases += [("r3", CONFIGS["r3"], torch.float16, 16, qw, "")]
    cases += [(name, cfg, torch.bfloat16, 16, qa, "act_order") for name, cfg in CONFIGS.items()]
    rows, lays = [], {}
    for name, cfg, dt, m, q, what in cases:
        lay = lays.setdefault((id(q), dt), int4_layout.repack_cuda(q, dt))
        x = torch.randn(m, 1024, device=dev, dtype=dt)
        ref = x.float() @ q.dequantize().float().t()
        row = {"diag": name, "dtype": str(dt).split(".")[1], "M": m, "case": what}
        try:
            y = run(x, lay, 128, cfg, sms).float()
        except Exception as ex:  # a form that does not compile or launch is a result, not a crash
            row["fail"] = f"{type(ex).__name__}: {str(ex)[:300]}"
        else:
            row["rel_err"] = ((y - ref).norm() / ref.norm()).item()
            row.update(_where_wrong(y, ref))
            if cfg.get("FOLD") and what == "":  # the counters back at zero, the bits of the second kernel's sum
                row["fold_repeat_equal"] = bool(torch.equal(run(x, lay, 128, cfg, sms).float(), y))
                row["fold_equals_reduce"] = bool(torch.equal(run(x, lay, 128, dict(cfg, FOLD=False), sms).float(), y))
                row["locks_zero"] = bool((lay["locks"] == 0).all().item())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--sass" in argv:
        return _sass_summary(argv)
    import w4a16_proto
    if "--dry" not in argv:
        import torch
        diagnose(torch.cuda.get_device_properties(0).multi_processor_count)
    from sdquant.kernels import int4_layout
    return w4a16_proto.main(argv, __doc__, "triton_gluon", CONFIGS, int4_layout.repack_cuda, run, MS, DRY_SHAPES,
                            DRY_MS, lambda cfg, k, n, m: applies(k, n, m, 128))


if __name__ == "__main__":
    main()
