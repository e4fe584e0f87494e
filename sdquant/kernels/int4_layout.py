"""Repacking canonical 4-bit ``QuantizedWeight`` tensors into the layouts of sdquant's W4A16 kernels, and back.

Packages store the canonical, kernel-neutral tensors (``sdquant.quant.qtensor``). When a layer is put on a
device, each kernel gets its own layout, built once by the functions here. Both layouts share three ideas:

* **act-order** (``g_idx``) is resolved once: input channels are permuted so that every group is a contiguous
  run of K (``perm``, int32 [K]); at run time the kernels gather ``x[:, perm]``. ``perm`` is None when the
  weight has no g_idx, or when its g_idx is the plain ``k // group_size``.
* **one op per weight**: the Triton layout stores scales in the activation dtype together with
  ``zs = -zero * scale``, so a code c dequantizes with one FMA ``c * s + zs``. The CUDA layout goes further:
  it stores the integer zero points (in the activation dtype, exact) so the int->float conversion yields
  ``c - zero`` directly (one sub after the lop3), and keeps the fp16 scales, which the kernel applies in fp32
  to each group's partial sums.
* every tensor is plain and contiguous, so a layer can register them as buffers.

API (used by the dispatch code; all return/accept plain dicts of tensors, never kernel objects)::

    repack_triton(qw, dtype) -> {"qweight": int32 [K/8, N], "scales": dtype [G, N], "zs": dtype [G, N],
                                 "perm": int32 [K] | None, "locks": int32 [N/32]}
        word [k8, n] holds codes k = 8*k8 .. 8*k8+7 of feature n, code k8*8+j in bits 4j..4j+3; N is the
        contiguous axis, so a thread's 16-byte load covers 4 features. "locks": split-K counters (one a
        32-feature tile at most), zero, left at zero by the kernels.
    repack_cuda(qw, dtype) -> {"qweight": int32 [N/64, K/16, 32, 4], "scales": fp16 [G, N/64, 8, 8],
                               "zeros": dtype [G, N/64, 8, 8], "perm": int32 [K] | None,
                               "locks": int32 [max(N/64, CUDA_LOCKS_MIN)]}
        fragment-ordered: lane l = 4g + t of a warp loads 16 bytes (4 words) per 64-feature x 16-k tile, exactly
        its A fragments for four m16n8k16 MMAs (features 16w+g and 16w+8+g of word w, k rows 2t, 2t+1, 2t+8,
        2t+9; see ``_CUDA_NIBBLES``); scales/zeros [g, nb, r, e] belong to feature nb*64 + 16*(e//2) + 8*(e%2)
        + r; "locks" is split-K scratch the kernel leaves at zero.
    unpack_triton(layout, symmetric) / unpack_cuda(layout, symmetric) -> QuantizedWeight (g_idx resolved into
        a permuted K is restored from perm), for round-trip tests.
    dequantize_triton(layout) / dequantize_cuda(layout) -> fp32 [N, K] in the original channel order: the
        pure-PyTorch meaning of a layout (CPU fallback of the ops, and what tests compare against).

Constraints (ShapeError otherwise): bits == 4; Triton: K % 32 == 0, N % 32 == 0; CUDA: K % 64 == 0,
N % 64 == 0; group sizes 32/64/128/... (multiples of 32) or per-channel; act-order
groups must all hold ``group_size`` channels.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from sdquant.errors import ShapeError
from sdquant.quant.qtensor import QuantizedWeight, effective_group_size

Layout = Dict[str, Optional[torch.Tensor]]

# m16n8k16 A fragment (the weight is the A operand): lane l = 4g + t holds rows g and g+8 of a 16x16 tile at
# k columns 2t, 2t+1, 2t+8, 2t+9. Word w of a lane covers tile rows 16w..16w+15, i.e. features j*8 + g with
# j = 2w (row g) and j = 2w+1 (row g+8); nibble p -> (j offset, k - 2t). lo/hi nibble extraction yields the
# half2 pairs (p0,p4) (p1,p5) of row g and (p2,p6) (p3,p7) of row g+8.
_CUDA_NIBBLES = [(0, 0), (0, 8), (1, 0), (1, 8), (0, 1), (0, 9), (1, 1), (1, 9)]  # (j offset, k row - 2t)


def _check_int4(qw: QuantizedWeight, k_mult: int, n_mult: int, gs_mult: int, what: str) -> int:
    if qw.bits != 4:
        raise ShapeError(f"{what}: bits={qw.bits}; the W4A16 kernels take 4-bit weights only")
    k, n = qw.in_features, qw.out_features
    if k % k_mult or n % n_mult:
        raise ShapeError(f"{what}: weight [N={n}, K={k}] is not supported: K must be a multiple of {k_mult} "
                         f"and N a multiple of {n_mult}")
    gs = effective_group_size(k, qw.group_size)
    if gs % gs_mult:
        raise ShapeError(f"{what}: group_size {qw.group_size} must be a multiple of {gs_mult} (or -1)")
    return gs


def act_order_perm(qw: QuantizedWeight) -> Optional[torch.Tensor]:
    """int64 [K] permutation that makes every group contiguous (stable sort of g_idx), or None if not needed."""
    if qw.g_idx is None:
        return None
    k = qw.in_features
    gs = effective_group_size(k, qw.group_size)
    g_idx = qw.g_idx.long().cpu()
    if torch.equal(g_idx, torch.arange(k) // gs):
        return None
    counts = torch.bincount(g_idx, minlength=k // gs)
    if not bool((counts == gs).all()):
        raise ShapeError(f"g_idx: every group must hold group_size={gs} input channels for the W4A16 kernels "
                         f"(found group sizes from {int(counts.min())} to {int(counts.max())})")
    return torch.sort(g_idx, stable=True).indices


def _prepared(qw: QuantizedWeight, dtype: torch.dtype):
    """codes [N, K] (permuted), scales / zs fp32 [N, G], perm int32 or None, all on qw's device."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ShapeError(f"dtype: W4A16 kernels take float16 or bfloat16 activations, got {dtype}")
    perm = act_order_perm(qw)
    codes = qw.codes()
    if perm is not None:
        perm = perm.to(codes.device)
        codes = codes[:, perm]
    s = qw.scales.float()
    z = torch.full_like(s, 8.0) if qw.zeros is None else qw.zeros.float()
    return codes, s, -z * s, None if perm is None else perm.to(torch.int32)


def _nibbles_to_words(c: torch.Tensor) -> torch.Tensor:
    """[..., 8] codes in [0, 16) -> int32 [...] with code i in bits 4i..4i+3 (two's complement wrap)."""
    c = c.to(torch.int32)
    w = c[..., 0]
    for i in range(1, 8):
        w = w | (c[..., i] << (4 * i))
    return w


def _words_to_nibbles(w: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, device=w.device, dtype=torch.int32)
    return ((w.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


# ------------------------------------------------------------------------------------------------ Triton
def repack_triton(qw: QuantizedWeight, dtype: torch.dtype) -> Layout:
    _check_int4(qw, 32, 32, 32, "repack_triton")
    codes, s, zs, perm = _prepared(qw, dtype)
    n, k = codes.shape
    words = _nibbles_to_words(codes.t().reshape(k // 8, 8, n).transpose(1, 2))  # [K/8, N]
    return {"qweight": words.contiguous(), "scales": s.t().contiguous().to(dtype),
            "zs": zs.t().contiguous().to(dtype), "perm": perm,
            "locks": torch.zeros(n // 32, dtype=torch.int32, device=codes.device)}


def _triton_codes_kn(layout: Layout) -> torch.Tensor:
    q = layout["qweight"]                                            # [K/8, N]
    return _words_to_nibbles(q).permute(0, 2, 1).reshape(q.shape[0] * 8, q.shape[1])  # [K, N]


def dequantize_triton(layout: Layout) -> torch.Tensor:
    codes = _triton_codes_kn(layout).float()                         # [K, N], permuted K
    k = codes.shape[0]
    gs = k // layout["scales"].shape[0]
    s = layout["scales"].float().repeat_interleave(gs, 0)
    zs = layout["zs"].float().repeat_interleave(gs, 0)
    return _unpermute((codes * s + zs).t(), layout["perm"])


# -------------------------------------------------------------------------------------------------- CUDA
def _cuda_index(device):
    """Index tensors [4 t, 4 w, 8 p] -> (j, k row) of the code held in nibble p of word w of lanes 4g+t."""
    t = torch.arange(4).view(4, 1, 1)
    w = torch.arange(4).view(1, 4, 1)
    joff = torch.tensor([a for a, _ in _CUDA_NIBBLES]).view(1, 1, 8)
    krow = torch.tensor([b for _, b in _CUDA_NIBBLES]).view(1, 1, 8)
    j = (2 * w + joff).expand(4, 4, 8)
    kr = (2 * t + krow).expand(4, 4, 8)
    return j.to(device), kr.to(device)


# Split-K / stream-K counters of a CUDA layout: max(N/64, this) (csrc/w4a16.h SDQ_LOCKS_MIN: the warp-specialized stream-K
# counts in on its owner CTA's lock, one a CTA of its grid)
CUDA_LOCKS_MIN = 1024


def repack_cuda(qw: QuantizedWeight, dtype: torch.dtype) -> Layout:
    _check_int4(qw, 64, 64, 32, "repack_cuda")
    codes, _, _, perm = _prepared(qw, dtype)
    n, k = codes.shape
    nb, kb, g = n // 64, k // 16, qw.scales.shape[1]
    c = codes.view(nb, 8, 8, kb, 16).permute(0, 3, 2, 1, 4)          # [NB, KB, g(row in 8), j, k row]
    j, kr = _cuda_index(codes.device)
    frag = c[:, :, :, j, kr]                                          # [NB, KB, 8 g, 4 t, 4 w, 8 p]
    words = _nibbles_to_words(frag).reshape(nb, kb, 32, 4)           # lane = 4g + t
    zeros = torch.full((n, g), 8, device=codes.device) if qw.zeros is None else qw.zeros

    def perm_groups(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:  # [N, G] -> [G, NB, 8 g, 8 j]
        return t.t().reshape(g, nb, 8, 8).transpose(2, 3).contiguous().to(dt)
    return {"qweight": words.contiguous(), "scales": perm_groups(qw.scales, torch.float16),
            "zeros": perm_groups(zeros, dtype), "perm": perm,
            "locks": torch.zeros(max(nb, CUDA_LOCKS_MIN), dtype=torch.int32, device=codes.device)}


def _cuda_codes_nk(layout: Layout) -> torch.Tensor:
    q = layout["qweight"]                                            # [NB, KB, 32, 4]
    nb, kb = q.shape[0], q.shape[1]
    nib = _words_to_nibbles(q).view(nb, kb, 8, 4, 4, 8)               # [NB, KB, g, t, w, p]
    j, kr = _cuda_index(q.device)
    c = torch.empty(nb, kb, 8, 8, 16, dtype=torch.uint8, device=q.device)  # [NB, KB, g, j, k row]
    c[:, :, :, j, kr] = nib
    return c.permute(0, 3, 2, 1, 4).reshape(nb * 64, kb * 16)          # [N, K] permuted K


def _cuda_scales_ng(t: torch.Tensor) -> torch.Tensor:
    g, nb = t.shape[0], t.shape[1]
    return t.transpose(2, 3).reshape(g, nb * 64).t()                  # [N, G]


def dequantize_cuda(layout: Layout) -> torch.Tensor:
    codes = _cuda_codes_nk(layout).float()                           # [N, K] permuted K
    k = codes.shape[1]
    gs = k // layout["scales"].shape[0]
    s = _cuda_scales_ng(layout["scales"]).float().repeat_interleave(gs, 1)
    z = _cuda_scales_ng(layout["zeros"]).float().repeat_interleave(gs, 1)
    return _unpermute((codes - z) * s, layout["perm"])


# ------------------------------------------------------------------------------------------- round trips
def _unpermute(w_nk: torch.Tensor, perm: Optional[torch.Tensor]) -> torch.Tensor:
    if perm is None:
        return w_nk.contiguous()
    out = torch.empty_like(w_nk)
    out[:, perm.long()] = w_nk
    return out


def _to_canonical(codes_nk, s_ng, zs_ng, perm, symmetric: bool) -> QuantizedWeight:
    n, k = codes_nk.shape
    g = s_ng.shape[1]
    gs = k // g
    scales = s_ng.to(torch.float16)
    zeros = None if symmetric else torch.round(-zs_ng.float() / s_ng.float()).clamp(0, 15).to(torch.uint8)
    g_idx = None
    if perm is not None:
        g_idx = torch.empty(k, dtype=torch.int32, device=codes_nk.device)
        g_idx[perm.long()] = (torch.arange(k, device=codes_nk.device) // gs).to(torch.int32)
        codes_nk = _unpermute(codes_nk, perm)
    return QuantizedWeight.from_codes(codes_nk, scales, zeros, 4, -1 if g == 1 else gs, g_idx)


def unpack_triton(layout: Layout, symmetric: bool) -> QuantizedWeight:
    codes = _triton_codes_kn(layout).t()
    return _to_canonical(codes, layout["scales"].t(), layout["zs"].t(), layout["perm"], symmetric)


def unpack_cuda(layout: Layout, symmetric: bool) -> QuantizedWeight:
    s = _cuda_scales_ng(layout["scales"]).float()
    return _to_canonical(_cuda_codes_nk(layout), s, -_cuda_scales_ng(layout["zeros"]).float() * s,
                         layout["perm"], symmetric)
