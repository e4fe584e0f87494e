"""The gpt-fast-style runtime reproduces the HF model (float and quantized, every supported family) through
its static KV cache, with fused qkv / gate-up linears."""
import pytest
import torch
import transformers as T

from sdquant.errors import ConfigError, SdquantError
from sdquant.kernels.linear import Fp8Linear, QuantLinear
from sdquant.runtime.model import ConcatLinear, Transformer, fuse_linears, generate
from sdquant.runtime.spec import UnsupportedModelError
from sdquant.runtime.testing import quantize_model_rtn, random_int_weight

FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": 6}),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 16}),
}


def tiny(family, quant):
    torch.manual_seed(0)
    C, M, extra = FAMILIES[family]
    cfg = C(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, **extra)
    m = M(cfg).eval()
    return m if quant is None else quantize_model_rtn(m, **quant)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("quant", [None, dict(bits=4, group_size=32), dict(bits=4, group_size=32, act_order=True),
                                   dict(fp8=True)], ids=["float", "int4", "int4-actorder", "fp8"])
def test_matches_hf_prefill_decode_and_generate(family, quant):
    model = tiny(family, quant)
    rt = Transformer.from_hf(model, max_seq_len=64)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 9), generator=g)
    rt.setup_caches(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(rt(ids, torch.arange(9)), model(ids).logits, atol=1e-5, rtol=1e-5)
        nxt = torch.randint(0, 128, (2, 1), generator=g)
        torch.testing.assert_close(rt.decode_step(nxt, torch.tensor([9])),
                                   model(torch.cat([ids, nxt], 1)).logits[:, -1], atol=1e-5, rtol=1e-5)
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(rt, ids, 6), hf)


def test_fusion_merges_compatible_linears_and_keeps_others_apart():
    model = tiny("llama", dict(bits=4, group_size=32))
    at = model.model.layers[0].self_attn
    fused = fuse_linears([at.q_proj, at.k_proj, at.v_proj])
    assert isinstance(fused, QuantLinear) and fused.out_features == 64 + 32 + 32
    x = torch.randn(3, 64)
    ref = torch.cat([at.q_proj(x), at.k_proj(x), at.v_proj(x)], -1)
    torch.testing.assert_close(fused(x), ref)
    # act-order layers with different permutations cannot share one weight
    ao = tiny("llama", dict(bits=4, group_size=32, act_order=True)).model.layers[0].self_attn
    assert isinstance(fuse_linears([ao.q_proj, ao.k_proj]), ConcatLinear)
    fp8 = tiny("llama", dict(fp8=True)).model.layers[0].mlp
    assert isinstance(fuse_linears([fp8.gate_proj, fp8.up_proj]), Fp8Linear)


def test_sampling_and_eos():
    rt = Transformer.from_hf(tiny("llama", None), max_seq_len=64)
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(0))
    a = generate(rt, ids, 8, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(5))
    b = generate(rt, ids, 8, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == (1, 12)
    first = int(generate(rt, ids, 1)[0, -1])
    assert generate(rt, ids, 8, eos_token_id=first).shape == (1, 5)   # stops right after emitting eos


def test_errors():
    model = tiny("llama", None)
    with pytest.raises(ConfigError, match="max_seq_len"):
        Transformer.from_hf(model, max_seq_len=4096)
    rt = Transformer.from_hf(model, max_seq_len=32)
    with pytest.raises(SdquantError, match="setup_caches"):
        rt(torch.zeros(1, 2, dtype=torch.long), torch.arange(2))
    with pytest.raises(ConfigError, match="max_seq"):
        rt.setup_caches(1, 64)
    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError):
        Transformer.from_hf(gpt2)


def test_random_int_weight_shapes():
    qw = random_int_weight(64, 256, group_size=128, symmetric=False)
    assert qw.qweight.shape == (64, 128) and qw.scales.shape == (64, 2) and qw.zeros.shape == (64, 2)
    assert 0.005 < qw.dequantize().std() < 0.05


def test_quant_embedding_dequantizes_looked_up_rows():
    from sdquant.runtime.model import QuantEmbedding
    for bits, sym in ((4, True), (4, False), (8, True)):
        qw = random_int_weight(50, 64, bits=bits, group_size=32, symmetric=sym)
        emb = QuantEmbedding(qw, torch.float32)
        idx = torch.tensor([[3, 49, 0], [7, 7, 1]])
        torch.testing.assert_close(emb(idx), qw.dequantize()[idx])


def test_random_decoder_and_e2e_harness_on_cpu(tmp_path):
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import e2e
    out = tmp_path / "e2e.json"
    e2e.main(["--tiny", "--variants", "bf16-eager,int4all-compiled", "--batches", "1,2", "--out", str(out)])
    sys.path.pop(0)
    res = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(res) == {"bf16-eager", "int4all-compiled"}
    for r in res.values():
        assert r["decode"]["1"]["tokens_per_s"] > 0 and r["decode"]["2"]["tokens_per_s"] > 0 and r["prefill"]["ms"] > 0
    # int4 everywhere (embedding and lm_head too) holds ~1/8 of the fp32 bytes (+ group scales)
    assert res["int4all-compiled"]["weights_gb"] < 0.15 * res["bf16-eager"]["weights_gb"]


def test_random_decoder_fp8_static_layers_plan_tensorwise():
    """random_decoder(linears="fp8-static") (bench/e2e.py's fp8static-compiled): every linear is an Fp8Linear with one
    weight scale and a static activation scale, so its _scaled_mm path is the tensorwise one; "fp8" stays rowwise."""
    import torch

    from sdquant.kernels.linear import Fp8Linear
    from sdquant.runtime.testing import TINY, random_decoder
    for kind, tensorwise in (("fp8-static", True), ("fp8", False)):
        m = random_decoder(TINY, linears=kind, device="cpu", dtype=torch.float32)
        fp8 = [x for x in m.modules() if isinstance(x, Fp8Linear)]
        assert len(fp8) == 4 * TINY["n_layers"]
        assert all(("tensorwise" in repr(x)) == tensorwise for x in fp8)
        assert all((x.input_scale is not None) == tensorwise for x in fp8)


def test_auto_attention_resolves_by_device_and_head_dim(monkeypatch):
    from types import SimpleNamespace

    from sdquant.kernels import decode_attention
    from sdquant.runtime import model as rm
    monkeypatch.setattr(decode_attention, "available", lambda: True)
    gpu, cpu = SimpleNamespace(is_cuda=True), torch.zeros(1)
    assert rm._resolve_attention("auto", gpu, 128) == "triton"
    assert rm._resolve_attention("auto", gpu, 80) == "matmul"       # not a power of two: the kernel refuses it
    assert rm._resolve_attention("auto", cpu, 128) == "matmul"
    assert rm._resolve_attention("sdpa", gpu, 128) == "sdpa"        # an explicit choice is kept
    monkeypatch.setattr(decode_attention, "available", lambda: False)
    assert rm._resolve_attention("auto", gpu, 128) == "matmul"


@pytest.mark.parametrize("impl", ["auto", "matmul", "sdpa", "sdpa_gqa"])
def test_decode_attention_implementations_agree(impl):
    model = tiny("mistral", dict(bits=4, group_size=32))     # sliding window 6 < 12 positions: mask exercised
    rt = Transformer.from_hf(model, max_seq_len=64).set_attention(impl)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        rt.setup_caches(2, 16)
        rt(hf[:, :11], torch.arange(11))
        torch.testing.assert_close(rt.decode_step(hf[:, 11:12], torch.tensor([11])),
                                   model(hf).logits[:, -1], atol=1e-5, rtol=1e-5)
    assert torch.equal(generate(rt, ids, 7), hf)
    with pytest.raises(ConfigError, match="attention"):
        rt.set_attention("flash")
