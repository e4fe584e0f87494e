"""torch.library ops for quantized linears: schemas, fake (meta) implementations for torch.compile, and the
pure-PyTorch reference implementations that run on any device and that every kernel is tested against.

The reference ops take the *canonical* tensors of ``sdquant.quant.qtensor`` (no kernel layout), so a package
made anywhere runs anywhere. Device kernels register their own ops over their own packed layouts.
Registering ops is not a global torch setting: it adds names under the ``sdquant`` namespace only.
"""
from __future__ import annotations

from typing import Optional

import torch

from sdquant.quant.qtensor import FP8_MAX, QuantizedWeight


@torch.library.custom_op("sdquant::int_linear", mutates_args=())
def int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
               g_idx: Optional[torch.Tensor], bias: Optional[torch.Tensor], bits: int, group_size: int,
               in_features: int) -> torch.Tensor:
    """y = x @ dequant(W).T + bias, x [..., K] fp16/bf16/fp32, weight in the canonical packed layout."""
    w = QuantizedWeight(qweight, scales, zeros, bits, group_size, in_features, g_idx).dequantize(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


@int_linear.register_fake
def _(x, qweight, scales, zeros, g_idx, bias, bits, group_size, in_features):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def quantize_fp8_per_token(x: torch.Tensor):
    """x [..., K] -> (float8_e4m3fn [..., K], fp32 scale [..., 1]) with one absmax scale per row."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor):
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


@torch.library.custom_op("sdquant::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """W8A8 e4m3: activations quantized per token (input_scale None) or with a static per-tensor scale,
    weights per output channel; accumulate in fp32; output in x.dtype. Reference emulation."""
    if input_scale is None:
        xq, xs = quantize_fp8_per_token(x)
    else:
        xq, xs = quantize_fp8_static(x, input_scale), input_scale.float().reshape(())
    y = (xq.float() @ weight.float().t()) * xs * weight_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@fp8_linear.register_fake
def _(x, weight, weight_scale, input_scale, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
