"""Mid-M Triton W4A16 GEMM over the layout of ``int4_layout.repack_triton`` (int32 [K/8, N]).

``int4_triton.w4a16_triton_impl`` dispatches here per M bucket (``int4_triton.MID_M_PLAN``: M = 2 ... 1024 on the
H200, where it was the fastest Triton path; docs/benchmarks/int4-triton.md "Triton mid-M INT4 GEMM"); nothing in this module registers an op.

Why a new kernel: the old ``_gemm_kernel`` puts the tokens on the MMA's wide (M) side and the dequantized weights
on the B side; at M = 32-256 most of its 64/128-row tiles are padding and Triton reads the B tile with scalar
shared-memory loads (see ``int4_triton_gemv``'s notes). This kernel is **swap-AB** like ``fp8_triton``'s GEMM:
it computes the transposed tile out^T [BN, BM] = W [BN, BK] @ x^T [BK, BM], so the weight features fill the
64/128-row side of the (wgmma) MMA and the tokens the 16..128 side, and several token tiles of one weight tile
run as neighbouring programs (program id 0 = token tile) so the weight tile is read from HBM once and from L2
after that.

Dequantization, right after the 16-byte loads of the int32 tile [BK/8, BN] (N contiguous): the tile is transposed
in registers to [BN, BK/8] and every word becomes 8 values ``BIAS + code`` by byte permutes (``UNPACK=2``: inline
PTX ``prmt`` + ``lop3``, the magic numbers of ``int4_triton_gemv``: bf16 ``0x4300 | c`` = 128 + c, fp16 ``0x6400 |
c`` = 1024 + c) or shifts (``UNPACK=1``) or ``.to()`` (``UNPACK=0``: the interpreter). Each of the 8 nibble tensors
[BN, BK/8] is then dequantized in the activation dtype, ``(v - BIAS) * s + zs`` (the subtraction is exact, so the
weight is ``code * s + zs`` rounded once or twice in the dtype, as a dequantize-then-GEMM would round it), and the
8 are joined into a K-contiguous [BN, BK] tile: no reshape of a broadcast, so no layout shuffle before the MMA.
Scales are one row per K tile when the group holds the tile (GS >= BK: per-channel too) and otherwise gathered per
word ([BN, BK/8], GS >= 32 > 8, so a word never straddles two groups). The accumulator stays on the MMA chain
(``tl.dot(w, xt, acc)``), so consecutive MMAs of a program need not wait for each other.

Split-K (``SPLIT_K`` K slices, each a whole number of BLOCK_K tiles) fills the 132 SMs where the N / BLOCK_N x
M / BLOCK_M tiles do not (14336 x 4096 at M = 64: 32 tiles); each slice writes an fp32 partial [M, N] and
``int4_triton_gemv``'s reduction sums them in a fixed order (deterministic, no atomics, no memset).

Reads ``x[:, perm]`` through the act-order permutation in the load; fp16/bf16; groups of 32/64/128/... dividing
K, or per-channel; fp32 accumulation. On CPU tensors it runs through Triton's interpreter (TRITON_INTERPRET=1),
where bf16 is evaluated in fp32 (the interpreter's bf16 arithmetic is wrong) and codes are converted with ``.to()``.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from sdquant.errors import ShapeError
from sdquant.kernels import int4_triton_gemv as small_m
from sdquant.kernels.int4_triton_gemv import _asm_unpack8, _codes8, _join8, _k_cols, _nib16  # noqa: F401 (helpers)
from sdquant.kernels.triton_jit import jit_in_namespace

try:  # Triton is optional; int4_triton checks availability before calling here
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ------------------------------------------------------------------------------------------------ helpers
def _add(a, b):
    return a + b


def _deq_nk(wt, s, z, R, BN, CDT, UNPACK, BIAS, SCALE):
    """[BN, R] uint32 words -> [BN, 8R] CDT weights code * s + zs (k = 8r + j contiguous in a thread), or with
    SCALE False the raw BIAS + code. ``s`` / ``z``: CDT, [BN, 1] (one group over the tile) or [BN, R] (the group
    of each word)."""
    o0, o1, o2, o3, o4, o5, o6, o7 = _codes8(wt, CDT, UNPACK)
    if SCALE:
        o0 = (o0 - BIAS) * s + z
        o1 = (o1 - BIAS) * s + z
        o2 = (o2 - BIAS) * s + z
        o3 = (o3 - BIAS) * s + z
        o4 = (o4 - BIAS) * s + z
        o5 = (o5 - BIAS) * s + z
        o6 = (o6 - BIAS) * s + z
        o7 = (o7 - BIAS) * s + z
    return tl.reshape(_join8(o0, o1, o2, o3, o4, o5, o6, o7), (BN, 8 * R))          # [BN, R, a, b, c]


# ------------------------------------------------------------------------------------------------- kernel
def _midm_kernel(x_ptr, qw_ptr, s_ptr, zs_ptr, perm_ptr, out_ptr, part_ptr, M, N, stride_xm, K_SPLIT,
                 GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 PARTIAL: tl.constexpr, HAS_PERM: tl.constexpr, CDT: tl.constexpr, UNPACK: tl.constexpr,
                 BIAS: tl.constexpr, SCALE_ACC: tl.constexpr):
    pid_m = tl.program_id(0)     # token tiles of one weight tile are neighbours: the tile is read once from HBM
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    R: tl.constexpr = BLOCK_K // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, R)
    m_mask = offs_m < M
    x_cols = x_ptr + offs_m[None, :] * stride_xm                                        # [1, BM]
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)                                  # out^T tile
    k_begin = pid_k * K_SPLIT
    # one scale row per K tile (GS >= BK) is 2 bytes a thread, too narrow for the pipeliner's async copies:
    # it is loaded one iteration ahead by hand, so its latency hides behind a tile's MMAs
    s_nx = tl.load(s_ptr + (k_begin // GS) * N + offs_n)
    z_nx = tl.load(zs_ptr + (k_begin // GS) * N + offs_n)
    for kt in range(0, K_SPLIT, BLOCK_K):
        k0 = k_begin + kt
        kx = _k_cols(perm_ptr, k0, BLOCK_K, HAS_PERM)
        xt = tl.load(x_cols + kx[:, None], mask=m_mask[None, :], other=0.0)             # [BK, BM]
        wq = tl.load(qw_ptr + (k0 // 8 + offs_r)[:, None] * N + offs_n[None, :])       # [R, BN] int32
        wt = tl.trans(wq).to(tl.uint32, bitcast=True)                                   # [BN, R]
        if SCALE_ACC:   # exact BIAS + code into the MMA; the group's scale applied once to its fp32 product
            sf = s_nx.to(tl.float32)
            zb = z_nx.to(tl.float32) - BIAS * sf
            more = (offs_n * 0 + kt + BLOCK_K) < K_SPLIT
            s_nx = tl.load(s_ptr + ((k0 + BLOCK_K) // GS) * N + offs_n, mask=more, other=0.0)
            z_nx = tl.load(zs_ptr + ((k0 + BLOCK_K) // GS) * N + offs_n, mask=more, other=0.0)
            d = tl.dot(_deq_nk(wt, sf, zb, R, BLOCK_N, CDT, UNPACK, BIAS, False), xt.to(CDT))
            xsum = tl.reduce(xt.to(tl.float32), 0, _add)                                  # [BM]
            acc += d * sf[:, None] + zb[:, None] * xsum[None, :]
        else:
            if GS >= BLOCK_K:
                s = s_nx.to(CDT)[:, None]
                z = z_nx.to(CDT)[:, None]
                more = (offs_n * 0 + kt + BLOCK_K) < K_SPLIT
                s_nx = tl.load(s_ptr + ((k0 + BLOCK_K) // GS) * N + offs_n, mask=more, other=0.0)
                z_nx = tl.load(zs_ptr + ((k0 + BLOCK_K) // GS) * N + offs_n, mask=more, other=0.0)
            else:
                rows = (k0 + offs_r * 8) // GS
                s = tl.trans(tl.load(s_ptr + rows[:, None] * N + offs_n[None, :]).to(CDT))    # [BN, R]
                z = tl.trans(tl.load(zs_ptr + rows[:, None] * N + offs_n[None, :]).to(CDT))
            w = _deq_nk(wt, s, z, R, BLOCK_N, CDT, UNPACK, BIAS, True)                      # [BN, BK]
            acc = tl.dot(w, xt.to(CDT), acc)
    _store_out_t(out_ptr, part_ptr, acc, offs_m, offs_n, m_mask, pid_k, M, N, PARTIAL)


def _store_out_t(out_ptr, part_ptr, acc, offs_m, offs_n, m_mask, pid_k, M, N, PARTIAL):
    """Store the out^T tile acc [BN, BM]: into y [M, N] in its dtype, or (PARTIAL) into split pid_k's fp32 slice."""
    if PARTIAL:
        tl.store(part_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=m_mask[None, :])
    else:
        tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=m_mask[None, :])


_HELPERS = ("_asm_unpack8", "_nib16", "_codes8", "_join8", "_k_cols", "_add", "_deq_nk", "_store_out_t")
_KERNELS: dict = {}


def _kernels():
    """{"midm"} jitted for the current interpreter mode (see sdquant.kernels.triton_jit), built on first use."""
    mode = _interpret()
    if mode not in _KERNELS:
        (midm,) = jit_in_namespace(globals(), (_midm_kernel,), [globals()[name] for name in _HELPERS])
        _KERNELS[mode] = {"midm": midm}
    return _KERNELS[mode]


# ---------------------------------------------------------------------------------------------- configs
DEFAULT = {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "SPLIT_K": 0, "waves": 1.0, "num_warps": 4,
           "num_stages": 4, "UNPACK": 2, "SCALE_ACC": False}


def default_config(m: int) -> dict:
    """Tiles by M: the token side covers M in one tile up to 64 (128 from M = 65)."""
    if m <= 32:
        return {**DEFAULT, "BLOCK_M": 32}
    if m <= 64:
        return dict(DEFAULT)
    return {**DEFAULT, "BLOCK_M": 128, "num_warps": 8, "num_stages": 3}


def _fit(v: int, limit: int, floor: int) -> int:
    while v > floor and limit % v:
        v //= 2
    return v


def resolve(cfg: dict, m: int, n: int, k: int, gs: int, sms: int) -> dict:
    """A launchable config: BLOCK_N dividing N, BLOCK_K dividing K and lying inside one group when the group is
    larger (smaller groups are gathered per word), BLOCK_M from 16 up to what M needs, and split-K chosen so the
    tiles cover ``waves`` x SMs where they can."""
    c = {**DEFAULT, **cfg}
    c["BLOCK_N"] = _fit(c["BLOCK_N"], n, 32)
    bk = c["BLOCK_K"]
    # SCALE_ACC scales a whole K tile's product at once: the tile must lie in one group
    while bk > 32 and (k % bk or (gs > bk and gs % bk) or (c["SCALE_ACC"] and gs % bk)):
        bk //= 2
    c["BLOCK_K"] = bk
    bm = 16
    while bm < m and bm < c["BLOCK_M"]:
        bm *= 2
    c["BLOCK_M"] = bm
    if n % c["BLOCK_N"] or k % bk:
        raise ShapeError(f"mid-M kernel: K={k}, N={n} do not divide into tiles of BLOCK_K={bk}, BLOCK_N={c['BLOCK_N']}")
    tiles = (n // c["BLOCK_N"]) * ((m + bm - 1) // bm)
    split = c["SPLIT_K"] or small_m.auto_split(k, bk, tiles, c["waves"] * sms)
    if (k // bk) % split:
        raise ShapeError(f"mid-M kernel: SPLIT_K={split} does not divide the {k // bk} K tiles of BLOCK_K={bk}")
    c["SPLIT_K"] = split
    return c


# ----------------------------------------------------------------------------------------------- launch
def run(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zs: torch.Tensor,
        perm: Optional[torch.Tensor], gs: int, cfg: Optional[dict] = None) -> torch.Tensor:
    """y [M, N] (x2's dtype) = x2 @ W.T for row-contiguous x2 [M, K] (any M >= 1), no bias. (Its split-K always
    takes the second pass: the GEMV's in-kernel sum, tried here and in the tensor-core kernel, took 0.98-1.75x the
    time at M = 2-256 on the H200, docs/benchmarks/int4-triton.md "Triton split-K summed in the kernel".)"""
    m, k = x2.shape
    n = qweight.shape[1]
    c = resolve({**default_config(m), **(cfg or {})}, m, n, k, gs, small_m.num_sms(x2.device))
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out
    split = c["SPLIT_K"]
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    has_perm = perm is not None
    interp = _interpret()
    # the interpreter runs no inline PTX and no bf16 bit tricks, and computes bf16 arithmetic wrongly
    unpack = 0 if interp and (c["UNPACK"] == 2 or x2.dtype == torch.bfloat16) else c["UNPACK"]
    if interp and x2.dtype == torch.bfloat16:
        cdt = tl.float32
    else:
        cdt = tl.float16 if x2.dtype == torch.float16 else tl.bfloat16
    bias = 0.0 if unpack == 0 else (1024.0 if x2.dtype == torch.float16 else 128.0)
    grid = (triton.cdiv(m, c["BLOCK_M"]), n // c["BLOCK_N"], split)
    # an optional register cap (ptxas maxnreg) trades spills for more programs per SM
    extra = {"maxnreg": c["maxnreg"]} if c.get("maxnreg") and not interp else {}
    _kernels()["midm"][grid](x2, qweight, scales, zs, perm if has_perm else qweight, out, part, m, n, x2.stride(0),
                             k // split, GS=gs, BLOCK_N=c["BLOCK_N"], BLOCK_M=c["BLOCK_M"], BLOCK_K=c["BLOCK_K"],
                             PARTIAL=split > 1, HAS_PERM=has_perm, CDT=cdt, UNPACK=unpack, BIAS=bias,
                             SCALE_ACC=bool(c["SCALE_ACC"]), num_warps=c["num_warps"], num_stages=c["num_stages"],
                             **extra)
    if split > 1:
        block = 512
        small_m._kernels()["reduce"][(triton.cdiv(m * n, block),)](part, out, m * n, SPLIT_K=split, BLOCK=block,
                                                                    EVEN=(m * n) % block == 0, num_warps=4)
    return out
