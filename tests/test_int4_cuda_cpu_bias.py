"""The CUDA-layout op's CPU path (no extension) takes a bias of another float dtype than x, like the GPU
kernel, whose epilogue converts it."""
import torch

from sdquant.kernels import int4_cuda, int4_layout
from sdquant.quant.qtensor import QuantizedWeight, compute_qparams, quantize_codes


def test_cpu_path_bias_in_another_dtype():
    torch.manual_seed(0)
    W = torch.randn(128, 256)
    s, z = compute_qparams(W, 4, 128, False)
    qw = QuantizedWeight.from_codes(quantize_codes(W, s, z, 4, 128), s, z, 4, 128)
    lay = int4_layout.repack_cuda(qw, torch.bfloat16)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    bias = torch.randn(128, dtype=torch.float32)
    y = int4_cuda.w4a16_cuda(x, lay["qweight"], lay["scales"], lay["zeros"], lay.get("perm"), lay["locks"], bias)
    ref = torch.nn.functional.linear(x, qw.dequantize(torch.float32).to(torch.bfloat16), bias.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref)
