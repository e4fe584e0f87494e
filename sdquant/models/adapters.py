"""Architecture adapters as data.

An adapter says, for one model family: where the transformer blocks are, which norm/linear feeds which
linears inside a block (the AWQ scaling groups), how a scale folds into that previous op, and which layers
stay in high precision by default. There are no subclasses per model; the one block walker reads this data.

    Adapter("llama", blocks="model.layers", groups=(
        Group("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        ...))

A group whose ``prev`` is None feeds its linears from something that cannot take a folded scale (e.g. the
previous block's LayerNorm in a post-LN encoder); the recipe then keeps an explicit per-channel multiply
(QuantLinear ``smooth``) or skips the group.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
from torch import nn

log = logging.getLogger("sdquant.models")

# How a per-input-channel scale s folds into the op before the linears, so that prev(x) / s feeds W * s:
#   "norm"          y = w * norm(x) + b          -> w /= s, b /= s
#   "norm_one_plus" y = (1 + w) * norm(x)        -> w = (1 + w) / s - 1          (Gemma)
#   "linear"        y = x W^T + b (rows = outputs) -> W[rows] /= s, b /= s
FOLD_KINDS = ("norm", "norm_one_plus", "linear")


@dataclass(frozen=True)
class Group:
    prev: Optional[str]                 # module name relative to the block, or None (cannot fold)
    linears: Tuple[str, ...]            # relative names of the linears that read prev's output
    inspect: str                        # relative name of the module whose output is the loss target
    fold: str = "norm"                  # one of FOLD_KINDS


@dataclass(frozen=True)
class Adapter:
    family: str
    blocks: str                                     # dotted path of the ModuleList of blocks
    groups: Tuple[Group, ...] = ()
    keep: Tuple[str, ...] = (r"(^|\.)lm_head$", r"embed")   # high precision by default (regex, re.search)
    final_norm: Optional[str] = None
    notes: str = ""


def _llama_like(family: str, fold: str = "norm", mlp_norm: str = "post_attention_layernorm") -> Adapter:
    return Adapter(family, "model.layers", (
        Group("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn", fold),
        # v -> o is exact only when v_proj's outputs are o_proj's inputs (no GQA); the walker checks shapes
        Group("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", "linear"),
        Group(mlp_norm, ("mlp.gate_proj", "mlp.up_proj"), "mlp", fold),
        # down_proj's input is act(gate) * up: linear in up's output, so up's rows take the scale exactly
        Group("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj", "linear"),
    ), final_norm="model.norm")


ADAPTERS = {
    "llama": _llama_like("llama"),
    "mistral": _llama_like("mistral"),
    "qwen2": _llama_like("qwen2"),
    "qwen3": _llama_like("qwen3"),
    "gemma": _llama_like("gemma", "norm_one_plus"),
    "gemma2": _llama_like("gemma2", "norm_one_plus", "pre_feedforward_layernorm"),
    "gemma3_text": _llama_like("gemma3_text", "norm_one_plus", "pre_feedforward_layernorm"),
    "phi3": Adapter("phi3", "model.layers", (
        Group("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
        Group("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
    ), final_norm="model.norm",
        notes="fused qkv/gate_up: v->o and up->down are not foldable (only part of the fused rows feed them)"),
    "gpt2": Adapter("gpt2", "transformer.h", (
        Group("ln_1", ("attn.c_attn",), "attn"),
        Group("ln_2", ("mlp.c_fc",), "mlp"),
    ), keep=(r"(^|\.)lm_head$", r"wte", r"wpe"), final_norm="transformer.ln_f",
        notes="GELU between c_fc and c_proj is not homogeneous: that pair is not scaled"),
    "gpt_neox": Adapter("gpt_neox", "gpt_neox.layers", (
        Group("input_layernorm", ("attention.query_key_value",), "attention"),
        Group("post_attention_layernorm", ("mlp.dense_h_to_4h",), "mlp"),
    ), keep=(r"embed_out$", r"(^|\.)lm_head$", r"embed_in"), final_norm="gpt_neox.final_layer_norm"),
    "opt": Adapter("opt", "model.decoder.layers", (
        Group("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        Group("self_attn.v_proj", ("self_attn.out_proj",), "self_attn.out_proj", "linear"),
        Group("final_layer_norm", ("fc1",), "fc1"),
        # ReLU(x / s) = ReLU(x) / s for s > 0: fc1's rows take the scale exactly
        Group("fc1", ("fc2",), "fc2", "linear"),
    ), keep=(r"(^|\.)lm_head$", r"embed"), final_norm="model.decoder.final_layer_norm"),
    "bert": Adapter("bert", "encoder.layer", (
        # post-LN: q/k/v read the previous block's output LayerNorm, which lives in another block
        Group(None, ("attention.self.query", "attention.self.key", "attention.self.value"), "attention.self"),
        Group("attention.self.value", ("attention.output.dense",), "attention.output.dense", "linear"),
        # attention.output.LayerNorm also feeds BertOutput's residual: folding into it is not exact -> smooth
        Group(None, ("intermediate.dense",), "intermediate"),
    ), keep=(r"embeddings", r"pooler")),
}


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for a model (by config.model_type), or a generic fallback that quantizes every Linear
    inside the largest ModuleList and declares no scaling groups (logged: what it could not find)."""
    family = getattr(getattr(model, "config", None), "model_type", None) or getattr(model, "sdquant_family", None)
    if family == "seedance":
        from sdquant.models.seedance import seedance_adapter
        return adapter_from_dict("seedance", seedance_adapter())
    if family in ADAPTERS:
        return ADAPTERS[family]
    blocks = _largest_module_list(model)
    if blocks is None:
        raise ValueError(f"cannot find transformer blocks (an nn.ModuleList) in {type(model).__name__}")
    log.warning("no adapter for model type %r: generic fallback with blocks=%s, no AWQ scaling groups "
                "(AWQ will act as GPTQ/RTN only); lm_head/embeddings kept in high precision", family, blocks)
    return Adapter(str(family or "generic"), blocks, (), notes="generic fallback: no scaling groups found")


def adapter_from_dict(family: str, d: dict) -> Adapter:
    """Build an Adapter from plain data: {"blocks", "scaling_groups": [{"prev", "linears", "inspect",
    "fold"?}], "keep_high_precision": [regex]}."""
    groups = tuple(Group(g.get("prev"), tuple(g["linears"]), g["inspect"], g.get("fold", "norm"))
                   for g in d.get("scaling_groups", ()))
    return Adapter(family, d["blocks"], groups, tuple(d.get("keep_high_precision", ())),
                   d.get("final_norm"), d.get("notes", ""))


def _largest_module_list(model: nn.Module) -> Optional[str]:
    best, best_n = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > best_n and any(
                isinstance(m, nn.Linear) for m in mod[0].modules()):
            best, best_n = name, len(mod)
    return best


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path) if path else root


def get_blocks(model: nn.Module, adapter: Adapter) -> nn.ModuleList:
    return model.get_submodule(adapter.blocks)


# --------------------------------------------------------------------------------- resolved groups
@dataclass
class ScalingGroup:
    """A Group resolved against one block: modules, full names, and the fold rule."""
    prev: Optional[nn.Module]
    prev_name: Optional[str]
    linears: list                      # [(full name, nn.Linear)]
    inspect: nn.Module
    inspect_name: str
    fold_kind: str = "norm"

    @torch.no_grad()
    def fold(self, s: torch.Tensor) -> None:
        """Apply a per-input-channel scale s [K]: prev's output is divided by s, every linear's weight
        columns are multiplied by s, so the block computes exactly the same function in full precision."""
        if self.prev is None:
            raise ValueError(f"group {[n for n, _ in self.linears]} has no foldable previous op")
        s = s.detach().to(torch.float32)
        for _, lin in self.linears:
            lin.weight.mul_(s.to(lin.weight.device).view(1, -1).to(lin.weight.dtype))
        fold_into(self.prev, s, self.fold_kind)


@torch.no_grad()
def fold_into(prev: nn.Module, s: torch.Tensor, kind: str) -> None:
    dev = prev.weight.device
    s = s.to(dev)
    if kind == "linear":
        w = prev.weight
        w.copy_((w.float() / s.view(-1, 1)).to(w.dtype))
    elif kind == "norm_one_plus":
        w = prev.weight
        w.copy_(((1.0 + w.float()) / s - 1.0).to(w.dtype))
    elif kind == "norm":
        w = prev.weight
        w.copy_((w.float() / s).to(w.dtype))
    else:
        raise ValueError(f"unknown fold kind {kind!r}")
    b = getattr(prev, "bias", None)
    if isinstance(b, torch.Tensor):
        b.copy_((b.float() / s).to(b.dtype))


def resolve_groups(block: nn.Module, prefix: str, adapter: Adapter, targets: dict) -> list:
    """Resolve the adapter's groups for one block. Linears not in ``targets`` (kept in high precision)
    are dropped from a group; a group whose linear inputs do not match prev's outputs is skipped."""
    out = []
    for g in adapter.groups:
        lins = []
        for rel in g.linears:
            full = prefix + rel
            if full in targets:
                lins.append((full, targets[full]))
        if not lins:
            continue
        try:
            prev = get_submodule(block, g.prev) if g.prev else None
            inspect = get_submodule(block, g.inspect)
        except AttributeError:
            continue
        if prev is not None:
            width = prev.weight.shape[0]
            if any(lin.in_features != width for _, lin in lins):
                log.debug("skip group %s -> %s: %d outputs feed %s inputs", g.prev, g.linears, width,
                          [lin.in_features for _, lin in lins])
                continue
        out.append(ScalingGroup(prev, prefix + g.prev if g.prev else None, lins, inspect, prefix + g.inspect,
                                g.fold))
    return out
