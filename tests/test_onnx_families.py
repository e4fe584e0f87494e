"""ONNX export of the non-Llama decoder families (Gemma 1/2/3-text, Phi-3, GPT-2, OPT, GPT-NeoX): the graph runs
in ONNX Runtime (CPU provider) and matches the PyTorch quantized model — prefill with left padding, then
cached single-token steps — within the Llama tests' tolerances (max |logit error| / max |logit|): 1e-5 at
accuracy_level 0, 3e-2 at accuracy_level 4, 5e-3 for a float16 graph.

Each case switches on what makes its family differ (sliding windows shorter than the prompt, softcaps small
enough to bend the logits, partial RoPE, post-LN, projections, inverse-layer-index scaling...)."""
import json

import numpy as np
import onnx
import pytest
import torch
import transformers as T

import sdquant
from sdquant.cli import main as cli_main
from sdquant.export.onnx import export_onnx
from sdquant.export.onnx_families import UnsupportedFamilyError, supported_families
from sdquant.export.onnx_ops import OnnxExportError
from sdquant.export.onnx_run import OnnxDecoder
from sdquant.models.hf import convert_conv1d, tiny_config
from sdquant.runtime.spec import UnsupportedModelError
from sdquant.runtime.testing import quantize_model_rtn

INT4 = dict(bits=4, group_size=32)
ACT_ORDER = dict(bits=4, group_size=32, symmetric=True, act_order=True)
FP8 = dict(fp8=True)

# id -> (family, quantization, config overrides, linears per layer)
CASES = {
    "gemma-int4": ("gemma", INT4, {}, 7),
    # query_pre_attn_scalar=1 makes scores large enough for a 0.1 cap to matter (1e-1 error without it)
    "gemma2-int4-window-softcap": ("gemma2", INT4, dict(sliding_window=4, query_pre_attn_scalar=1,
                                                         attn_logit_softcapping=0.1, final_logit_softcapping=1.0), 7),
    "gemma3-int4-local-global": ("gemma3_text", INT4, dict(sliding_window=4, layer_types=[
        "sliding_attention", "full_attention"]), 7),
    "phi3-actorder-partial-rope-window": ("phi3", ACT_ORDER, dict(partial_rotary_factor=0.5, sliding_window=5), 4),
    "phi3-fp8": ("phi3", FP8, {}, 4),
    "gpt2-int4-inverse-layer-scale": ("gpt2", INT4, dict(scale_attn_by_inverse_layer_idx=True), 4),
    "opt-int4-projections": ("opt", INT4, dict(word_embed_proj_dim=32), 6),
    "opt-actorder-post-ln": ("opt", ACT_ORDER, dict(do_layer_norm_before=False,
                                                    layer_norm_elementwise_affine=False), 6),
    "gpt_neox-int4-parallel": ("gpt_neox", INT4, {}, 4),
    "gpt_neox-fp8-sequential": ("gpt_neox", FP8, dict(use_parallel_residual=False), 4),
}


def tiny(family, quant=INT4, **overrides):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    convert_conv1d(model)          # GPT-2's Conv1D -> nn.Linear, as sdquant's loaders do
    return quantize_model_rtn(model, **quant)


def positions(mask):
    """The decoder's convention (OnnxDecoder.forward): real tokens count from 0, padding gets 0. Given to the
    HF model too, as GPT-2 otherwise numbers padded rows from their first (padding) column."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def rel_err(a, b, valid=None):
    d = np.abs(a.astype(np.float32) - b)
    if valid is not None:
        d = d[valid]
    return float(d.max() / np.abs(b).max())


def check_parity(model, dec, tol, steps=3):
    """Prefill [2, 9] with 3 left-padded tokens in row 1, then `steps` single-token steps through the KV cache
    (sequence 9 + 3 > every test window). Returns the largest relative error seen."""
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=positions(mask)).logits.numpy()
    logits, past = dec.forward(ids.numpy(), mask.numpy(), dec.empty_past(2))
    errs = [rel_err(logits, ref, mask.numpy().astype(bool))]
    for _ in range(steps):
        nxt = torch.randint(0, vocab, (2, 1), generator=g)
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        with torch.no_grad():
            ref = model(ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1:].numpy()
        logits, past = dec.forward(nxt.numpy(), mask.numpy(), past)
        assert past[0][0].shape == (2, dec.n_kv, ids.shape[1], dec.head_dim)
        errs.append(rel_err(logits, ref))
    assert max(errs) < tol, errs
    return max(errs)


@pytest.mark.parametrize("case", list(CASES))
def test_ort_matches_pytorch(tmp_path, case):
    family, quant, overrides, per_layer = CASES[case]
    model = tiny(family, quant, **overrides)
    res = export_onnx(model, tmp_path, accuracy_level=0)
    onnx.checker.check_model(str(res.path))
    n_lin = 2 * per_layer + (2 if overrides.get("word_embed_proj_dim") else 0)   # OPT project_in/out
    assert (res.n_fp8 if quant.get("fp8") else res.n_matmulnbits) == n_lin and res.n_float_linear == 1
    m = onnx.load(str(res.path))
    if not quant.get("fp8"):
        nbits = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
        assert nbits and all(n.domain == "com.microsoft" for n in nbits)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    assert dims["input_ids"] == ["batch", "sequence"] and dims["attention_mask"] == ["batch", "total_sequence"]
    meta = json.loads((tmp_path / "sdquant_onnx.json").read_text())
    assert meta["family"] == family and meta["n_layers"] == 2
    assert dims["past_key_values.1.key"] == ["batch", meta["n_kv_heads"], "past_sequence", meta["head_dim"]]
    dec = OnnxDecoder(tmp_path)
    check_parity(model, dec, 1e-5)
    # another batch size and length through the same session (dynamic axes)
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    logits, _ = dec.forward(ids.numpy(), np.ones((1, 5)), dec.empty_past(1))
    with torch.no_grad():
        assert rel_err(logits, model(ids).logits.numpy()) < 1e-5


def test_raw_hf_gpt2_with_conv1d_exports_as_float(tmp_path):
    """An unquantized HF GPT-2 still holds Conv1D ([in, out] weights): lowered as transposed float MatMuls."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(tiny_config("gpt2")).eval()
    res = export_onnx(model, tmp_path, accuracy_level=0)
    assert res.n_matmulnbits == 0 and res.n_float_linear == 2 * 4 + 1
    check_parity(model, OnnxDecoder(tmp_path), 1e-5, steps=1)


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_greedy_generation_matches_hf_generate(tmp_path, family):
    model = tiny(family, INT4, **({"final_logit_softcapping": 1.0} if family == "gemma2" else {}))
    export_onnx(model, tmp_path, accuracy_level=0)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    ours = OnnxDecoder(tmp_path).generate(ids.numpy(), max_new_tokens=6, eos_token_id=None)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                            do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(ours, hf.numpy())


@pytest.mark.parametrize("family", ["gemma3_text", "opt"])
def test_float16_graph_runs_on_cpu(tmp_path, family):
    """The CUDA deployment export (dtype="float16"): Gemma's (1+w) norm and LayerNormalization in half."""
    model = tiny(family, INT4, **({"sliding_window": 4} if family == "gemma3_text" else {}))
    export_onnx(model, tmp_path, accuracy_level=0, dtype="float16")
    dec = OnnxDecoder(tmp_path)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    logits, past = dec.forward(ids.numpy(), np.ones((2, 9)), dec.empty_past(2))
    assert logits.dtype == np.float16 and past[0][0].dtype == np.float16
    with torch.no_grad():
        assert rel_err(logits, model(ids).logits.numpy()) < 5e-3


def test_accuracy_level_4_and_unfused_export(tmp_path):
    model = tiny("gemma", INT4)
    export_onnx(model, tmp_path, accuracy_level=4)
    nodes = [n for n in onnx.load(str(tmp_path / "model.onnx")).graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 2 * 4            # q/k/v and gate/up fused into one node each (exact)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["accuracy_level"] == 4 and attrs["bits"] == 4 and attrs["block_size"] == 32
    check_parity(model, OnnxDecoder(tmp_path), 3e-2, steps=1)
    export_onnx(model, tmp_path, accuracy_level=0, fuse=False)
    assert sum(n.op_type == "MatMulNBits" for n in onnx.load(str(tmp_path / "model.onnx")).graph.node) == 2 * 7
    check_parity(model, OnnxDecoder(tmp_path), 1e-5, steps=1)


def test_cli_exports_a_gpt2_package(tmp_path, capsys):
    """calibrate (RTN) -> .sd2 -> `sdquant export SRC --format onnx`: the package's GPT-2 is rebuilt with
    nn.Linear in place of Conv1D, and the ONNX model matches the loaded package."""
    from pathlib import Path
    from sdquant.config import load_config
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "templates" / "tiny-rtn.yaml", ["model.name=tiny-gpt2"])
    pkg = sdquant.export(sdquant.calibrate(None, cfg, progress=False), tmp_path / "m.sd2", format="sd2")
    assert cli_main(["export", str(pkg), "--format", "onnx", "--output", str(tmp_path / "onnx"),
                     "--accuracy-level", "0"]) == 0
    assert (tmp_path / "onnx" / "tokenizer.json").exists()
    model = sdquant.load(pkg, kernels="reference")
    check_parity(model, OnnxDecoder(tmp_path / "onnx"), 1e-5, steps=1)


def test_refusals_name_the_field(tmp_path):
    bloom = T.BloomForCausalLM(T.BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=64))
    with pytest.raises(OnnxExportError, match=r"model_type 'bloom'.*supported: llama, .*gemma2.*gpt_neox") as e:
        export_onnx(bloom, tmp_path)
    assert isinstance(e.value, UnsupportedModelError) and isinstance(e.value, UnsupportedFamilyError)
    assert "\n" not in str(e.value)
    assert set(supported_families()) == {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                                         "phi3", "gpt2", "opt", "gpt_neox"}
    bidir = T.AutoModelForCausalLM.from_config(tiny_config("gemma3_text", use_bidirectional_attention=True))
    with pytest.raises(OnnxExportError, match="use_bidirectional_attention"):
        export_onnx(bidir, tmp_path)
    long_rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                     original_max_position_embeddings=64)
    phi = T.AutoModelForCausalLM.from_config(tiny_config("phi3", rope_parameters=long_rope,
                                                         original_max_position_embeddings=64))
    with pytest.raises(OnnxExportError, match="longrope"):
        export_onnx(phi, tmp_path)
    quick = T.AutoModelForCausalLM.from_config(tiny_config("gpt2", activation_function="quick_gelu"))
    with pytest.raises(OnnxExportError, match="activation_function.*quick_gelu"):
        export_onnx(quick, tmp_path)
    assert not (tmp_path / "model.onnx").exists()   # nothing half-written
