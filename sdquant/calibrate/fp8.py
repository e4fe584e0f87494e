"""FP8 W8A8 (e4m3) calibration math: per-output-channel (or per-tensor) weight scales, static per-tensor activation scales
from calibrated absmax, or dynamic per-token scales (no calibration), and SmoothQuant-style migration of
activation outliers into the weights with the same fold/smooth machinery as AWQ.

Pure functions on tensors:
    amax = channel_absmax_update(amax, x)               # streaming [K] running max |x|
    s = smooth_scales(amax, [W_q, W_k, W_v], alpha)     # x / s, W · s: flattens activation outliers
    input_scale = static_input_scale(amax / s)          # per-tensor scale of the (smoothed) input
    fw = quantize_fp8(W · s, input_scale)               # Fp8Weight
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from sdquant.errors import ConfigError
from sdquant.quant.qtensor import FP8_MAX, Fp8Weight, quantize_fp8_weight


def channel_absmax_update(amax: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Running per-channel max |x| (float32 [K]) over a batch x [..., K]."""
    cur = x.reshape(-1, x.shape[-1]).float().abs().amax(0)
    return cur if amax is None else torch.maximum(amax, cur)


def static_input_scale(channel_amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor e4m3 activation scale (fp32 scalar) so that the calibrated absmax maps to FP8_MAX."""
    return (channel_amax.float().max() / FP8_MAX).clamp(min=1e-12).reshape(())


def smooth_scales(channel_amax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant: s_k = max|x_k|^α / max_n |W_nk|^(1−α) over the group's stacked weights; x is divided by s.
    Returns s [K] float32 (channels that never fired keep s = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError("quant.fp8.smooth_alpha", f"must lie in [0, 1], got {alpha}")
    w_amax = torch.cat([w.detach().float().abs() for w in weights], 0).amax(0).clamp(min=1e-5)
    a = channel_amax.float()
    s = a.clamp(min=1e-5).pow(alpha) / w_amax.pow(1.0 - alpha)
    s = torch.where(a > 0, s, torch.ones_like(s))
    return s.clamp(min=1e-5, max=1e5)


def quantize_fp8(W: torch.Tensor, input_scale: Optional[torch.Tensor] = None, per_tensor: bool = False) -> Fp8Weight:
    """Absmax e4m3 weight, per output channel (or per tensor); input_scale None = dynamic per-token activations."""
    return quantize_fp8_weight(W, input_scale, per_tensor=per_tensor)


def fake_quant_fp8_activation(x: torch.Tensor, input_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """What the W8A8 kernel does to activations (for losses and tests): per-token absmax, or static scale."""
    xf = x.float()
    if input_scale is None:
        scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    else:
        scale = input_scale.float()
    return ((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
