"""Dequantize+cuBLAS straight from a W4A16 kernel layout, so a prepared layer needs no canonical tensors on the
GPU: the one int4 layout it keeps for its small-M kernel also serves the large-M (compute-bound) buckets.

    torch.ops.sdquant.w4a16_dequant_triton(x, qweight, scales, zs, perm, bias) -> y    (repack_triton layout)
    torch.ops.sdquant.w4a16_dequant_cuda(x, qweight, scales, zeros, perm, bias) -> y   (repack_cuda layout)
        y = x @ W.T + bias, W written once as a dense x.dtype matrix by a Triton kernel, then one cuBLAS GEMM.

W is produced in the layout's permuted channel order (act-order resolved at repack time), so the activations
are gathered with ``perm`` before the GEMM instead of scattering W's columns back. Values: the CUDA layout
holds the canonical fp16 scales and integer zeros, so ``(c - zero) * scale`` in fp32 gives exactly the
canonical dequantization (``sdquant::int_linear_dequant``); the Triton layout holds scale and -zero*scale in
the activation dtype, so W is what its own GEMM kernel computes (bf16-rounded scales).

* Triton layout (int32 [K/8, N], N contiguous): a program loads a [BLOCK_K/8, BLOCK_N] tile with 16-byte
  loads along N, unpacks 8 shifts -> [BLOCK_K, BLOCK_N] and stores W^T [K, N] (the GEMM reads it transposed).
* CUDA layout (fragment-ordered [N/64, K/16, 32, 4]): a program owns one 64-feature block and BLOCK_K of K,
  i.e. BLOCK_K/16 consecutive 512-byte tiles, and gathers for every W[n, k] the word and nibble that hold it
  (the inverse of ``int4_layout._CUDA_NIBBLES``); each word is read 8 times, from L1. W [N, K] row-major.

Devices: CUDA tensors run the Triton kernels; CPU tensors run them in Triton's interpreter when
``TRITON_INTERPRET=1`` is set at call time (CI), otherwise the layout's PyTorch meaning
(``int4_layout.dequantize_triton`` / ``dequantize_cuda``). Kernels are wrapped lazily per interpreter mode, as
in ``int4_triton``, so importing this module compiles nothing.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from sdquant.errors import ShapeError
from sdquant.kernels import int4_layout

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs use the PyTorch evaluation
    triton = None
    tl = None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_layout_kernel(q_ptr, s_ptr, zs_ptr, w_ptr, N, GS: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    # BLOCK_K divides the group size, so one scale row covers the whole tile
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_k8 = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wq = tl.load(q_ptr + offs_k8[:, None].to(tl.int64) * N + offs_n[None, :])           # [BK/8, BN] int32
    shifts = tl.arange(0, 8) * 4
    c = (wq[:, None, :] >> shifts[None, :, None]) & 0xF                                  # [BK/8, 8, BN]
    c = tl.reshape(c, (BLOCK_K, BLOCK_N)).to(tl.float32)                                 # row k = 8*k8 + i
    g = (pid_k * BLOCK_K) // GS
    s = tl.load(s_ptr + g * N + offs_n).to(tl.float32)
    zs = tl.load(zs_ptr + g * N + offs_n).to(tl.float32)
    w = c * s[None, :] + zs[None, :]
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + offs_k[:, None].to(tl.int64) * N + offs_n[None, :], w.to(w_ptr.dtype.element_ty))


def _cuda_layout_kernel(q_ptr, s_ptr, z_ptr, w_ptr, K, NB, GS: tl.constexpr, BLOCK_K: tl.constexpr):
    nb = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = tl.arange(0, 64)                      # feature nb*64 + n = nb*64 + 8*j + r
    j = n // 8
    r = n % 8
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    kb = k // 16
    kr = k % 16                               # k row in the 16-wide tile = 2t + {0, 1, 8, 9}
    t = (kr % 8) // 2
    lane = 4 * r[:, None] + t[None, :]        # [64, BK]
    tile = nb.to(tl.int64) * (K // 16) + kb[None, :]
    word = (tile * 32 + lane) * 4 + (j // 2)[:, None]
    # nibble p of the word: (j offset, k row - 2t) = _CUDA_NIBBLES[p]  ->  p = 2*(j%2) + (kr>=8) + 4*(kr%2)
    p = 2 * (j % 2)[:, None] + (kr // 8)[None, :] + 4 * (kr % 2)[None, :]
    c = (tl.load(q_ptr + word) >> (4 * p)) & 0xF
    g = (pid_k * BLOCK_K) // GS
    sidx = (g * NB + nb) * 64 + r * 8 + j     # scales/zeros [G, NB, 8 r, 8 j]
    s = tl.load(s_ptr + sidx).to(tl.float32)
    z = tl.load(z_ptr + sidx).to(tl.float32)
    w = (c.to(tl.float32) - z[:, None]) * s[:, None]
    rows = (nb * 64 + n).to(tl.int64)
    tl.store(w_ptr + rows[:, None] * K + k[None, :], w.to(w_ptr.dtype.element_ty))


_KERNELS: dict = {}


def _kernels():
    mode = _interpret()
    if mode not in _KERNELS:  # triton.jit reads TRITON_INTERPRET when it wraps, so wrap per mode at call time
        _KERNELS[mode] = (triton.jit(_triton_layout_kernel), triton.jit(_cuda_layout_kernel))
    return _KERNELS[mode]


def _runs_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or _interpret())


def _block_k(k: int, gs: int) -> int:
    for bk in (128, 64, 32):
        if k % bk == 0 and gs % bk == 0:
            return bk
    raise ShapeError(f"layout dequant: K={k}, group size {gs}: both must be multiples of 32")


def _warps(t: torch.Tensor) -> dict:
    return {} if t.device.type == "cpu" else {"num_warps": 4}


def dequant_triton_layout(qweight: torch.Tensor, scales: torch.Tensor, zs: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] in ``dtype`` (K in the layout's permuted order) from a ``repack_triton`` layout."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    g = scales.shape[0]
    if n % 32 or k % 32 or g == 0 or k % g or tuple(zs.shape) != (g, n) or tuple(scales.shape) != (g, n):
        raise ShapeError(f"w4a16_dequant_triton: qweight {list(qweight.shape)}, scales {list(scales.shape)}, "
                         f"zs {list(zs.shape)} are not a Triton int4 layout")
    bk = _block_k(k, k // g)
    bn = 128 if n % 128 == 0 else (64 if n % 64 == 0 else 32)
    w = torch.empty((k, n), dtype=dtype, device=qweight.device)
    _kernels()[0][(k // bk, n // bn)](qweight, scales, zs, w, n, GS=k // g, BLOCK_K=bk, BLOCK_N=bn,
                                      **_warps(qweight))
    return w


def dequant_cuda_layout(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in ``dtype`` (K in the layout's permuted order) from a ``repack_cuda`` layout."""
    if qweight.dim() != 4 or tuple(qweight.shape[2:]) != (32, 4):
        raise ShapeError(f"w4a16_dequant_cuda: qweight {list(qweight.shape)} is not a CUDA int4 layout "
                         f"[N/64, K/16, 32, 4]")
    nb, k = qweight.shape[0], qweight.shape[1] * 16
    g = scales.shape[0]
    if g == 0 or k % g or tuple(scales.shape) != (g, nb, 8, 8) or tuple(zeros.shape) != (g, nb, 8, 8):
        raise ShapeError(f"w4a16_dequant_cuda: scales {list(scales.shape)} / zeros {list(zeros.shape)} do not "
                         f"match qweight {list(qweight.shape)}")
    bk = _block_k(k, k // g)
    w = torch.empty((nb * 64, k), dtype=dtype, device=qweight.device)
    _kernels()[1][(nb, k // bk)](qweight, scales, zeros, w, k, nb, GS=k // g, BLOCK_K=bk, **_warps(qweight))
    return w


def _gemm(x: torch.Tensor, w: torch.Tensor, w_is_kn: bool, perm: Optional[torch.Tensor],
          bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., K] @ W (given as [K, N] or [N, K], K permuted by ``perm``) + bias."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if perm is not None:
        x2 = x2.index_select(1, perm if x2.is_cuda else perm.long())
    y = x2 @ w if w_is_kn else torch.nn.functional.linear(x2, w)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _check_x(x: torch.Tensor, k: int, what: str):
    if x.shape[-1] != k:
        raise ShapeError(f"x: last dim {x.shape[-1]} does not match the {what} layout's in_features {k}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ShapeError(f"x: dtype {x.dtype}; the int4 layouts serve float16/bfloat16 activations")


@torch.library.custom_op("sdquant::w4a16_dequant_triton", mutates_args=())
def w4a16_dequant_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zs: torch.Tensor,
                         perm: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x @ W.T + bias with W dequantized from the Triton int4 layout, then cuBLAS (see module docstring)."""
    _check_x(x, qweight.shape[0] * 8, "Triton")
    if not _runs_triton(qweight):
        w = int4_layout.dequantize_triton({"qweight": qweight, "scales": scales, "zs": zs, "perm": perm})
        return _gemm(x, w.to(x.dtype), False, None, bias)
    return _gemm(x, dequant_triton_layout(qweight, scales, zs, x.dtype), True, perm, bias)


@w4a16_dequant_triton.register_fake
def _(x, qweight, scales, zs, perm, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[1]))


@torch.library.custom_op("sdquant::w4a16_dequant_cuda", mutates_args=())
def w4a16_dequant_cuda(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       perm: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x @ W.T + bias with W dequantized from the CUDA int4 layout, then cuBLAS (see module docstring)."""
    _check_x(x, qweight.shape[1] * 16, "CUDA")
    if not _runs_triton(qweight):
        w = int4_layout.dequantize_cuda({"qweight": qweight, "scales": scales, "zeros": zeros, "perm": perm})
        return _gemm(x, w.to(x.dtype), False, None, bias)
    return _gemm(x, dequant_cuda_layout(qweight, scales, zeros, x.dtype), False, perm, bias)


@w4a16_dequant_cuda.register_fake
def _(x, qweight, scales, zeros, perm, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0] * 64))
