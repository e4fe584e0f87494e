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
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


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


# ------------------------------------------------------------------------------------------------------
# Device ops chosen by QuantLinear/Fp8Linear.prepare (issue 4). Each takes the same canonical tensors as the
# reference ops plus, for FP8, the unfolded ``smooth`` [K], which the activation-quantization kernel divides
# out in the same pass. Triton is imported lazily: ``import sdquant`` must not need it.
def _quantize_act(x2: torch.Tensor, smooth: Optional[torch.Tensor], input_scale: Optional[torch.Tensor]):
    """x2 [M, K] -> (e4m3 [M, K], fp32 scale [M] or scalar): Triton on a GPU, PyTorch elsewhere."""
    if x2.is_cuda:
        from sdquant.kernels import fp8_triton
        if fp8_triton.available():
            return fp8_triton.quantize_act(x2, smooth, input_scale)
    return quantize_act_torch(x2, smooth, input_scale)


def quantize_act_torch(x2: torch.Tensor, smooth: Optional[torch.Tensor], input_scale: Optional[torch.Tensor]):
    """``_quantize_act``'s maths as plain torch ops (x2 [M, K] -> e4m3 [M, K], fp32 scale [M] or scalar).
    Fp8Linear uses it under torch.compile, where inductor fuses it into the kernel that produced x (the
    residual-add + RMSNorm before qkv and gate/up, the SiLU·up before down): no separate quantize launch."""
    xf = x2.float() if smooth is None else x2.float() / smooth.float()
    if input_scale is None:
        xq, xs = quantize_fp8_per_token(xf)
        return xq, xs.reshape(-1)
    return quantize_fp8_static(xf, input_scale), input_scale.float().reshape(())


@torch.library.custom_op("sdquant::fp8_gemm_triton", mutates_args=())
def fp8_gemm_triton(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: Optional[torch.Tensor], out_dtype: torch.dtype, config: list[int]) -> torch.Tensor:
    """out [M, N] = (xq [M, K] e4m3 @ weight [N, K]^T) * xs * weight_scale + bias in ``out_dtype``: the GEMM of
    ``fp8_linear_triton`` on activations quantized elsewhere (``xs`` fp32 [M] per token, or a scalar)."""
    from sdquant.kernels import fp8_triton
    cfg = fp8_triton.GemmConfig.from_list(config) if config else None
    return fp8_triton.gemm_swapab(xq, xs, weight, weight_scale, bias, out_dtype, cfg)


@fp8_gemm_triton.register_fake
def _(xq, xs, weight, weight_scale, bias, out_dtype, config):
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("sdquant::fp8_gemm_scaled_mm", mutates_args=())
def fp8_gemm_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: Optional[torch.Tensor], out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``fp8_linear_scaled_mm``'s GEMM (``torch._scaled_mm``, rowwise scales; tensorwise when ``xs`` is a scalar and
    ``weight_scale`` has one element) on pre-quantized activations."""
    m = xq.shape[0]
    if m == 0:
        return xq.new_empty((0, weight.shape[0]), dtype=out_dtype)
    return _scaled_mm_fp8(xq, xs, weight, weight_scale, bias, out_dtype, fast_accum)


@fp8_gemm_scaled_mm.register_fake
def _(xq, xs, weight, weight_scale, bias, out_dtype, fast_accum=False):
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)


def _scaled_mm_fp8(xq, xs, weight, weight_scale, bias, out_dtype, fast_accum: bool = False):
    """fast_accum: cuBLASLt's ``use_fast_accum`` (the FP8 tensor-core accumulator is not periodically promoted to
    fp32: faster at large M, less accurate; Fp8Linear.fast_accum). A scalar ``xs`` (static activation scale) with a
    one-element ``weight_scale`` (a per-tensor weight, as Fp8Linear passes it) runs cuBLASLt's tensorwise kernel,
    bias fused, in the output dtype; anything else the rowwise one."""
    m = xq.shape[0]
    if xs.dim() == 0 and weight_scale.numel() == 1 and out_dtype in (torch.bfloat16, torch.float16):
        return torch._scaled_mm(xq, weight.t(), scale_a=xs.float(), scale_b=weight_scale.float().reshape(()),
                                bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype,
                                use_fast_accum=bool(fast_accum))
    scale_a = xs.reshape(-1, 1) if xs.dim() == 1 else xs.reshape(1, 1).expand(m, 1).contiguous()
    # cuBLASLt rowwise scaling writes bf16 only (torch 2.4-2.11); the CPU kernel writes any float type
    mm_dtype = torch.bfloat16 if xq.is_cuda else out_dtype
    y = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=weight_scale.float().reshape(1, -1),
                         out_dtype=mm_dtype, use_fast_accum=bool(fast_accum))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(out_dtype)


@torch.library.custom_op("sdquant::fp8_linear_triton", mutates_args=())
def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      input_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                      smooth: Optional[torch.Tensor], config: list[int]) -> torch.Tensor:
    """W8A8 through sdquant's Triton kernels (fused quantize, swap-AB split-K GEMM). ``config`` is a
    GemmConfig list [block_n, block_m, block_k, split_k, num_warps, num_stages] or [] for the heuristic.
    CPU tensors run in Triton's interpreter (TRITON_INTERPRET=1)."""
    from sdquant.kernels import fp8_triton
    cfg = fp8_triton.GemmConfig.from_list(config) if config else None
    return fp8_triton.fp8_linear(x, weight, weight_scale, input_scale, bias, smooth, cfg)


@fp8_linear_triton.register_fake
def _(x, weight, weight_scale, input_scale, bias, smooth, config):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("sdquant::fp8_linear_scaled_mm", mutates_args=())
def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                         smooth: Optional[torch.Tensor], fast_accum: bool = False) -> torch.Tensor:
    """W8A8 through ``torch._scaled_mm`` with rowwise scales (cuBLASLt on the GPU): per-token scale_a [M, 1],
    per-channel scale_b [1, N]; tensorwise (both scalars) for a static activation scale with a one-element
    ``weight_scale``. weight [N, K] row-major is exactly the column-major [K, N] operand it wants, so
    ``weight.t()`` is a view, no copy."""
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], n))
    xq, xs = _quantize_act(x2.contiguous(), smooth, input_scale)
    return _scaled_mm_fp8(xq, xs, weight, weight_scale, bias, x.dtype, fast_accum).reshape(*x.shape[:-1], n)


@fp8_linear_scaled_mm.register_fake
def _(x, weight, weight_scale, input_scale, bias, smooth, fast_accum=False):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("sdquant::fp8_linear_dequant", mutates_args=())
def fp8_linear_dequant(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       input_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                       smooth: Optional[torch.Tensor]) -> torch.Tensor:
    """The same W8A8 function through a plain 16-bit GEMM: e4m3 values are exact in bf16 (3 of its 7 mantissa
    bits), so bf16(xq) @ bf16(W)^T with fp32 accumulation sums the same products as the fp8 GEMM; the scales
    are applied afterwards. The fallback wherever no fp8 GEMM runs (pre-Hopper GPUs, odd shapes)."""
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    xq, xs = _quantize_act(x2.contiguous(), smooth, input_scale)
    mm_dtype = torch.bfloat16 if x.is_cuda else torch.float32
    acc = torch.nn.functional.linear(xq.to(mm_dtype), weight.to(mm_dtype)).float()  # [M, N]
    y = acc * (xs.reshape(-1, 1) if xs.dim() == 1 else xs) * weight_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


@fp8_linear_dequant.register_fake
def _(x, weight, weight_scale, input_scale, bias, smooth):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("sdquant::int_linear_dequant", mutates_args=())
def int_linear_dequant(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                       g_idx: Optional[torch.Tensor], bias: Optional[torch.Tensor], bits: int, group_size: int,
                       in_features: int) -> torch.Tensor:
    """Dequantize+cuBLAS: W written once as a dense x.dtype matrix by a Triton kernel, then F.linear.
    Same schema as ``int_linear``; where Triton cannot run it dequantizes with the reference code."""
    from sdquant.kernels import dequant_triton
    qw = QuantizedWeight(qweight, scales, zeros, bits, group_size, in_features, g_idx)
    return dequant_triton.dequant_linear(x, qw, bias)


@int_linear_dequant.register_fake
def _(x, qweight, scales, zeros, g_idx, bias, bits, group_size, in_features):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))
