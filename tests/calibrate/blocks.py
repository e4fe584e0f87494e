"""Tiny real blocks for calibration tests: a random LlamaDecoderLayer (transformers) with the lead's
BlockContext and adapter groups, and activations with channel outliers so AWQ has something to find."""
from __future__ import annotations

import dataclasses
import logging

import torch

from sdquant.calibrate.pipeline import BlockContext, block_targets
from sdquant.config import QuantConfig
from sdquant.models.adapters import ADAPTERS, resolve_groups


def tiny_llama_block(hidden=64, inter=128, heads=4, kv_heads=4, seed=0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=128, head_dim=hidden // heads)
    cfg._attn_implementation = "sdpa"
    block = LlamaDecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for n, p in block.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.3 * torch.rand_like(p))     # non-trivial norm weights to fold into
    rope = LlamaRotaryEmbedding(cfg)
    return block, rope


def block_inputs(block_rope, n_batches=4, batch=2, seq=32, hidden=64, seed=1):
    _, rope = block_rope
    g = torch.Generator().manual_seed(seed)
    outlier = torch.ones(hidden)
    outlier[torch.randperm(hidden, generator=g)[:4]] = 8.0          # a few large-activation channels
    inputs = []
    for _ in range(n_batches):
        h = torch.randn(batch, seq, hidden, generator=g) * outlier
        pos = torch.arange(seq)[None].expand(batch, seq)
        cos, sin = rope(h, pos)
        inputs.append(((h,), {"position_embeddings": (cos, sin), "attention_mask": None, "position_ids": pos}))
    return inputs


def make_ctx(block, inputs, **quant):
    q = QuantConfig(**quant)
    adapter = ADAPTERS["llama"]
    prefix = "model.layers.0."
    targets = block_targets(block, prefix, q, ())
    groups = resolve_groups(block, prefix, adapter, targets)
    return BlockContext(block, 0, prefix, inputs, groups, targets, q, (), torch.device("cpu"), torch.float32,
                        logging.getLogger("sdquant.test"))


def with_quant(q: QuantConfig, **kw) -> QuantConfig:
    return dataclasses.replace(q, **kw)
