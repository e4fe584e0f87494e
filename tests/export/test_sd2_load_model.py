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


def test_a_package_carries_its_runtime_kernel_preference():
    """`runtime.kernels` / `runtime.compile` of the calibration config (a template's kernel preference) travel in the
    package's calibration report and are what ``sdquant.load`` uses on a GPU when the caller names none; a CPU load
    runs the reference ops; a malformed section is a PackageError naming the field."""
    from sdquant.export.sd2 import runtime_preference
    from sdquant.errors import PackageError
    cal = {"method": "awq+gptq", "config": {"runtime": {"kernels": "triton", "compile": True}}}
    assert runtime_preference(cal) == ("triton", True)
    for old in ({"method": "rtn"}, {"config": {}}, {}, {"config": {"runtime": {}}}):  # older or foreign packages
        assert runtime_preference(old) == ("auto", False)
    for bad, field in [({"runtime": []}, "calibration.config.runtime:"),
                       ({"runtime": {"kernels": "fast"}}, "runtime.kernels: 'fast' is not one of auto, cuda"),
                       ({"runtime": {"kernels": "cuda", "compile": "yes"}}, "runtime.compile: expected true or false")]:
        with pytest.raises(PackageError, match=field):
            runtime_preference({"config": bad})


def test_a_calibrated_package_records_the_runtime_section_that_load_reads():
    """The calibration report written into a package holds the whole config, runtime section included (what
    ``runtime_preference`` reads back)."""
    from sdquant.api import CalibrationResult
    from sdquant.export.sd2 import runtime_preference
    from sdquant.config import from_dict
    cfg = from_dict({"model": {"kind": "builtin", "name": "smollm2-135m"}, "runtime": {"kernels": "triton"}})
    res = CalibrationResult(model=torch.nn.Linear(2, 2), config=cfg, weights={})
    report = json.loads(json.dumps(res.report()))  # as the manifest stores it
    assert runtime_preference(report) == ("triton", False)


def test_load_and_verify_refuse_a_package_whose_runtime_section_is_malformed(tmp_path):
    transformers = pytest.importorskip("transformers")
    import sdquant
    from sdquant.errors import PackageError
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=32, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg).eval()
    arch = json.loads(cfg.to_json_string(use_diff=False))
    for k in ("transformers_version", "torch_dtype", "dtype", "_name_or_path"):
        arch.pop(k, None)
    w = rtn(model.model.layers[0].mlp.down_proj.weight.detach(), 4, 32, symmetric=True, act_order=False, seed=0)
    floats = [(k, v) for k, v in model.state_dict().items() if not k.startswith("model.layers.0.mlp.down_proj.")]
    good = write_sd2(tmp_path / "good.sd2", family="llama", arch_config=arch, float_tensors=floats,
                     quant_layers=[("model.layers.0.mlp.down_proj", w, None, None)],
                     calibration={"config": {"runtime": {"kernels": "cuda"}}})
    loaded = sdquant.load(good, device="cpu", dtype=torch.float32)  # the GPU preference does not apply on a CPU
    assert loaded.model.layers[0].mlp.down_proj.kernel == "M1+:reference"
    bad = write_sd2(tmp_path / "bad.sd2", family="llama", arch_config=arch, float_tensors=floats,
                    quant_layers=[("model.layers.0.mlp.down_proj", w, None, None)],
                    calibration={"config": {"runtime": {"kernels": "fastest"}}})
    with pytest.raises(PackageError, match="calibration.config.runtime.kernels"):
        sdquant.load(bad, device="cpu")
    assert verify_sd2(good) == []
    assert [p for p in verify_sd2(bad) if "calibration.config.runtime.kernels: 'fastest'" in p]  # `sdquant verify`
