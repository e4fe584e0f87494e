"""The canonical quantized-weight types: what packages store and every kernel repacks from.

Integer weights (``QuantizedWeight``), for a linear with N output and K input features:

    qweight  uint8  [N, K * bits / 8]   codes packed along K as a little-endian bit stream per row:
                                        code k occupies bits [k*bits, (k+1)*bits) of the row.
                                        bits=4: byte j = code[2j] | code[2j+1] << 4.
    scales   fp16   [N, G]              G = K / group_size (G = 1 for per-channel, group_size = -1)
    zeros    uint8  [N, G] or None      integer zero points; None means symmetric (zero = 2**(bits-1))
    g_idx    int32  [K] or None         group of each input channel (act-order "group"); None = k // group_size

    dequantized W[n, k] = (code[n, k] - zero[n, g]) * scale[n, g],   g = g_idx[k]

FP8 weights (``Fp8Weight``): ``weight`` float8_e4m3fn [N, K], ``weight_scale`` fp32 [N] (per output channel),
``input_scale`` fp32 scalar (static, calibrated per tensor) or None (dynamic, per token).

These are kernel-neutral: no tile orders, no interleaving. Kernels repack at load time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sdquant.errors import ShapeError

SUPPORTED_BITS = (2, 3, 4, 8)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def num_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size in (-1, 0) else in_features // group_size


def effective_group_size(in_features: int, group_size: int) -> int:
    return in_features if group_size in (-1, 0) else group_size


def check_shape(name: str, in_features: int, bits: int, group_size: int) -> None:
    """Raise ShapeError naming the layer when (bits, group_size) cannot be applied to K = in_features."""
    if bits not in SUPPORTED_BITS:
        raise ShapeError(f"{name}: bits={bits} is not supported (choose from {SUPPORTED_BITS})")
    if group_size not in (-1, 0) and (group_size <= 0 or in_features % group_size):
        raise ShapeError(f"{name}: group_size {group_size} does not divide in_features {in_features}")
    if (in_features * bits) % 8:
        raise ShapeError(f"{name}: in_features {in_features} x {bits} bits is not a whole number of bytes")


# ----------------------------------------------------------------------------------------------- packing
_PACK_ROWS = 4096     # rows per chunk for the 3-bit bit-matrix path (its temporaries are 8·bits bytes a code)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] integer codes in [0, 2**bits) -> uint8 [N, K*bits/8] little-endian bit stream per row.

    2/4/8 bits work in uint8 (a code never straddles a byte), so packing a 57k × 8k fused weight needs no
    int64 temporaries (those were 8 bytes a code, ~10 GB at that size); 3 bits go through a bit matrix in
    row chunks."""
    n, k = codes.shape
    if (k * bits) % 8:
        raise ShapeError(f"cannot pack K={k} codes of {bits} bits into whole bytes")
    if bits == 8:
        return codes.to(torch.uint8)
    if 8 % bits == 0:
        per = 8 // bits
        c = codes.to(torch.uint8).reshape(n, k // per, per)
        out = c[..., 0].clone()
        for j in range(1, per):
            out |= c[..., j] << (j * bits)
        return out
    if n > _PACK_ROWS:
        return torch.cat([pack_codes(codes[r0:r0 + _PACK_ROWS], bits) for r0 in range(0, n, _PACK_ROWS)], 0)
    c = codes.to(torch.int64)
    bit_idx = torch.arange(bits, device=c.device, dtype=torch.int64)
    bitsm = ((c.unsqueeze(-1) >> bit_idx) & 1).reshape(n, k * bits // 8, 8)
    weights = torch.arange(8, device=c.device, dtype=torch.int64)
    return (bitsm << weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of pack_codes: uint8 [N, K*bits/8] -> uint8 [N, K]."""
    n = packed.shape[0]
    mask = (1 << bits) - 1
    if bits == 8:
        return packed.to(torch.uint8)
    if 8 % bits == 0:
        p = packed.to(torch.uint8)
        per = 8 // bits
        parts = [(p >> (j * bits)) & mask for j in range(per)]
        return torch.stack(parts, -1).reshape(n, -1)[:, :in_features]
    if n > _PACK_ROWS:
        return torch.cat([unpack_codes(packed[r0:r0 + _PACK_ROWS], bits, in_features)
                          for r0 in range(0, n, _PACK_ROWS)], 0)
    p = packed.to(torch.int64)
    b = torch.arange(8, device=p.device, dtype=torch.int64)
    bitsm = ((p.unsqueeze(-1) >> b) & 1).reshape(n, -1, bits)
    weights = torch.arange(bits, device=p.device, dtype=torch.int64)
    return (bitsm << weights).sum(-1)[:, :in_features].to(torch.uint8)


# -------------------------------------------------------------------------------------------- quantizer
def compute_qparams(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                    clip_ratio: float | torch.Tensor = 1.0):
    """Min/max quantization parameters for w [N, K] in contiguous groups along K.

    Returns (scales fp16 [N, G], zeros uint8 [N, G] or None). Scales are rounded to fp16 *before* codes are
    chosen, so what is stored is exactly what the codes were fitted against. ``clip_ratio`` shrinks the range
    (scalar, or a [N, G] tensor from a clipping search).
    """
    n, k = w.shape
    gs = effective_group_size(k, group_size)
    wg = w.detach().float().reshape(n, k // gs, gs)
    maxq = (1 << bits) - 1
    if symmetric:
        amax = wg.abs().amax(-1) * clip_ratio
        scale = (2 * amax / maxq)
        scale = _safe_scale(scale)
        return scale, None
    wmax = wg.amax(-1) * clip_ratio
    wmin = wg.amin(-1) * clip_ratio
    scale = _safe_scale((wmax - wmin) / maxq)
    zero = torch.clamp(torch.round(-wmin / scale.float()), 0, maxq).to(torch.uint8)
    return scale, zero


def _safe_scale(scale: torch.Tensor) -> torch.Tensor:
    # an all-zero group gets scale 1 (any value reproduces zeros); fp16 rounding must not produce 0 or inf
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale.clamp(min=6.2e-5, max=65504.0).to(torch.float16)


def expand_groups(t: torch.Tensor, in_features: int, group_size: int, g_idx: Optional[torch.Tensor]):
    """[N, G] per-group tensor -> [N, K] per-input-channel tensor."""
    if g_idx is not None:
        return t[:, g_idx.long()]
    gs = effective_group_size(in_features, group_size)
    return t.repeat_interleave(gs, dim=1)


def zero_points(zeros: Optional[torch.Tensor], scales: torch.Tensor, bits: int) -> torch.Tensor:
    if zeros is None:
        return torch.full(scales.shape, float(1 << (bits - 1)), device=scales.device)
    return zeros.float()


def quantize_codes(w: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], bits: int,
                   group_size: int, g_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Round w [N, K] (or a column block whose params are already expanded) to uint8 codes."""
    k = w.shape[1]
    s = expand_groups(scales.float(), k, group_size, g_idx)
    z = expand_groups(zero_points(zeros, scales, bits), k, group_size, g_idx)
    return torch.clamp(torch.round(w.float() / s) + z, 0, (1 << bits) - 1).to(torch.uint8)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Quantize-dequantize with already expanded float scale/zero broadcastable to w (used by GPTQ/AWQ loops)."""
    q = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
    return (q - zero) * scale


# ----------------------------------------------------------------------------------------------- types
@dataclass
class QuantizedWeight:
    qweight: torch.Tensor                 # uint8 [N, K*bits/8]
    scales: torch.Tensor                  # fp16 [N, G]
    zeros: Optional[torch.Tensor]         # uint8 [N, G] or None (symmetric)
    bits: int
    group_size: int                       # -1 = per output channel
    in_features: int
    g_idx: Optional[torch.Tensor] = None  # int32 [K]

    def __post_init__(self):
        n = self.qweight.shape[0]
        k = self.in_features
        check_shape("QuantizedWeight", k, self.bits, self.group_size)
        g = num_groups(k, self.group_size)
        if self.qweight.dtype != torch.uint8 or tuple(self.qweight.shape) != (n, k * self.bits // 8):
            raise ShapeError(f"qweight must be uint8 [{n}, {k * self.bits // 8}], got "
                             f"{self.qweight.dtype} {list(self.qweight.shape)}")
        if tuple(self.scales.shape) != (n, g):
            raise ShapeError(f"scales must be [{n}, {g}], got {list(self.scales.shape)}")
        if self.zeros is not None and tuple(self.zeros.shape) != (n, g):
            raise ShapeError(f"zeros must be [{n}, {g}], got {list(self.zeros.shape)}")
        if self.g_idx is not None:
            if tuple(self.g_idx.shape) != (k,):
                raise ShapeError(f"g_idx must be [{k}], got {list(self.g_idx.shape)}")
            if self.g_idx.numel() and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= g):
                raise ShapeError(f"g_idx values must lie in [0, {g})")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def shape(self):
        return (self.out_features, self.in_features)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @classmethod
    def from_codes(cls, codes, scales, zeros, bits, group_size, g_idx=None) -> "QuantizedWeight":
        return cls(pack_codes(codes, bits), scales.to(torch.float16),
                   None if zeros is None else zeros.to(torch.uint8), bits, group_size, codes.shape[1],
                   None if g_idx is None else g_idx.to(torch.int32))

    def codes(self) -> torch.Tensor:
        return unpack_codes(self.qweight, self.bits, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        k = self.in_features
        if self.g_idx is None:
            # contiguous groups: broadcast the [N, G] parameters over [N, G, gs] views in place, so the only
            # weight-sized temporary is the result (a 57k x 8k fused weight: 1.9 GB, not four times that)
            n, g = self.scales.shape
            out = self.codes().view(n, g, k // g).to(torch.float32)
            out.sub_(zero_points(self.zeros, self.scales, self.bits)[..., None])
            out.mul_(self.scales.float()[..., None])
            return out.view(n, k).to(dtype)
        s = expand_groups(self.scales.float(), k, self.group_size, self.g_idx)
        z = expand_groups(zero_points(self.zeros, self.scales, self.bits), k, self.group_size, self.g_idx)
        return ((self.codes().float() - z) * s).to(dtype)

    def to(self, device) -> "QuantizedWeight":
        # already validated: skip __post_init__ (its g_idx range check would sync a GPU / fail on meta)
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        out = object.__new__(QuantizedWeight)
        out.__dict__.update(self.__dict__, qweight=mv(self.qweight), scales=mv(self.scales),
                            zeros=mv(self.zeros), g_idx=mv(self.g_idx))
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros, self.g_idx)
                   if t is not None)

    def scheme(self) -> dict:
        return {"type": "int", "bits": self.bits, "group_size": self.group_size,
                "symmetric": self.symmetric, "act_order": self.g_idx is not None}


@dataclass
class Fp8Weight:
    weight: torch.Tensor                       # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor                 # fp32 [N]
    input_scale: Optional[torch.Tensor] = None  # fp32 [] static per-tensor, None = dynamic per token

    def __post_init__(self):
        if self.weight.dtype != torch.float8_e4m3fn or self.weight.dim() != 2:
            raise ShapeError(f"fp8 weight must be float8_e4m3fn [N, K], got {self.weight.dtype} "
                             f"{list(self.weight.shape)}")
        if tuple(self.weight_scale.shape) != (self.weight.shape[0],):
            raise ShapeError(f"weight_scale must be [{self.weight.shape[0]}], got {list(self.weight_scale.shape)}")
        if self.input_scale is not None and self.input_scale.numel() != 1:
            raise ShapeError("input_scale must be a scalar")

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale.float()[:, None]).to(dtype)

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.weight.to(device), self.weight_scale.to(device),
                         None if self.input_scale is None else self.input_scale.to(device))

    def nbytes(self) -> int:
        return self.weight.numel() + self.weight_scale.numel() * 4 + (4 if self.input_scale is not None else 0)

    def scheme(self) -> dict:
        return {"type": "fp8", "format": "e4m3", "weight": "per_channel",
                "activation": "static" if self.input_scale is not None else "dynamic_per_token"}


def quantize_fp8_weight(w: torch.Tensor, input_scale: Optional[torch.Tensor] = None,
                        per_tensor: bool = False) -> Fp8Weight:
    """e4m3 weight quantization (absmax): one scale per output channel, or (``per_tensor``) one for the whole
    matrix, stored repeated as [N] so packages keep one format. With a static ``input_scale`` too, a per-tensor
    weight runs on cuBLASLt's tensorwise FP8 GEMM (Fp8Linear; the NVIDIA ModelOpt / TensorRT-LLM FP8 recipe)."""
    w = w.detach().float()
    if per_tensor:
        scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12).expand(w.shape[0]).contiguous()
    else:
        scale = (w.abs().amax(1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale, None if input_scale is None else input_scale.float().reshape(()))
