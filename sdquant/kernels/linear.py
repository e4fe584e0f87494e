"""QuantLinear: the one module every runtime path (eager, torch.compile, ONNX export) uses for a quantized
linear. It stores the canonical tensors as buffers and calls a torch.library op; which kernel runs is chosen
once per layer (``prepare``), never per call and never by a module-level flag."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sdquant.kernels import ops  # noqa: F401  (registers torch.ops.sdquant.*)
from sdquant.quant.qtensor import Fp8Weight, QuantizedWeight


class QuantLinear(nn.Module):
    """W4A16-style weight-only integer linear (bits 2/3/4/8)."""

    def __init__(self, qw: QuantizedWeight, bias: Optional[torch.Tensor] = None,
                 smooth: Optional[torch.Tensor] = None):
        super().__init__()
        self.in_features, self.out_features = qw.in_features, qw.out_features
        self.bits, self.group_size = qw.bits, qw.group_size
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("zeros", qw.zeros)
        self.register_buffer("g_idx", qw.g_idx)
        self.register_buffer("bias", bias)
        # an AWQ scale that could not be folded into the previous op: x is divided by it before the GEMM
        self.register_buffer("smooth", smooth)
        self.kernel = "reference"

    @property
    def weight_q(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size,
                               self.in_features, self.g_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.smooth is not None:
            x = x / self.smooth.to(x.dtype)
        return torch.ops.sdquant.int_linear(x, self.qweight, self.scales, self.zeros, self.g_idx, self.bias,
                                            self.bits, self.group_size, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, symmetric={self.zeros is None}, kernel={self.kernel}")


class Fp8Linear(nn.Module):
    """W8A8 e4m3 linear: per-channel weight scales, static or dynamic per-token activation scales."""

    def __init__(self, fw: Fp8Weight, bias: Optional[torch.Tensor] = None, smooth: Optional[torch.Tensor] = None):
        super().__init__()
        self.in_features, self.out_features = fw.in_features, fw.out_features
        self.register_buffer("weight", fw.weight)
        self.register_buffer("weight_scale", fw.weight_scale)
        self.register_buffer("input_scale", fw.input_scale)
        self.register_buffer("bias", bias)
        self.register_buffer("smooth", smooth)
        self.kernel = "reference"

    @property
    def weight_q(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale, self.input_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.smooth is not None:
            x = x / self.smooth.to(x.dtype)
        return torch.ops.sdquant.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)

    def extra_repr(self) -> str:
        mode = "static" if self.input_scale is not None else "dynamic"
        return f"in_features={self.in_features}, out_features={self.out_features}, act={mode}, kernel={self.kernel}"
