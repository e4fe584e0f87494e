"""Runs sdquant's Triton kernels in Triton's interpreter on CPU tensors and prints one JSON report.

Started by test_fp8_triton.py in a child process with TRITON_INTERPRET=1 (triton reads it when a kernel is
decorated, i.e. at import), so the setting never leaks into the pytest process. Each check records the
measured error; the test asserts the bounds. Not collected by pytest (no test_ prefix).
"""
import json
import math
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

from sdquant.errors import ShapeError  # noqa: E402
from sdquant.kernels import dequant_triton, fp8_triton  # noqa: E402
from sdquant.kernels.linear import Fp8Linear  # noqa: E402
from sdquant.kernels.ops import quantize_fp8_per_token, quantize_fp8_static  # noqa: E402
from sdquant.quant.qtensor import QuantizedWeight, quantize_fp8_weight  # noqa: E402

MS = (1, 3, 16, 33)
out = {"quant": [], "gemm": [], "op": [], "dequant": [], "errors": [], "opcheck": [], "int4_adapter": []}
g = torch.Generator().manual_seed(0)


def rel(y, ref):
    return float((y.double() - ref.double()).norm() / ref.double().norm())


# 1. quantize stage: scaled+clamped fp32 values and scales must equal torch's exactly ---------------------
for k in (256, 4096, 1040):
    for m in MS:
        for smooth_on in (False, True):
            for static in (False, True):
                x = torch.randn(m, k, generator=g).to(torch.bfloat16) * 3
                smooth = torch.rand(k, generator=g) + 0.5 if smooth_on else None
                xf = x.float() / smooth if smooth_on else x.float()
                isc = (xf.abs().amax() / 300.0).reshape(()) if static else None
                v, s = fp8_triton.quantize_act(x, smooth, isc, out_fp32=True, cast=False)
                if static:
                    ref_v, ref_s = (xf / isc).clamp(-448, 448), isc
                else:
                    ref_s = (xf.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
                    ref_v = (xf / ref_s).clamp(-448, 448)
                q, _ = fp8_triton.quantize_act(x, smooth, isc)
                ref_q = quantize_fp8_static(xf, isc) if static else quantize_fp8_per_token(xf)[0]
                out["quant"].append({"k": k, "m": m, "smooth": smooth_on, "static": static,
                                     "max_abs_v": float((v - ref_v).abs().max()),
                                     "max_abs_s": float((s.reshape(-1) - ref_s.reshape(-1)).abs().max()),
                                     "codes_equal": bool(torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)))})

# 2. swap-AB GEMM (+ split-K reduce) against fp64, fp32 and bf16 outputs ----------------------------------
cfgs = [fp8_triton.GemmConfig(32, 16, 64, 1), fp8_triton.GemmConfig(64, 16, 64, 3),
        fp8_triton.GemmConfig(16, 32, 32, 2), fp8_triton.GemmConfig(64, 64, 128, 4), None]
for (k, n) in ((256, 96), (272, 48), (14336, 32), (4096, 64)):
    fw = quantize_fp8_weight(torch.randn(n, k, generator=g) / math.sqrt(k))
    bias = torch.randn(n, generator=g)
    for m in MS:
        if k >= 4096 and m not in (3, 33):
            continue
        x = torch.randn(m, k, generator=g)
        xq, xs = quantize_fp8_per_token(x)
        ref = (xq.double() @ fw.weight.double().t()) * xs.double() * fw.weight_scale.double() + bias.double()
        for cfg in (cfgs if k < 4096 else cfgs[3:]):
            for dt in (torch.float32, torch.bfloat16):
                y = fp8_triton.gemm_swapab(xq, xs.reshape(-1), fw.weight, fw.weight_scale, bias.to(dt), dt, cfg)
                out["gemm"].append({"k": k, "n": n, "m": m, "cfg": cfg.as_list() if cfg else None,
                                    "dtype": str(dt), "rel": rel(y, ref), "finite": bool(torch.isfinite(y).all())})
        # static (scalar) activation scale
        isc = (x.abs().amax() / 448.0).reshape(())
        xq2 = quantize_fp8_static(x, isc)
        ref2 = (xq2.double() @ fw.weight.double().t()) * isc.double() * fw.weight_scale.double()
        y2 = fp8_triton.gemm_swapab(xq2, isc, fw.weight, fw.weight_scale, None, torch.float32,
                                    fp8_triton.GemmConfig(32, 16, 64, 2))
        out["gemm"].append({"k": k, "n": n, "m": m, "cfg": "static", "dtype": "torch.float32", "rel": rel(y2, ref2),
                            "finite": True})

# 3. the whole layer through the registered op and Fp8Linear.prepare(kernels="triton") ------------------
for m in MS:
    k, n = 512, 80
    fw = quantize_fp8_weight(torch.randn(n, k, generator=g) / math.sqrt(k))
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    smooth = torch.rand(k, generator=g) + 0.5
    layer = Fp8Linear(fw, bias, smooth).prepare("cpu", torch.bfloat16, kernels="triton")
    x = torch.randn(2, m, k, generator=g).to(torch.bfloat16)
    xq, xs = quantize_fp8_per_token(x.float().reshape(-1, k) / smooth)
    ref = (xq.double() @ fw.weight.double().t()) * xs.double() * fw.weight_scale.double() + bias.double()
    y = layer(x)
    out["op"].append({"m": m, "kernel": layer.kernel, "shape": list(y.shape), "rel": rel(y.reshape(-1, n), ref)})

# opcheck of the Triton op itself (schema, fake tensor, AOT dispatch); test_schema cannot run on fp8 inputs
# on CPU (see test_ops.py)
x = torch.randn(3, 64, generator=g)
fw = quantize_fp8_weight(torch.randn(32, 64, generator=g) / 8)
for isc, cfg in ((None, []), (torch.tensor(0.02), [32, 16, 32, 2, 4, 4])):
    torch.library.opcheck(torch.ops.sdquant.fp8_linear_triton,
                          (x, fw.weight, fw.weight_scale, isc, torch.randn(32, generator=g), None, cfg),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    out["opcheck"].append("fp8_linear_triton ok" + (" static" if isc is not None else ""))
    # the GEMM alone on activations quantized by torch (Fp8Linear's path under torch.compile)
    from sdquant.kernels.ops import quantize_act_torch
    b32 = torch.randn(32, generator=g)
    xq, xs = quantize_act_torch(x, None, isc)
    args = (xq, xs, fw.weight, fw.weight_scale, b32, torch.float32, cfg)
    torch.library.opcheck(torch.ops.sdquant.fp8_gemm_triton, args,
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    ref = torch.ops.sdquant.fp8_linear(x, fw.weight, fw.weight_scale, isc, b32)
    out["opcheck"].append(f"fp8_gemm_triton ok rel={rel(torch.ops.sdquant.fp8_gemm_triton(*args), ref):.1e}")

# the dispatch adapter over the int4 helper's Triton op (argument names read from its schema)
try:
    from sdquant.kernels import int4_triton  # noqa: F401
    have_int4 = hasattr(torch.ops.sdquant, "w4a16_triton")
except ImportError:
    have_int4 = False
if have_int4:
    from sdquant.kernels.linear import QuantLinear
    from sdquant.quant.qtensor import compute_qparams, quantize_codes
    n, k, gs = 64, 256, 64
    w = torch.randn(n, k, generator=g)
    sc, z = compute_qparams(w, 4, gs, False)
    qw = QuantizedWeight.from_codes(quantize_codes(w, sc, z, 4, gs), sc, z, 4, gs)
    bias = torch.randn(n, generator=g)
    for m in (1, 33):
        layer = QuantLinear(qw, bias).prepare("cpu", torch.bfloat16, kernels="triton")
        xx = torch.randn(m, k, generator=g).to(torch.bfloat16)
        ref = xx.double() @ qw.dequantize(torch.float64).t() + bias.double()
        out["int4_adapter"].append({"m": m, "kernel": layer.kernel, "rel": rel(layer(xx), ref),
                                    "buffers": sorted(b for b, _ in layer.named_buffers() if b.startswith("_triton"))})

try:
    fp8_triton.gemm_swapab(torch.zeros(1, 40, dtype=torch.float8_e4m3fn), torch.ones(1),
                           torch.zeros(32, 40, dtype=torch.float8_e4m3fn), torch.ones(32), None, torch.float32)
    out["errors"].append("no error for K=40")
except ShapeError as e:
    out["errors"].append("ShapeError: " + str(e))

# 4. integer dequantization kernel: exact against QuantizedWeight.dequantize ------------------------------
for bits in (2, 4, 8):
    for gs in (32, 128, -1):
        for sym in (True, False):
            for act_order in (False, True):
                n, k = 48, 256
                codes = torch.randint(0, 1 << bits, (n, k), generator=g)
                ng = 1 if gs == -1 else k // gs
                scales = torch.rand(n, ng, generator=g) + 0.01
                zeros = None if sym else torch.randint(0, 1 << bits, (n, ng), generator=g)
                g_idx = torch.randperm(k, generator=g) % ng if act_order else None
                qw = QuantizedWeight.from_codes(codes, scales, zeros, bits, gs, g_idx)
                w = dequant_triton.dequantize(qw, torch.float32)
                out["dequant"].append({"bits": bits, "gs": gs, "sym": sym, "act_order": act_order,
                                       "max_abs": float((w - qw.dequantize(torch.float32)).abs().max())})

json.dump(out, sys.stdout)
