"""ONNX lowering of quantized decoders, driven token by token: Llama-family (llama, mistral, qwen2, qwen3) here,
Gemma 1/2/3-text, Phi-3, GPT-2, OPT and GPT-NeoX through ``onnx_families`` + ``onnx_family_graph`` (same
interface and linear lowering).

The graph is built directly with onnx.helper from ``sdquant.runtime.spec.decoder_spec`` (not traced): every
node is known, INT4/INT2/INT8 linears become ``com.microsoft::MatMulNBits`` (see ``onnx_ops``), FP8 linears
become float8 QuantizeLinear/DequantizeLinear pairs, float linears stay MatMul. Tracing HF models through
torch.onnx breaks with each transformers release; a hand-built graph of a known architecture does not.

Interface (the convention of Optimum / onnxruntime-genai decoders):

    inputs   input_ids                     int64  [batch, sequence]
             attention_mask                int64  [batch, total_sequence]     1 = real token, 0 = padding
             position_ids                  int64  [batch, sequence]
             past_key_values.{i}.key|value float  [batch, kv_heads, past_sequence, head_dim]
    outputs  logits                        float  [batch, sequence, vocab]
             present.{i}.key|value         float  [batch, kv_heads, total_sequence, head_dim]

total_sequence = past_sequence + sequence. Start with past_sequence = 0 (empty tensors), feed ``present`` back
as ``past`` each step. Left padding works: attention_mask masks padded keys, position_ids skip them.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from sdquant.errors import ConfigError
from sdquant.export.onnx_ops import GraphBuilder, OnnxExportError, linear_nodes
from sdquant.runtime.spec import SUPPORTED_FAMILIES as LLAMA_FAMILIES
from sdquant.runtime.spec import DecoderSpec, decoder_spec

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
META_FILE = "sdquant_onnx.json"
TWO_GB = 2 ** 31


@dataclass
class OnnxExportResult:
    """What was written. Path-like (``os.fspath(result)`` is the model file), so callers that expect a path
    (the CLI prints ``wrote <path>``) can use it as one."""
    path: Path                 # model.onnx
    external_data: bool
    n_matmulnbits: int
    n_fp8: int
    n_float_linear: int
    size_bytes: int            # model.onnx + external data

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


def export_onnx(model_or_package, out_dir: Union[str, os.PathLike], *, accuracy_level: int = 4, opset: int = 21,
                dtype: str = "float32", max_positions: Optional[int] = None,
                external_data: Union[bool, str] = "auto", check: bool = True, tokenizer=None,
                fuse: bool = True) -> OnnxExportResult:
    """Export a (quantized) HF decoder or a .sd2 package to ``out_dir/model.onnx``.

    accuracy_level: MatMulNBits' minimum accuracy of A: 0 = unset (ONNX Runtime computes in A's type),
        1 = fp32, 2 = fp16, 3 = bf16, 4 = int8 (A quantized per block to int8: fastest on CPU; moved SmolLM2's
        logits by up to 9% of the max logit, see docs/ONNX.md). 0 matches the PyTorch model to ~1e-6.
    opset: default-domain opset (>= 18; FP8 linears need >= 19).
    dtype: float32 (CPU) or float16 (CUDA provider) for activations, float weights, scales and KV cache.
    max_positions: size of the RoPE tables (default: config.max_position_embeddings, capped at 32768); GPT-2/OPT
        keep their learned position table.
    external_data: True, False or "auto" (weights go to model.onnx.data when the model is over 2 GB).
    tokenizer: a HF tokenizer saved next to the model (default: ``model.tokenizer`` when the model has one).
    fuse: one MatMulNBits for q/k/v and one for gate/up per layer where the weights allow (exact).
    """
    if not isinstance(accuracy_level, int) or not 0 <= accuracy_level <= 4:
        raise ConfigError("accuracy_level", f"must be an integer in 0..4, got {accuracy_level!r}")
    if not isinstance(opset, int) or opset < 18:
        raise ConfigError("opset", f"must be an integer >= 18, got {opset!r}")
    if dtype not in ("float32", "float16"):
        raise ConfigError("dtype", f"must be float32 or float16 for ONNX export, got {dtype!r}")
    if external_data not in (True, False, "auto"):
        raise ConfigError("external_data", f"must be true, false or 'auto', got {external_data!r}")
    model = _load(model_or_package)
    if getattr(getattr(model, "config", None), "model_type", None) in LLAMA_FAMILIES:
        spec = decoder_spec(model)
        d = spec.dims
        family, n_layers, n_kv, head_dim, vocab = d.family, d.n_layers, d.n_kv_heads, d.head_dim, d.vocab_size
        max_pos, build = d.max_position_embeddings, build_decoder_graph
    else:   # Gemma, Phi-3, GPT-2, OPT, GPT-NeoX (raises UnsupportedFamilyError for any other model_type)
        from sdquant.export.onnx_families import family_spec
        from sdquant.export.onnx_family_graph import build_family_graph
        spec = family_spec(model)
        family, n_layers, n_kv, head_dim, vocab = (spec.family, len(spec.layers), spec.n_kv_heads, spec.head_dim,
                                                   spec.vocab_size)
        max_pos, build = spec.max_position_embeddings, build_family_graph
    n_pos = max_positions or min(max_pos, 32768)
    if not isinstance(n_pos, int) or n_pos < 1:
        raise ConfigError("max_positions", f"must be a positive integer, got {max_positions!r}")
    gb, counts = build(spec, dtype=dtype, opset=opset, accuracy_level=accuracy_level, max_positions=n_pos, fuse=fuse)
    meta = {"format": "sdquant-onnx-decoder", "version": 1, "family": family, "n_layers": n_layers,
            "n_kv_heads": n_kv, "head_dim": head_dim, "vocab_size": vocab, "dtype": dtype, "opset": opset,
            "accuracy_level": accuracy_level, "max_positions": n_pos, "matmulnbits": counts[0],
            "fp8_qdq": counts[1], "float_linear": counts[2]}
    onnx_model = gb.make_model(f"sdquant_{family}_decoder", opset,
                               {k: json.dumps(v) if not isinstance(v, str) else v for k, v in meta.items()})
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is not None:
        meta["eos_token_id"] = eos
    res = _save(onnx_model, Path(out_dir), meta, external_data, check, counts)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(out_dir))
    return res


def _load(model_or_package):
    if isinstance(model_or_package, torch.nn.Module):
        return model_or_package
    if isinstance(model_or_package, (str, os.PathLike)):
        try:
            from sdquant.api import load
        except ImportError as e:  # pragma: no cover - the loader lands with the foundation issue
            raise OnnxExportError(f"cannot load {model_or_package}: sdquant.load is not available ({e})") from e
        return load(model_or_package, device="cpu", dtype=torch.float32)
    raise ConfigError("model", f"expected a torch model or a package path, got {type(model_or_package).__name__}")


# ------------------------------------------------------------------------------------------------- graph
def build_decoder_graph(spec: DecoderSpec, dtype="float32", opset=21, accuracy_level=4, max_positions=4096,
                        fuse: bool = True):
    """-> (GraphBuilder, (n_matmulnbits, n_fp8, n_float_linear)); counts are of the model's linears (a fused
    q/k/v is one node but three linears). fuse: q/k/v and gate/up as one node each where the weights allow."""
    import onnx
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    d = spec.dims
    gb = GraphBuilder(dtype)
    ft = gb.elem_type
    i64 = onnx.TensorProto.INT64
    ids = gb.add_input("input_ids", i64, ["batch", "sequence"])
    amask = gb.add_input("attention_mask", i64, ["batch", "total_sequence"])
    pos = gb.add_input("position_ids", i64, ["batch", "sequence"])
    past = []
    for i in range(d.n_layers):
        past.append(tuple(gb.add_input(f"past_key_values.{i}.{kv}", ft, ["batch", d.n_kv_heads, "past_sequence",
                                                                         d.head_dim]) for kv in ("key", "value")))
    gb.add_output("logits", ft, ["batch", "sequence", d.vocab_size])
    for i in range(d.n_layers):
        for kv in ("key", "value"):
            gb.add_output(f"present.{i}.{kv}", ft, ["batch", d.n_kv_heads, "total_sequence", d.head_dim])

    embed = gb.float_init("model.embed_tokens.weight", spec.embed)
    x = gb.op("Gather", [embed, ids], name="embed")                                       # [B, S, H]

    # RoPE tables from the model's own rotary module, gathered per token: [B, 1, S, hd]
    cos_t, sin_t = spec.rope_tables(max_positions)
    cos = gb.op("Unsqueeze", [gb.op("Gather", [gb.float_init("rope.cos", cos_t), pos]), gb.const([1])])
    sin = gb.op("Unsqueeze", [gb.op("Gather", [gb.float_init("rope.sin", sin_t), pos]), gb.const([1])])

    biases = {w: _mask_bias(gb, ids, amask, w) for w in sorted(set(d.sliding_window), key=lambda v: v or 0)}
    rep = d.n_heads // d.n_kv_heads
    scale = d.head_dim ** -0.5
    for i, L in enumerate(spec.layers):
        p = f"model.layers.{i}"
        lin = lambda mod, name, inp: linear_nodes(gb, inp, mod, f"{p}.{name}", accuracy_level, opset)  # noqa: E731
        h = _rms_norm(gb, x, L.input_norm, d.rms_eps, f"{p}.input_layernorm")
        q, k, v = _parallel_linears(gb, lin, h, [(L.q, "self_attn.q_proj"), (L.k, "self_attn.k_proj"),
                                                  (L.v, "self_attn.v_proj")], fuse, "self_attn.qkv_proj")
        q = _heads(gb, q, d.n_heads, d.head_dim)                                           # [B, S, nh, hd]
        k = _heads(gb, k, d.n_kv_heads, d.head_dim)
        v = _heads(gb, v, d.n_kv_heads, d.head_dim)
        if L.q_norm is not None:
            q = _rms_norm(gb, q, L.q_norm, d.rms_eps, f"{p}.self_attn.q_norm")
            k = _rms_norm(gb, k, L.k_norm, d.rms_eps, f"{p}.self_attn.k_norm")
        q = gb.op("Transpose", [q], perm=[0, 2, 1, 3])                                    # [B, nh, S, hd]
        k = gb.op("Transpose", [k], perm=[0, 2, 1, 3])                                    # [B, nkv, S, hd]
        v = gb.op("Transpose", [v], perm=[0, 2, 1, 3])
        q = _rope(gb, q, cos, sin, d.head_dim)
        k = _rope(gb, k, cos, sin, d.head_dim)
        k_all = gb.op("Concat", [past[i][0], k], axis=2, outputs=[f"present.{i}.key"])   # [B, nkv, T, hd]
        v_all = gb.op("Concat", [past[i][1], v], axis=2, outputs=[f"present.{i}.value"])
        k_all, v_all = f"present.{i}.key", f"present.{i}.value"
        # grouped-query attention without copying K/V: query heads of one KV head share a broadcast axis
        q5 = gb.op("Reshape", [gb.op("Mul", [q, gb.fconst(scale)]),
                               gb.const([0, d.n_kv_heads, rep, -1, d.head_dim])])         # [B, nkv, rep, S, hd]
        kt = gb.op("Unsqueeze", [gb.op("Transpose", [k_all], perm=[0, 1, 3, 2]), gb.const([2])])  # [B,nkv,1,hd,T]
        scores = gb.op("Add", [gb.op("MatMul", [q5, kt]), biases[d.sliding_window[i]]])    # [B, nkv, rep, S, T]
        probs = gb.op("Softmax", [scores], axis=-1)
        att = gb.op("MatMul", [probs, gb.op("Unsqueeze", [v_all, gb.const([2])])])        # [B, nkv, rep, S, hd]
        att = gb.op("Reshape", [att, gb.const([0, d.n_heads, -1, d.head_dim])])
        att = gb.op("Reshape", [gb.op("Transpose", [att], perm=[0, 2, 1, 3]), gb.const([0, 0, d.q_size])])
        x = gb.op("Add", [x, lin(L.o, "self_attn.o_proj", att)], name=f"{p}/residual1")
        h = _rms_norm(gb, x, L.post_norm, d.rms_eps, f"{p}.post_attention_layernorm")
        g, u = _parallel_linears(gb, lin, h, [(L.gate, "mlp.gate_proj"), (L.up, "mlp.up_proj")], fuse,
                                 "mlp.gate_up_proj")
        act = gb.op("Mul", [gb.op("Mul", [g, gb.op("Sigmoid", [g])]), u], name=f"{p}/silu_mul")
        x = gb.op("Add", [x, lin(L.down, "mlp.down_proj", act)], name=f"{p}/residual2")
    h = _rms_norm(gb, x, spec.final_norm, d.rms_eps, "model.norm")
    head = spec.lm_head
    if type(head) is torch.nn.Linear and d.tie_embeddings and head.weight.data_ptr() == spec.embed.data_ptr():
        # tied: reuse the embedding initializer instead of storing the matrix twice
        logits = gb.op("MatMul", [h, gb.op("Transpose", [embed], perm=[1, 0])], name="lm_head/MatMul")
    else:
        logits = linear_nodes(gb, h, head, "lm_head", accuracy_level, opset)
    gb.op("Identity", [logits], outputs=["logits"])
    mods = [m for L in spec.layers for m in (L.q, L.k, L.v, L.o, L.gate, L.up, L.down)] + [head]
    counts = (sum(isinstance(m, QuantLinear) for m in mods), sum(isinstance(m, Fp8Linear) for m in mods),
              sum(type(m) is torch.nn.Linear for m in mods))
    return gb, counts


def _parallel_linears(gb: GraphBuilder, lin, x: str, mods, fuse: bool, fused_name: str):
    """Outputs of several linears reading the same x. Fused into one node and split when the weights can be
    concatenated along N (same kind, bits, group size, act-order permutation): one larger GEMM per layer instead
    of two or three small ones, which is what decode on a CPU is short of. Exact: the same codes and scales."""
    from sdquant.runtime.model import ConcatLinear, fuse_linears
    if fuse:
        fused = fuse_linears([m for m, _ in mods])
        if not isinstance(fused, ConcatLinear):
            y = lin(fused, fused_name, x)
            sizes = [m.out_features for m, _ in mods]
            return gb.op("Split", [y, gb.const(sizes)], n_out=len(mods), axis=-1, name=f"{fused_name}/split")
    return [lin(m, name, x) for m, name in mods]


def _rms_norm(gb: GraphBuilder, x: str, weight, eps: float, prefix: str) -> str:
    """HF RMSNorm: in fp32, x * 1/sqrt(mean(x^2) + eps), cast back, times weight. The Pow/ReduceMean/Add/Sqrt/
    Div/Mul chain is the pattern ONNX Runtime fuses into SimplifiedLayerNormalization."""
    import onnx
    xf = x if gb.dtype == "float32" else gb.op("Cast", [x], to=onnx.TensorProto.FLOAT)
    f32 = lambda v: gb.const(v, np.float32)  # noqa: E731
    var = gb.op("ReduceMean", [gb.op("Pow", [xf, f32(2.0)]), gb.const([-1])], keepdims=1)
    y = gb.op("Div", [xf, gb.op("Sqrt", [gb.op("Add", [var, f32(eps)])])])
    if gb.dtype != "float32":
        y = gb.op("Cast", [y], to=gb.elem_type)
    return gb.op("Mul", [y, gb.float_init(f"{prefix}.weight", weight)], name=f"{prefix}/scale")


def _heads(gb, t, n, hd):
    return gb.op("Reshape", [t, gb.const([0, 0, n, hd])])


def _rope(gb, t, cos, sin, hd):
    """t * cos + rotate_half(t) * sin, rotate_half(t) = concat(-t2, t1) over the two halves of head_dim."""
    t1, t2 = gb.op("Split", [t, gb.const([hd // 2, hd // 2])], n_out=2, axis=-1)
    rot = gb.op("Concat", [gb.op("Neg", [t2]), t1], axis=-1)
    return gb.op("Add", [gb.op("Mul", [t, cos]), gb.op("Mul", [rot, sin])])


def _mask_bias(gb: GraphBuilder, ids: str, amask: str, window: Optional[int]) -> str:
    """Additive attention bias [B, 1, 1, S, T]: 0 where query i (cache index T-S+i) may see key j, else a large
    negative. Causal by cache index, padded keys masked by attention_mask, optional sliding window."""
    import onnx
    s = gb.op("Squeeze", [gb.op("Shape", [ids], start=1, end=2)])                         # scalar S
    t = gb.op("Squeeze", [gb.op("Shape", [amask], start=1, end=2)])                       # scalar T
    k_idx = gb.op("Range", [gb.const(0), t, gb.const(1)])                                  # [T]
    q_idx = gb.op("Range", [gb.op("Sub", [t, s]), t, gb.const(1)])                          # [S]
    qcol = gb.op("Unsqueeze", [q_idx, gb.const([1])])                                       # [S, 1]
    krow = gb.op("Unsqueeze", [k_idx, gb.const([0])])                                       # [1, T]
    allowed = gb.op("LessOrEqual", [krow, qcol])                                            # [S, T]
    if window is not None:
        allowed = gb.op("And", [allowed, gb.op("Greater", [krow, gb.op("Sub", [qcol, gb.const(window)])])])
    pad = gb.op("Cast", [amask], to=onnx.TensorProto.BOOL)                                  # [B, T]
    allowed = gb.op("And", [gb.op("Unsqueeze", [allowed, gb.const([0, 1, 2])]),              # [1, 1, 1, S, T]
                            gb.op("Unsqueeze", [pad, gb.const([1, 2, 3])])])                 # [B, 1, 1, 1, T]
    neg = float(np.finfo(gb.np_dtype).min)
    return gb.op("Where", [allowed, gb.fconst(0.0), gb.fconst(neg)], name=f"mask_bias_{window or 'full'}")


# -------------------------------------------------------------------------------------------------- save
def _save(onnx_model, out_dir: Path, meta: dict, external_data, check: bool, counts) -> OnnxExportResult:
    import onnx
    out_dir.mkdir(parents=True, exist_ok=True)
    size = sum(len(t.raw_data) for t in onnx_model.graph.initializer)
    use_ext = bool(external_data) if external_data != "auto" else size > TWO_GB - 256 * 2 ** 20
    tmp = Path(tempfile.mkdtemp(prefix=".onnx-tmp-", dir=out_dir))
    try:
        path = tmp / MODEL_FILE
        if use_ext:
            onnx.save_model(onnx_model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=DATA_FILE, size_threshold=1024)
        else:
            onnx.save_model(onnx_model, str(path))
        if check:
            onnx.checker.check_model(str(path))  # path form: works past 2 GB and checks external data
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        # the model file last: a reader that sees model.onnx sees its data file too
        for name in (DATA_FILE, META_FILE, MODEL_FILE):
            if (tmp / name).exists():
                os.replace(tmp / name, out_dir / name)
        if not use_ext and (out_dir / DATA_FILE).exists():
            os.remove(out_dir / DATA_FILE)   # stale data file from an earlier export to this folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum((out_dir / n).stat().st_size for n in (MODEL_FILE, DATA_FILE) if (out_dir / n).exists())
    return OnnxExportResult(out_dir / MODEL_FILE, use_ext, *counts, size_bytes=total)
