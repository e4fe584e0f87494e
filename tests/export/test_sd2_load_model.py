"""End to end through the package: a tiny Llama with quantized linears -> write_sd2 -> sdquant.load ->
identical logits (the loader builds QuantLinear layers from the zero-copy tensors)."""
from __future__ import annotations

import json

import pytest
import torch

from sd2_testutil import rtn
from sdquant.export.sd2 import open_sd2, verify_sd2, write_sd2


def test_package_loads_into_a_model_with_identical_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    import sdquant
    from sdquant.models.hf import replace_linears

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    weights = {n: rtn(model.get_submodule(n).weight.detach(), 4, 32, symmetric=(i % 2 == 0), act_order=(i % 3 == 0),
                      seed=i) for i, n in enumerate(names)}
    arch = json.loads(cfg.to_json_string(use_diff=False))
    for k in ("transformers_version", "torch_dtype", "dtype", "_name_or_path"):
        arch.pop(k, None)
    floats = [(k, v) for k, v in model.state_dict().items() if k.rpartition(".")[0] not in weights]
    path = write_sd2(tmp_path / "tiny.sd2", family="llama", arch_config=arch, float_tensors=floats,
                     quant_layers=[(n, w, None, None) for n, w in weights.items()],
                     calibration={"method": "rtn"}, high_precision=["lm_head"])
    assert verify_sd2(path) == []
    ref = replace_linears(model, weights)
    ids = torch.tensor([[1, 5, 9, 33, 2, 71]])
    with torch.no_grad():
        want = ref(ids).logits
        loaded = sdquant.load(path, device="cpu", dtype=torch.float32, kernels="reference")
        got = loaded(ids).logits
    assert torch.equal(got, want)
    with open_sd2(path) as pkg:
        assert set(pkg.quant_layers()) == set(weights)
