"""Quantized models for tests and benchmarks without a calibration run: round-to-nearest on real weights
(``quantize_model_rtn``) and random canonical weights built directly on a device (``random_int_weight``,
``random_fp8_weight``, for speed measurements of real shapes where the values do not matter)."""
from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
from torch import nn

from sdquant.quant.qtensor import (Fp8Weight, QuantizedWeight, compute_qparams, num_groups, quantize_codes,
                                   quantize_fp8_weight)


def rtn_weight(w: torch.Tensor, bits=4, group_size=32, symmetric=False, act_order=False, seed=0) -> QuantizedWeight:
    """Min/max round-to-nearest. act_order=True emulates GPTQ's act-order layout: channels are visited in a
    random order and consecutive visited channels share a group, so g_idx is a real permutation."""
    w = w.detach().float().cpu()
    if not act_order:
        scales, zeros = compute_qparams(w, bits, group_size, symmetric)
        return QuantizedWeight.from_codes(quantize_codes(w, scales, zeros, bits, group_size), scales, zeros,
                                          bits, group_size)
    k = w.shape[1]
    gs = k if group_size in (-1, 0) else group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // gs).to(torch.int32)
    scales, zeros = compute_qparams(w[:, order], bits, group_size, symmetric)
    codes = quantize_codes(w, scales, zeros, bits, group_size, g_idx)
    return QuantizedWeight.from_codes(codes, scales, zeros, bits, group_size, g_idx)


def quantize_model_rtn(model: nn.Module, bits=4, group_size=32, symmetric=False, act_order=False, fp8=False,
                       skip: Iterable[str] = (r"lm_head$",), only: Optional[str] = None) -> nn.Module:
    """Replace every nn.Linear (except names matching ``skip``) in place by QuantLinear (RTN) or Fp8Linear."""
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    skip_re = [re.compile(s) for s in skip]
    targets = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear
               and not any(r.search(n) for r in skip_re) and (only is None or re.search(only, n))]
    for i, (name, lin) in enumerate(targets):
        bias = None if lin.bias is None else lin.bias.detach().clone()
        if fp8:
            new = Fp8Linear(quantize_fp8_weight(lin.weight), bias)
        else:
            new = QuantLinear(rtn_weight(lin.weight, bits, group_size, symmetric, act_order, seed=i), bias)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return model


def random_int_weight(n: int, k: int, bits=4, group_size=128, symmetric=True, device="cpu",
                      generator: Optional[torch.Generator] = None) -> QuantizedWeight:
    """Random codes and plausible scales (~0.02 / 2**(bits-1) so dequantized weights have std ~0.01)."""
    g = num_groups(k, group_size)
    qweight = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, device=device, generator=generator)
    scales = (torch.rand(n, g, device=device, generator=generator) * 0.5 + 0.75) * (0.02 / (1 << (bits - 1)))
    zeros = None if symmetric else torch.randint(
        (1 << bits) // 2 - 2, (1 << bits) // 2 + 2, (n, g), dtype=torch.uint8, device=device, generator=generator)
    return QuantizedWeight(qweight, scales.half(), zeros, bits, group_size, k)


def random_fp8_weight(n: int, k: int, device="cpu", generator: Optional[torch.Generator] = None) -> Fp8Weight:
    w = torch.randn(n, k, device=device, generator=generator).clamp(-6, 6).to(torch.float8_e4m3fn)
    return Fp8Weight(w, torch.full((n,), 0.01 / 2, device=device), None)
