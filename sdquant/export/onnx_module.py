"""ONNX export of any module holding QuantLinear layers (e.g. a quantized Seedance DiT) through
``torch.onnx.export(dynamo=True)``: each ``sdquant::int_linear`` call becomes one ``com.microsoft::MatMulNBits``
node that reads the package's canonical tensors directly.

Why this works without repacking: the canonical 4-bit layout packs codes along K, low nibble first, one row
per output feature — exactly MatMulNBits' ``B`` once viewed as [N, K/block, block/2]; scales [N, G] flatten
to its [N * G] scales; integer zero points are given in the scales' float type (MatMulNBits accepts
unpacked zero points of type T1), and a symmetric layer omits them (MatMulNBits' default zero point is
2^(bits-1) = 8, the canonical symmetric zero). The LLM decoder exporter (``sdquant.export.onnx``) builds
its graphs node by node instead; this path serves models without a hand-written graph.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from sdquant.errors import SdquantError

_MAX_BLOCK = 256


def _matmulnbits_op():
    import onnxscript
    from onnx.defs import OpSchema

    fp = OpSchema.FormalParameter
    # ORT's contrib op is not in onnx's schema registry; declare the part of its signature we use
    schema = OpSchema(
        "MatMulNBits", "com.microsoft", 1,
        inputs=[fp("A", "T1"), fp("B", "T2"), fp("scales", "T1"),
                fp("zero_points", "T3", param_option=OpSchema.FormalParameterOption.Optional)],
        outputs=[fp("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("T2", ["tensor(uint8)"], ""),
                          ("T3", ["tensor(uint8)", "tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
        attributes=[OpSchema.Attribute(a, OpSchema.AttrType.INT, "")
                    for a in ("K", "N", "bits", "block_size", "accuracy_level")])
    return onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "MatMulNBits", schema)


def check_exportable(model: torch.nn.Module) -> None:
    """One clear error for the first layer MatMulNBits cannot express."""
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            raise SdquantError(f"{name}: FP8 layers are not supported by the module ONNX exporter (the LLM "
                               f"decoder exporter lowers them to float8 Q/DQ); export an INT4 package")
        if isinstance(m, QuantLinear):
            gs = m.in_features if m.group_size in (-1, 0) else m.group_size
            if m.bits != 4:
                raise SdquantError(f"{name}: {m.bits}-bit layers cannot be exported as MatMulNBits here (4 bits only)")
            if m.g_idx is not None:
                raise SdquantError(f"{name}: act-order (g_idx) layers are not supported by the module exporter")
            if gs < 16 or gs > _MAX_BLOCK or gs & (gs - 1):
                raise SdquantError(f"{name}: group size {gs} is not a MatMulNBits block size (a power of two in "
                                   f"16..{_MAX_BLOCK})")
            if m.smooth is not None:
                raise SdquantError(f"{name}: an unfolded smooth scale is not supported by the module exporter")


def export_module_onnx(model: torch.nn.Module, args: tuple, path, *, dynamic_shapes=None,
                       input_names: Optional[Sequence[str]] = None, output_names: Optional[Sequence[str]] = None,
                       accuracy_level: int = 0, opset: int = 18) -> Path:
    """Export ``model(*args)`` to ``path`` (written to a temporary name, checked, then renamed)."""
    import onnx
    from onnxscript import opset18 as op

    if accuracy_level not in (0, 1, 2, 3, 4):
        raise SdquantError(f"accuracy_level must be 0-4, got {accuracy_level}")
    check_exportable(model)
    matmulnbits = _matmulnbits_op()

    def int_linear(x, qweight, scales, zeros, g_idx, bias, bits: int, group_size: int, in_features: int):
        n, k = qweight.shape[0], in_features
        gs = k if group_size in (-1, 0) else group_size
        b = op.Reshape(qweight, op.Constant(value_ints=[n, k // gs, gs * bits // 8]))
        inputs = [x, b, op.Reshape(op.CastLike(scales, x), op.Constant(value_ints=[-1]))]
        if zeros is not None:
            inputs.append(op.Reshape(op.CastLike(zeros, x), op.Constant(value_ints=[-1])))
        y = matmulnbits(*inputs, K=k, N=n, bits=bits, block_size=gs, accuracy_level=accuracy_level)
        return y if bias is None else op.Add(y, op.CastLike(bias, x))

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # export into a private folder under the final name (torch may write external data beside it, named
    # after the model file), check, then move every file into place
    import shutil
    import tempfile
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        staged = tmpdir / path.name
        torch.onnx.export(model, args, str(staged), dynamo=True, dynamic_shapes=dynamic_shapes, opset_version=opset,
                          input_names=list(input_names or []) or None,
                          output_names=list(output_names or []) or None,
                          custom_translation_table={torch.ops.sdquant.int_linear.default: int_linear})
        onnx.checker.check_model(str(staged))
        for f in sorted(tmpdir.iterdir(), key=lambda f: f == staged):  # the model file last
            f.replace(path.parent / f.name)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return path


def export_seedance_onnx(model: torch.nn.Module, path, accuracy_level: int = 0) -> Path:
    """A (quantized) Seedance DiT with dynamic batch and time (T >= 3: the dual-branch graph)."""
    from sdquant.models.seedance import seedance_export_spec
    args, dyn, names, outs = seedance_export_spec(model)
    return export_module_onnx(model, args, path, dynamic_shapes=dyn, input_names=names, output_names=outs,
                              accuracy_level=accuracy_level)
