"""ONNX export of any module holding QuantLinear/Fp8Linear layers (e.g. a quantized Seedance DiT) through
``torch.onnx.export(dynamo=True)``: each ``sdquant::int_linear`` call becomes one ``com.microsoft::MatMulNBits``
node that reads the package's canonical tensors directly; each ``sdquant::fp8_linear`` call becomes the float8
e4m3 QuantizeLinear/DequantizeLinear + MatMul pattern of the LLM exporters (``onnx_seedance_fp8``, opset >= 19).

Why this works without repacking: the canonical 4-bit layout packs codes along K, low nibble first, one row
per output feature — exactly MatMulNBits' ``B`` once viewed as [N, K/block, block/2]; scales [N, G] flatten
to its [N * G] scales; integer zero points are given in the scales' float type (MatMulNBits accepts
unpacked zero points of type T1), and a symmetric layer omits them (MatMulNBits' default zero point is
2^(bits-1) = 8, the canonical symmetric zero). The LLM decoder exporter (``sdquant.export.onnx``) builds
its graphs node by node instead; this path serves models without a hand-written graph.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

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
        if isinstance(m, Fp8Linear) and m.weight.dtype != torch.float8_e4m3fn:
            raise SdquantError(f"{name}: FP8 weight is {m.weight.dtype}; the ONNX exporter needs float8_e4m3fn")
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
                       accuracy_level: int = 0, opset: Optional[int] = None,
                       postprocess: Optional[Callable] = None) -> Path:
    """Export ``model(*args)`` to ``path`` (written to a temporary name, checked, then renamed).

    opset: default-domain opset; default 18, or 21 when the model has FP8 layers (float8 Q/DQ need >= 19).
    postprocess: called with the traced onnx ModelProto (edited in place) before the check and the save."""
    import onnx
    from onnxscript import opset18 as op
    from sdquant.errors import ConfigError
    from sdquant.export import onnx_seedance_fp8 as fp8
    from sdquant.kernels.linear import Fp8Linear

    if accuracy_level not in (0, 1, 2, 3, 4):
        raise SdquantError(f"accuracy_level must be 0-4, got {accuracy_level}")
    check_exportable(model)
    has_fp8 = any(isinstance(m, Fp8Linear) for m in model.modules())
    opset = (21 if has_fp8 else 18) if opset is None else opset
    if has_fp8 and (not isinstance(opset, int) or opset < fp8.FP8_MIN_OPSET):
        raise ConfigError("opset", f"FP8 layers need opset >= {fp8.FP8_MIN_OPSET} (float8 QuantizeLinear), "
                                   f"got {opset!r}")
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
        table = {torch.ops.sdquant.int_linear.default: int_linear}
        if has_fp8:
            table.update(fp8.fp8_translation_table())
        torch.onnx.export(model, args, str(staged), dynamo=True, dynamic_shapes=dynamic_shapes, opset_version=opset,
                          input_names=list(input_names or []) or None,
                          output_names=list(output_names or []) or None,
                          custom_translation_table=table)
        if has_fp8 or postprocess is not None:
            proto = onnx.load(str(staged))          # external data (if torch wrote any) is read in too
            if has_fp8:
                fp8.lower_fp8_placeholders(proto, opset)
            if postprocess is not None:
                postprocess(proto)
            _resave(proto, tmpdir, staged)
        onnx.checker.check_model(str(staged))
        for f in sorted(tmpdir.iterdir(), key=lambda f: f == staged):  # the model file last
            f.replace(path.parent / f.name)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return path


def _resave(proto, folder: Path, staged: Path) -> None:
    """Write an edited model over the traced one: external data (one file) past ~1.75 GB, as the LLM exporter."""
    import onnx
    for f in folder.iterdir():   # onnx appends to an existing data file: start from an empty folder
        f.unlink()
    size = sum(len(t.raw_data) for t in proto.graph.initializer)
    if size > 2 ** 31 - 256 * 2 ** 20:
        onnx.save_model(proto, str(staged), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=staged.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(proto, str(staged))


def time_guard(input_name: str, axis: int, min_frames: int, graph_rule: str):
    """A postprocess step that makes the graph fail on fewer than ``min_frames`` along ``axis`` of an input:
    the traced graph is the one branch the example took, and on shorter clips it would run silently with the
    wrong semantics (Seedance: T < 3 is spatial-only in PyTorch, not the dual-branch graph that was exported).
    ONNX has no assert op, so a Reshape gets the target shape [1] when T >= min_frames and the invalid [-2]
    otherwise; its output (1.0) multiplies the input (exact). The node name carries the rule into ONNX
    Runtime's error message."""
    import onnx
    from onnx import helper, numpy_helper
    import numpy as np

    def apply(proto) -> None:
        g = proto.graph
        if input_name not in {i.name for i in g.input}:
            raise SdquantError(f"time guard: the graph has no input {input_name!r}")
        p = "sdq_guard/"
        checked = p + input_name
        for n in g.node:
            n.input[:] = [checked if v == input_name else v for v in n.input]
        inits = {p + "min": np.array([min_frames], np.int64), p + "ok_shape": np.array([1], np.int64),
                 p + "bad_shape": np.array([-2], np.int64), p + "one": np.array([1.0], np.float32)}
        g.initializer.extend(numpy_helper.from_array(v, k) for k, v in inits.items())
        guard = [
            helper.make_node("Shape", [input_name], [p + "t"], name=p + "time", start=axis, end=axis + 1),
            helper.make_node("GreaterOrEqual", [p + "t", p + "min"], [p + "ok"], name=p + "time_ok"),
            helper.make_node("Where", [p + "ok", p + "ok_shape", p + "bad_shape"], [p + "shape"], name=p + "pick"),
            helper.make_node("Reshape", [p + "one", p + "shape"], [p + "unit"], name=graph_rule),
            helper.make_node("Mul", [input_name, p + "unit"], [checked], name=p + "apply"),
        ]
        elem = next(i for i in g.input if i.name == input_name).type.tensor_type.elem_type
        if elem != onnx.TensorProto.FLOAT:
            guard.insert(4, helper.make_node("CastLike", [p + "unit", input_name], [p + "unit_t"], name=p + "cast"))
            guard[-1].input[1] = p + "unit_t"
        nodes = guard + list(g.node)
        del g.node[:]
        g.node.extend(nodes)
    return apply


def export_seedance_onnx(model: torch.nn.Module, path, accuracy_level: int = 0, opset: Optional[int] = None) -> Path:
    """A (quantized: INT4 or FP8) Seedance DiT with dynamic batch and time. The graph is the dual-branch one
    (T >= 3); running it on fewer frames fails in ONNX Runtime at the node named ``seedance_needs_T_ge_3...``
    (export the spatial-only model separately for T < 3)."""
    from sdquant.models.seedance import MIN_TEMPORAL_FRAMES, seedance_export_spec
    args, dyn, names, outs = seedance_export_spec(model)
    rule = f"seedance_needs_T_ge_{MIN_TEMPORAL_FRAMES}_frames_this_graph_is_the_dual_branch_one"
    return export_module_onnx(model, args, path, dynamic_shapes=dyn, input_names=names, output_names=outs,
                              accuracy_level=accuracy_level, opset=opset,
                              postprocess=time_guard("x", 1, MIN_TEMPORAL_FRAMES, rule))
