"""What a non-Llama decoder *is*, for the ONNX exporter: Gemma (1, 2, 3 text), Phi-3, GPT-2, OPT and GPT-NeoX
read from a Hugging Face model into one ``FamilySpec`` (dimensions, norms, linears, positions), which
``onnx_family_graph.build_family_graph`` lowers node by node. Llama-family models (llama, mistral, qwen2,
qwen3) keep their own path (``sdquant.runtime.spec`` + ``onnx.build_decoder_graph``).

The families differ only in data here:

    family       norm             positions               attention                 MLP
    gemma        (1+w)·RMS        RoPE                    q/k/v, head_dim free      gelu-tanh(gate)·up; embed·√H
    gemma2       (1+w)·RMS ×4     RoPE                    + logit softcap, windows  + final logit softcap
    gemma3_text  (1+w)·RMS ×4     RoPE local/global       + per-head q/k norm       (sliding layers' own RoPE)
    phi3         RMS              RoPE (partial)          fused qkv_proj            fused gate_up_proj, SiLU
    gpt2         LayerNorm+bias   learned                 fused c_attn (Conv1D)     gelu_new, not gated
    opt          LayerNorm+bias   learned, offset 2       q/k/v + biases            ReLU; pre- or post-LN
    gpt_neox     LayerNorm+bias   RoPE (partial)          fused, per-head q|k|v     GELU; parallel residual

Everything that changes the function and is not implemented is refused with an ``OnnxExportError`` naming
the config field (e.g. length-dependent RoPE such as ``longrope``/``dynamic``, Gemma-3 bidirectional
attention, GPT-2 cross-attention).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from sdquant.export.onnx_ops import OnnxExportError
from sdquant.runtime.spec import SUPPORTED_FAMILIES as LLAMA_FAMILIES
from sdquant.runtime.spec import UnsupportedModelError

Lin = Tuple[nn.Module, str]          # a linear module and its dotted name (initializer prefix)

# HF activation name -> the graph's activation
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
# RoPE whose tables depend on the current sequence length, not only on the position: one table cannot hold it
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class UnsupportedFamilyError(OnnxExportError, UnsupportedModelError):
    """A model_type the ONNX exporter has no graph for (also an ``UnsupportedModelError``, as the Llama-family
    reader raises for the same condition)."""


@dataclass
class Norm:
    kind: str                        # "rms": w·x̂ | "rms1p": (1+w)·x̂ in fp32 (Gemma) | "layer": LayerNorm
    weight: torch.Tensor             # [D] (ones for a LayerNorm without elementwise affine)
    bias: Optional[torch.Tensor]     # [D] (LayerNorm only)
    eps: float
    name: str


@dataclass
class FamilyLayer:
    attn_norm: Norm
    qkv: List[Lin]                   # (q, k, v) or one fused linear
    qkv_layout: str                  # "separate" | "concat" (q|k|v along N) | "per_head" (GPT-NeoX [nh, q|k|v])
    o: Lin
    mlp_norm: Norm
    mlp_in: List[Lin]                # gated: (gate, up) or one fused gate|up; plain: (fc,)
    down: Lin
    scale: float                     # attention score scale (GPT-2's inverse-layer-index scaling included)
    window: Optional[int] = None     # sliding window (keys with distance < window), None = full
    rope: Optional[str] = None       # key of the RoPE table this layer uses; None for learned positions
    post_attn_norm: Optional[Norm] = None   # Gemma-2/3 sandwich norms on the branch outputs
    post_mlp_norm: Optional[Norm] = None
    q_norm: Optional[Norm] = None    # Gemma-3 per-head norms before RoPE
    k_norm: Optional[Norm] = None


@dataclass
class FamilySpec:
    family: str
    vocab_size: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    act: str                         # a value of ACTIVATIONS
    gated: bool                      # act(gate) * up, else act(fc)
    residual: str                    # "pre" (pre-LN) | "post" (OPT-350m post-LN) | "parallel" (GPT-NeoX)
    embed: torch.Tensor              # [V, E]
    layers: List[FamilyLayer]
    lm_head: nn.Module
    final_norm: Optional[Norm]
    max_position_embeddings: int
    embed_scale: Optional[float] = None          # Gemma: √H rounded to the weight dtype
    pos_embed: Optional[torch.Tensor] = None     # [P, H] learned positions (GPT-2, OPT)
    pos_offset: int = 0                          # OPT reads row position + 2
    rope_tables: Optional[Callable[[int], Dict[str, Tuple[torch.Tensor, torch.Tensor]]]] = None
    rotary_dim: int = 0                          # leading head_dim channels that RoPE rotates
    attn_softcap: Optional[float] = None         # Gemma-2: cap·tanh(scores/cap)
    final_softcap: Optional[float] = None
    project_in: Optional[Lin] = None             # OPT word_embed_proj_dim != hidden
    project_out: Optional[Lin] = None

    def linears(self) -> List[nn.Module]:
        mods = [m for L in self.layers for m, _ in (*L.qkv, L.o, *L.mlp_in, L.down)]
        mods += [p[0] for p in (self.project_in, self.project_out) if p is not None]
        return mods + [self.lm_head]


def supported_families() -> Tuple[str, ...]:
    return tuple(LLAMA_FAMILIES) + tuple(READERS)


def family_spec(model: nn.Module) -> FamilySpec:
    """Read a HF *ForCausalLM of a family in READERS (linears may already be quantized)."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family not in READERS:
        raise UnsupportedFamilyError(f"model_type {family!r} cannot be exported to ONNX (supported: "
                                     f"{', '.join(supported_families())})")
    return READERS[family](model, cfg)


# ------------------------------------------------------------------------------------------- helpers
def _act(cfg, field_name: str) -> str:
    name = getattr(cfg, field_name, None)
    if name not in ACTIVATIONS:
        raise OnnxExportError(f"config.{field_name}: activation {name!r} is not supported by the ONNX exporter "
                              f"(supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def _norm(mod: nn.Module, kind: str, name: str) -> Norm:
    w = getattr(mod, "weight", None)
    b = getattr(mod, "bias", None)
    if w is None and kind == "layer":   # LayerNorm without elementwise affine: unit scale, no bias
        w = torch.ones(tuple(mod.normalized_shape))
    eps = getattr(mod, "eps", None)
    if eps is None:
        eps = getattr(mod, "variance_epsilon", 1e-6)
    return Norm(kind, None if w is None else w.detach(), None if b is None else b.detach(), float(eps), name)


def _check_rope(rotary: nn.Module, field_name: str = "rope_parameters") -> None:
    types = rotary.rope_type if isinstance(rotary.rope_type, dict) else {"": rotary.rope_type}
    for t in types.values():
        if t in _LENGTH_DEPENDENT_ROPE:
            raise OnnxExportError(f"config.{field_name}: rope_type {t!r} changes the RoPE table with the sequence "
                                  f"length, which a fixed-table ONNX graph cannot reproduce")


def _rope_fn(rotary: nn.Module, layer_types: Optional[List[str]] = None):
    """n_positions -> {table key: (cos, sin) [n_positions, rotary_dim]} from the model's own rotary module
    (exact for every static rope_type). Gemma-3 has one table per layer type."""
    def tables(n: int):
        pos = torch.arange(n)[None]
        x = torch.zeros(1, dtype=torch.float32)
        out = {}
        with torch.no_grad():
            for key in (sorted(set(layer_types)) if layer_types else ["rope"]):
                cos, sin = rotary(x, pos, key) if layer_types else rotary(x, pos)
                out[key] = (cos[0].float(), sin[0].float())
        return out
    return tables


def _rotary_dim(rotary: nn.Module, layer_types=None) -> int:
    return next(iter(_rope_fn(rotary, layer_types)(1).values()))[0].shape[-1]


def _windows(cfg, n_layers: int) -> List[Optional[int]]:
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    return [int(window) if window is not None and (types is None or types[i] == "sliding_attention") else None
            for i in range(n_layers)]


def _conv1d_as_linear(mod: nn.Module) -> nn.Module:
    """transformers' Conv1D (GPT-2, weight [in, out]) as the equivalent nn.Linear; sdquant's loaders convert
    them already (``models.hf.convert_conv1d``), a raw HF GPT-2 still has them."""
    if type(mod).__name__ != "Conv1D":
        return mod
    k, n = mod.weight.shape
    lin = nn.Linear(k, n, bias=mod.bias is not None)
    lin.weight = nn.Parameter(mod.weight.detach().t(), requires_grad=False)
    if mod.bias is not None:
        lin.bias = nn.Parameter(mod.bias.detach(), requires_grad=False)
    return lin


def _lin(root: nn.Module, path: str, prefix: str) -> Lin:
    return _conv1d_as_linear(root.get_submodule(path)), f"{prefix}.{path}"


# ------------------------------------------------------------------------------------------- readers
def _gemma(model, cfg) -> FamilySpec:
    fam = cfg.model_type
    base = model.model
    if getattr(cfg, "use_bidirectional_attention", False):
        raise OnnxExportError(f"config.use_bidirectional_attention: {fam} with bidirectional attention is not a "
                              f"causal decoder; the ONNX exporter supports causal attention only")
    act = _act(cfg, "hidden_act" if fam == "gemma" else "hidden_activation")
    _check_rope(base.rotary_emb)
    n = cfg.num_hidden_layers
    types = list(cfg.layer_types) if fam == "gemma3_text" else None
    windows = _windows(cfg, n) if fam != "gemma" else [None] * n
    layers = []
    for i, blk in enumerate(base.layers):
        p = f"model.layers.{i}"
        at = blk.self_attn
        four = fam != "gemma"   # gemma2/3: post-attention and pre/post-feedforward sandwich norms
        layers.append(FamilyLayer(
            attn_norm=_norm(blk.input_layernorm, "rms1p", f"{p}.input_layernorm"),
            qkv=[_lin(blk, f"self_attn.{x}_proj", p) for x in "qkv"], qkv_layout="separate",
            o=_lin(blk, "self_attn.o_proj", p),
            mlp_norm=_norm(blk.pre_feedforward_layernorm if four else blk.post_attention_layernorm, "rms1p",
                           f"{p}.{'pre_feedforward' if four else 'post_attention'}_layernorm"),
            mlp_in=[_lin(blk, "mlp.gate_proj", p), _lin(blk, "mlp.up_proj", p)], down=_lin(blk, "mlp.down_proj", p),
            scale=float(at.scaling), window=windows[i], rope=types[i] if types else "rope",
            post_attn_norm=_norm(blk.post_attention_layernorm, "rms1p", f"{p}.post_attention_layernorm")
            if four else None,
            post_mlp_norm=_norm(blk.post_feedforward_layernorm, "rms1p", f"{p}.post_feedforward_layernorm")
            if four else None,
            q_norm=_norm(at.q_norm, "rms1p", f"{p}.self_attn.q_norm") if fam == "gemma3_text" else None,
            k_norm=_norm(at.k_norm, "rms1p", f"{p}.self_attn.k_norm") if fam == "gemma3_text" else None))
    emb = base.embed_tokens
    # HF multiplies by the scale cast to the weight dtype (bf16 rounds √3072 to 55.5): reproduce that value
    scale = getattr(emb, "embed_scale", torch.tensor(cfg.hidden_size ** 0.5))
    return FamilySpec(
        family=fam, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        act=act, gated=True, residual="pre", embed=emb.weight.detach(), layers=layers, lm_head=model.lm_head,
        final_norm=_norm(base.norm, "rms1p", "model.norm"),
        max_position_embeddings=int(cfg.max_position_embeddings),
        embed_scale=float(scale.to(emb.weight.dtype)), rope_tables=_rope_fn(base.rotary_emb, types),
        rotary_dim=_rotary_dim(base.rotary_emb, types),
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if fam == "gemma2" else None,  # gemma3: unused
        final_softcap=getattr(cfg, "final_logit_softcapping", None) if fam != "gemma" else None)


def _phi3(model, cfg) -> FamilySpec:
    base = model.model
    _check_rope(base.rotary_emb)
    windows = [None if cfg.sliding_window is None else int(cfg.sliding_window)] * cfg.num_hidden_layers
    layers = []
    for i, blk in enumerate(base.layers):
        p = f"model.layers.{i}"
        layers.append(FamilyLayer(
            attn_norm=_norm(blk.input_layernorm, "rms", f"{p}.input_layernorm"),
            qkv=[_lin(blk, "self_attn.qkv_proj", p)], qkv_layout="concat", o=_lin(blk, "self_attn.o_proj", p),
            mlp_norm=_norm(blk.post_attention_layernorm, "rms", f"{p}.post_attention_layernorm"),
            mlp_in=[_lin(blk, "mlp.gate_up_proj", p)], down=_lin(blk, "mlp.down_proj", p),
            scale=float(blk.self_attn.scaling), window=windows[i], rope="rope"))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return FamilySpec(
        family="phi3", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads, head_dim=head_dim, intermediate_size=cfg.intermediate_size,
        act=_act(cfg, "hidden_act"), gated=True, residual="pre", embed=base.embed_tokens.weight.detach(),
        layers=layers, lm_head=model.lm_head, final_norm=_norm(base.norm, "rms", "model.norm"),
        max_position_embeddings=int(cfg.max_position_embeddings), rope_tables=_rope_fn(base.rotary_emb),
        rotary_dim=_rotary_dim(base.rotary_emb))


def _gpt2(model, cfg) -> FamilySpec:
    base = model.transformer
    if getattr(cfg, "add_cross_attention", False):
        raise OnnxExportError("config.add_cross_attention: GPT-2 with cross-attention is an encoder-decoder "
                              "block; the ONNX exporter supports decoder-only GPT-2")
    layers = []
    for i, blk in enumerate(base.h):
        p = f"transformer.h.{i}"
        layers.append(FamilyLayer(
            attn_norm=_norm(blk.ln_1, "layer", f"{p}.ln_1"), qkv=[_lin(blk, "attn.c_attn", p)],
            qkv_layout="concat", o=_lin(blk, "attn.c_proj", p), mlp_norm=_norm(blk.ln_2, "layer", f"{p}.ln_2"),
            mlp_in=[_lin(blk, "mlp.c_fc", p)], down=_lin(blk, "mlp.c_proj", p), scale=float(blk.attn.scaling)))
    inner = cfg.n_inner or 4 * cfg.n_embd
    return FamilySpec(
        family="gpt2", vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, n_heads=cfg.n_head, n_kv_heads=cfg.n_head,
        head_dim=cfg.n_embd // cfg.n_head, intermediate_size=inner, act=_act(cfg, "activation_function"),
        gated=False, residual="pre", embed=base.wte.weight.detach(), layers=layers, lm_head=model.lm_head,
        final_norm=_norm(base.ln_f, "layer", "transformer.ln_f"), max_position_embeddings=int(cfg.n_positions),
        pos_embed=base.wpe.weight.detach())


def _opt(model, cfg) -> FamilySpec:
    dec = model.model.decoder
    layers = []
    for i, blk in enumerate(dec.layers):
        p = f"model.decoder.layers.{i}"
        layers.append(FamilyLayer(
            attn_norm=_norm(blk.self_attn_layer_norm, "layer", f"{p}.self_attn_layer_norm"),
            qkv=[_lin(blk, f"self_attn.{x}_proj", p) for x in "qkv"], qkv_layout="separate",
            o=_lin(blk, "self_attn.out_proj", p),
            mlp_norm=_norm(blk.final_layer_norm, "layer", f"{p}.final_layer_norm"),
            mlp_in=[_lin(blk, "fc1", p)], down=_lin(blk, "fc2", p), scale=float(blk.self_attn.scaling)))
    pre = bool(cfg.do_layer_norm_before)
    proj = lambda name: None if getattr(dec, name, None) is None else (dec.get_submodule(name),  # noqa: E731
                                                                        f"model.decoder.{name}")
    return FamilySpec(
        family="opt", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_attention_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.ffn_dim, act=_act(cfg, "activation_function"), gated=False,
        residual="pre" if pre else "post", embed=dec.embed_tokens.weight.detach(), layers=layers,
        lm_head=model.lm_head,
        final_norm=None if dec.final_layer_norm is None else _norm(dec.final_layer_norm, "layer",
                                                                   "model.decoder.final_layer_norm"),
        max_position_embeddings=int(cfg.max_position_embeddings), pos_embed=dec.embed_positions.weight.detach(),
        pos_offset=int(getattr(dec.embed_positions, "offset", 2)), project_in=proj("project_in"),
        project_out=proj("project_out"))


def _gpt_neox(model, cfg) -> FamilySpec:
    base = model.gpt_neox
    _check_rope(base.rotary_emb)
    layers = []
    for i, blk in enumerate(base.layers):
        p = f"gpt_neox.layers.{i}"
        layers.append(FamilyLayer(
            attn_norm=_norm(blk.input_layernorm, "layer", f"{p}.input_layernorm"),
            qkv=[_lin(blk, "attention.query_key_value", p)], qkv_layout="per_head",
            o=_lin(blk, "attention.dense", p),
            mlp_norm=_norm(blk.post_attention_layernorm, "layer", f"{p}.post_attention_layernorm"),
            mlp_in=[_lin(blk, "mlp.dense_h_to_4h", p)], down=_lin(blk, "mlp.dense_4h_to_h", p),
            scale=float(blk.attention.scaling), rope="rope"))
    return FamilySpec(
        family="gpt_neox", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_attention_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads, intermediate_size=cfg.intermediate_size,
        act=_act(cfg, "hidden_act"), gated=False, residual="parallel" if cfg.use_parallel_residual else "pre",
        embed=base.embed_in.weight.detach(), layers=layers, lm_head=model.get_output_embeddings(),
        final_norm=_norm(base.final_layer_norm, "layer", "gpt_neox.final_layer_norm"),
        max_position_embeddings=int(cfg.max_position_embeddings), rope_tables=_rope_fn(base.rotary_emb),
        rotary_dim=_rotary_dim(base.rotary_emb))


READERS = {"gemma": _gemma, "gemma2": _gemma, "gemma3_text": _gemma, "phi3": _phi3, "gpt2": _gpt2, "opt": _opt,
           "gpt_neox": _gpt_neox}
