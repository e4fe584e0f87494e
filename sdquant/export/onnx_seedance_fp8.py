"""FP8 (W8A8 e4m3) linears in the traced module exporter (``onnx_module``, used by the Seedance DiT).

``torch.onnx.export(dynamo=True)`` lowers ``sdquant::fp8_linear`` through a custom translation that emits one
placeholder node per layer (domain ``sdquant.fp8_placeholder``) holding the layer's graph values: x and the
initializers of weight (float8e4m3fn [N, K]), weight_scale (fp32 [N]), input_scale (fp32 scalar or absent =
dynamic per token) and bias. ``lower_fp8_placeholders`` then replaces every placeholder by the nodes of
``onnx_ops.fp8_linear_nodes`` — the lowering the LLM decoder exporters use, so both paths emit the same QDQ
pattern:

    dynamic:  s = max(ReduceMax(|x2|, axis 1) / 448, 1e-12)       [M, 1] per token (x2 = x as [M, K])
              xdq = DequantizeLinear(QuantizeLinear(x2 / s, 1, float8 zero)) * s
    static:   xdq = DequantizeLinear(QuantizeLinear(x2, s_in, float8 zero), s_in, float8 zero)
    weight:   wdq = DequantizeLinear(weight_fp8, weight_scale, axis=0)   [N, K] fp32
    y = MatMul(xdq, Transpose(wdq)) (+ bias), reshaped back to [..., N]

Why a placeholder and a rewrite instead of writing the pattern in onnxscript: the pattern then exists once
(``fp8_linear_nodes``), and every exporter that lowers an ``Fp8Linear`` gives the same graph.
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from sdquant.export.onnx_ops import GraphBuilder, OnnxExportError, fp8_linear_nodes
from sdquant.quant.qtensor import Fp8Weight

PLACEHOLDER_DOMAIN = "sdquant.fp8_placeholder"
PLACEHOLDER_OP = "Fp8Linear"
FP8_MIN_OPSET = 19      # float8 QuantizeLinear/DequantizeLinear
_NEW = "sdq_fp8/"       # prefix of every name the rewrite adds (kept apart from the traced graph's names)


def _placeholder_op():
    import onnxscript
    from onnx.defs import OpSchema

    fp = OpSchema.FormalParameter
    opt = OpSchema.FormalParameterOption.Optional
    schema = OpSchema(
        PLACEHOLDER_OP, PLACEHOLDER_DOMAIN, 1,
        inputs=[fp("x", "T"), fp("weight", "T8"), fp("weight_scale", "T"),
                fp("input_scale", "T", param_option=opt), fp("bias", "T", param_option=opt)],
        outputs=[fp("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("T8", ["tensor(float8e4m3fn)"], "")])
    return onnxscript.values.Op(onnxscript.values.Opset(PLACEHOLDER_DOMAIN, 1), PLACEHOLDER_OP, schema)


def fp8_translation_table() -> dict:
    """custom_translation_table entry for ``torch.onnx.export``: sdquant::fp8_linear -> placeholder node."""
    placeholder = _placeholder_op()

    def fp8_linear(x, weight, weight_scale, input_scale, bias):
        return placeholder(x, weight, weight_scale, input_scale, bias)

    return {torch.ops.sdquant.fp8_linear.default: fp8_linear}


def _value_types(graph) -> Dict[str, int]:
    types = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in graph.initializer:
        types[t.name] = t.data_type
    return types


def _init_tensor(init, layer: str, what: str) -> torch.Tensor:
    """An initializer as a torch tensor (float8 bytes reinterpreted exactly, no float round trip)."""
    import onnx
    from onnx import numpy_helper
    if init is None:
        raise OnnxExportError(f"{layer}: the FP8 {what} is not a constant initializer in the traced graph")
    if init.data_type == onnx.TensorProto.FLOAT8E4M3FN:
        arr = numpy_helper.to_array(init)
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(tuple(init.dims))
        return torch.from_numpy(raw.copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.array(numpy_helper.to_array(init), dtype=np.float32))


def _used_names(graph, acc: set) -> set:
    for n in graph.node:
        acc.update(n.input)
        for a in n.attribute:   # names read inside subgraphs (If/Loop bodies) count as uses too
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                _used_names(g, acc)
    acc.update(o.name for o in graph.output)
    return acc


def lower_fp8_placeholders(model, opset: int) -> int:
    """Replace every placeholder node of ``model`` (an onnx ModelProto, edited in place) by the float8 QDQ
    nodes of ``fp8_linear_nodes``; drop the initializers only the placeholders read. -> layers lowered."""
    import onnx
    graph = model.graph
    if opset < FP8_MIN_OPSET:
        raise OnnxExportError(f"opset {opset}: FP8 linears need opset >= {FP8_MIN_OPSET} "
                              f"(float8 QuantizeLinear/DequantizeLinear)")
    inits = {t.name: t for t in graph.initializer}
    types = _value_types(graph)
    taken = set(inits) | {i.name for i in graph.input} | {n.name for n in graph.node}
    taken.update(o for n in graph.node for o in n.output)
    gb = GraphBuilder("float32")  # one builder: the float8 zero point and shape constants are shared
    nodes: List = []
    n_lowered = 0
    for node in graph.node:
        if node.domain != PLACEHOLDER_DOMAIN:
            nodes.append(node)
            continue
        ins = list(node.input) + [""] * (5 - len(node.input))
        x, w, ws, xs, b = ins[:5]
        layer = w[:-len(".weight")] if w.endswith(".weight") else (w or node.name)
        if types.get(x, onnx.TensorProto.FLOAT) != onnx.TensorProto.FLOAT:
            raise OnnxExportError(f"{layer}: FP8 layers are exported in float32 graphs only (input is "
                                  f"{onnx.TensorProto.DataType.Name(types[x])}); export the float32 model")
        fw = Fp8Weight(_init_tensor(inits.get(w), layer, "weight"),
                       _init_tensor(inits.get(ws), layer, "weight_scale"),
                       _init_tensor(inits.get(xs), layer, "input_scale").reshape(()) if xs else None)
        bias = _init_tensor(inits.get(b), layer, "bias") if b else None
        start = len(gb.nodes)
        y = fp8_linear_nodes(gb, x, fw, layer, bias, opset)
        new = gb.nodes[start:]
        # gb's names live in their own namespace: prefix what it made, keep x, end on the placeholder's output
        own = {t.name for t in gb.initializers} | {o for n in new for o in n.output}
        for n in new:
            n.name = _NEW + n.name
            n.input[:] = [_NEW + v if v in own else v for v in n.input]
            n.output[:] = [node.output[0] if v == y else _NEW + v for v in n.output]
        nodes.extend(new)       # in place of the placeholder: they read x and initializers only
        n_lowered += 1
    if not n_lowered:
        return 0
    new_inits = []
    for t in gb.initializers:
        t.name = _NEW + t.name
        new_inits.append(t)
    clash = taken & ({t.name for t in new_inits} | {o for n in gb.nodes for o in n.output if o.startswith(_NEW)})
    if clash:
        raise OnnxExportError(f"FP8 lowering: names {sorted(clash)[:3]} already exist in the traced graph")
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(new_inits)
    used = _used_names(graph, set())
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    produced = {o for n in graph.node for o in n.output}
    hints = [vi for vi in graph.value_info if vi.name in produced]   # drop hints of values no longer made
    del graph.value_info[:]
    graph.value_info.extend(hints)
    imports = [o for o in model.opset_import if o.domain != PLACEHOLDER_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and o.version < FP8_MIN_OPSET:
            raise OnnxExportError(f"opset {o.version}: FP8 linears need opset >= {FP8_MIN_OPSET}")
    return n_lowered
