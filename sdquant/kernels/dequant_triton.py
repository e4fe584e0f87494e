"""Dequantize a canonical integer weight to a dense [N, K] fp16/bf16 matrix in one pass (Triton).

This is the first half of the dequantize+cuBLAS path that every QuantLinear keeps as its fallback: at large M
the GEMM is compute-bound and cuBLAS at full tensor-core rate beats any weight-only kernel, so the layer
writes W once (N*K*2 bytes) and calls F.linear. Reads the canonical packing of ``sdquant.quant.qtensor``
directly (bits 2/4/8: codes never straddle a byte); 3-bit weights use the PyTorch reference dequantizer.

W[n, k] = (code[n, k] - zero[n, g]) * scale[n, g],  g = g_idx[k] or k // group_size.
"""
from typing import Optional

import torch

from sdquant.quant.qtensor import QuantizedWeight, effective_group_size, num_groups

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # pragma: no cover
    class tl:  # noqa: N801
        constexpr = None
    triton = None
    HAVE_TRITON = False


def _jit(fn):
    return triton.jit(fn) if HAVE_TRITON else fn


@_jit
def _dequant_kernel(q_ptr, s_ptr, z_ptr, g_ptr, w_ptr, N, K, G, stride_q,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_GIDX: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    rows = offs_n[:, None].to(tl.int64)
    # each byte is loaded PER times (once per code it holds); the repeats hit L1
    byte = tl.load(q_ptr + rows * stride_q + offs_k[None, :] // PER, mask=ok, other=0).to(tl.int32)
    code = (byte >> ((offs_k[None, :] % PER) * BITS)) & ((1 << BITS) - 1)
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0)[None, :]
    else:
        g = (offs_k // GROUP)[None, :]
    scale = tl.load(s_ptr + rows * G + g, mask=ok, other=0.0).to(tl.float32)
    if HAS_ZERO:
        zero = tl.load(z_ptr + rows * G + g, mask=ok, other=0).to(tl.float32)
    else:
        zero = float(1 << (BITS - 1))
    w = (code.to(tl.float32) - zero) * scale
    tl.store(w_ptr + rows * K + offs_k[None, :], w.to(w_ptr.dtype.element_ty), mask=ok)


@_jit
def _dequant4_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, G, stride_q,
                     GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SUB: tl.constexpr):
    """4-bit, groups contiguous along K (no act-order): coalesced byte loads (each byte once), nibbles
    interleaved with join+reshape, one scale/zero per SUB-wide run broadcast instead of gathered per element."""
    NSUB: tl.constexpr = BLOCK_K // SUB
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    rows = offs_n[:, None].to(tl.int64)
    n_ok = offs_n[:, None] < N
    byte = tl.load(q_ptr + rows * stride_q + offs_b[None, :], mask=n_ok & (offs_b[None, :] < K // 2), other=0)
    byte = byte.to(tl.int32)
    code = tl.join(byte & 15, byte >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)  # k = 2j (lo), 2j+1 (hi)
    g = (k0 + tl.arange(0, NSUB) * SUB) // GROUP                                   # [NSUB]
    g_ok = n_ok & ((k0 + tl.arange(0, NSUB) * SUB)[None, :] < K)
    scale = tl.load(s_ptr + rows * G + g[None, :], mask=g_ok, other=0.0).to(tl.float32)  # [BN, NSUB]
    if HAS_ZERO:
        zero = tl.load(z_ptr + rows * G + g[None, :], mask=g_ok, other=0).to(tl.float32)
    else:
        zero = tl.full([BLOCK_N, NSUB], 8.0, tl.float32)
    w = (code.reshape(BLOCK_N, NSUB, SUB) - zero[:, :, None]) * scale[:, :, None]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rows * K + offs_k[None, :], w.reshape(BLOCK_N, BLOCK_K).to(w_ptr.dtype.element_ty),
             mask=n_ok & (offs_k[None, :] < K))


def can_run(device: torch.device) -> bool:
    if not HAVE_TRITON:
        return False
    return device.type == "cuda" or bool(triton.knobs.runtime.interpret)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Dense [N, K] weight in ``dtype``; the Triton kernel where it can run, else the reference."""
    if qw.bits not in (2, 4, 8) or not can_run(qw.qweight.device):
        return qw.dequantize(dtype)
    n, k = qw.out_features, qw.in_features
    g = num_groups(k, qw.group_size)
    w = torch.empty((n, k), device=qw.qweight.device, dtype=dtype)
    if n == 0 or k == 0:
        return w
    kw = {} if qw.qweight.device.type == "cpu" else {"num_warps": 4}
    gs = effective_group_size(k, qw.group_size)
    if qw.bits == 4 and qw.g_idx is None and k % 2 == 0:
        bn, bk = 16, 256
        sub = min(gs, bk) if (bk % min(gs, bk) == 0 and gs % min(gs, bk) == 0) else 0
        if sub >= 2:
            _dequant4_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
                qw.qweight, qw.scales, qw.zeros if qw.zeros is not None else qw.scales, w, n, k, g,
                qw.qweight.stride(0), GROUP=gs, HAS_ZERO=qw.zeros is not None, BLOCK_N=bn, BLOCK_K=bk,
                SUB=sub, **kw)
            return w
    bn, bk = 32, 128
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        qw.qweight, qw.scales, qw.zeros if qw.zeros is not None else qw.scales,
        qw.g_idx if qw.g_idx is not None else qw.scales, w, n, k, g, qw.qweight.stride(0),
        BITS=qw.bits, GROUP=effective_group_size(k, qw.group_size), HAS_ZERO=qw.zeros is not None,
        HAS_GIDX=qw.g_idx is not None, BLOCK_N=bn, BLOCK_K=bk, **kw)
    return w


def dequant_linear(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x @ W^T + bias with W dequantized once for this call, then cuBLAS (or the CPU GEMM)."""
    return torch.nn.functional.linear(x, dequantize(qw, x.dtype), None if bias is None else bias.to(x.dtype))
