"""The float Seedance model through torch.compile (fullgraph, dynamic shapes) and ONNX (dynamic batch and
time) — the quantized paths reuse the same graph with QuantLinear/Fp8Linear ops."""
import pytest
import torch

from sdquant.models.seedance import SeedanceConfig, build_seedance, seedance_export_spec

CFG = SeedanceConfig(in_channels=3, hidden_size=32, depth=1, num_heads=2, cond_dim=8, stride_t=2,
                     window_3d=(2, 2, 2))


def _inputs(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, 3, 8, 8, generator=g), torch.rand(b, generator=g), torch.randn(b, 8, generator=g)


@pytest.mark.slow
def test_torch_compile_fullgraph_dynamic():
    m = build_seedance(CFG, seed=1).eval()
    cm = torch.compile(m, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for b, t in [(1, 2), (2, 4)]:    # T = 2: spatial-only (its log call must not break the graph)
            x, ts, c = _inputs(b, t, b + t)
            torch.testing.assert_close(cm(x, ts, c), m(x, ts, c), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_onnx_dynamic_batch_and_time_matches_pytorch(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    m = build_seedance(CFG, seed=1).eval()
    args, dyn, names, outs = seedance_export_spec(m)
    path = tmp_path / "seedance.onnx"
    torch.onnx.export(m, args, str(path), dynamo=True, dynamic_shapes=dyn, input_names=names, output_names=outs)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b, t in [(2, 4), (1, 7), (3, 3)]:               # 7 frames: the 3D windows need padding
        x, ts, c = _inputs(b, t, 10 * b + t)
        got = torch.from_numpy(sess.run(None, {"x": x.numpy(), "t": ts.numpy(), "cond": c.numpy()})[0])
        with torch.no_grad():
            ref = m(x, ts, c)
        assert got.shape == ref.shape
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.slow
def test_quantized_onnx_matmulnbits_dynamic_batch_and_time(tmp_path):
    """The W4 package's model exports with one MatMulNBits per quantized linear, runs in ONNX Runtime with
    dynamic batch and time, and matches the PyTorch quantized model."""
    import re
    import onnx
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from torch import nn
    from sdquant.calibrate.rtn import rtn_quantize
    from sdquant.export.onnx_module import export_seedance_onnx
    from sdquant.models.hf import replace_linears
    from sdquant.models.seedance import seedance_adapter

    m = build_seedance(SeedanceConfig(in_channels=3, hidden_size=64, depth=1, num_heads=2, cond_dim=8, stride_t=2,
                                      window_3d=(2, 2, 2)), seed=1).eval()
    keep = seedance_adapter(m)["keep_high_precision"]
    ws = {n: rtn_quantize(mod.weight.detach(), 4, 32, sym) for i, (n, mod) in enumerate(m.named_modules())
          for sym in [i % 2 == 0]
          if isinstance(mod, nn.Linear) and n.startswith("blocks.") and not any(re.search(p, n) for p in keep)}
    replace_linears(m, ws)
    path = export_seedance_onnx(m, tmp_path / "q" / "model.onnx")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("MatMulNBits") == len(ws)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b, t in [(2, 4), (1, 7), (3, 3)]:
        g = torch.Generator().manual_seed(10 * b + t)
        x, ts, c = torch.randn(b, t, 3, 8, 8, generator=g), torch.rand(b, generator=g), torch.randn(b, 8, generator=g)
        got = torch.from_numpy(sess.run(None, {"x": x.numpy(), "t": ts.numpy(), "cond": c.numpy()})[0])
        with torch.no_grad():
            ref = m(x, ts, c)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-4


def test_module_exporter_refuses_what_matmulnbits_cannot_hold():
    from sdquant.calibrate.rtn import rtn_quantize
    from sdquant.errors import SdquantError
    from sdquant.export.onnx_module import check_exportable
    from sdquant.kernels.linear import QuantLinear
    with pytest.raises(SdquantError, match="3-bit layers cannot be exported"):
        check_exportable(torch.nn.Sequential(QuantLinear(rtn_quantize(torch.randn(8, 64), 3, 32, False))))
    with pytest.raises(SdquantError, match="group size 24 is not a MatMulNBits block size"):
        check_exportable(torch.nn.Sequential(QuantLinear(rtn_quantize(torch.randn(8, 48), 4, 24, False))))
