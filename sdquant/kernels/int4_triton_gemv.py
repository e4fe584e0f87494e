"""Small-M (decode) Triton W4A16 kernels over the layout of ``int4_layout.repack_triton`` (int32 [K/8, N]).

``int4_triton`` dispatches M <= 16 here (per M bucket, ``int4_triton.SMALL_M_PLAN``); nothing in this module
registers an op. Two kernels, both split-K over every SM. The splits of an output tile are summed in a fixed
order (deterministic) by a second pass (``_reduce_kernel``: no atomics, no memset), or, in the GEMV at M = 1 when
the caller passes split-K counters (``locks``, int32 [>= N/BLOCK_N], zero before and after a call), inside the
kernel by the last program of the tile to finish (``_fold``: a CTA barrier, one acq_rel atomic, the partials read
through L2; the CUDA kernels' count-in), which saves the second launch. Both sum in the same order from the same
start, so both give the same bits:

* ``_tc_kernel`` (tensor cores, any M <= 16 per 16-row tile): the int32 tile [BK/8, BN] (16-byte loads along N)
  is unpacked straight into the dtype's bits with a magic number -- ``0x4300 | code`` is the bf16 value
  128 + code, ``0x6400 | code`` the fp16 value 1024 + code -- so there is no int->float conversion (the old
  ``_splitk_kernel`` spent one quarter-rate I2F per code) and no dequantization per weight: the tile of
  (BIAS + code) goes to ``tl.dot`` as is, and each group's scale is applied once to the fp32 product,
  ``acc += s * dot(x, BIAS + c) + (zs - BIAS * s) * sum(x)`` (exact codes, fp32 scale/zero arithmetic; a K
  tile never crosses a group). The 8 codes of a word are built as 4 bf16x2/f16x2 pairs by byte permutes
  (``UNPACK=2``: inline PTX ``prmt`` + ``lop3``, 9 instructions per word) or by shifts in plain Triton
  (``UNPACK=1``); ``UNPACK=3`` is the old kernel's broadcast+reshape with the magic number (a fallback);
  ``UNPACK=0`` converts with ``.to()`` (Triton's interpreter, and any dtype). The 8 nibble
  tensors are joined so that the in-register tile is K-contiguous per thread (vectorized shared-memory stores
  for the dot operand). ``SWAP=True`` (default) computes the transposed tile, out^T [BN, 16] = W^T @ x^T, so the
  weights are the MMA's A operand: on Hopper Triton then issues wgmma with the weight tile read by ldmatrix from
  a K-contiguous buffer; with SWAP=False (weights as the B operand) Triton 3.6 read the tile with scalar LDS
  (655 vs 462 SASS instructions per 128x128 tile in the main loop, compiled for sm_90 offline).
* ``_gemv_kernel`` (M <= 4, no ``tl.dot``): every thread holds all BK/8 word rows of 4-column chunks, so the
  reduction over K stays in registers; a nibble is converted in place with a per-position fp32 magic number
  (``(w & 0xF << P) | (150 - P) << 23`` is the float 2**(23-P) + code; P = 0..16, the top three nibbles from
  ``w >> 12``) and one FADD that removes the constant 2**(23-P); then one FFMA per code and row against the
  activation, fp32 throughout. The zero point enters once a tile and row, ``acc += s * sum(code * x) + zs *
  sum(x)``: 5-11% faster on the H200 than removing ``zero = -zs/s`` from every code, which cost a division per
  column and tile (docs/benchmarks/int4-triton.md, "Triton small-M: the folded zero point"). The magic number comes in as a
  kernel argument so that it stays in a register.

Both kernels read ``x[:, perm]`` through the act-order permutation in the load, take fp16/bf16 activations,
groups of 32/64/128/... (multiples of 32 dividing K) or per-channel, and accumulate in fp32.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from sdquant.errors import ShapeError
from sdquant.kernels.triton_jit import jit_in_namespace

try:  # Triton is optional; int4_triton checks availability before calling here
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

NUM_SMS_DEFAULT = 132
MAGIC_F32 = 0x4B000000   # bits of the float 2**23


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ------------------------------------------------------------------------------------------------ helpers
# Only Triton builtins and the helpers below (jitted per interpreter mode with the kernels): the library's own
# @jit functions (tl.zeros, tl.sum, ...) were wrapped when triton was imported and cannot run in an interpreter
# switched on later in the same process (how tests/kernels/test_int4_triton.py runs them).
def _add(a, b):
    return a + b


def _split8(xa, R):
    """[R, 8] -> its 8 columns [R] (column j = 4a + 2b + c)."""
    a = tl.reshape(xa, (R, 2, 2, 2))
    c0, c1 = tl.split(a)
    c00, c01 = tl.split(c0)
    c10, c11 = tl.split(c1)
    x0, x4 = tl.split(c00)
    x2, x6 = tl.split(c01)
    x1, x5 = tl.split(c10)
    x3, x7 = tl.split(c11)
    return x0, x1, x2, x3, x4, x5, x6, x7


def _nib32(w, P, mg):
    """Nibble at bit P (P <= 16) of uint32 words -> fp32 2**(23-P) + code (exact), no shift, no I2F."""
    return ((w & (0xF << P)) | (mg - (P << 23))).to(tl.float32, bitcast=True)


def _asm_unpack8(wq, CDT):
    """uint32 words -> 8 tensors BIAS + code_j (j = 0..7) in CDT (bf16: 0x4300 | c = 128 + c; fp16: 0x6400 | c
    = 1024 + c). Pairs (2i, 2i+1) are byte-permuted from w and w >> 4 into one 32-bit register."""
    if CDT == tl.float16:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 w4, t0, t1, t2, t3;
            shr.b32 w4, $8, 4;
            prmt.b32 t0, $8, w4, 0x4400;
            prmt.b32 t1, $8, w4, 0x5511;
            prmt.b32 t2, $8, w4, 0x6622;
            prmt.b32 t3, $8, w4, 0x7733;
            lop3.b32 t0, t0, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 t1, t1, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 t2, t2, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 t3, t3, 0x000F000F, 0x64006400, 0xEA;
            mov.b32 {$0, $1}, t0;
            mov.b32 {$2, $3}, t1;
            mov.b32 {$4, $5}, t2;
            mov.b32 {$6, $7}, t3;
            }""",
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[wq], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 w4, t0, t1, t2, t3;
            shr.b32 w4, $8, 4;
            prmt.b32 t0, $8, w4, 0x4400;
            prmt.b32 t1, $8, w4, 0x5511;
            prmt.b32 t2, $8, w4, 0x6622;
            prmt.b32 t3, $8, w4, 0x7733;
            lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 t2, t2, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 t3, t3, 0x000F000F, 0x43004300, 0xEA;
            mov.b32 {$0, $1}, t0;
            mov.b32 {$2, $3}, t1;
            mov.b32 {$4, $5}, t2;
            mov.b32 {$6, $7}, t3;
            }""",
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[wq], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


def _nib16(wq, P, CDT, UNPACK):
    c = (wq >> P) & 0xF
    if UNPACK == 0:
        return c.to(CDT)
    elif CDT == tl.float16:
        return (c | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        return (c | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)


def _k_cols(perm_ptr, k0, BLOCK_K, HAS_PERM):
    """The activation columns of K tile [k0, k0 + BLOCK_K): act-order (HAS_PERM) gathers them through perm."""
    kx = k0 + tl.arange(0, BLOCK_K)
    if HAS_PERM:
        kx = tl.load(perm_ptr + kx)
    return kx


def _codes8(wq, CDT, UNPACK):
    """uint32 words -> 8 tensors of the same shape, nibble j (bits 4j..4j+3) as BIAS + code in CDT (UNPACK 2:
    the byte-permute asm; 1: 16-bit magic number; 0: plain conversion, BIAS = 0)."""
    if UNPACK == 2:
        o0, o1, o2, o3, o4, o5, o6, o7 = _asm_unpack8(wq, CDT)
    else:
        o0 = _nib16(wq, 0, CDT, UNPACK)
        o1 = _nib16(wq, 4, CDT, UNPACK)
        o2 = _nib16(wq, 8, CDT, UNPACK)
        o3 = _nib16(wq, 12, CDT, UNPACK)
        o4 = _nib16(wq, 16, CDT, UNPACK)
        o5 = _nib16(wq, 20, CDT, UNPACK)
        o6 = _nib16(wq, 24, CDT, UNPACK)
        o7 = _nib16(wq, 28, CDT, UNPACK)
    return o0, o1, o2, o3, o4, o5, o6, o7


def _join8(o0, o1, o2, o3, o4, o5, o6, o7):
    """8 tensors [*S] -> [*S, 2, 2, 2] holding o_j at (a, b, c) with j = 4a + 2b + c (join appends a trailing axis),
    so that flattening the last axes puts the 8 codes of a word in order."""
    return tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))


def _unpack_kn(wq, R, BN, CDT, UNPACK):
    """[R, BN] uint32 words -> [8R, BN] CDT tile of BIAS + code (k = 8r + j), K-contiguous in each thread."""
    if UNPACK == 3:   # the old kernel's broadcast-and-reshape unpack, with the 16-bit magic number (a fallback)
        w = (wq[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
        if CDT == tl.float16:
            w = (w | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
        else:
            w = (w | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.reshape(w, (8 * R, BN))
    o0, o1, o2, o3, o4, o5, o6, o7 = _codes8(wq, CDT, UNPACK)
    t = tl.permute(_join8(o0, o1, o2, o3, o4, o5, o6, o7), (0, 2, 3, 4, 1))          # [R, a, b, c, BN]
    return tl.reshape(t, (8 * R, BN))


def _unpack_nk(wq, R, BN, CDT, UNPACK):
    """[R, BN] uint32 words -> [BN, 8R] CDT tile of BIAS + code (the transposed tile: weights as the MMA's A
    operand), K-contiguous: the 8 codes of a word are adjacent."""
    o0, o1, o2, o3, o4, o5, o6, o7 = _codes8(tl.trans(wq), CDT, UNPACK)               # each [BN, R]
    return tl.reshape(_join8(o0, o1, o2, o3, o4, o5, o6, o7), (BN, 8 * R))


# ---------------------------------------------------------------------------------------------- kernels
def _tc_kernel(x_ptr, qw_ptr, s_ptr, zs_ptr, perm_ptr, out_ptr, part_ptr, M, N, stride_xm, K_SPLIT,
               GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PARTIAL: tl.constexpr, HAS_PERM: tl.constexpr, CDT: tl.constexpr,
               UNPACK: tl.constexpr, BIAS: tl.constexpr, SWAP: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    R: tl.constexpr = BLOCK_K // 8
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    m_mask = offs_m < M
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_t = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    k_begin = pid_k * K_SPLIT
    for kt in range(0, K_SPLIT, BLOCK_K):
        k0 = k_begin + kt
        kx = _k_cols(perm_ptr, k0, BLOCK_K, HAS_PERM)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :], mask=m_mask[:, None], other=0.0)
        wq = tl.load(qw_ptr + (k0 // 8 + offs_r)[:, None] * N + offs_n[None, :]).to(tl.uint32, bitcast=True)
        g = k0 // GS
        s = tl.load(s_ptr + g * N + offs_n).to(tl.float32)
        zb = tl.load(zs_ptr + g * N + offs_n).to(tl.float32) - BIAS * s
        xs = tl.reduce(x.to(tl.float32), 1, _add)
        if SWAP:   # out^T tile [BN, BM] = W^T [BN, BK] @ x^T [BK, BM]: the weights are the A operand
            d = tl.dot(_unpack_nk(wq, R, BLOCK_N, CDT, UNPACK), tl.trans(x.to(CDT)))
            acc_t += d * s[:, None] + zb[:, None] * xs[None, :]
        else:
            d = tl.dot(x.to(CDT), _unpack_kn(wq, R, BLOCK_N, CDT, UNPACK))
            acc += d * s[None, :] + xs[:, None] * zb[None, :]
    if SWAP:
        acc = tl.trans(acc_t)
    if not PARTIAL:
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None])
    else:
        tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=m_mask[:, None])


def _gemv_dot(x_ptr, stride_xm, ROW, M, kx, R, d0, d1, d2, d3, d4, d5, d6, d7):
    """(sum over the tile's K of d[k, n] * x[ROW, k] as fp32 [BN] (one FMA chain per element), sum of x[ROW, k])."""
    xa = tl.load(x_ptr + ROW * stride_xm + kx, mask=(kx * 0 + ROW) < M, other=0.0).to(tl.float32)  # [R, 8]
    a0, a1, a2, a3, a4, a5, a6, a7 = _split8(xa, R)
    p = (d0 * a0[:, None] + d1 * a1[:, None] + d2 * a2[:, None] + d3 * a3[:, None]
         + d4 * a4[:, None] + d5 * a5[:, None] + d6 * a6[:, None] + d7 * a7[:, None])
    return tl.reduce(p, 0, _add), tl.reduce(tl.reduce(xa, 1, _add), 0, _add)


def _gemv_code(wq, wh, j, mg):
    """code_j as fp32 [R, BN]: in-place nibble + magic number, one FADD (exact)."""
    if j < 5:
        w = wq
        P = 4 * j
    else:
        w = wh
        P = 4 * j - 12
    return _nib32(w, P, mg) - (1 << (23 - P))


def _fold(part_ptr, out_ptr, lock_ptr, tile, offs_m, offs_n, M, N, BM: tl.constexpr, BN: tl.constexpr,
          SPLIT: tl.constexpr):
    """After this program stored its fp32 partial of output rows offs_m [BM] x columns offs_n [BN] (split-major
    [SPLIT, M, N], as ``_reduce_kernel`` reads it): count in on the tile's counter ``lock_ptr[tile]``; the last of
    the SPLIT programs sums the partials in split order 0..SPLIT-1 from 0.0 (the second pass's order and start, so
    the bits match it), stores the output and resets the counter. The barrier puts every thread's partial store
    before the release of the one atomic (Triton runs a scalar atomic in one thread and broadcasts its result
    through shared memory behind a barrier, which carries the acquire to the others)."""
    tl.debug_barrier()
    if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
        mask = (offs_m < M)[:, None]
        at = offs_m[:, None] * N + offs_n[None, :]
        acc = tl.full((BM, BN), 0.0, tl.float32)
        for s in tl.static_range(SPLIT):   # every split's load in flight at once
            acc += tl.load(part_ptr + s * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")


def _gemv_kernel(x_ptr, qw_ptr, s_ptr, zs_ptr, perm_ptr, out_ptr, part_ptr, lock_ptr, M, N, stride_xm, K_SPLIT,
                 MAGIC, GS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PARTIAL: tl.constexpr, HAS_PERM: tl.constexpr, FOLD: tl.constexpr, SPLIT: tl.constexpr,
                 ROWS_P: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    R: tl.constexpr = BLOCK_K // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    offs_j = tl.arange(0, 8)
    mg = MAGIC.to(tl.uint32)
    acc0 = tl.full((BLOCK_N,), 0.0, tl.float32)
    acc1 = tl.full((BLOCK_N,), 0.0, tl.float32)
    acc2 = tl.full((BLOCK_N,), 0.0, tl.float32)
    acc3 = tl.full((BLOCK_N,), 0.0, tl.float32)
    k_begin = pid_k * K_SPLIT
    for kt in range(0, K_SPLIT, BLOCK_K):
        k0 = k_begin + kt
        wq = tl.load(qw_ptr + (k0 // 8 + offs_r)[:, None] * N + offs_n[None, :]).to(tl.uint32, bitcast=True)
        wh = wq >> 12
        kk = k0 + offs_r[:, None] * 8 + offs_j[None, :]                                   # [R, 8]
        if HAS_PERM:
            kx = tl.load(perm_ptr + kk)
        else:
            kx = kk
        g = k0 // GS
        s = tl.load(s_ptr + g * N + offs_n).to(tl.float32)
        zs = tl.load(zs_ptr + g * N + offs_n).to(tl.float32)
        d0 = _gemv_code(wq, wh, 0, mg)
        d1 = _gemv_code(wq, wh, 1, mg)
        d2 = _gemv_code(wq, wh, 2, mg)
        d3 = _gemv_code(wq, wh, 3, mg)
        d4 = _gemv_code(wq, wh, 4, mg)
        d5 = _gemv_code(wq, wh, 5, mg)
        d6 = _gemv_code(wq, wh, 6, mg)
        d7 = _gemv_code(wq, wh, 7, mg)
        # s * (code - zero) = s * code + zs: the zero point enters once a tile and row, through sum(x)
        p0, x0 = _gemv_dot(x_ptr, stride_xm, 0, M, kx, R, d0, d1, d2, d3, d4, d5, d6, d7)
        acc0 += p0 * s + zs * x0
        if ROWS > 1:
            p1, x1 = _gemv_dot(x_ptr, stride_xm, 1, M, kx, R, d0, d1, d2, d3, d4, d5, d6, d7)
            acc1 += p1 * s + zs * x1
        if ROWS > 2:
            p2, x2 = _gemv_dot(x_ptr, stride_xm, 2, M, kx, R, d0, d1, d2, d3, d4, d5, d6, d7)
            acc2 += p2 * s + zs * x2
        if ROWS > 3:
            p3, x3 = _gemv_dot(x_ptr, stride_xm, 3, M, kx, R, d0, d1, d2, d3, d4, d5, d6, d7)
            acc3 += p3 * s + zs * x3
    if not PARTIAL:
        dst = out_ptr + offs_n
        tl.store(dst, acc0.to(out_ptr.dtype.element_ty))
        if ROWS > 1:
            tl.store(dst + N, acc1.to(out_ptr.dtype.element_ty), mask=(offs_n * 0 + 1) < M)
        if ROWS > 2:
            tl.store(dst + 2 * N, acc2.to(out_ptr.dtype.element_ty), mask=(offs_n * 0 + 2) < M)
        if ROWS > 3:
            tl.store(dst + 3 * N, acc3.to(out_ptr.dtype.element_ty), mask=(offs_n * 0 + 3) < M)
    else:
        dst = part_ptr + pid_k * M * N + offs_n
        tl.store(dst, acc0)
        if ROWS > 1:
            tl.store(dst + N, acc1, mask=(offs_n * 0 + 1) < M)
        if ROWS > 2:
            tl.store(dst + 2 * N, acc2, mask=(offs_n * 0 + 2) < M)
        if ROWS > 3:
            tl.store(dst + 3 * N, acc3, mask=(offs_n * 0 + 3) < M)
        if FOLD:
            _fold(part_ptr, out_ptr, lock_ptr, pid_n, tl.arange(0, ROWS_P), offs_n, M, N, ROWS_P, BLOCK_N, SPLIT)


def _reduce_kernel(part_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """out = sum of the SPLIT_K partial slices in a fixed order. The loop is unrolled so that every partial's
    load is in flight at once (a rolled loop waits one L2 round trip per split: ~10 us at 16 splits when only
    a few programs run, as at M = 1 on 4096x4096); EVEN (MN % BLOCK == 0) drops the mask for 16-byte loads."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for s in tl.static_range(SPLIT_K):
        if EVEN:
            acc += tl.load(part_ptr + s * MN + offs)
        else:
            acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if EVEN:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_HELPERS = ("_add", "_split8", "_nib32", "_asm_unpack8", "_nib16", "_codes8", "_join8", "_k_cols", "_unpack_kn",
            "_unpack_nk", "_gemv_dot", "_gemv_code", "_fold")
_KERNELS: dict = {}


def _kernels():
    """{"tc", "gemv", "reduce"} jitted for the current interpreter mode, built on first use, one set per mode
    (see sdquant.kernels.triton_jit)."""
    mode = _interpret()
    if mode not in _KERNELS:
        tc, gemv, reduce = jit_in_namespace(globals(), (_tc_kernel, _gemv_kernel, _reduce_kernel),
                                            [globals()[name] for name in _HELPERS])
        _KERNELS[mode] = {"tc": tc, "gemv": gemv, "reduce": reduce}
    return _KERNELS[mode]


# ---------------------------------------------------------------------------------------------- configs
DEFAULT_TC = {"kernel": "tc", "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0,
              "SPLIT_K": 0, "UNPACK": 2, "SWAP": True}
DEFAULT_GEMV = {"kernel": "gemv", "BLOCK_N": 512, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "waves": 3.0,
                "SPLIT_K": 0}


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


def _fit_block_k(k: int, gs: int, want: int) -> int:
    bk = want
    while bk > 32 and (gs % bk or k % bk):
        bk //= 2
    return bk


def _fit_block_n(n: int, want: int) -> int:
    bn = want
    while bn > 32 and n % bn:
        bn //= 2
    return bn


def auto_split(k: int, block_k: int, tiles_n: int, target_programs: float) -> int:
    """Smallest split s (K/BK divisible by s) with tiles_n * s >= target_programs, else the largest."""
    kt = k // block_k
    divs = [s for s in range(1, kt + 1) if kt % s == 0]
    for s in divs:
        if tiles_n * s >= target_programs:
            return s
    return divs[-1]


def resolve(cfg: dict, m: int, n: int, k: int, gs: int, sms: int) -> dict:
    """A launchable config: block sizes fitted to the shape and group size, split-K chosen."""
    c = dict(DEFAULT_TC if cfg.get("kernel", "tc") == "tc" else DEFAULT_GEMV)
    c.update(cfg)
    c["BLOCK_K"] = _fit_block_k(k, gs, c["BLOCK_K"])
    c["BLOCK_N"] = _fit_block_n(n, c["BLOCK_N"])
    if c["kernel"] == "gemv":
        if m > 4:
            raise ShapeError(f"gemv kernel: M={m} > 4 rows")
        # all K rows of a tile in one thread: BLOCK_N >= 4 columns x 32 lanes x warps
        c["num_warps"] = max(1, min(c["num_warps"], c["BLOCK_N"] // 128))
    elif m > 16:
        raise ShapeError(f"tc small-M kernel: M={m} > 16 rows")
    tiles = n // c["BLOCK_N"]
    split = c["SPLIT_K"] or auto_split(k, c["BLOCK_K"], tiles, c["waves"] * sms)
    if (k // c["BLOCK_K"]) % split:
        raise ShapeError(f"SPLIT_K={split} does not divide the {k // c['BLOCK_K']} K tiles")
    c["SPLIT_K"] = split
    return c


# ----------------------------------------------------------------------------------------------- launch
def use_fold(locks: Optional[torch.Tensor], split: int, tiles: int, device: torch.device, cfg: dict,
             default: bool = True) -> bool:
    """Whether a launch of ``tiles`` output tiles sums its splits in the kernel (``_fold``): split-K, counters
    given (int32 on the launch's device; a wrong one is an error) and enough of them (else the second pass), and
    the config's ``"fold"`` (else ``default``) true. ``run`` folds the GEMV at M = 1 by default: on the H200 that
    was 0.3-1.9 us faster than the second pass on every Llama shape, while at M = 2 (and in the tensor-core and
    mid-M kernels, M = 2-256) the kernels with the fold took 0.98-1.75x the time (docs/benchmarks/int4-triton.md, "Triton
    split-K summed in the kernel")."""
    if split <= 1 or locks is None or not cfg.get("fold", default):
        return False
    if locks.dtype != torch.int32 or locks.device != device or locks.dim() != 1:
        raise ShapeError(f"locks: expected a 1-D int32 tensor on {device}, got {locks.dtype} "
                         f"{list(locks.shape)} on {locks.device}")
    return locks.numel() >= tiles


def run(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zs: torch.Tensor,
        perm: Optional[torch.Tensor], gs: int, cfg: dict, locks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [M, N] (x2's dtype) = x2 @ W.T for contiguous-row x2 [M, K] (M <= 16; <= 4 for "gemv"), no bias.
    ``locks`` (int32, at least N / BLOCK_N entries, all zero; left at zero): the GEMV's split-K sum inside the
    kernel (``_fold``) instead of ``_reduce_kernel`` where ``use_fold`` says so (M = 1 unless the config's
    ``"fold"`` says otherwise); None keeps the second pass."""
    m, k = x2.shape
    n = qweight.shape[1]
    c = resolve(cfg, m, n, k, gs, num_sms(x2.device))
    kern = _kernels()
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    split = c["SPLIT_K"]
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    grid = (n // c["BLOCK_N"], split)
    has_perm = perm is not None
    perm_arg = perm if has_perm else qweight
    fold = c["kernel"] == "gemv" and use_fold(locks, split, grid[0], x2.device, c, m == 1)
    lock_arg = locks if fold else part
    if c["kernel"] == "gemv":
        kern["gemv"][grid](x2, qweight, scales, zs, perm_arg, out, part, lock_arg, m, n, x2.stride(0), k // split,
                           MAGIC_F32, GS=gs, ROWS=m, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], PARTIAL=split > 1,
                           HAS_PERM=has_perm, FOLD=fold, SPLIT=split if fold else 1,
                           ROWS_P=triton.next_power_of_2(m), num_warps=c["num_warps"], num_stages=c["num_stages"])
    else:
        interp = _interpret()
        # the interpreter runs no inline PTX and no bf16 bit tricks: plain conversion there (fp16 magic is fine)
        unpack = 0 if interp and (c["UNPACK"] == 2 or x2.dtype == torch.bfloat16) else c["UNPACK"]
        if interp and x2.dtype == torch.bfloat16:
            cdt = tl.float32    # the interpreter computes bf16 arithmetic wrongly
        else:
            cdt = tl.float16 if x2.dtype == torch.float16 else tl.bfloat16
        bias = 0.0 if unpack == 0 else (1024.0 if x2.dtype == torch.float16 else 128.0)
        kern["tc"][grid](x2, qweight, scales, zs, perm_arg, out, part, m, n, x2.stride(0), k // split, GS=gs,
                         BLOCK_M=16, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], PARTIAL=split > 1,
                         HAS_PERM=has_perm, CDT=cdt, UNPACK=unpack, BIAS=bias, SWAP=bool(c["SWAP"]),
                         num_warps=c["num_warps"], num_stages=c["num_stages"])
    if split > 1 and not fold:
        block = 512
        kern["reduce"][(triton.cdiv(m * n, block),)](part, out, m * n, SPLIT_K=split, BLOCK=block,
                                                     EVEN=(m * n) % block == 0, num_warps=4)
    return out
