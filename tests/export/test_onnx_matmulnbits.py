"""Canonical QuantizedWeight -> com.microsoft::MatMulNBits conversion: layout unit tests (no runtime) and
single-node parity in ONNX Runtime's CPU provider."""
import numpy as np
import pytest
import torch

import sdquant.kernels.ops  # noqa: F401  (registers torch.ops.sdquant.*)

from sdquant.errors import ShapeError
from sdquant.export.onnx_ops import (GraphBuilder, OnnxExportError, matmulnbits_block_size, matmulnbits_dequantize,
                                     matmulnbits_node, to_matmulnbits, fp8_linear_nodes)
from sdquant.quant.qtensor import QuantizedWeight, compute_qparams, quantize_codes, quantize_fp8_weight


def make_qw(n, k, bits=4, group_size=32, symmetric=False, act_order=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    g_idx = None
    if act_order:
        # GPTQ act-order: channels visited in a random order, consecutive visited channels share a group
        order = torch.randperm(k, generator=g)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
        ws = w[:, order]
        scales, zeros = compute_qparams(ws, bits, group_size, symmetric)
        codes = quantize_codes(w, scales, zeros, bits, group_size, g_idx)
    else:
        scales, zeros = compute_qparams(w, bits, group_size, symmetric)
        codes = quantize_codes(w, scales, zeros, bits, group_size)
    return QuantizedWeight.from_codes(codes, scales, zeros, bits, group_size, g_idx)


@pytest.mark.parametrize("bits,group_size,symmetric,act_order,k", [
    (4, 32, False, False, 64), (4, 128, True, False, 256), (4, -1, False, False, 96), (4, 48, False, False, 96),
    (4, 32, False, True, 128), (8, 64, False, False, 128), (2, 16, False, False, 80), (4, 64, False, False, 576),
    (4, 32, False, False, 160),  # k_blocks = 5: odd count, zero points padded within the row
])
def test_layout_dequantizes_to_the_same_matrix(bits, group_size, symmetric, act_order, k):
    qw = make_qw(24, k, bits, group_size, symmetric, act_order)
    m = to_matmulnbits(qw)
    kb = k // m.block_size
    assert m.B.shape == (24, kb, m.block_size * bits // 8) and m.B.dtype == np.uint8
    assert m.scales.shape == (24, kb)
    assert m.block_size >= 16 and m.block_size & (m.block_size - 1) == 0
    if symmetric:
        assert m.zero_points is None
    else:
        assert m.zero_points.shape == (24, -(-kb * bits // 8)) and m.zero_points.dtype == np.uint8
    ref = qw.dequantize().numpy()
    if m.perm is not None:
        assert sorted(m.perm.tolist()) == list(range(k))
        ref = ref[:, m.perm]
    np.testing.assert_array_equal(matmulnbits_dequantize(m), ref)


def test_byte_layout_matches_spec_example():
    # codes 0..15 in one row, one block of 16: byte j = code[2j] | code[2j+1] << 4 (low nibble first)
    codes = torch.arange(16, dtype=torch.uint8)[None].repeat(2, 1)
    qw = QuantizedWeight.from_codes(codes, torch.ones(2, 1), torch.tensor([[3], [12]], dtype=torch.uint8), 4, 16)
    m = to_matmulnbits(qw)
    assert m.B[0, 0].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    # one block per row: the low nibble holds the zero point, the high nibble is padding (8)
    assert m.zero_points.tolist() == [[0x83], [0x8C]]
    assert matmulnbits_block_size(576, 64) == 64 and matmulnbits_block_size(576, -1) == 64
    assert matmulnbits_block_size(96, 48) == 16


def test_rejects_what_matmulnbits_cannot_represent():
    with pytest.raises(OnnxExportError, match="3-bit"):
        to_matmulnbits(make_qw(8, 64, bits=3, group_size=32), name="layers.0.q_proj")
    with pytest.raises(ShapeError, match="power-of-two"):
        to_matmulnbits(make_qw(8, 72, group_size=24), name="x")
    qw = make_qw(8, 64, group_size=32)
    qw.g_idx = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32)
    with pytest.raises(ShapeError, match="unequal"):
        to_matmulnbits(qw)


def _run_single(build, x):
    import onnx
    import onnxruntime as ort
    gb = GraphBuilder("float32")
    xin = gb.add_input("x", onnx.TensorProto.FLOAT, ["m", x.shape[-1]])
    gb.op("Identity", [build(gb, xin)], outputs=["y"])
    gb.add_output("y", onnx.TensorProto.FLOAT, ["m", None])
    model = gb.make_model("t", 21)
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x.numpy()})[0]


@pytest.mark.parametrize("bits,group_size,symmetric,act_order", [
    (4, 32, False, False), (4, 64, True, False), (4, 32, False, True), (4, -1, False, False), (8, 32, False, False)])
def test_ort_matmulnbits_matches_reference_op(bits, group_size, symmetric, act_order):
    qw = make_qw(48, 128, bits, group_size, symmetric, act_order, seed=1)
    bias = torch.randn(48)
    x = torch.randn(5, 128)
    y = _run_single(lambda gb, xin: matmulnbits_node(gb, xin, qw, "lin", bias), x)
    ref = torch.ops.sdquant.int_linear(x, qw.qweight, qw.scales, qw.zeros, qw.g_idx, bias, bits, group_size, 128)
    rel = np.linalg.norm(y - ref.numpy()) / np.linalg.norm(ref.numpy())
    assert rel < 1e-5, rel


def test_ort_fp8_qdq_matches_reference_op():
    w = torch.randn(32, 64)
    x = torch.randn(6, 64) * 3
    for input_scale in (None, torch.tensor(0.02)):
        fw = quantize_fp8_weight(w, input_scale)
        y = _run_single(lambda gb, xin: fp8_linear_nodes(gb, xin, fw, "fp8"), x)
        ref = torch.ops.sdquant.fp8_linear(x, fw.weight, fw.weight_scale, fw.input_scale, None).numpy()
        rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert rel < 1e-5, (input_scale, rel)
