"""FP8 (W8A8 e4m3) Seedance DiT -> ONNX: the float8 QDQ pattern of the LLM exporters (one lowering,
``onnx_ops.fp8_linear_nodes``), the CGF gate kept a float32 MatMul, dynamic batch and time with the T >= 3 rule
enforced in the graph, and ONNX Runtime (CPU provider) output matching the PyTorch FP8 model."""
import copy
import re

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from sdquant.errors import ConfigError  # noqa: E402
from sdquant.export.onnx_module import export_seedance_onnx  # noqa: E402
from sdquant.models.hf import replace_linears  # noqa: E402
from sdquant.models.seedance import SeedanceConfig, build_seedance, seedance_adapter  # noqa: E402
from sdquant.quant.qtensor import quantize_fp8_weight  # noqa: E402

CFG = SeedanceConfig(in_channels=3, hidden_size=32, depth=1, num_heads=2, cond_dim=8, stride_t=2,
                     window_3d=(2, 2, 2))
TOL = 1e-4          # relative L2 error of the velocity, ORT vs PyTorch FP8 (seen: ~5e-6)
STATIC_SCALE = 0.05


def _inputs(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, 3, 8, 8, generator=g), torch.rand(b, generator=g),
            torch.randn(b, CFG.cond_dim, generator=g))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(float model, FP8 model, {layer: Fp8Weight}, smoothed layer, path of the exported FP8 model)."""
    ref = build_seedance(CFG, seed=1).eval()
    m = copy.deepcopy(ref)
    keep = seedance_adapter(m)["keep_high_precision"]
    names = [n for n, mod in m.named_modules() if isinstance(mod, nn.Linear) and n.startswith("blocks.")
             and not any(re.search(p, n) for p in keep)]
    # both activation modes: dynamic per-token (what templates/seedance-fp8.yaml calibrates) on most layers,
    # a static per-tensor input scale on every third; plus one unfolded smooth scale (traced as a Div)
    ws = {n: quantize_fp8_weight(m.get_submodule(n).weight.detach(),
                                 torch.tensor(STATIC_SCALE) if i % 3 == 1 else None) for i, n in enumerate(names)}
    smoothed = names[2]
    sm = {smoothed: torch.rand(m.get_submodule(smoothed).in_features, generator=torch.Generator().manual_seed(3))
          + 0.5}
    replace_linears(m, ws, smooth=sm)
    path = export_seedance_onnx(m, tmp_path_factory.mktemp("fp8") / "model.onnx")
    return ref, m, ws, smoothed, path


def test_fp8_onnx_matches_pytorch_with_dynamic_batch_and_time(exported):
    ref, m, ws, _, path = exported
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b, t in [(2, 4), (1, 7), (3, 3)]:               # 7 frames: the 3D windows pad the time axis
        x, ts, c = _inputs(b, t, 10 * b + t)
        got = torch.from_numpy(sess.run(None, {"x": x.numpy(), "t": ts.numpy(), "cond": c.numpy()})[0])
        with torch.no_grad():
            want, full = m(x, ts, c), ref(x, ts, c)
        assert got.shape == want.shape == (b, t, 3, 8, 8)
        err = ((got - want).norm() / want.norm()).item()
        assert err < TOL, (b, t, err)
        # the tolerance can see quantization: the FP8 model is far from the float one
        assert ((want - full).norm() / full.norm()).item() > 100 * TOL


def test_each_lowered_layer_equals_fp8linear_on_the_same_input(exported, tmp_path):
    """Layer by layer, on the PyTorch layer's own input, the lowered QDQ nodes give Fp8Linear's output (end to
    end, a per-token e4m3 code flipped by an fp32 rounding difference upstream can cascade in deep models)."""
    _, m, ws, smoothed, path = exported
    from sdquant.kernels.linear import Fp8Linear
    caps = {}
    hooks = [mod.register_forward_hook(lambda mod, i, o, n=n: caps.__setitem__(n, (i[0], o)))
             for n, mod in m.named_modules() if isinstance(mod, Fp8Linear)]
    with torch.no_grad():
        m(*_inputs(2, 4, 5))
    for h in hooks:
        h.remove()
    g = onnx.load(str(path)).graph
    node = {n.name: n for n in g.node}
    x_of = {n: node[f"sdq_fp8/{n}/flatten"].input[0] for n in ws}     # the layer's input value in the graph
    y_of = {n: node[f"sdq_fp8/{n}/unflatten"].output[0] for n in ws}
    feeds = {}
    for n in ws:
        x = caps[n][0]
        if n == smoothed:   # the smooth Div is traced before the layer's nodes
            x = x.float() / m.get_submodule(n).smooth.float()
        feeds[x_of[n]] = x.numpy()
    sub = tmp_path / "layers.onnx"
    onnx.utils.extract_model(str(path), str(sub), sorted(feeds), [y_of[n] for n in ws])
    sess = ort.InferenceSession(str(sub), providers=["CPUExecutionProvider"])
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    for n in ws:
        want = caps[n][1]
        got = torch.from_numpy(outs[y_of[n]])
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), n


def test_fp8_graph_is_float8_qdq_with_fp32_cgf_gate(exported):
    ref, m, ws, smoothed, path = exported
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    g = model.graph
    ops = [n.op_type for n in g.node]
    n_static = sum(w.input_scale is not None for w in ws.values())
    assert ops.count("QuantizeLinear") == len(ws)
    assert ops.count("DequantizeLinear") == 2 * len(ws)          # activation + weight per layer
    assert ops.count("ReduceMax") == len(ws) - n_static          # per-token absmax of the dynamic layers
    assert "MatMulNBits" not in ops
    assert {o.domain for o in model.opset_import} == {""}        # no placeholder domain left behind
    assert next(o.version for o in model.opset_import if o.domain == "") >= 19
    inits = {t.name: t for t in g.initializer}
    f8 = {n: t for n, t in inits.items() if t.data_type == onnx.TensorProto.FLOAT8E4M3FN}
    consumers = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    # every layer's e4m3 codes are stored as they are in PyTorch (bit for bit) and read by a per-channel DQ
    for name, w in ws.items():
        t = f8[f"sdq_fp8/{name}.weight_fp8"]
        assert list(t.dims) == list(w.weight.shape)
        assert t.raw_data == w.weight.view(torch.uint8).numpy().tobytes()
        (dq,) = consumers[t.name]
        assert dq.op_type == "DequantizeLinear" and onnx.helper.get_attribute_value(dq.attribute[0]) == 0
    # QuantizeLinear outputs float8 (its zero point's type); static layers quantize with their own scale
    for q in (n for n in g.node if n.op_type == "QuantizeLinear"):
        assert inits[q.input[2]].data_type == onnx.TensorProto.FLOAT8E4M3FN
    static_scales = [onnx.numpy_helper.to_array(inits[q.input[1]]).item() for q in g.node
                     if q.op_type == "QuantizeLinear" and q.input[1].endswith(".input_scale")]
    assert static_scales == pytest.approx([STATIC_SCALE] * n_static)
    assert f"sdq_fp8/{smoothed}.weight_fp8" in f8 and any(n.op_type == "Div" and n.input[1].endswith(".smooth")
                                                           for n in g.node)
    assert len(f8) == len(ws) + 1                                  # + the shared float8 zero point
    # CGF gate: a float32 weight (exactly the PyTorch one) read by a MatMul/Gemm, no quantize op on its path
    gate = m.blocks[0].cgf.gate.weight.detach().numpy()
    hits = [n for n, t in inits.items() if t.data_type == onnx.TensorProto.FLOAT and tuple(t.dims) in
            (gate.shape, gate.shape[::-1]) and any(np.array_equal(onnx.numpy_helper.to_array(t), a)
                                                    for a in (gate, gate.T))]
    assert len(hits) == 1
    assert {n.op_type for n in consumers[hits[0]]} <= {"MatMul", "Gemm"}
    # dynamic axes on input and output
    dims = lambda vi: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]  # noqa: E731
    x_in = next(i for i in g.input if i.name == "x")
    assert dims(x_in)[:2] == ["batch", "time"]
    assert all(isinstance(d, str) for d in dims(g.output[0])[:2])


def test_fewer_than_three_frames_fail_in_onnx_runtime(exported):
    *_, path = exported
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x, ts, c = _inputs(1, 2, 0)
    with pytest.raises(Exception, match="seedance_needs_T_ge_3"):
        sess.run(None, {"x": x.numpy(), "t": ts.numpy(), "cond": c.numpy()})


def test_fp8_needs_opset_19(exported, tmp_path):
    _, m, *_ = exported
    with pytest.raises(ConfigError, match="opset"):
        export_seedance_onnx(m, tmp_path / "model.onnx", opset=18)
    assert not list(tmp_path.iterdir())
