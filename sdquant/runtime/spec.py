"""What a Llama-family decoder *is*, read once from a Hugging Face model: dimensions plus the modules that
hold its weights (nn.Linear, QuantLinear or Fp8Linear). The sdquant runtime and the ONNX exporter are both
built from this one description, so they agree on the architecture by construction.

Supported families (``config.model_type``): llama, mistral, qwen2, qwen3. They differ only in data:
q/k/v biases (qwen2), per-head q/k RMSNorm before RoPE (qwen3), sliding-window attention (mistral, qwen2
with use_sliding_window). RoPE tables come from the model's own rotary module, so every rope_type the HF
model supports with a position-only table (default, llama3, linear, yarn, ...) is reproduced exactly;
length-dependent ones (dynamic, longrope) are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn

from sdquant.errors import SdquantError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(SdquantError):
    """A model whose architecture the runtime / ONNX exporter does not implement."""


@dataclass
class DecoderDims:
    family: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    tie_embeddings: bool
    qk_norm: bool = False
    sliding_window: List[Optional[int]] = field(default_factory=list)  # per layer; None = full attention
    max_position_embeddings: int = 4096

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass
class LayerModules:
    input_norm: torch.Tensor          # [H]
    post_norm: torch.Tensor           # [H]
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module
    q_norm: Optional[torch.Tensor] = None   # [head_dim] (qwen3)
    k_norm: Optional[torch.Tensor] = None


@dataclass
class DecoderSpec:
    dims: DecoderDims
    embed: torch.Tensor               # [V, H]
    layers: List[LayerModules]
    final_norm: torch.Tensor          # [H]
    lm_head: nn.Module                # nn.Linear (usually bf16/fp32) or a quantized linear
    rotary: nn.Module                 # the HF rotary module: rotary(x, position_ids) -> (cos, sin)

    def rope_tables(self, n_positions: int, dtype=torch.float32, device="cpu"):
        """cos, sin [n_positions, head_dim] computed by the model's own rotary module (exact for any rope_type)."""
        pos = torch.arange(n_positions, device=device)[None]
        x = torch.zeros(1, dtype=torch.float32, device=device)
        rot = self.rotary
        with torch.no_grad():
            cos, sin = rot(x, pos)
        return cos[0].to(dtype), sin[0].to(dtype)


def _get(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def decoder_spec(model: nn.Module) -> DecoderSpec:
    """Read a HF *ForCausalLM of a supported family (linears may already be quantized)."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(f"model_type {family!r} is not supported by the sdquant runtime / ONNX "
                                    f"exporter (supported: {', '.join(SUPPORTED_FAMILIES)})")
    act = _get(cfg, "hidden_act", default="silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"config.hidden_act: {act!r} is not supported (the runtime implements SiLU MLPs)")
    base = model.model
    rope_type = getattr(base.rotary_emb, "rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        # these recompute the table from the current sequence length; one fixed table would silently differ
        raise UnsupportedModelError(f"config.rope_parameters: rope_type {rope_type!r} changes the RoPE table with "
                                    f"the sequence length; the runtime and ONNX graph use one fixed table")
    n_heads = cfg.num_attention_heads
    head_dim = _get(cfg, "head_dim", default=cfg.hidden_size // n_heads)
    n_layers = cfg.num_hidden_layers
    window = _get(cfg, "sliding_window")
    if family == "qwen2" and not getattr(cfg, "use_sliding_window", False):
        window = None
    layer_types = getattr(cfg, "layer_types", None)
    windows = []
    for i in range(n_layers):
        sliding = window is not None and (layer_types is None or layer_types[i] == "sliding_attention")
        windows.append(int(window) if sliding else None)
    dims = DecoderDims(
        family=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=_get(cfg, "num_key_value_heads", default=n_heads), head_dim=head_dim,
        intermediate_size=cfg.intermediate_size, rms_eps=float(_get(cfg, "rms_norm_eps", default=1e-6)),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), qk_norm=family == "qwen3",
        sliding_window=windows, max_position_embeddings=int(_get(cfg, "max_position_embeddings", default=4096)))
    layers = []
    for i, blk in enumerate(base.layers):
        at, mlp = blk.self_attn, blk.mlp
        layers.append(LayerModules(
            input_norm=blk.input_layernorm.weight.detach(), post_norm=blk.post_attention_layernorm.weight.detach(),
            q=at.q_proj, k=at.k_proj, v=at.v_proj, o=at.o_proj, gate=mlp.gate_proj, up=mlp.up_proj,
            down=mlp.down_proj,
            q_norm=at.q_norm.weight.detach() if dims.qk_norm else None,
            k_norm=at.k_norm.weight.detach() if dims.qk_norm else None))
    return DecoderSpec(dims=dims, embed=base.embed_tokens.weight.detach(), layers=layers,
                       final_norm=base.norm.weight.detach(), lm_head=model.lm_head, rotary=base.rotary_emb)
