"""ONNX graph of a ``FamilySpec`` decoder (Gemma 1/2/3, Phi-3, GPT-2, OPT, GPT-NeoX), built node by node.

Same interface as the Llama-family graph (``sdquant.export.onnx``): input_ids / attention_mask / position_ids /
past_key_values.{i}.key|value in, logits / present.{i}.key|value out, dynamic batch and sequence axes; the
linears lower through ``onnx_ops.linear_nodes`` (INT4 -> MatMulNBits, FP8 -> float8 Q/DQ, float -> MatMul).
What differs per family is data in the spec: the norm (RMS, Gemma's (1+w) RMS, LayerNorm with bias), the
positions (RoPE tables, partial RoPE, learned tables with an offset), how q/k/v come out of one or three
linears, the MLP (gated or not; SiLU, GELU, GELU-tanh, ReLU), the residual layout (pre-LN, post-LN,
parallel), Gemma's embedding scale, sandwich norms, per-layer RoPE tables and logit softcaps.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from sdquant.export.onnx import _heads, _mask_bias, _parallel_linears, _rope
from sdquant.export.onnx_families import FamilyLayer, FamilySpec, Norm
from sdquant.export.onnx_ops import GraphBuilder, linear_nodes


def build_family_graph(spec: FamilySpec, dtype="float32", opset=21, accuracy_level=4, max_positions=4096,
                       fuse: bool = True):
    """-> (GraphBuilder, (n_matmulnbits, n_fp8, n_float_linear)); counts are of the model's linears."""
    import onnx
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    gb = GraphBuilder(dtype)
    ft = gb.elem_type
    i64 = onnx.TensorProto.INT64
    n_layers, nkv, hd = len(spec.layers), spec.n_kv_heads, spec.head_dim
    ids = gb.add_input("input_ids", i64, ["batch", "sequence"])
    amask = gb.add_input("attention_mask", i64, ["batch", "total_sequence"])
    pos = gb.add_input("position_ids", i64, ["batch", "sequence"])
    past = [tuple(gb.add_input(f"past_key_values.{i}.{kv}", ft, ["batch", nkv, "past_sequence", hd])
                  for kv in ("key", "value")) for i in range(n_layers)]
    gb.add_output("logits", ft, ["batch", "sequence", spec.vocab_size])
    for i in range(n_layers):
        for kv in ("key", "value"):
            gb.add_output(f"present.{i}.{kv}", ft, ["batch", nkv, "total_sequence", hd])
    lin = lambda lk, inp: linear_nodes(gb, inp, lk[0], lk[1], accuracy_level, opset)  # noqa: E731

    embed = gb.float_init("embed_tokens.weight", spec.embed)
    x = gb.op("Gather", [embed, ids], name="embed")                                           # [B, S, E]
    if spec.embed_scale is not None:
        x = gb.op("Mul", [x, gb.fconst(spec.embed_scale)], name="embed_scale")
    if spec.project_in is not None:
        x = lin(spec.project_in, x)                                                            # [B, S, H]
    if spec.pos_embed is not None:
        p = pos if not spec.pos_offset else gb.op("Add", [pos, gb.const(spec.pos_offset)])
        x = gb.op("Add", [x, gb.op("Gather", [gb.float_init("embed_positions.weight", spec.pos_embed), p])],
                  name="positions")
    ropes = {}
    keys = sorted({L.rope for L in spec.layers if L.rope is not None})
    if keys:
        tables = spec.rope_tables(max_positions)
        for key in keys:   # gathered per token once, shared by the layers using them: [B, 1, S, rotary_dim]
            cos, sin = tables[key]
            ropes[key] = tuple(gb.op("Unsqueeze", [gb.op("Gather", [gb.float_init(f"rope.{key}.{nm}", t), pos]),
                                                   gb.const([1])]) for nm, t in (("cos", cos), ("sin", sin)))
    biases = {w: _mask_bias(gb, ids, amask, w)
              for w in sorted({L.window for L in spec.layers}, key=lambda v: v or 0)}

    for i, L in enumerate(spec.layers):
        pre = f"layer{i}"
        if spec.residual == "post":        # OPT-350m: x = LN(x + attn(x)); x = LN(x + mlp(x))
            x = _norm(gb, gb.op("Add", [x, _attention(gb, spec, L, i, x, lin, ropes, biases, past[i], fuse)]),
                      L.attn_norm)
            x = _norm(gb, gb.op("Add", [x, _mlp(gb, spec, L, x, lin, fuse)]), L.mlp_norm)
            continue
        a = _attention(gb, spec, L, i, _norm(gb, x, L.attn_norm), lin, ropes, biases, past[i], fuse)
        if L.post_attn_norm is not None:
            a = _norm(gb, a, L.post_attn_norm)
        if spec.residual == "parallel":    # GPT-NeoX: x + attn(LN1(x)) + mlp(LN2(x))
            m = _mlp(gb, spec, L, _norm(gb, x, L.mlp_norm), lin, fuse)
            x = gb.op("Add", [gb.op("Add", [m, a]), x], name=f"{pre}/residual")
            continue
        x = gb.op("Add", [x, a], name=f"{pre}/residual1")
        m = _mlp(gb, spec, L, _norm(gb, x, L.mlp_norm), lin, fuse)
        if L.post_mlp_norm is not None:
            m = _norm(gb, m, L.post_mlp_norm)
        x = gb.op("Add", [x, m], name=f"{pre}/residual2")

    if spec.final_norm is not None:
        x = _norm(gb, x, spec.final_norm)
    if spec.project_out is not None:
        x = lin(spec.project_out, x)
    head = spec.lm_head
    if type(head) is torch.nn.Linear and head.weight.data_ptr() == spec.embed.data_ptr() and head.bias is None:
        # tied: reuse the embedding initializer instead of storing the matrix twice
        logits = gb.op("MatMul", [x, gb.op("Transpose", [embed], perm=[1, 0])], name="lm_head/MatMul")
    else:
        logits = linear_nodes(gb, x, head, "lm_head", accuracy_level, opset)
    if spec.final_softcap is not None:
        logits = _softcap(gb, logits, spec.final_softcap)
    gb.op("Identity", [logits], outputs=["logits"])
    mods = spec.linears()
    counts = (sum(isinstance(m, QuantLinear) for m in mods), sum(isinstance(m, Fp8Linear) for m in mods),
              sum(type(m) is torch.nn.Linear for m in mods))
    return gb, counts


def _attention(gb: GraphBuilder, spec: FamilySpec, L: FamilyLayer, i: int, h: str, lin, ropes, biases, past,
               fuse: bool) -> str:
    """Self-attention of one layer on normalized input h [B, S, H] -> o_proj output [B, S, H]; writes
    present.{i}.key|value [B, nkv, T, hd]."""
    nh, nkv, hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
    if L.qkv_layout == "separate":
        q, k, v = _parallel_linears(gb, lambda mod, name, inp: lin((mod, name), inp), h, L.qkv, fuse,
                                    L.qkv[0][1].rsplit(".", 1)[0] + ".qkv_proj")
        q, k, v = _heads(gb, q, nh, hd), _heads(gb, k, nkv, hd), _heads(gb, v, nkv, hd)      # [B, S, n, hd]
    elif L.qkv_layout == "concat":       # Phi-3 qkv_proj, GPT-2 c_attn: [q | k | v] along N
        y = lin(L.qkv[0], h)
        q, k, v = gb.op("Split", [y, gb.const([nh * hd, nkv * hd, nkv * hd])], n_out=3, axis=-1)
        q, k, v = _heads(gb, q, nh, hd), _heads(gb, k, nkv, hd), _heads(gb, v, nkv, hd)
    else:                                # GPT-NeoX: per head [q | k | v], i.e. view [B, S, nh, 3 * hd]
        y = _heads(gb, lin(L.qkv[0], h), nh, 3 * hd)
        q, k, v = gb.op("Split", [y, gb.const([hd, hd, hd])], n_out=3, axis=-1)
    if L.q_norm is not None:
        q, k = _norm(gb, q, L.q_norm), _norm(gb, k, L.k_norm)
    q = gb.op("Transpose", [q], perm=[0, 2, 1, 3])                                         # [B, nh, S, hd]
    k = gb.op("Transpose", [k], perm=[0, 2, 1, 3])                                         # [B, nkv, S, hd]
    v = gb.op("Transpose", [v], perm=[0, 2, 1, 3])
    if L.rope is not None:
        cos, sin = ropes[L.rope]
        q, k = _rope_partial(gb, q, cos, sin, hd, spec.rotary_dim), _rope_partial(gb, k, cos, sin, hd,
                                                                                 spec.rotary_dim)
    gb.op("Concat", [past[0], k], axis=2, outputs=[f"present.{i}.key"])                   # [B, nkv, T, hd]
    gb.op("Concat", [past[1], v], axis=2, outputs=[f"present.{i}.value"])
    k_all, v_all = f"present.{i}.key", f"present.{i}.value"
    # grouped-query attention without copying K/V: the query heads of one KV head share a broadcast axis
    rep = nh // nkv
    q5 = gb.op("Reshape", [gb.op("Mul", [q, gb.fconst(L.scale)]), gb.const([0, nkv, rep, -1, hd])])
    kt = gb.op("Unsqueeze", [gb.op("Transpose", [k_all], perm=[0, 1, 3, 2]), gb.const([2])])    # [B,nkv,1,hd,T]
    scores = gb.op("MatMul", [q5, kt])                                                     # [B, nkv, rep, S, T]
    if spec.attn_softcap is not None:
        scores = _softcap(gb, scores, spec.attn_softcap)
    probs = gb.op("Softmax", [gb.op("Add", [scores, biases[L.window]])], axis=-1)
    att = gb.op("MatMul", [probs, gb.op("Unsqueeze", [v_all, gb.const([2])])])            # [B, nkv, rep, S, hd]
    att = gb.op("Reshape", [att, gb.const([0, nh, -1, hd])])
    att = gb.op("Reshape", [gb.op("Transpose", [att], perm=[0, 2, 1, 3]), gb.const([0, 0, nh * hd])])
    return lin(L.o, att)


def _mlp(gb: GraphBuilder, spec: FamilySpec, L: FamilyLayer, h: str, lin, fuse: bool) -> str:
    if not spec.gated:
        return lin(L.down, _activation(gb, lin(L.mlp_in[0], h), spec.act))
    if len(L.mlp_in) == 2:
        g, u = _parallel_linears(gb, lambda mod, name, inp: lin((mod, name), inp), h, L.mlp_in, fuse,
                                 L.mlp_in[0][1].rsplit(".", 1)[0] + ".gate_up_proj")
    else:                                # Phi-3 gate_up_proj: [gate | up] along N
        i_size = spec.intermediate_size
        g, u = gb.op("Split", [lin(L.mlp_in[0], h), gb.const([i_size, i_size])], n_out=2, axis=-1)
    return lin(L.down, gb.op("Mul", [_activation(gb, g, spec.act), u]))


def _activation(gb: GraphBuilder, x: str, act: str) -> str:
    if act == "silu":
        return gb.op("Mul", [x, gb.op("Sigmoid", [x])], name="silu")
    if act == "relu":
        return gb.op("Relu", [x])
    half_x = gb.op("Mul", [x, gb.fconst(0.5)])
    if act == "gelu":                    # exact: 0.5 x (1 + erf(x / sqrt(2)))
        inner = gb.op("Erf", [gb.op("Mul", [x, gb.fconst(1.0 / math.sqrt(2.0))])])
    else:                                # tanh approximation (gelu_pytorch_tanh, gelu_new)
        cube = gb.op("Mul", [gb.op("Mul", [x, x]), x])
        z = gb.op("Mul", [gb.op("Add", [x, gb.op("Mul", [cube, gb.fconst(0.044715)])]),
                          gb.fconst(math.sqrt(2.0 / math.pi))])
        inner = gb.op("Tanh", [z])
    return gb.op("Mul", [half_x, gb.op("Add", [inner, gb.fconst(1.0)])], name=f"gelu_{act}")


def _softcap(gb: GraphBuilder, x: str, cap: float) -> str:
    """cap * tanh(x / cap) (Gemma-2 attention and final logits)."""
    return gb.op("Mul", [gb.op("Tanh", [gb.op("Div", [x, gb.fconst(cap)])]), gb.fconst(cap)], name="softcap")


def _rope_partial(gb: GraphBuilder, t: str, cos: str, sin: str, hd: int, rd: int) -> str:
    """RoPE on the first rd channels of head_dim, the rest passed through (Phi-3 / GPT-NeoX partial rotary)."""
    if rd == hd:
        return _rope(gb, t, cos, sin, hd)
    t_rot, t_pass = gb.op("Split", [t, gb.const([rd, hd - rd])], n_out=2, axis=-1)
    return gb.op("Concat", [_rope(gb, t_rot, cos, sin, rd), t_pass], axis=-1)


def _norm(gb: GraphBuilder, x: str, n: Norm) -> str:
    """RMSNorm in fp32 (Llama/Phi-3: cast back, then times w; Gemma: times (1 + w) in fp32, then cast), or
    LayerNorm (ONNX LayerNormalization, fp32 statistics) with its bias."""
    import onnx
    if n.kind == "layer":
        inputs = [x, gb.float_init(f"{n.name}.weight", n.weight)]
        if n.bias is not None:
            inputs.append(gb.float_init(f"{n.name}.bias", n.bias))
        return gb.op("LayerNormalization", inputs, axis=-1, epsilon=float(n.eps), name=n.name)
    xf = x if gb.dtype == "float32" else gb.op("Cast", [x], to=onnx.TensorProto.FLOAT)
    f32 = lambda v: gb.const(v, np.float32)  # noqa: E731
    var = gb.op("ReduceMean", [gb.op("Pow", [xf, f32(2.0)]), gb.const([-1])], keepdims=1)
    y = gb.op("Div", [xf, gb.op("Sqrt", [gb.op("Add", [var, f32(n.eps)])])])
    if n.kind == "rms1p":
        y = gb.op("Mul", [y, gb.initializer(f"{n.name}.weight_1p", (1.0 + n.weight.float()).numpy())],
                  name=f"{n.name}/scale")
        return y if gb.dtype == "float32" else gb.op("Cast", [y], to=gb.elem_type)
    if gb.dtype != "float32":
        y = gb.op("Cast", [y], to=gb.elem_type)
    return gb.op("Mul", [y, gb.float_init(f"{n.name}.weight", n.weight)], name=f"{n.name}/scale")
