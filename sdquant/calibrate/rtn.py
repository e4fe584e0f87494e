"""Round-to-nearest: min/max group quantization, no calibration data needed."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sdquant.calibrate._util import cfg
from sdquant.quant.qtensor import QuantizedWeight, compute_qparams, quantize_codes, quantize_fp8_weight


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                 clip_ratio: float | torch.Tensor = 1.0) -> QuantizedWeight:
    """w [N, K] -> QuantizedWeight. Example: rtn_quantize(torch.randn(8, 64), 4, 32, False).dequantize()."""
    scales, zeros = compute_qparams(w, bits, group_size, symmetric, clip_ratio)
    codes = quantize_codes(w, scales, zeros, bits, group_size)
    return QuantizedWeight.from_codes(codes, scales, zeros, bits, group_size)


def reconstruction_loss(w: torch.Tensor, w_hat: torch.Tensor, H: torch.Tensor | None = None) -> float:
    """tr((W - Ŵ) H (W - Ŵ)^T) / N with H = X^T X / n (the GPTQ objective); plain MSE when H is None."""
    d = (w.float() - w_hat.float())
    if H is None:
        return float(d.pow(2).mean())
    return float(((d @ H.float()) * d).sum() / d.shape[0])


@dataclass
class BlockResult:
    weights: dict = field(default_factory=dict)   # full name -> QuantizedWeight | Fp8Weight
    smooth: dict = field(default_factory=dict)    # full name -> [K] divisor kept as an explicit multiply
    rows: list = field(default_factory=list)      # per-layer table rows
    scales: dict = field(default_factory=dict)    # replayable search results (AWQ scales, clips)


@torch.no_grad()
def rtn_block(ctx) -> BlockResult:
    """RTN (or dynamic FP8) for every target linear of a block; leaves the dequantized weight in place."""
    res = BlockResult()
    for name, lin in ctx.targets.items():
        t0 = time.perf_counter()
        spec = ctx.spec(name)
        w = lin.weight.detach()
        if spec.method == "fp8":
            qw = quantize_fp8_weight(w, per_tensor=cfg(ctx.qcfg, "fp8.weights", "channel") == "tensor")
        else:
            qw = rtn_quantize(w, spec.bits, spec.group_size, spec.symmetric)
        w_hat = qw.dequantize(w.dtype)
        res.rows.append({"layer": name, "method": "rtn" if spec.method != "fp8" else "fp8",
                         "bits": getattr(qw, "bits", 8), "loss": reconstruction_loss(w, w_hat),
                         "seconds": time.perf_counter() - t0})
        lin.weight.copy_(w_hat)
        res.weights[name] = qw.to("cpu")
    return res
