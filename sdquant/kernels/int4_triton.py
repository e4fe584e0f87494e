"""Triton W4A16 kernels over the layout of ``int4_layout.repack_triton``, as the op ``sdquant::w4a16_triton``.

    torch.ops.sdquant.w4a16_triton(x, qweight, scales, zs, perm, bias, locks=None) -> y
        x       fp16/bf16 [..., K]        (dtype must match scales)
        qweight int32 [K/8, N]            scales / zs  dtype [G, N]  (G = K / group_size; 1 = per-channel)
        perm    int32 [K] or None         act-order: the kernels read x[:, perm] (gathered in the load)
        bias    dtype [N] or None
        locks   int32 [>= N/32] or None   split-K counters (the layout's, zero before and after a call): the
                                          GEMV at M = 1 then sums its splits inside the kernel (the last program
                                          of a tile) instead of in a second launch; the same bits
        y       x.dtype [..., N] = x @ W.T + bias,   W = dequant(layout) in the original channel order

Kernels (a swap-AB variant over an [N, K/8] layout was measured on the H200 and was slower at every
shape: 192 vs 129 us at 8192x28672, M=1; see docs/benchmarks/int4-triton.md):
* M = 1 (and M <= 16 where no mid-M plan applies, e.g. M = 2 on the shapes ``MID_SHAPE_PLAN`` sends back): the
  small-M kernels of ``int4_triton_gemv`` -- a
  tensor-core split-K kernel that unpacks codes with magic numbers (no int->float conversion) and applies
  scales once per group, and a ``tl.dot``-free GEMV for M <= 4 -- chosen per M bucket by ``SMALL_M_PLAN``
  (``SHAPE_PLAN`` overrides per K x N), set from ``bench/triton_small_m.py`` on the H200 (docs/benchmarks/int4-triton.md,
  "Triton small-M kernels"). A bucket whose plan is None runs ``_splitk_kernel``.
* M = 2 ... 1024 (per M bucket, ``MID_M_PLAN``; ``MID_SHAPE_PLAN`` overrides per K x N): the swap-AB tensor-core
  GEMM of ``int4_triton_midm`` (weights on the MMA's wide side, tokens on the narrow one, the int4 tile dequantized
  in registers, split-K where the tiles do not fill the SMs). A bucket whose plan is None runs the old kernels.
* ``_splitk_kernel`` for M <= 32 (decode) where no small-M or mid-M plan applies: a 16/32-row tensor-core tile
  per program over BLOCK_N columns and one slice of K; the grid is (N / BLOCK_N, SPLIT_K) sized so every SM gets
  work even at M = 1 on K >> N shapes. With SPLIT_K > 1 each program stores its fp32 partial and
  ``_reduce_kernel`` sums them in a fixed order (deterministic; no memset, no atomics).
* ``_gemm_kernel`` for larger M: a classic tiled GEMM (grouped program order for L2 reuse) whose B tile is
  dequantized in registers right after the load.
Dequantization: the int32 tile [BLOCK_K/8, BLOCK_N] (16-byte loads along N) is unpacked by broadcasting 8
shifts -> [BLOCK_K, BLOCK_N];
then ``code * s + zs`` (one FMA; scale rows broadcast over the group). Group sizes >= 32 dividing K.

Devices: CUDA tensors run the compiled kernels. CPU tensors run the same kernels through Triton's interpreter
when ``TRITON_INTERPRET=1`` is set at call time (how CI tests them), otherwise a pure-PyTorch evaluation of
the layout (``int4_layout.dequantize_triton``). Kernels are built lazily per interpreter mode, so importing
this module starts no compiler and changes no global setting.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from sdquant.errors import ShapeError
from sdquant.kernels import int4_layout
from sdquant.kernels import int4_triton_gemv as small_m
from sdquant.kernels import int4_triton_midm as mid_m
from sdquant.kernels.int4_triton_gemv import _k_cols  # noqa: F401  (re-jitted below as a helper)
from sdquant.kernels.triton_jit import jit_in_namespace

try:  # Triton is optional (CPU-only installs, macOS); the op then uses the PyTorch path on CPU only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

NUM_SMS_DEFAULT = 132


def available() -> bool:
    return triton is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------------- kernels
def _splitk_kernel(x_ptr, qw_ptr, s_ptr, zs_ptr, perm_ptr, out_ptr, part_ptr, M, N, K, stride_xm,
                   GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   K_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_PERM: tl.constexpr,
                   CDT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k8 = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    m_mask = offs_m < M
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    k_begin = pid_k * K_SPLIT
    for kt in range(0, K_SPLIT, BLOCK_K):
        k0 = k_begin + kt
        kx = _k_cols(perm_ptr, k0, BLOCK_K, HAS_PERM)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :], mask=m_mask[:, None], other=0.0)
        wq = tl.load(qw_ptr + (k0 // 8 + offs_k8)[:, None] * N + offs_n[None, :])      # [BK/8, BN] int32
        w = (wq[:, None, :] >> shifts[None, :, None]) & 0xF                              # [BK/8, 8, BN]
        if GS >= BLOCK_K:
            g = k0 // GS
            s = tl.load(s_ptr + g * N + offs_n).to(CDT)
            zs = tl.load(zs_ptr + g * N + offs_n).to(CDT)
            w = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(CDT) * s[None, :] + zs[None, :]
        else:
            offs_g = k0 // GS + tl.arange(0, BLOCK_K // GS)
            s = tl.load(s_ptr + offs_g[:, None] * N + offs_n[None, :]).to(CDT)         # [BK/GS, BN]
            zs = tl.load(zs_ptr + offs_g[:, None] * N + offs_n[None, :]).to(CDT)
            w = tl.reshape(w, (BLOCK_K // GS, GS, BLOCK_N)).to(CDT) * s[:, None, :] + zs[:, None, :]
            w = tl.reshape(w, (BLOCK_K, BLOCK_N))
        acc += tl.dot(x.to(CDT), w)
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None])
    else:
        tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=m_mask[:, None])


def _reduce_kernel(part_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _gemm_kernel(x_ptr, qw_ptr, s_ptr, zs_ptr, perm_ptr, out_ptr, M, N, K, stride_xm,
                 GS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, HAS_PERM: tl.constexpr, CDT: tl.constexpr):
    pid = tl.program_id(0)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = N // BLOCK_N
    # grouped order: GROUP_M row-blocks share each weight column-block while it sits in L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k8 = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    m_mask = offs_m < M
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kx = _k_cols(perm_ptr, k0, BLOCK_K, HAS_PERM)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :], mask=m_mask[:, None], other=0.0)
        wq = tl.load(qw_ptr + (k0 // 8 + offs_k8)[:, None] * N + offs_n[None, :])
        w = (wq[:, None, :] >> shifts[None, :, None]) & 0xF
        if GS >= BLOCK_K:
            g = k0 // GS
            s = tl.load(s_ptr + g * N + offs_n).to(CDT)
            zs = tl.load(zs_ptr + g * N + offs_n).to(CDT)
            w = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(CDT) * s[None, :] + zs[None, :]
        else:
            offs_g = k0 // GS + tl.arange(0, BLOCK_K // GS)
            s = tl.load(s_ptr + offs_g[:, None] * N + offs_n[None, :]).to(CDT)
            zs = tl.load(zs_ptr + offs_g[:, None] * N + offs_n[None, :]).to(CDT)
            w = tl.reshape(w, (BLOCK_K // GS, GS, BLOCK_N)).to(CDT) * s[:, None, :] + zs[:, None, :]
            w = tl.reshape(w, (BLOCK_K, BLOCK_N))
        acc += tl.dot(x.to(CDT), w)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None])


_KERNELS: dict = {}


def _kernels():
    """(splitk, reduce, gemm) compiled for the current mode; built on first use, one set per mode."""
    mode = _interpret()
    if mode not in _KERNELS:
        # jitted per mode (see sdquant.kernels.triton_jit): one process runs both the interpreter (CPU tests)
        # and compiled kernels
        _KERNELS[mode] = jit_in_namespace(globals(), (_splitk_kernel, _reduce_kernel, _gemm_kernel), (_k_cols,))
    return _KERNELS[mode]


# ---------------------------------------------------------------------------------------------- configs
# Small-M plan per M bucket (M rounded up to a power of two, 1..16): a config of int4_triton_gemv.run
# ({"kernel": "tc" | "gemv", tile sizes, split}), or None for _splitk_kernel. Chosen from the H200 sweep of
# bench/triton_small_m.py (only where faster than the old kernel in the same run); SHAPE_PLAN holds
# per-(K, N, bucket) overrides for the measured Llama shapes.
_GV256K32 = {"kernel": "gemv", "BLOCK_N": 256, "BLOCK_K": 32, "num_warps": 2, "num_stages": 1, "waves": 6.0}
_TC64 = {"kernel": "tc", "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 4.0}
_TC128K64 = {"kernel": "tc", "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 6, "waves": 2.0}
# the GEMV (its zero point folded in once a tile since 2026-12-01: s * sum(code x) + zs * sum(x)) by tile and waves
_GV512K64Z = {"kernel": "gemv", "BLOCK_N": 512, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "waves": 4.0}
_GV512K64Z3 = {"kernel": "gemv", "BLOCK_N": 512, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "waves": 3.0}
_GV512K128Z = {"kernel": "gemv", "BLOCK_N": 512, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1, "waves": 3.0}
_GV256K64Z = {"kernel": "gemv", "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 2, "num_stages": 1, "waves": 6.0}
# 128-feature tiles, one warp, 16 waves of programs (2026-12-02, bench/results/triton_small_m_h200_kn{,2}.json)
_GV128K64W16 = {"kernel": "gemv", "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 1, "num_stages": 1, "waves": 16.0}
# H200 run of 2026-12-01 (commit eefb295, bench/results/triton_small_m_h200.json): the GEMV is 1.4-3.1x the old
# kernel at M = 1 and 1.1-2.3x at M = 2; the tensor-core kernel only 0.9-1.7x at M = 4-16 (geo-mean 0.91x time).
# M = 1-2 from the run of 2026-12-01 20:47 UTC (commit d3493c1, bench/results/triton_small_m_h200_zfold.json): the
# folded zero point made the GEMV 5-11% faster (geo-mean time / best at M = 1: gv512k64 1.113, gv512k64zw4 1.042)
# M = 1 from the runs of 2026-12-02 06:22 / 06:25 UTC (commits e8a8f5e / 03c5e70, bench/results/triton_small_m_h200_kn.json
# and _kn2.json): 128-feature tiles in one warp at 16 waves were the best geo-mean over the eight Llama shapes (1.04 /
# 1.04 of the best per point, against 1.11 / 1.14 for the previous default) and 6-20% faster than the previous plan on
# the four widest ones
SMALL_M_PLAN: dict = {1: _GV128K64W16, 2: _GV512K64Z, 4: _TC64, 8: _TC64, 16: _TC64}
# per (K, N, bucket): the measured winner where it beats the bucket default by > 2%; None = the old kernel where
# it was the fastest in that run
# M = 1 overrides from both GEMV runs of 20:47 and 20:52 UTC (the second: bench/results/triton_small_m_h200_zfold2.json;
# 2 warps and 8 waves of programs were 3-5% faster on the three largest shapes, where ncu had the loads' latency
# as the top stall)
# (2026-12-02: the three M = 1 entries of 256-feature tiles in 2 warps at 8 waves moved to the bucket default
# _GV128K64W16, same process: 8192x28672 50.9 -> 46.3 us, 28672x8192 53.7 -> 49.0, 4096x28672 27.7 -> 26.0; the lm_head
# 4096x128256 takes it too, 92.4 us against 102-116 for the other configs of that run (the previous default's own
# launch, split 2, was not timed there); 8192x10240 keeps the previous default's launch (split 32, the same as
# _GV512K64Z3's): 22.0 against 22.2)
# (2026-12-03, with the split-K sum in the GEMV at M = 1, bench/results/triton_small_m_h200_fold.json: 14336x4096 moved
# to 256-feature tiles at 6 waves, 17.8 -> 16.9 us, and 4096x6144 to 64-K tiles at 4 waves, 11.1 -> 10.0; the other M = 1
# entries were within 2% of that run's best)
SHAPE_PLAN: dict = {
    (8192, 10240, 1): _GV512K64Z3,
    (14336, 4096, 1): _GV256K64Z, (4096, 4096, 1): _GV512K128Z, (4096, 6144, 1): _GV512K64Z,
    (8192, 10240, 2): _GV256K64Z,
    (4096, 4096, 4): None, (4096, 4096, 8): None, (4096, 4096, 16): None,
    (4096, 28672, 4): None, (4096, 28672, 8): None, (14336, 4096, 4): None, (14336, 4096, 8): None,
    (4096, 6144, 4): _TC128K64, (4096, 6144, 8): _TC128K64, (4096, 6144, 16): _TC128K64,
    (8192, 10240, 4): _GV256K32,
}


# Mid-M plan per M bucket (M rounded up to a power of two; buckets without an entry use the other kernels): a
# config of int4_triton_midm.run (the swap-AB tensor-core GEMM), or None for the other kernels (the small-M plan
# at M <= 16, _splitk_kernel at M <= 32, _gemm_kernel above); MID_SHAPE_PLAN holds per-(K, N, bucket)
# overrides (None = the other kernels). Chosen from the H200 sweep of bench/triton_mid_m.py (per bucket the best
# geometric-mean config where it beats the old kernels; per shape the point's winner where it beats that by > 3%).
_MM32W8 = {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4}
_MM32X2 = {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0}
_MM32W8X4 = {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "waves": 4.0}
_MN64M32X2 = {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0}
_MN64M32X4 = {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 4.0}
_MM64 = {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
_MM64K64X2 = {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "waves": 2.0}
_MN64M64 = {"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
_MM128 = {"BLOCK_N": 128, "BLOCK_M": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}
_MM128K64 = {"BLOCK_N": 128, "BLOCK_M": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
_MM256S4 = {"BLOCK_N": 128, "BLOCK_M": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
# H200 run 3 of bench/triton_mid_m.py (2026-12-01, commit 7307065, bench/results/triton_mid_m_h200.json; the
# configs from the wider sweeps of runs 1-2, *_run1/_run2.json): the swap-AB kernel was the fastest Triton path at
# every measured point with M >= 4 (1.2-1.7x the small-M plan at M = 4-16 -- its 16-row tile costs the same at
# M = 3 as at 16 -- 1.2-2.3x the old kernels at M = 32, 1.2-6.7x at M = 64-1024). Run 4 (2026-12-01, 18:17 UTC,
# commit 3a549c2, bench/results/triton_mid_m_h200_run4_m2.*, same process): at M = 2 too, 11-22% faster than the GEMV
# (8192x28672 89.3 -> 79.5 us, 28672x8192 91.1 -> 74.8, 4096x4096 13.4 -> 10.5; 4096x6144 16.5 -> 14.0 with m32x2)
# except on 8192x10240 (34.8 vs 38.3), which keeps the GEMV; M = 1 stays with the GEMV everywhere. After the GEMV's
# folded zero point the GEMV also beat it at M = 2 on 8192x28672 (72.9 vs 80.0 us) and 4096x28672 (39.4 vs 41.4),
# which go back to the small-M plan (triton_mid_m of 20:49 UTC, same process, triton_mid_m_h200_run5_m2.json)
# M = 4-16 from triton_mid_m of 20:53 UTC (commit 8c62956, bench/results/triton_mid_m_h200_run5.json): an ncu of
# m32w8 (bench/results/ncu_triton_h200.txt) showed 224 programs on 8192x28672 (no split-K, 21% occupancy); with
# split-K (waves) m32w8x4 / n64m32x2 were 2-22% faster than the plan before in the same process. Run 6 (20:55 UTC,
# commit d3493be, triton_mid_m_h200_run6.json): n64m32x2 also at M = 2 where the mid-M kernel serves it (4096x6144
# 12.5 vs 14.3 us, 28672x8192 73.2 vs 75.5), n64m32x4 on 8192x10240 (29.0 vs 30.6 at M = 4); SCALE_ACC won nowhere
MID_M_PLAN: dict = {2: _MN64M32X2, 4: _MN64M32X2, 8: _MN64M32X2, 16: _MN64M32X2, 32: _MM32W8, 64: _MM128,
                    128: _MM128K64, 256: _MM256S4, 512: _MM256S4, 1024: _MM256S4}
MID_SHAPE_PLAN: dict = {
    (8192, 10240, 2): None, (8192, 28672, 2): None, (4096, 28672, 2): None,
    (8192, 28672, 4): _MM32W8X4, (8192, 28672, 8): _MM32W8X4, (8192, 28672, 16): _MM32W8X4,
    (8192, 10240, 4): _MN64M32X4, (8192, 10240, 8): _MN64M32X4, (8192, 10240, 16): _MN64M32X4,
    (8192, 10240, 32): _MM32X2, (4096, 6144, 32): _MM32X2,
    (8192, 28672, 64): _MM64, (4096, 28672, 64): _MM64, (8192, 10240, 64): _MM64K64X2, (4096, 6144, 64): _MM64K64X2,
    (8192, 10240, 128): _MM64K64X2, (4096, 6144, 128): _MM64K64X2,
    (14336, 4096, 256): _MM128K64, (4096, 4096, 256): _MN64M64, (4096, 4096, 512): _MM128K64,
    (8192, 10240, 512): _MM128,
}


def m_bucket(m: int) -> int:
    b = 1
    while b < m:
        b *= 2
    return b


def small_m_plan(m: int, n: int, k: int) -> Optional[dict]:
    """The small-M config for this call, or None (use _splitk_kernel / _gemm_kernel)."""
    if m > 16:
        return None
    b = m_bucket(m)
    cfg = SHAPE_PLAN.get((k, n, b), SMALL_M_PLAN.get(b))
    if cfg is not None and cfg.get("kernel") == "gemv" and m > 4:
        return None
    return cfg


def mid_m_plan(m: int, n: int, k: int) -> Optional[dict]:
    """The mid-M config for this call, or None (the small-M plan, _splitk_kernel or _gemm_kernel): buckets without
    an entry in MID_M_PLAN (M <= 8 as measured so far) use the others."""
    b = m_bucket(m)
    key = (k, n, b)
    return MID_SHAPE_PLAN[key] if key in MID_SHAPE_PLAN else MID_M_PLAN.get(b)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


def _block_k(k: int, gs: int, choices) -> int:
    # a K tile must lie in one group or hold whole groups, so one scale row (or a reshape) covers it
    for bk in choices:
        if k % bk == 0 and (gs % bk == 0 or bk % gs == 0):
            return bk
    return 32


def splitk_config(m: int, n: int, k: int, gs: int, num_sms: int) -> dict:
    """Tile sizes of the small-M kernel: enough programs for ~2 per SM, each slice of K a whole number of
    BLOCK_K tiles (and of groups where a group spans several tiles)."""
    block_m = 16 if m <= 16 else 32
    block_n = 128 if n % 128 == 0 and n >= 16384 else (64 if n % 64 == 0 else 32)
    block_k = _block_k(k, gs, (128, 64, 32))
    tiles_n = n // block_n
    split = 1
    while (tiles_n * split * 2 <= 2 * num_sms and k % (split * 2 * block_k) == 0
           and k // (split * 2) >= 4 * block_k):
        split *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 4, "num_stages": 4}


def gemm_config(m: int, n: int, k: int, gs: int) -> dict:
    block_m = 64 if m <= 64 else 128
    block_n = 128 if n % 128 == 0 else (64 if n % 64 == 0 else 32)
    block_k = _block_k(k, gs, (64, 32))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8,
            "num_warps": 8 if block_m * block_n >= 128 * 128 else 4, "num_stages": 4}


# ------------------------------------------------------------------------------------------------- launch
def _check(x, qweight, scales, zs, perm):
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[-1] != k:
        raise ShapeError(f"x: last dim {x.shape[-1]} does not match the weight's in_features {k}")
    if x.dtype not in (torch.float16, torch.bfloat16) or scales.dtype != x.dtype or zs.dtype != x.dtype:
        raise ShapeError(f"x: dtype {x.dtype} must be float16/bfloat16 and equal the layout's {scales.dtype}")
    g = scales.shape[0]
    if k % 32 or n % 32 or g == 0 or k % g or (g > 1 and (k // g) % 32):
        raise ShapeError(f"w4a16_triton: K={k}, N={n}, groups={g}: K and N must be multiples of 32 and the "
                         f"group size a multiple of 32")
    if perm is not None and perm.shape != (k,):
        raise ShapeError(f"perm: expected [{k}], got {list(perm.shape)}")
    return k, n, k // g


def w4a16_triton_impl(x, qweight, scales, zs, perm, bias, force_path: Optional[str] = None,
                      config: Optional[dict] = None, locks: Optional[torch.Tensor] = None):
    """The op's body. ``force_path`` ("splitk"|"gemm"|"tc"|"gemv"|"small"|"midm") and ``config`` (overrides of
    the chosen tile config) exist for tests and the benchmarks' sweeps; "small" = ``small_m_plan``, "midm" =
    ``mid_m_plan`` (or ``int4_triton_midm.default_config`` where the plan has none)."""
    k, n, gs = _check(x, qweight, scales, zs, perm)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if x.device.type == "cpu" and not _interpret():
        w = int4_layout.dequantize_triton({"qweight": qweight, "scales": scales, "zs": zs, "perm": perm})
        return torch.nn.functional.linear(x, w.to(x.dtype), bias)
    if triton is None:
        raise ShapeError("w4a16_triton: triton is not installed; use the reference op sdquant::int_linear")
    splitk, reduce_k, gemm = _kernels()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # the interpreter computes bf16 arithmetic wrongly: evaluate bf16 in fp32 there (CPU tests only)
    cdt = tl.float32 if (_interpret() and x.dtype == torch.bfloat16) else (
        tl.float16 if x.dtype == torch.float16 else tl.bfloat16)
    has_perm = perm is not None
    perm_arg = perm if has_perm else qweight  # never read when HAS_PERM is False
    plan = small_m_plan(m, n, k)
    mid = mid_m_plan(m, n, k)
    path = force_path or ("midm" if mid is not None else "small" if plan is not None else
                          "splitk" if m <= 32 else "gemm")
    if path == "midm" and m > 0:
        out = mid_m.run(x2, qweight, scales, zs, perm, gs, {**(mid or mid_m.default_config(m)), **(config or {})})
    elif path in ("tc", "gemv", "small") and m > 0:
        if path == "small":
            cfg = {**(plan or small_m.DEFAULT_TC), **(config or {})}
        else:
            cfg = {**(small_m.DEFAULT_TC if path == "tc" else small_m.DEFAULT_GEMV), **(config or {}), "kernel": path}
        out = small_m.run(x2, qweight, scales, zs, perm, gs, cfg, locks)
    elif m > 0 and path == "splitk":
        cfg = {**splitk_config(m, n, k, gs, _num_sms(x.device)), **(config or {})}
        split = cfg["SPLIT_K"]
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
        grid = (n // cfg["BLOCK_N"], split)
        splitk[grid](x2, qweight, scales, zs, perm_arg, out, part, m, n, k, x2.stride(0), GS=gs,
                     BLOCK_M=max(cfg["BLOCK_M"], 16 * ((m + 15) // 16)), BLOCK_N=cfg["BLOCK_N"],
                     BLOCK_K=cfg["BLOCK_K"], K_SPLIT=k // split, SPLIT_K=split, HAS_PERM=has_perm, CDT=cdt,
                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if split > 1:
            block = 1024
            reduce_k[(triton.cdiv(m * n, block),)](part, out, m * n, SPLIT_K=split, BLOCK=block)
    elif m > 0:
        cfg = {**gemm_config(m, n, k, gs), **(config or {})}
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * (n // cfg["BLOCK_N"]),)
        gemm[grid](x2, qweight, scales, zs, perm_arg, out, m, n, k, x2.stride(0), GS=gs,
                   BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                   HAS_PERM=has_perm, CDT=cdt, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if bias is not None:
        out += bias
    return out.reshape(*lead, n)


# ``locks`` (the layout's split-K counters) is not declared mutated: the kernels leave it at zero, as the CUDA op's
@torch.library.custom_op("sdquant::w4a16_triton", mutates_args=())
def w4a16_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zs: torch.Tensor,
                 perm: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 locks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W.T + bias over the Triton layout (see module docstring)."""
    return w4a16_triton_impl(x, qweight, scales, zs, perm, bias, locks=locks)


@w4a16_triton.register_fake
def _(x, qweight, scales, zs, perm, bias, locks=None):
    return x.new_empty((*x.shape[:-1], qweight.shape[1]))
