"""torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) of sdquant's linear ops
on CPU tensors."""
import math

import pytest
import torch

import sdquant.kernels.ops
from sdquant.quant.qtensor import QuantizedWeight, compute_qparams, quantize_codes, quantize_fp8_weight


def _int_args(sym: bool, act_order: bool, bias: bool):
    g = torch.Generator().manual_seed(0)
    n, k, gs = 24, 64, 16
    w = torch.randn(n, k, generator=g)
    s, z = compute_qparams(w, 4, gs, sym)
    g_idx = (torch.randperm(k, generator=g) % (k // gs)).to(torch.int32) if act_order else None
    qw = QuantizedWeight.from_codes(quantize_codes(w, s, z, 4, gs, g_idx), s, z, 4, gs, g_idx)
    x = torch.randn(3, 5, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return (x, qw.qweight, qw.scales, qw.zeros, qw.g_idx, b, 4, gs, k)


def _fp8_args(static: bool, bias: bool):
    g = torch.Generator().manual_seed(1)
    n, k = 32, 64
    x = torch.randn(2, 3, k, generator=g)
    fw = quantize_fp8_weight(torch.randn(n, k, generator=g) / math.sqrt(k),
                             (x.abs().amax() / 448).reshape(()) if static else None)
    return (x, fw.weight, fw.weight_scale, fw.input_scale, torch.randn(n, generator=g) if bias else None)


@pytest.mark.parametrize("sym,act_order,bias", [(True, False, False), (False, True, True)])
@pytest.mark.parametrize("op", ["int_linear", "int_linear_dequant"])
def test_opcheck_int(op, sym, act_order, bias):
    torch.library.opcheck(getattr(torch.ops.sdquant, op), _int_args(sym, act_order, bias))


# opcheck's test_schema compares inputs before and after the call with arithmetic that torch has no CPU
# kernel for on float8_e4m3fn ("mul_cpu_reduced_float" not implemented); the other checks run, and
# _check_no_mutation covers what test_schema would have checked (the op leaves its inputs untouched).
FP8_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def _check_no_mutation(op, args):
    before = [a.view(torch.uint8).clone() if isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn
              else a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    op(*args)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a, b)


@pytest.mark.parametrize("static,bias", [(False, False), (True, True)])
def test_opcheck_fp8(static, bias):
    args = _fp8_args(static, bias)
    torch.library.opcheck(torch.ops.sdquant.fp8_linear, args, test_utils=FP8_UTILS)
    _check_no_mutation(torch.ops.sdquant.fp8_linear, args)


@pytest.mark.parametrize("op", ["fp8_linear_scaled_mm", "fp8_linear_dequant"])
@pytest.mark.parametrize("static,smooth", [(False, False), (True, True)])
def test_opcheck_fp8_device_paths(op, static, smooth):
    args = _fp8_args(static, True)
    sm = torch.rand(args[0].shape[-1]) + 0.5 if smooth else None
    torch.library.opcheck(getattr(torch.ops.sdquant, op), (*args, sm), test_utils=FP8_UTILS)
    _check_no_mutation(getattr(torch.ops.sdquant, op), (*args, sm))


@pytest.mark.parametrize("op", ["fp8_linear_scaled_mm", "fp8_linear_dequant"])
def test_fp8_device_paths_match_reference_on_cpu(op):
    x, w, ws, isc, b = _fp8_args(False, True)
    sm = torch.rand(x.shape[-1]) + 0.5
    ref = torch.ops.sdquant.fp8_linear(x / sm, w, ws, isc, b)
    y = getattr(torch.ops.sdquant, op)(x, w, ws, isc, b, sm)
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert float((y - ref).norm() / ref.norm()) < 1e-5


def test_int_dequant_op_matches_reference():
    args = _int_args(False, True, True)
    torch.testing.assert_close(torch.ops.sdquant.int_linear_dequant(*args), torch.ops.sdquant.int_linear(*args))


@pytest.mark.parametrize("static", [False, True])
def test_opcheck_fp8_gemm_on_prequantized_activations(static):
    x, w, ws, isc, b = _fp8_args(static, True)
    xq, xs = sdquant.kernels.ops.quantize_act_torch(x.reshape(-1, x.shape[-1]), None, isc)
    args = (xq, xs, w, ws, b, torch.float32)
    torch.library.opcheck(torch.ops.sdquant.fp8_gemm_scaled_mm, args, test_utils=FP8_UTILS)
    _check_no_mutation(torch.ops.sdquant.fp8_gemm_scaled_mm, args)
    ref = torch.ops.sdquant.fp8_linear(x, w, ws, isc, b).reshape(-1, w.shape[0])
    torch.testing.assert_close(torch.ops.sdquant.fp8_gemm_scaled_mm(*args), ref, rtol=1e-5, atol=1e-5)


def _graph_ops(layer, x):
    """Compile ``layer`` (fullgraph, aot_eager) and return the sdquant ops in its FX graph and its output."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "sdquant" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    y = torch.compile(layer, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    return seen, y


@pytest.mark.parametrize("smooth", [False, True])
def test_compiled_fp8_linear_quantizes_outside_the_op(smooth, monkeypatch):
    """Under torch.compile, Fp8Linear leaves the activation quantization to plain torch ops (which inductor fuses
    into the producer) and calls only the GEMM op; eager calls and fuse_act_quant=False keep the whole-layer op.
    Both give the same numbers."""
    from sdquant.kernels.linear import Fp8Linear
    from sdquant.quant.qtensor import Fp8Weight
    x, w, ws, isc, b = _fp8_args(False, True)
    sm = torch.rand(x.shape[-1], generator=torch.Generator().manual_seed(3)) + 0.5 if smooth else None
    layer = Fp8Linear(Fp8Weight(w, ws, isc), bias=b, smooth=sm).prepare("cpu", torch.float32, kernels="cuda")
    assert layer.kernel.endswith(":scaled_mm")
    eager = layer(x)
    ops_fused, y = _graph_ops(layer, x)
    assert any("fp8_gemm_scaled_mm" in t for t in ops_fused) and not any("fp8_linear" in t for t in ops_fused)
    torch.testing.assert_close(y, eager, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(Fp8Linear, "fuse_act_quant", False)
    ops_op, y2 = _graph_ops(layer, x)
    assert any("fp8_linear_scaled_mm" in t for t in ops_op) and not any("fp8_gemm" in t for t in ops_op)
    torch.testing.assert_close(y2, eager, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_fast_accum_reaches_scaled_mm(fused, monkeypatch):
    """Fp8Linear.fast_accum is passed to torch._scaled_mm's use_fast_accum on the scaled_mm path, through the
    whole-layer op (eager) and through the GEMM-only op (fused activation quantization); opcheck takes the flag."""
    from sdquant.kernels.linear import Fp8Linear
    x, w, ws, isc, b = _fp8_args(False, True)
    seen = []
    real = torch._scaled_mm

    def spy(*a, **kw):
        seen.append(kw.get("use_fast_accum"))
        return real(*a, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    layer = Fp8Linear(quantize_fp8_weight(w.float() * ws.reshape(-1, 1)), b)
    layer.prepare(kernels="cuda")  # on CPU tensors: torch's CPU _scaled_mm
    ref = layer(x)
    layer.fast_accum = True
    if fused:
        y = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    else:
        y = layer(x)
    assert seen[0] is False and seen[-1] is True
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)  # the CPU kernel accumulates exactly either way
    xq, xs = sdquant.kernels.ops.quantize_act_torch(x.reshape(-1, x.shape[-1]), None, isc)
    torch.library.opcheck(torch.ops.sdquant.fp8_gemm_scaled_mm, (xq, xs, w, ws, b, torch.float32, True),
                          test_utils=FP8_UTILS)
    torch.library.opcheck(torch.ops.sdquant.fp8_linear_scaled_mm, (x, w, ws, isc, b, None, True),
                          test_utils=FP8_UTILS)


def test_fp8_per_tensor_weight_quantization():
    """quantize_fp8_weight(per_tensor=True): one absmax scale for the matrix, stored repeated as [N] (the package
    format of per-channel weights), every value within half an e4m3 step of the weight."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 96, generator=g)
    w[7] *= 10.0                                            # one loud channel sets the tensor's scale
    fw = quantize_fp8_weight(w, per_tensor=True)
    assert fw.weight_scale.shape == (48,) and torch.all(fw.weight_scale == fw.weight_scale[0])
    assert fw.weight_scale[0].item() == pytest.approx(w.abs().max().item() / 448, rel=1e-6)
    err = (fw.dequantize() - w).abs() / fw.weight_scale[0]
    assert err.max().item() <= 16 + 1e-3                    # e4m3 values near 448 are 32 apart: half a step
    per_ch = quantize_fp8_weight(w)
    assert not torch.all(per_ch.weight_scale == per_ch.weight_scale[0])


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_per_tensor_static_layer_runs_tensorwise(fused, monkeypatch):
    """A per-tensor weight with a static activation scale reaches torch._scaled_mm with scalar scales (cuBLASLt's
    tensorwise kernel, bias fused) on the scaled_mm path, eager and compiled; a dynamic-activation or per-channel
    layer keeps rowwise scales. All agree with the reference W8A8 function (bf16 outputs)."""
    from sdquant.kernels.linear import Fp8Linear
    g = torch.Generator().manual_seed(2)
    n, k = 32, 64
    x = torch.randn(2, 3, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g)
    isc = (x.float().abs().amax() / 448).reshape(())
    seen = []
    real = torch._scaled_mm

    def spy(*a, **kw):
        seen.append((tuple(kw["scale_a"].shape), tuple(kw["scale_b"].shape), kw.get("bias") is not None))
        return real(*a, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    cases = [(True, isc, [((), (), True)]),                      # per-tensor + static: tensorwise, bias fused
             (True, None, [((6, 1), (1, n), False)]),            # dynamic activations: rowwise
             (False, isc, [((6, 1), (1, n), False)])]            # per-channel weight: rowwise
    for per_tensor, in_scale, want in cases:
        fw = quantize_fp8_weight(w, in_scale, per_tensor=per_tensor)
        layer = Fp8Linear(fw, b).prepare("cpu", torch.bfloat16, kernels="cuda")
        assert layer.kernel.endswith(":scaled_mm")
        assert ("tensorwise" in repr(layer)) == (per_tensor and in_scale is not None)
        ref = torch.ops.sdquant.fp8_linear(x, fw.weight, fw.weight_scale, fw.input_scale, b).float()
        seen.clear()
        y = torch.compile(layer, backend="aot_eager", fullgraph=True)(x) if fused else layer(x)
        torch._dynamo.reset()
        assert seen == want, (per_tensor, in_scale is not None, seen)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def test_fp8_tensorwise_bench_dry_run():
    """bench/fp8_tensorwise.py --dry: both layers it times plan the _scaled_mm path (the per-tensor one tensorwise)
    and match an fp64 evaluation of their W8A8 function on CPU, so its device run times correct layers."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "bench" / "fp8_tensorwise.py"), "--dry"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(rows) == 12 and {row["path"] for row in rows} == {"channel_layer", "tensor_layer"}
    assert max(row["rel_err"] for row in rows) <= 1e-2
