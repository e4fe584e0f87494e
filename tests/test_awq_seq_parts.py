"""The per-sequence gradient path of the per-channel ratio refinement (used on GPUs, where the deterministic
attention backend would otherwise hold every sequence's score matrices at once) gives the gradient of the
whole-sample loss."""
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from sdquant.calibrate import awq, awq_search


def _attention_loss():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    att = LlamaAttention(cfg, 0).eval()
    for p in att.parameters():
        p.requires_grad_(False)
    x = torch.randn(3, 16, 64)
    pe = LlamaRotaryEmbedding(cfg)(x, torch.arange(16)[None].expand(3, 16))
    calls = [((x,), {"position_embeddings": pe, "attention_mask": None})]
    refs = [att(*a, **k)[0].float() for a, k in calls]
    lins = [att.q_proj, att.k_proj, att.v_proj]
    names = {m: n for n, m in att.named_modules()}
    f = awq_search.make_loss_fn(att, [names[m] + ".weight" for m in lins], calls, refs, torch.float32)
    return f, [m.weight.float() for m in lins], x.abs().mean((0, 1))


def test_parts_cover_every_sequence_and_sum_to_the_loss():
    f, ws, _ = _attention_loss()
    assert len(f.parts) == 3
    wq = [awq.scaled_fake_quant(w, torch.ones(64), 4, 32, False) for w in ws]
    whole = float(f(wq))
    assert whole > 0
    assert abs(sum(float(p(wq)) for p in f.parts) / f.count - whole) <= 1e-6 * whole


def test_per_sequence_gradient_equals_whole_sample_gradient():
    f, ws, xm = _attention_loss()
    s0 = awq.awq_search_scales(xm, ws, f, 4, 32, False, grid=5).scales

    def grad(per_part):
        r = torch.ones(64, requires_grad=True)
        if per_part:
            for p in f.parts:
                (p([awq._ste_effective(w, s0 * r, 4, 32, False) for w in ws]) / f.count).backward()
        else:
            f([awq._ste_effective(w, s0 * r, 4, 32, False) for w in ws]).backward()
        return r.grad
    g_whole, g_parts = grad(False), grad(True)
    assert float(g_whole.abs().max()) > 0
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-4, atol=1e-9)


def test_mlp_inspect_has_no_parts():
    lin = torch.nn.Linear(8, 8)
    f = awq_search.make_loss_fn(lin, ["weight"], [((torch.randn(4, 8),), {})], [torch.randn(4, 8)], torch.float32)
    assert not hasattr(f, "parts")
