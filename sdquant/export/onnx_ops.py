"""ONNX building blocks for quantized linears, reusable by every exporter (LLM decoders, Seedance DiTs).

The one conversion that matters is canonical ``QuantizedWeight`` -> ``com.microsoft::MatMulNBits``
(ONNX Runtime contrib op, domain ``com.microsoft``, version 1):

    Y[..., N] = A[..., K] @ dequant(B).T (+ bias),   dequant = (code - zero_point) * scale per block of K

    B            uint8  [N, k_blocks, block_size * bits / 8]   codes packed low-bits-first along K
    scales       T(A)   [N, k_blocks]
    zero_points  uint8  [N, ceil(k_blocks * bits / 8)]          packed like B, each row padded to a byte;
                                                                 absent = 2**(bits-1) (our symmetric case)
    attributes   K, N, bits in {2, 4, 8}, block_size (power of two >= 16), accuracy_level 0..4

sdquant's canonical packing (``qtensor.pack_codes``: a little-endian bit stream per row) is already
MatMulNBits' packing, so B is a reshape of ``qweight``. What needs converting:

- group size vs block size: MatMulNBits wants a power-of-two block >= 16. A group size g that is not a
  power of two (or per-channel, g = K) is split into blocks of the largest power of two dividing g, and the
  group's scale/zero is repeated in each block. This is exact: same codes, same scale per element.
- act-order ``g_idx``: the op's own g_idx input is deprecated. We permute K instead: sort input channels by
  group, reorder the weight codes once, and gather the activation columns in the graph (a ``Gather`` on the
  last axis). Exact when every group holds exactly g channels (what GPTQ's act-order produces).
- bits 3 has no MatMulNBits kernel: rejected with a ShapeError naming the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from sdquant.errors import ShapeError, SdquantError
from sdquant.quant.qtensor import (Fp8Weight, QuantizedWeight, effective_group_size, num_groups, pack_codes,
                                   unpack_codes)

MATMULNBITS_BITS = (2, 4, 8)
MS_DOMAIN = "com.microsoft"

_NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class OnnxExportError(SdquantError):
    """A model or layer that the ONNX exporter cannot lower (the message names the layer and why)."""


def _largest_pow2_divisor(n: int, cap: int = 256) -> int:
    b = 1
    while n % (b * 2) == 0 and b * 2 <= cap:
        b *= 2
    return b


def matmulnbits_block_size(in_features: int, group_size: int) -> int:
    """The MatMulNBits block size that represents a canonical group exactly (see module doc)."""
    g = effective_group_size(in_features, group_size)
    if g >= 16 and g & (g - 1) == 0 and g <= 256:
        return g
    return _largest_pow2_divisor(g, cap=128 if g > 256 else 256)


@dataclass
class MatMulNBitsWeight:
    """The initializers and attributes of one MatMulNBits node (numpy arrays, ready for ONNX)."""
    B: np.ndarray                       # uint8 [N, k_blocks, blob]
    scales: np.ndarray                  # float [N, k_blocks]
    zero_points: Optional[np.ndarray]   # uint8 [N, ceil(k_blocks * bits / 8)] or None (symmetric)
    perm: Optional[np.ndarray]          # int64 [K]: A must be gathered A[..., perm] first (act-order), or None
    K: int
    N: int
    bits: int
    block_size: int


def to_matmulnbits(qw: QuantizedWeight, dtype: str = "float32", name: str = "linear") -> MatMulNBitsWeight:
    """Canonical QuantizedWeight -> MatMulNBits tensors (exact: dequantizes to the same matrix)."""
    if qw.bits not in MATMULNBITS_BITS:
        raise OnnxExportError(f"{name}: {qw.bits}-bit weights have no MatMulNBits kernel in ONNX Runtime "
                              f"(supported bits: {MATMULNBITS_BITS})")
    if dtype not in _NP_DTYPES:
        raise OnnxExportError(f"dtype: {dtype!r} is not supported for ONNX export (choose float32 or float16)")
    n, k = qw.out_features, qw.in_features
    g = effective_group_size(k, qw.group_size)
    block = matmulnbits_block_size(k, qw.group_size)
    if block < 16:
        raise ShapeError(f"{name}: group size {g} has no power-of-two divisor >= 16, which MatMulNBits needs "
                         f"as its block size")
    codes = qw.codes().cpu()                                   # uint8 [N, K]
    scales = qw.scales.cpu().float()                           # [N, G]
    zeros = None if qw.zeros is None else qw.zeros.cpu()       # [N, G]
    perm = None
    if qw.g_idx is not None:
        g_idx = qw.g_idx.cpu().long()
        if torch.equal(g_idx, torch.arange(k) // g):
            pass  # trivial act-order (static): nothing to permute
        else:
            counts = torch.bincount(g_idx, minlength=num_groups(k, qw.group_size))
            if not bool((counts == g).all()):
                raise ShapeError(f"{name}: g_idx assigns unequal channel counts to groups "
                                 f"(min {int(counts.min())}, max {int(counts.max())}, group size {g}); "
                                 f"MatMulNBits needs exactly {g} channels per group")
            p = torch.sort(g_idx, stable=True).indices        # channels of group 0 first, then group 1, ...
            codes = codes[:, p]
            perm = p.numpy().astype(np.int64)
    rep = g // block                                           # blocks per canonical group
    kb = k // block
    B = pack_codes(codes, qw.bits).reshape(n, kb, block * qw.bits // 8).numpy()
    scales_b = scales.repeat_interleave(rep, dim=1).numpy().astype(_NP_DTYPES[dtype])
    zp = None
    if zeros is not None:
        zb = zeros.repeat_interleave(rep, dim=1).to(torch.int64)  # [N, kb]
        per_byte = 8 // qw.bits
        pad = (-kb) % per_byte
        if pad:
            # pad with the symmetric default; padded slots are never read (there are only kb blocks)
            zb = torch.cat([zb, torch.full((n, pad), 1 << (qw.bits - 1), dtype=torch.int64)], dim=1)
        zp = pack_codes(zb, qw.bits).numpy()
    return MatMulNBitsWeight(np.ascontiguousarray(B), np.ascontiguousarray(scales_b), zp, perm, k, n, qw.bits,
                             block)


def matmulnbits_dequantize(m: MatMulNBitsWeight) -> np.ndarray:
    """Reference dequantization of MatMulNBits tensors -> float32 [N, K] in the (possibly permuted) K order,
    following the contrib-op spec; used to test ``to_matmulnbits`` independently of ONNX Runtime."""
    n, kb, _ = m.B.shape
    codes = unpack_codes(torch.from_numpy(m.B.reshape(n, -1)), m.bits, m.K).float()      # [N, K]
    if m.zero_points is None:
        z = torch.full((n, kb), float(1 << (m.bits - 1)))
    else:
        z = unpack_codes(torch.from_numpy(m.zero_points), m.bits, m.zero_points.shape[1] * 8 // m.bits)
        z = z[:, :kb].float()
    s = torch.from_numpy(m.scales.astype(np.float32))
    w = (codes - z.repeat_interleave(m.block_size, 1)) * s.repeat_interleave(m.block_size, 1)
    return w.numpy()


# ------------------------------------------------------------------------------------------- graph builder
class GraphBuilder:
    """A thin helper over onnx.helper: unique names, initializers from numpy/torch, constant caching."""

    def __init__(self, dtype: str = "float32"):
        import onnx  # noqa: F401  (fail early with ImportError if the onnx extra is missing)
        if dtype not in _NP_DTYPES:
            raise OnnxExportError(f"dtype: {dtype!r} is not supported for ONNX export (float32 or float16)")
        self.dtype = dtype
        self.np_dtype = _NP_DTYPES[dtype]
        self.nodes: list = []
        self.initializers: list = []
        self.inputs: list = []
        self.outputs: list = []
        self._names: Dict[str, int] = {}
        self._consts: Dict[tuple, str] = {}
        self.uses_ms_domain = False

    @property
    def elem_type(self) -> int:
        import onnx
        return onnx.TensorProto.FLOAT if self.dtype == "float32" else onnx.TensorProto.FLOAT16

    def name(self, base: str) -> str:
        i = self._names.get(base, 0)
        self._names[base] = i + 1
        return base if i == 0 else f"{base}_{i}"

    def initializer(self, name: str, arr) -> str:
        from onnx import numpy_helper
        if isinstance(arr, torch.Tensor):
            arr = arr.detach().cpu().numpy()
        name = self.name(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def float_init(self, name: str, t) -> str:
        """A float initializer in the graph's dtype."""
        if isinstance(t, torch.Tensor):
            t = t.detach().float().cpu().numpy()
        return self.initializer(name, np.asarray(t, dtype=np.float32).astype(self.np_dtype))

    def const(self, value, dtype=np.int64) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.initializer("const", arr)
        return self._consts[key]

    def fconst(self, value) -> str:
        return self.const(value, self.np_dtype)

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, domain: str = "", name: Optional[str] = None,
           outputs: Optional[List[str]] = None, **attrs):
        from onnx import helper
        base = name or op_type
        outs = outputs or [self.name(f"{base}_out") for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.name(base), domain=domain or None,
                                           **attrs))
        if domain == MS_DOMAIN:
            self.uses_ms_domain = True
        return outs[0] if n_out == 1 and outputs is None else outs

    def add_input(self, name: str, elem_type: int, shape: Sequence) -> str:
        from onnx import helper
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def add_output(self, name: str, elem_type: int, shape: Optional[Sequence]) -> None:
        from onnx import helper
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, None if shape is None else list(shape)))

    def make_model(self, graph_name: str, opset: int, metadata: Optional[Dict[str, str]] = None):
        from onnx import helper
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", opset)]
        if self.uses_ms_domain:
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="sdquant")
        model.ir_version = min(model.ir_version, 10)  # ORT 1.18+ reads IR 10; keep older runtimes able to load
        for k, v in (metadata or {}).items():
            model.metadata_props.add(key=k, value=str(v))
        return model


# --------------------------------------------------------------------------------------- linear lowering
def matmulnbits_node(gb: GraphBuilder, x: str, qw: QuantizedWeight, prefix: str, bias=None,
                     accuracy_level: int = 0) -> str:
    """Emit the MatMulNBits node (plus a Gather for act-order) for y = x @ dequant(qw).T + bias."""
    m = to_matmulnbits(qw, gb.dtype, prefix)
    if m.perm is not None:
        x = gb.op("Gather", [x, gb.initializer(f"{prefix}.perm", m.perm)], axis=-1, name=f"{prefix}/act_order")
    inputs = [x, gb.initializer(f"{prefix}.qweight", m.B), gb.initializer(f"{prefix}.scales", m.scales)]
    inputs.append(gb.initializer(f"{prefix}.qzeros", m.zero_points) if m.zero_points is not None else "")
    if bias is not None:
        inputs += ["", gb.float_init(f"{prefix}.bias", bias)]   # g_idx slot left empty (deprecated input)
    while inputs and inputs[-1] == "":
        inputs.pop()
    return gb.op("MatMulNBits", inputs, domain=MS_DOMAIN, name=f"{prefix}/MatMulNBits", K=m.K, N=m.N,
                 bits=m.bits, block_size=m.block_size, accuracy_level=int(accuracy_level))


def fp8_linear_nodes(gb: GraphBuilder, x: str, fw: Fp8Weight, prefix: str, bias=None, opset: int = 21) -> str:
    """W8A8 e4m3 as standard QDQ (opset >= 19): activation QuantizeLinear->DequantizeLinear in float8e4m3fn
    (dynamic per-token scale computed in the graph, or the static scale), weight DequantizeLinear per output
    channel, then a float MatMul. Runtimes that fuse QDQ run it in fp8; others emulate it exactly.
    Always computed in fp32 (a float16 graph casts in and out), as the reference op accumulates in fp32."""
    import onnx
    from onnx import helper
    if opset < 19:
        raise OnnxExportError(f"{prefix}: FP8 linears need opset >= 19 (float8 QuantizeLinear); got opset {opset}")
    n, k = fw.weight.shape
    f32 = lambda name, t: gb.initializer(name, np.asarray(  # noqa: E731
        t.detach().float().cpu().numpy() if isinstance(t, torch.Tensor) else t, dtype=np.float32))
    fc = lambda v: gb.const(v, np.float32)  # noqa: E731
    half = gb.dtype != "float32"
    if half:
        x = gb.op("Cast", [x], to=onnx.TensorProto.FLOAT, name=f"{prefix}/to_fp32")
    # weight: float8 [N, K] with per-row scale; DequantizeLinear(axis=0) gives fp32 [N, K]
    w8 = fw.weight.cpu().view(torch.uint8).numpy()
    wname = gb.name(f"{prefix}.weight_fp8")
    gb.initializers.append(helper.make_tensor(wname, onnx.TensorProto.FLOAT8E4M3FN, [n, k], w8.tobytes(), raw=True))
    wdq = gb.op("DequantizeLinear", [wname, f32(f"{prefix}.weight_scale", fw.weight_scale)], axis=0,
                name=f"{prefix}/w_dq")                                                      # [N, K]
    wt = gb.op("Transpose", [wdq], perm=[1, 0], name=f"{prefix}/w_t")                       # [K, N]
    shape_x = gb.op("Shape", [x])
    x2 = gb.op("Reshape", [x, gb.const([-1, k])], name=f"{prefix}/flatten")                 # [M, K]
    zp = _fp8_zero(gb, prefix)
    if fw.input_scale is None:
        # dynamic per-token scale s [M, 1] = absmax / 448; the QDQ pair runs at unit scale on x / s (a float8
        # zero point cannot be broadcast per row by Expand in ONNX Runtime), then the result is rescaled by s
        amax = gb.op("ReduceMax", [gb.op("Abs", [x2]), gb.const([1])], keepdims=1)          # [M, 1]
        s = gb.op("Max", [gb.op("Div", [amax, fc(448.0)]), fc(1e-12)])
        xq = gb.op("QuantizeLinear", [gb.op("Div", [x2, s]), fc(1.0), zp], saturate=1, name=f"{prefix}/x_q")
        xdq = gb.op("Mul", [gb.op("DequantizeLinear", [xq, fc(1.0), zp], name=f"{prefix}/x_dq"), s])
    else:
        s = f32(f"{prefix}.input_scale", fw.input_scale.reshape(()))
        xq = gb.op("QuantizeLinear", [x2, s, zp], saturate=1, name=f"{prefix}/x_q")
        xdq = gb.op("DequantizeLinear", [xq, s, zp], name=f"{prefix}/x_dq")
    y = gb.op("MatMul", [xdq, wt], name=f"{prefix}/MatMul")
    if bias is not None:
        y = gb.op("Add", [y, f32(f"{prefix}.bias", bias)])
    out_shape = gb.op("Concat", [gb.op("Slice", [shape_x, gb.const([0]), gb.const([-1])]), gb.const([n])], axis=0)
    y = gb.op("Reshape", [y, out_shape], name=f"{prefix}/unflatten")
    return gb.op("Cast", [y], to=gb.elem_type, name=f"{prefix}/to_half") if half else y


def _fp8_zero(gb: GraphBuilder, prefix: str) -> str:
    import onnx
    from onnx import helper
    key = ("fp8zero",)
    if key not in gb._consts:
        nm = gb.name("fp8_zero_point")
        gb.initializers.append(helper.make_tensor(nm, onnx.TensorProto.FLOAT8E4M3FN, [], b"\x00", raw=True))
        gb._consts[key] = nm
    return gb._consts[key]


def float_linear_nodes(gb: GraphBuilder, x: str, weight: torch.Tensor, prefix: str, bias=None) -> str:
    """y = x @ W.T + b with W stored pre-transposed [K, N] (no Transpose node at run time)."""
    y = gb.op("MatMul", [x, gb.float_init(f"{prefix}.weight_t", weight.detach().t().contiguous())],
              name=f"{prefix}/MatMul")
    if bias is not None:
        y = gb.op("Add", [y, gb.float_init(f"{prefix}.bias", bias)], name=f"{prefix}/bias")
    return y


def linear_nodes(gb: GraphBuilder, x: str, module: torch.nn.Module, prefix: str, accuracy_level: int = 0,
                 opset: int = 21) -> str:
    """Lower any supported linear module (nn.Linear, QuantLinear, Fp8Linear) applied to graph value x."""
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    smooth = getattr(module, "smooth", None)
    if smooth is not None:
        x = gb.op("Div", [x, gb.float_init(f"{prefix}.smooth", smooth)], name=f"{prefix}/smooth")
    if isinstance(module, QuantLinear):
        return matmulnbits_node(gb, x, module.weight_q, prefix, module.bias, accuracy_level)
    if isinstance(module, Fp8Linear):
        return fp8_linear_nodes(gb, x, module.weight_q, prefix, module.bias, opset)
    if isinstance(module, torch.nn.Linear):
        return float_linear_nodes(gb, x, module.weight, prefix, module.bias)
    raise OnnxExportError(f"{prefix}: cannot lower a {type(module).__name__} to ONNX "
                          f"(supported: nn.Linear, QuantLinear, Fp8Linear)")
