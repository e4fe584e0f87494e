import pytest
import torch

from sdquant.errors import ShapeError
from sdquant.quant.qtensor import (QuantizedWeight, compute_qparams, pack_codes, quantize_codes,
                                   quantize_fp8_weight, unpack_codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [8, 64, 72])
def test_pack_roundtrip(bits, k):
    g = torch.Generator().manual_seed(bits * 100 + k)
    codes = torch.randint(0, 1 << bits, (5, k), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, k * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, k), codes)


def test_pack_layout_int4_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x0F]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gs", [32, -1])
def test_quantize_dequantize_error_bound(bits, sym, gs):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    s, z = compute_qparams(w, bits, gs, sym)
    qw = QuantizedWeight.from_codes(quantize_codes(w, s, z, bits, gs), s, z, bits, gs)
    err = (qw.dequantize() - w).abs()
    # inside the range, rounding error is at most half a step (+ fp16 scale rounding)
    step = qw.scales.float().repeat_interleave(64 if gs == -1 else gs, 1)
    assert (err <= step * 0.5 + 1e-3 + (step if sym else 0)).all()
    assert qw.symmetric == sym


def test_g_idx_dequantize_uses_group_of_each_column():
    w = torch.randn(4, 64)
    s, z = compute_qparams(w, 4, 32, False)
    g_idx = torch.tensor([i % 2 for i in range(64)], dtype=torch.int32)
    codes = quantize_codes(w, s, z, 4, 32, g_idx)
    qw = QuantizedWeight.from_codes(codes, s, z, 4, 32, g_idx)
    expect = (codes.float() - z.float()[:, g_idx.long()]) * s.float()[:, g_idx.long()]
    assert torch.equal(qw.dequantize(), expect)


def test_invalid_shapes_name_the_problem():
    with pytest.raises(ShapeError, match="group_size 48 does not divide in_features 64"):
        QuantizedWeight(torch.zeros(2, 32, dtype=torch.uint8), torch.ones(2, 1, dtype=torch.float16), None, 4, 48, 64)
    with pytest.raises(ShapeError, match="scales must be"):
        QuantizedWeight(torch.zeros(2, 32, dtype=torch.uint8), torch.ones(2, 3, dtype=torch.float16), None, 4, 32, 64)
    with pytest.raises(ShapeError, match="g_idx values"):
        QuantizedWeight(torch.zeros(2, 32, dtype=torch.uint8), torch.ones(2, 2, dtype=torch.float16), None, 4, 32, 64,
                        torch.full((64,), 5, dtype=torch.int32))


def test_fp8_weight_roundtrip_relative_error():
    w = torch.randn(32, 64)
    fw = quantize_fp8_weight(w)
    rel = (fw.dequantize() - w).norm() / w.norm()
    assert rel < 0.05
    assert fw.weight.dtype == torch.float8_e4m3fn
