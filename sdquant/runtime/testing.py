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
    """Replace every nn.Linear (except names matching ``skip``) in place by QuantLinear (RTN) or Fp8Linear,
    through ``sdquant.models.hf.replace_linears`` (the swap every loader uses)."""
    from sdquant.models.hf import replace_linears
    skip_re = [re.compile(s) for s in skip]
    targets = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear
               and not any(r.search(n) for r in skip_re) and (only is None or re.search(only, n))]
    weights = {name: quantize_fp8_weight(lin.weight) if fp8 else
               rtn_weight(lin.weight, bits, group_size, symmetric, act_order, seed=i)
               for i, (name, lin) in enumerate(targets)}
    return replace_linears(model, weights)


def random_int_weight(n: int, k: int, bits=4, group_size=128, symmetric=True, device="cpu",
                      generator: Optional[torch.Generator] = None) -> QuantizedWeight:
    """Random codes and plausible scales (~0.02 / 2**(bits-1) so dequantized weights have std ~0.01)."""
    g = num_groups(k, group_size)
    qweight = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, device=device, generator=generator)
    scales = (torch.rand(n, g, device=device, generator=generator) * 0.5 + 0.75) * (0.02 / (1 << (bits - 1)))
    zeros = None if symmetric else torch.randint(
        (1 << bits) // 2 - 2, (1 << bits) // 2 + 2, (n, g), dtype=torch.uint8, device=device, generator=generator)
    return QuantizedWeight(qweight, scales.half(), zeros, bits, group_size, k)


def random_fp8_weight(n: int, k: int, device="cpu", generator: Optional[torch.Generator] = None,
                      input_scale: Optional[float] = None) -> Fp8Weight:
    """Random e4m3 codes with one (per-tensor) weight scale; ``input_scale``: a static activation scale (then the
    layer runs the tensorwise ``_scaled_mm`` at large M), None = dynamic per-token."""
    w = torch.randn(n, k, device=device, generator=generator).clamp(-6, 6).to(torch.float8_e4m3fn)
    isc = None if input_scale is None else torch.tensor(float(input_scale), device=device)
    return Fp8Weight(w, torch.full((n,), 0.01 / 2, device=device), isc)


# ------------------------------------------------------------------------------- random runtime models
LLAMA3_8B = dict(family="llama", vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                 head_dim=128, intermediate_size=14336, rms_eps=1e-5, tie_embeddings=False)
TINY = dict(family="llama", vocab_size=512, hidden_size=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
            intermediate_size=512, rms_eps=1e-5, tie_embeddings=False)


def default_rope_tables(n_positions: int, head_dim: int, theta: float = 500000.0):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    f = torch.arange(n_positions, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().float(), emb.sin().float()


def random_decoder(dims: dict, linears: str = "bf16", device="cuda", dtype=torch.bfloat16, group_size: int = 128,
                   symmetric: bool = True, lm_head: str = "bf16", embed: str = "bf16", max_seq_len: int = 4096,
                   kernels: str = "auto", seed: int = 0, fused: Optional[bool] = None):
    """A runtime Transformer of the given shape with random weights made directly on ``device``.

    linears: "bf16" (nn.Linear in ``dtype``), "int4" (QuantLinear, g``group_size``), "fp8" (Fp8Linear, dynamic
    per-token activations) or "fp8-static" (Fp8Linear, per-tensor weight and a static activation scale of 8 / 448:
    the RMS-normalized unit-variance inputs of this random model stay inside the e4m3 range). lm_head: "bf16" or "int4"; embed: "bf16" or "int4" (QuantEmbedding).
    Fused qkv / gate-up weights are made fused (one [N_q+2N_kv, H] and one [2I, H] weight per layer).
    fused: as ``Transformer.from_spec``'s (None: on for INT4 linears where the CUDA kernel is built): the random
    gate/up weight is then read as interleaved (``Block.gate_up_block``).
    """
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    from sdquant.runtime.model import Attention, Block, QuantEmbedding, Transformer, _prepare
    from sdquant.runtime.spec import DecoderDims
    d = DecoderDims(**dims, sliding_window=[None] * dims["n_layers"], max_position_embeddings=max_seq_len)
    g = torch.Generator(device=device).manual_seed(seed)

    def linear(n, k, kind):
        if kind == "int4":
            m = QuantLinear(random_int_weight(n, k, 4, group_size, symmetric, device, g))
        elif kind in ("fp8", "fp8-static"):
            m = Fp8Linear(random_fp8_weight(n, k, device, g, 8.0 / 448 if kind == "fp8-static" else None))
        else:
            m = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
            with torch.no_grad():
                m.weight.normal_(0, 0.02, generator=g)
            m.weight.requires_grad_(False)
        _prepare(m, device, dtype, kernels)
        return m

    ones = lambda n: torch.ones(n, device=device, dtype=dtype)  # noqa: E731
    blocks = []
    h, i = d.hidden_size, d.intermediate_size
    for _ in range(d.n_layers):
        attn = Attention(d, linear(d.q_size + 2 * d.kv_size, h, linears), linear(h, d.q_size, linears))
        blocks.append(Block(d, attn, linear(2 * i, h, linears), linear(h, i, linears), ones(h), ones(h), None))
    if embed == "int4":
        emb = QuantEmbedding(random_int_weight(d.vocab_size, h, 4, group_size, symmetric, device, g), dtype)
    else:
        emb = (torch.randn(d.vocab_size, h, device=device, generator=g) * 0.02).to(dtype)
    head = linear(d.vocab_size, h, "int4" if lm_head == "int4" else "bf16")
    cos, sin = default_rope_tables(max_seq_len, d.head_dim)
    rt = Transformer(d, emb, blocks, ones(h), head, cos.to(device, dtype), sin.to(device, dtype)).eval()
    if fused is None:
        fused = torch.device(device).type == "cuda" and linears == "int4"
        if fused:
            from sdquant.kernels import int4_cuda
            fused = int4_cuda.available()
    if fused and linears == "int4" and i % 64 == 0:
        from sdquant.kernels.int4_cuda import FUSED_BLOCK
        for blk in rt.layers:
            blk.gate_up_block = FUSED_BLOCK
        rt.fused_decode = True
    return rt


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the canonical weights a model holds (its state_dict: parameters and persistent buffers).
    Kernel layouts built by ``prepare``, KV caches and RoPE tables are non-persistent and not counted."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
