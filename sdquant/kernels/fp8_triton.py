"""Triton kernels for W8A8 e4m3 linears (Hopper first, any Triton GPU with fp8 dot).

Three kernels, each a plain Python function turned into a Triton kernel on first use:

* ``_quant_act_kernel``  x [M, K] (fp16/bf16/fp32) -> e4m3 [M, K] + fp32 scale [M]: one program per token;
  rows up to 32768 wide are held in registers (one read of x), wider ones take an absmax pass and a
  quantize pass. An unfolded AWQ/SmoothQuant
  ``smooth`` [K] is divided out in the same pass, so the layer needs no separate elementwise kernel.
* ``_gemm_swapab_kernel`` the decode GEMM. At small M the token count is far too small for a tensor-core
  tile, so the kernel computes the transposed product out^T [N, M] = W [N, K] @ xq^T [K, M]: the weight rows
  fill the wide side of the MMA (64/128), the few tokens the narrow side (16..64). Both operands are K-major
  (W is stored [N, K] row-major, xq [M, K] row-major), which is what the fp8 tensor-core instructions want,
  so the canonical weight needs no repacking at all. Split-K spreads a K >> N layer (14336 -> 4096) over all
  SMs; each split writes an fp32 partial [M, N] and ``_splitk_reduce_kernel`` sums them and applies
  the per-token x per-channel scales and the bias.
* the large-M path is cuBLASLt (``torch._scaled_mm`` rowwise, see ops.py): it reaches the tensor-core peak there.

Every launcher takes CPU tensors too when Triton's interpreter is on (TRITON_INTERPRET=1 set before triton is
imported; the CI tests do this in a child process so that nothing leaks into other tests). Triton's interpreter rounds fp32 -> e4m3 wrongly for
some values (seen with triton 3.9: -124.8 -> -64, and ties away from even), so on CPU the quantize kernel
writes its scaled, clamped values in fp32 (``out_fp32``) and torch performs the e4m3 cast (round to nearest
even, like the GPU's cvt.rn.satfinite). On the GPU the kernel casts itself.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from sdquant.errors import ShapeError
from sdquant.quant.qtensor import FP8_MAX

try:  # Triton is an optional (dev / GPU) dependency; importing sdquant must not need it
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is absent
    class tl:  # noqa: N801  (lets the kernel signatures below be defined; they are never launched)
        constexpr = None
    triton = None
    HAVE_TRITON = False


def available() -> bool:
    return HAVE_TRITON


def _jit(fn):
    return triton.jit(fn) if HAVE_TRITON else fn


def _interpreting() -> bool:
    # triton decides at decoration time (import) whether @jit functions are interpreted
    return HAVE_TRITON and bool(triton.knobs.runtime.interpret)


# ------------------------------------------------------------------------------------------------ kernels
@_jit
def _quant_act_kernel(x_ptr, smooth_ptr, in_scale_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                      HAS_SMOOTH: tl.constexpr, STATIC: tl.constexpr, OUT_FP32: tl.constexpr,
                      BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    if ONE_PASS:  # the whole row fits in registers (BLOCK_K >= K): one read of x, no second round trip
        offs = tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        if HAS_SMOOTH:  # divided in fp32 (the eager path rounds x / smooth to x.dtype first)
            x = tl.math.div_rn(x, tl.load(smooth_ptr + offs, mask=offs < K, other=1.0).to(tl.float32))
        if STATIC:
            scale = tl.load(in_scale_ptr).to(tl.float32)
        else:
            scale = tl.maximum(tl.max(tl.abs(x), 0) / 448.0, 1e-12)
            tl.store(s_ptr + row, scale)
        v = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
        if OUT_FP32:
            tl.store(q_row + offs, v, mask=offs < K)
        else:
            tl.store(q_row + offs, v.to(tl.float8e4nv), mask=offs < K)
    else:
        if STATIC:
            scale = tl.load(in_scale_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                if HAS_SMOOTH:
                    x = tl.math.div_rn(x, tl.load(smooth_ptr + offs, mask=offs < K, other=1.0).to(tl.float32))
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
            tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            if HAS_SMOOTH:
                x = tl.math.div_rn(x, tl.load(smooth_ptr + offs, mask=offs < K, other=1.0).to(tl.float32))
            v = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
            if OUT_FP32:
                tl.store(q_row + offs, v, mask=offs < K)
            else:
                tl.store(q_row + offs, v.to(tl.float8e4nv), mask=offs < K)


@_jit
def _gemm_swapab_kernel(w_ptr, x_ptr, ws_ptr, xs_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
                        stride_wn, stride_xm, stride_om,
                        XS_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                        EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)          # weight rows = output features
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # tokens
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_begin = pid_k * k_per_split
    w_base = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn   # [BN, 1]
    x_base = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm   # [1, BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)        # out^T tile
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_base + offs_k[None, :], mask=n_ok[:, None], other=0.0)                 # [BN, BK]
            xt = tl.load(x_base + offs_k[:, None], mask=m_ok[None, :], other=0.0)                # [BK, BM]
        else:
            k_ok = offs_k < K
            w = tl.load(w_base + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_base + offs_k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, xt, acc)
    if SPLIT_K == 1:
        ws = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        if XS_PER_ROW:
            xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
            y = acc * ws[:, None] * xs[None, :]
        else:
            y = acc * (ws * tl.load(xs_ptr))[:, None]
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        o_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
    else:  # fp32 partial for this K slice: part [SPLIT_K, M, N]
        p_ptrs = part_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=n_ok[:, None] & m_ok[None, :])


@_jit
def _splitk_reduce_kernel(part_ptr, ws_ptr, xs_ptr, bias_ptr, out_ptr, M, N, stride_om,
                          XS_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                          BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    m = offs // N
    n = offs % N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    y = acc * tl.load(ws_ptr + n, mask=ok, other=0.0)
    if XS_PER_ROW:
        y = y * tl.load(xs_ptr + m, mask=ok, other=0.0)
    else:
        y = y * tl.load(xs_ptr)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + n, y.to(out_ptr.dtype.element_ty), mask=ok)


def _kernel(fn, interpret: bool):
    """The Triton kernel ``fn``; CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before import)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed: the sdquant Triton kernels are unavailable")
    if interpret and not _interpreting():
        raise RuntimeError("sdquant Triton kernels got CPU tensors: run on a GPU, or set TRITON_INTERPRET=1 "
                           "before triton is first imported to run them in Triton's interpreter")
    return fn


# ---------------------------------------------------------------------------------------------- launchers
def quant_launch(k: int, interpret: bool = False) -> tuple:
    """(BLOCK_K, num_warps) of the quantize kernel for rows of k. Rows up to 8192 wide stay in registers: one pass
    over x. Wider rows take two passes of 2048 / 4096-wide blocks at 16 warps (the second read hits L2):
    bench/fp8_quant_sweep.py on the H200 (2026-12-01) measured K = 14336 at 61.2 / 16.5 / 3.8 us (M = 4096 / 1024 /
    16) against 81.8 / 22.2 / 5.0 for one 16384-wide pass, and K = 28672 at 113.8 / 34.8 / 5.5 against 199.5 /
    55.6 / 6.8 (identical outputs); K <= 8192 was fastest in one pass. The interpreter (CPU) uses one pass up to
    2048 and two above, so the tests exercise both paths."""
    if interpret:
        return min(triton.next_power_of_2(k), 2048), 4
    if k <= 8192:
        block = triton.next_power_of_2(k)
        return block, 4 if block <= 2048 else 8
    return (2048 if k < 16384 else 4096), 16


def quantize_act(x: torch.Tensor, smooth: Optional[torch.Tensor] = None,
                 input_scale: Optional[torch.Tensor] = None, out_fp32: Optional[bool] = None,
                 cast: bool = True, launch: Optional[tuple] = None):
    """x [M, K] -> (xq e4m3 [M, K], scale fp32 [M] (dynamic) or the static scalar). Equals
    ``ops.quantize_fp8_per_token`` / ``quantize_fp8_static`` applied to ``x.float() / smooth.float()``.

    ``out_fp32`` (default: on CPU) makes the kernel write the scaled, clamped values in fp32; torch then does
    the e4m3 cast (see the module docstring for why), or, with ``cast=False``, they are returned as they are
    (the tests check that stage on its own). ``launch`` = (block_k, num_warps) overrides the launch heuristic
    (bench/fp8_quant_sweep.py; block_k < K means two passes over the row)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ShapeError(f"quantize_act: x must be a 2-D row-contiguous tensor, got {list(x.shape)}")
    m, k = x.shape
    interpret = x.device.type == "cpu"
    if out_fp32 is None:
        out_fp32 = interpret
    q = torch.empty((m, k), device=x.device, dtype=torch.float32 if out_fp32 else torch.float8_e4m3fn)
    static = input_scale is not None
    s = input_scale.float().reshape(()) if static else torch.empty((m,), device=x.device, dtype=torch.float32)
    if m == 0:
        return q.to(torch.float8_e4m3fn), s
    block, warps = quant_launch(k, interpret) if launch is None else (min(int(launch[0]), triton.next_power_of_2(k)),
                                                                       int(launch[1]))
    kw = {} if interpret else {"num_warps": warps}
    one_pass = block >= k
    _kernel(_quant_act_kernel, interpret)[(m,)](
        x, smooth if smooth is not None else x, s if static else x, q, s, k, x.stride(0), q.stride(0),
        HAS_SMOOTH=smooth is not None, STATIC=static, OUT_FP32=out_fp32, BLOCK_K=block, ONE_PASS=one_pass,
        **kw)
    if out_fp32 and cast:
        q = q.to(torch.float8_e4m3fn)  # round to nearest even, saturated by the clamp above
    return q, s


@dataclass(frozen=True)
class GemmConfig:
    """Tile configuration of the swap-AB kernel. ``split_k`` K slices each produce an fp32 partial."""
    block_n: int = 64
    block_m: int = 16
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def as_list(self) -> list:
        return [self.block_n, self.block_m, self.block_k, self.split_k, self.num_warps, self.num_stages]

    @classmethod
    def from_list(cls, v) -> "GemmConfig":
        return cls(*[int(t) for t in v])


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> GemmConfig:
    """Heuristic tiles when the crossover table has none for this shape: enough programs for ~2 waves."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 32 else 128
    block_k = 256 if k % 256 == 0 else 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m) if HAVE_TRITON else 1
    split = 1
    while tiles * split < 2 * num_sms and k // (block_k * split * 2) >= 4:
        split *= 2
    return GemmConfig(block_n, block_m, block_k, split, 4, 4)


def check_gemm_shape(n: int, k: int) -> None:
    # 16-byte aligned rows keep the fp8 loads vectorised; _scaled_mm has the same rule
    if k % 16 or n % 16:
        raise ShapeError(f"fp8 kernels need in_features and out_features divisible by 16, got K={k}, N={n}")


def gemm_swapab(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                config: Optional[GemmConfig] = None) -> torch.Tensor:
    """out [M, N] = (xq [M, K] @ weight [N, K]^T) * xs * weight_scale + bias, fp32 accumulation.
    ``xs`` is fp32 [M] (per token) or a scalar (static)."""
    m, k = xq.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ShapeError(f"fp8 gemm: x has K={k} but weight is {list(weight.shape)}")
    check_gemm_shape(n, k)
    interpret = xq.device.type == "cpu"
    cfg = config or default_config(m, n, k)
    out = torch.empty((m, n), device=xq.device, dtype=out_dtype)
    if m == 0:
        return out
    # K slice per split: a whole number of BLOCK_K steps, so only the last slice can run past K
    steps = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, steps))
    k_per_split = triton.cdiv(steps, split) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    even_k = k % cfg.block_k == 0 and k_per_split * split == k
    part = torch.empty((split, m, n), device=xq.device, dtype=torch.float32) if split > 1 else out
    per_row = xs.numel() > 1 or xs.dim() == 1
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    kw = {} if interpret else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _kernel(_gemm_swapab_kernel, interpret)[grid](
        weight, xq, weight_scale, xs, bias if bias is not None else weight_scale, out, part, m, n, k,
        k_per_split, weight.stride(0), xq.stride(0), out.stride(0),
        XS_PER_ROW=per_row, HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_K=even_k,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, **kw)
    if split > 1:
        block = 1024
        kw = {} if interpret else {"num_warps": 4}
        _kernel(_splitk_reduce_kernel, interpret)[(triton.cdiv(m * n, block),)](
            part, weight_scale, xs, bias if bias is not None else weight_scale, out, m, n, out.stride(0),
            XS_PER_ROW=per_row, HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=block, **kw)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               smooth: Optional[torch.Tensor] = None, config: Optional[GemmConfig] = None) -> torch.Tensor:
    """The whole W8A8 layer through Triton: quantize (fused smoothing) then the swap-AB GEMM.
    x [..., K] -> [..., N] in x.dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xq, xs = quantize_act(x2, smooth, input_scale)
    y = gemm_swapab(xq, xs, weight, weight_scale, bias, x.dtype, config)
    return y.reshape(*x.shape[:-1], weight.shape[0])


__all__ = ["available", "quantize_act", "gemm_swapab", "fp8_linear", "GemmConfig", "default_config",
           "check_gemm_shape", "FP8_MAX"]
