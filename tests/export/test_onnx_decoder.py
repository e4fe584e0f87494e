"""Exported decoders run in ONNX Runtime (CPU provider) and match the PyTorch quantized model.

Tolerances (max |logit error| / max |logit|): 1e-5 with accuracy_level=0 (both sides compute in fp32 from
identical dequantized weights); 3e-2 with accuracy_level=4 (ORT quantizes activations to int8 per block)."""
import json

import numpy as np
import onnx
import pytest
import torch
import transformers as T

from sdquant.errors import ConfigError
from sdquant.export.onnx import export_onnx
from sdquant.export.onnx_ops import OnnxExportError
from sdquant.export.onnx_run import OnnxDecoder
from sdquant.runtime.spec import UnsupportedModelError
from sdquant.runtime.testing import quantize_model_rtn

FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": 6}),   # window < prompt: exercised
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 16}),
}


def tiny(family, seed=0, **quant):
    torch.manual_seed(seed)
    C, M, extra = FAMILIES[family]
    cfg = C(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, **extra)
    return quantize_model_rtn(M(cfg).eval(), **quant)


def rel_err(a, b, valid=None):
    d = np.abs(a - b)
    if valid is not None:
        d = d[valid]
    return float(d.max() / np.abs(b).max())


def check_parity(model, dec, tol):
    """Prefill with left padding, then two single-token steps through the KV cache."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits.numpy()
    logits, past = dec.forward(ids.numpy(), mask.numpy(), dec.empty_past(2))
    assert rel_err(logits, ref, mask.numpy().astype(bool)) < tol
    for _ in range(2):
        nxt = torch.randint(0, 128, (2, 1), generator=g)
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        with torch.no_grad():
            ref = model(ids, attention_mask=mask).logits[:, -1:].numpy()
        logits, past = dec.forward(nxt.numpy(), mask.numpy(), past)
        assert past[0][0].shape == (2, 2, ids.shape[1], 16)
        assert rel_err(logits, ref) < tol


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("quant", [dict(bits=4, group_size=32), dict(bits=4, group_size=32, symmetric=True,
                                                                       act_order=True), dict(fp8=True)],
                         ids=["int4-asym-g32", "int4-sym-actorder", "fp8"])
def test_ort_matches_pytorch(tmp_path, family, quant):
    model = tiny(family, **quant)
    res = export_onnx(model, tmp_path, accuracy_level=0)
    onnx.checker.check_model(str(res.path))
    n_lin = 2 * 7
    assert (res.n_fp8 if quant.get("fp8") else res.n_matmulnbits) == n_lin and res.n_float_linear == 1
    check_parity(model, OnnxDecoder(tmp_path), 1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_accuracy_level_4_int8_activations(tmp_path, family):
    model = tiny(family, bits=4, group_size=32)
    export_onnx(model, tmp_path, accuracy_level=4)
    g = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph
    nodes = [n for n in g.node if n.op_type == "MatMulNBits"]
    assert nodes and all(n.domain == "com.microsoft" for n in nodes)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["accuracy_level"] == 4 and attrs["bits"] == 4 and attrs["block_size"] == 32
    check_parity(model, OnnxDecoder(tmp_path), 3e-2)


def test_greedy_generation_matches_hf_generate(tmp_path):
    model = tiny("llama", bits=4, group_size=32)
    export_onnx(model, tmp_path, accuracy_level=0)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    ours = OnnxDecoder(tmp_path).generate(ids.numpy(), max_new_tokens=8)   # eos from sdquant_onnx.json
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            pad_token_id=0)
    np.testing.assert_array_equal(ours, hf.numpy())


def test_external_data_and_dynamic_axes(tmp_path):
    model = tiny("llama", bits=4, group_size=32)
    res = export_onnx(model, tmp_path, accuracy_level=0, external_data=True)
    assert res.external_data and (tmp_path / "model.onnx.data").stat().st_size > 0
    assert (tmp_path / "model.onnx").stat().st_size < 64 * 1024   # weights live in the data file
    assert not list(tmp_path.glob(".onnx-tmp-*"))                 # temp folder cleaned up
    m = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    assert dims["input_ids"] == ["batch", "sequence"]
    assert dims["past_key_values.1.value"] == ["batch", 2, "past_sequence", 16]
    meta = json.loads((tmp_path / "sdquant_onnx.json").read_text())
    assert meta["n_layers"] == 2 and meta["matmulnbits"] == 14
    check_parity(model, OnnxDecoder(tmp_path), 1e-5)
    # re-export without external data into the same folder removes the stale data file
    export_onnx(model, tmp_path, accuracy_level=0, external_data=False)
    assert not (tmp_path / "model.onnx.data").exists()


def test_bad_arguments_and_unsupported_models(tmp_path):
    model = tiny("llama", bits=4, group_size=32)
    with pytest.raises(ConfigError, match="accuracy_level"):
        export_onnx(model, tmp_path, accuracy_level=7)
    with pytest.raises(ConfigError, match="opset"):
        export_onnx(model, tmp_path, opset=13)
    with pytest.raises(ConfigError, match="dtype"):
        export_onnx(model, tmp_path, dtype="bfloat16")
    with pytest.raises(OnnxExportError, match="3-bit"):
        export_onnx(tiny("llama", bits=3, group_size=32), tmp_path)
    bloom = T.BloomForCausalLM(T.BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="bloom"):   # gpt2 exports now (tests/test_onnx_families.py)
        export_onnx(bloom, tmp_path)
    assert not (tmp_path / "model.onnx").exists()   # nothing half-written


@pytest.mark.parametrize("quant,tol", [(dict(bits=4, group_size=32), 5e-3), (dict(fp8=True), 6e-2)],
                         ids=["int4", "fp8"])
def test_float16_graph_for_the_cuda_provider_runs_on_cpu(tmp_path, quant, tol):
    """dtype="float16" is the CUDA deployment export; ORT's CPU provider runs it too, so it is checked here.
    FP8's per-token e4m3 rounding is discontinuous: fp16 roundings upstream flip a few codes, hence 6e-2."""
    model = tiny("llama", **quant)
    export_onnx(model, tmp_path, accuracy_level=0, dtype="float16")
    dec = OnnxDecoder(tmp_path)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    logits, past = dec.forward(ids.numpy(), np.ones((2, 9)), dec.empty_past(2))
    assert logits.dtype == np.float16 and past[0][0].dtype == np.float16
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    assert rel_err(logits.astype(np.float32), ref) < tol


def test_qkv_and_gate_up_fused_into_one_node_where_weights_allow(tmp_path):
    def n_nodes(model, **kw):
        export_onnx(model, tmp_path, accuracy_level=0, **kw)
        g = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph
        return sum(n.op_type == "MatMulNBits" for n in g.node)
    plain = tiny("qwen2", bits=4, group_size=32)          # qwen2: q/k/v biases are concatenated too
    assert n_nodes(plain) == 2 * 4 and n_nodes(plain, fuse=False) == 2 * 7
    check_parity(plain, OnnxDecoder(tmp_path), 1e-5)      # unfused export still in the folder
    export_onnx(plain, tmp_path, accuracy_level=0)
    check_parity(plain, OnnxDecoder(tmp_path), 1e-5)
    # act-order layers carry different channel permutations: they stay separate nodes
    assert n_nodes(tiny("llama", bits=4, group_size=32, act_order=True)) == 2 * 7


def test_llama3_rope_scaling_is_reproduced(tmp_path):
    """RoPE tables come from the model's own rotary module, so scaled RoPE (Llama-3's) exports exactly."""
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        rope_parameters=rope)
    model = quantize_model_rtn(T.LlamaForCausalLM(cfg).eval(), bits=4, group_size=32)
    assert model.model.rotary_emb.rope_type == "llama3"
    export_onnx(model, tmp_path, accuracy_level=0)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))   # past the original 16
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    dec = OnnxDecoder(tmp_path)
    logits, _ = dec.forward(ids.numpy(), np.ones((1, 40)), dec.empty_past(1))
    assert rel_err(logits, ref) < 1e-5
