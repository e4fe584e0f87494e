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


def test_greedy_step_returns_the_logits_argmax():
    """decode_step(greedy=True) / forward(greedy=True): the logits' argmax computed inside the step, eager and with the
    step's glue compiled (compile_decode(scope="block") compiles _embed_call and _head_call for decode steps)."""
    import sdquant
    rt = Transformer.from_hf(tiny("llama", dict(bits=4, group_size=32)), max_seq_len=64)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    nxt = torch.randint(0, 128, (2, 1), generator=torch.Generator().manual_seed(4))
    rt.setup_caches(2, 32)
    for compiled in (False, True):
        if compiled:
            sdquant.compile(rt, backend="aot_eager", scope="block")
            assert rt._embed_fn is not None and rt._head_fn is not None
        with torch.no_grad():
            logits = rt(ids, torch.arange(6), last_only=True)
            assert torch.equal(rt(ids, torch.arange(6), last_only=True, greedy=True), logits.argmax(-1))
            step = rt.decode_step(nxt, torch.tensor([6]))
            tok = rt.decode_step(nxt, torch.tensor([6]), greedy=True)
        assert tok.shape == (2,) and tok.dtype == torch.int64 and torch.equal(tok, step.argmax(-1))


@pytest.mark.parametrize("v", [10, 1024, 1025, 5000, 128256])
def test_greedy_argmax_is_torch_argmax(v):
    """The two-stage argmax of greedy steps: torch.argmax's index (the first of a tie, NaN as the maximum, all -inf ->
    0) over any vocabulary size, batched or not, eager and compiled."""
    from sdquant.runtime.model import greedy_argmax
    g = torch.Generator().manual_seed(v)
    compiled = torch.compile(greedy_argmax, backend="aot_eager")
    for shape in ((v,), (3, v), (2, 1, v)):
        x = torch.randn(*shape, generator=g)
        tie = x.clone()
        tie[..., 7] = tie[..., v - 1] = 100.0
        nan = x.clone()
        nan[..., v // 2] = float("nan")
        for t in (x, tie, nan, torch.full(shape, float("-inf"))):
            assert torch.equal(greedy_argmax(t), t.argmax(-1))
            assert torch.equal(compiled(t), t.argmax(-1))


def test_feedback_why_not():
    """CUDAGraphStep(feedback=True) feeds a step's output back as its next token: only [B, 1] integer tokens pass,
    and for a step that returns logits, the wrong shape or no tensor it gives a one-line reason."""
    import re
    from sdquant.runtime.model import feedback_why_not
    idx = torch.zeros(3, 1, dtype=torch.long)
    assert feedback_why_not(torch.ones(3, 1, dtype=torch.long), idx) is None
    assert feedback_why_not(torch.ones(3, 1, dtype=torch.int32), idx) is None
    assert re.search(r"shape \(3,\)", feedback_why_not(torch.ones(3, dtype=torch.long), idx))
    assert "not integer tokens" in feedback_why_not(torch.ones(3, 1), idx)
    assert "returned tuple" in feedback_why_not((torch.ones(3, 1, dtype=torch.long),), idx)
    assert all("\n" not in feedback_why_not(o, idx) for o in (torch.ones(3), torch.ones(3, 1), None))


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


def _bench_e2e():
    """bench/e2e.py as a module (it puts bench/ on sys.path for its own imports)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        import e2e
    finally:
        sys.path.pop(0)
    return e2e


def test_random_decoder_and_e2e_harness_on_cpu(tmp_path):
    import json
    e2e = _bench_e2e()
    out = tmp_path / "e2e.json"
    e2e.main(["--tiny", "--variants", "bf16-eager,int4all-compiled", "--batches", "1,2", "--generate", "5",
              "--out", str(out)])
    res = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(res) == {"bf16-eager", "int4all-compiled"}
    gen = res["int4all-compiled"]["generate"]   # generate() timed on compiled variants only (CPU: no decode graph)
    assert gen["tokens"] == 5 and gen["tokens_per_s"] > 0 and gen["same_tokens"] and not gen["decode_graph"]
    assert "generate" not in res["bf16-eager"]
    for r in res.values():
        assert r["decode"]["1"]["tokens_per_s"] > 0 and r["decode"]["2"]["tokens_per_s"] > 0 and r["prefill"]["ms"] > 0
    # int4 everywhere (embedding and lm_head too) holds ~1/8 of the fp32 bytes (+ group scales)
    assert res["int4all-compiled"]["weights_gb"] < 0.15 * res["bf16-eager"]["weights_gb"]


def test_e2e_timeline_partitions_each_replay_by_advance():
    """bench/e2e.py --timeline's arithmetic: kernels split into replays at gaps over 5 ms; each kernel's advance of the
    running end (0 for one that ends under the previous one's tail), which sums to the replay's span; the last replay's
    advances and busy times by kernel name."""
    e2e = _bench_e2e()
    step = [("gemm", 0, 10), ("attn", 5, 10), ("tiny", 6, 2), ("gemm", 16, 2)]   # (name, start, duration) in us
    events = [{"cat": "kernel", "name": n, "ts": t0 + t, "dur": d} for t0 in (1000, 9000) for n, t, d in step]
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 1001, "dur": 50})
    out = e2e.timeline_of(events)
    assert out["kernels"] == 8 and len(out["replays"]) == 2
    for r in out["replays"]:
        assert [k["advance_us"] for k in r["kernels"]] == [10, 5, 0, 3]
        assert r["span_us"] == 18 == sum(k["advance_us"] for k in r["kernels"])
    assert out["by_name"] == [{"name": "gemm", "count": 2, "advance_us": 13.0, "busy_us": 12.0},
                              {"name": "attn", "count": 1, "advance_us": 5.0, "busy_us": 10.0},
                              {"name": "tiny", "count": 1, "advance_us": 0.0, "busy_us": 2.0}]


def test_e2e_ratios_take_the_median_of_a_repeated_baseline():
    """bench/e2e.py's ratios: each quantized variant over bf16 compiled at each batch size; a variant run more than once
    in a process (the baseline before and after the others) counts with the median of its runs, which the JSON lists."""
    e2e = _bench_e2e()
    res = [{"variant": "bf16-compiled", "decode": {"1": {"tokens_per_s": 200.0}, "8": {"tokens_per_s": 1000.0}}},
           {"variant": "int4all-compiled-pdl-early", "decode": {"1": {"tokens_per_s": 500.0},
                                                               "8": {"error": "RuntimeError: x"}}},
           {"variant": "bf16-eager", "decode": {"1": {"tokens_per_s": 20.0}}},
           {"variant": "bf16-compiled", "decode": {"1": {"tokens_per_s": 250.0}, "8": {"tokens_per_s": 1100.0}}},
           {"variant": "bf16-compiled", "decode": {"1": {"tokens_per_s": 210.0}}}]
    r = e2e.ratios_to_baseline(res, [1, 8])
    assert r == {"int4all-compiled-pdl-early/bf16-compiled B=1": 500.0 / 210.0,
                 "runs": {"bf16-compiled B=1": [200.0, 250.0, 210.0], "bf16-compiled B=8": [1000.0, 1100.0]}}


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


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_fused_decode_blocks_from_hf(family, monkeypatch):
    """Transformer.from_hf(fused=True) on an INT4 model (g64): gate/up interleaved, decode steps through
    Block.forward_fused (the fused op's reference on CPU over the real CUDA layout), the same logits and tokens as the
    unfused blocks and as the HF model; prompts and qwen2's biased qkv (not fusable) keep the unfused blocks."""
    from sdquant.kernels import linear
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear, "_cuda_kernel_runs", lambda device: True)
    torch.manual_seed(0)
    C, M, extra = FAMILIES[family]
    cfg = C(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, **{**extra, "head_dim": 32})
    model = quantize_model_rtn(M(cfg).eval(), bits=4, group_size=64)
    with torch.no_grad():
        for mod in model.modules():  # norm weights away from 1, so their place in the fused kernels is tested
            if type(mod).__name__.endswith("RMSNorm") and getattr(mod, "weight", None) is not None:
                mod.weight.add_(0.3 * torch.randn_like(mod.weight))
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    nxt = torch.randint(0, 128, (2, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # before from_hf prepares the model's layers for bf16 activations
        ref = model(torch.cat([ids, nxt], 1)).logits[:, -1]
    kw = dict(max_seq_len=64, dtype=torch.bfloat16, kernels="cuda")
    fused, plain = Transformer.from_hf(model, fused=True, **kw), Transformer.from_hf(model, fused=False, **kw)
    assert fused.fused_decode and fused.fused_why_not(2) is None and "prompt" in fused.fused_why_not(2, s=7)
    assert all(blk.gate_up_block == 64 for blk in fused.layers) and not plain.fused_decode
    for rt in (fused, plain):
        rt.setup_caches(2, 32)
    with torch.no_grad():
        for rt in (fused, plain):
            rt(ids, torch.arange(7))
        a, b = fused.decode_step(nxt, torch.tensor([7])), plain.decode_step(nxt, torch.tensor([7]))
    assert float((a - b).norm() / b.norm()) < 2e-2
    assert float((a - ref).norm() / ref.norm()) < 5e-2 and float((b - ref).norm() / ref.norm()) < 5e-2
    # more steps, both fed the unfused model's greedy tokens (bf16 near-ties may flip a free-running argmax)
    toks = generate(plain, ids, 4)
    for rt in (fused, plain):
        rt.setup_caches(2, 32)
    with torch.no_grad():
        for rt in (fused, plain):
            rt(ids, torch.arange(7))
        for i in range(7, 10):
            a, b = (rt.decode_step(toks[:, i:i + 1], torch.tensor([i])) for rt in (fused, plain))
            assert float((a - b).norm() / b.norm()) < 2e-2
            # the fused head's argmax inside the step (the same slot rewritten with the same key and value)
            assert torch.equal(fused.decode_step(toks[:, i:i + 1], torch.tensor([i]), greedy=True), a.argmax(-1))
            assert torch.equal(b.argmax(-1), toks[:, i + 1])


def test_fused_decode_refuses_biased_qkv(monkeypatch):
    """qwen2's qkv bias is not fused: its blocks say why and decode unfused, still matching the HF model."""
    from sdquant.kernels import linear
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear, "_cuda_kernel_runs", lambda device: True)
    torch.manual_seed(0)
    cfg = T.Qwen2Config(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = quantize_model_rtn(T.Qwen2ForCausalLM(cfg).eval(), bits=4, group_size=64)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits[:, -1]
    rt = Transformer.from_hf(model, max_seq_len=64, dtype=torch.bfloat16, kernels="cuda", fused=True)
    assert "wqkv" in rt.fused_why_not(1) and "bias" in rt.fused_why_not(1)
    rt.setup_caches(1, 16)
    with torch.no_grad():
        rt(ids[:, :4], torch.arange(4))
        got = rt.decode_step(ids[:, 4:], torch.tensor([4]))
    assert float((got - ref).norm() / ref.norm()) < 5e-2


def test_from_hf_leaves_the_model_and_other_runtimes_alone(monkeypatch):
    """from_hf builds its own linears (sharing the weights' storage): the caller's model is not cast or moved, and a
    second runtime from the same model re-prepares none of the first's layers. Before, the unfused linears (o, down)
    were the model's own modules: a second runtime's prepare re-attached their kernel layouts, so a CUDA graph captured
    on the first kept reading freed memory (Pending 30), and a float model's o / down were cast in place."""
    from sdquant.kernels import linear
    model = tiny("llama", None)
    before = {n: (p.dtype, p.device, p.data_ptr()) for n, p in model.named_parameters()}
    rt = Transformer.from_hf(model, max_seq_len=64, dtype=torch.float64)
    assert {n: (p.dtype, p.device, p.data_ptr()) for n, p in model.named_parameters()} == before
    assert rt.layers[0].attn.wo.weight.dtype == torch.float64 and rt.layers[0].w2.weight.dtype == torch.float64

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(linear, "_cuda_kernel_runs", lambda device: True)   # the CUDA layouts, built on the host
    torch.manual_seed(0)   # shapes the CUDA layout takes (as test_fused_decode_blocks_from_hf's), so no fallback runs
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128)
    q = quantize_model_rtn(T.LlamaForCausalLM(cfg).eval(), bits=4, group_size=64)
    kw = dict(max_seq_len=64, dtype=torch.bfloat16, kernels="cuda", fused=False)
    first = Transformer.from_hf(q, **kw)
    first.setup_caches(2, 16)
    held = {n: t.data_ptr() for n, t in first.named_buffers() if t is not None}
    assert any(n.endswith("_cuda_qweight") for n in held) and any(".wo." in n for n in held)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = first(ids, torch.arange(5))
    second = Transformer.from_hf(q, **kw)
    ours = {id(m) for m in first.modules()}
    assert not ours & {id(m) for m in second.modules()} and not ours & {id(m) for m in q.modules()}
    assert {n: t.data_ptr() for n, t in first.named_buffers() if t is not None} == held
    with torch.no_grad():
        assert torch.equal(first(ids, torch.arange(5)), ref)


def test_a_prompt_after_a_poisoned_cache_is_its_own():
    """generate starts every prompt on a clean cache: slots a previous request left non-finite (an overflow, a bad
    input) must not reach the next request through the masked attention (zero weights times NaN values are NaN)."""
    rt = Transformer.from_hf(tiny("llama", None), max_seq_len=64)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = generate(rt, ids, 6)
        for blk in rt.layers:   # what a failed request could leave behind, past the next prompt's length
            blk.attn.kv_cache.kv[..., 20:, :] = float("nan")
        got = generate(rt, ids, 6)
        assert torch.equal(got, want)
        rt.clear_caches()
        assert all(bool((blk.attn.kv_cache.kv == 0).all()) for blk in rt.layers)
