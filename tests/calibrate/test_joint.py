"""The Hessian-coordinate regression test: joint AWQ+GPTQ equals plain GPTQ on a model whose scales were
applied beforehand, and differs from the wrong-coordinates variant (H collected before scaling)."""
import copy

import torch

from blocks import block_inputs, make_ctx, tiny_llama_block
from sdquant.calibrate import recipes
from sdquant.calibrate.gptq import accumulate_hessian, gptq_quantize, layer_loss
from sdquant.calibrate.joint import joint_quantize, scale_hessian, wrong_coordinates_quantize
from sdquant.calibrate.recipes import _fold


def _setup(seed=0, n=32, k=128):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, k, generator=g)
    x = torch.randn(512, k, generator=g) * (0.3 + 3 * torch.rand(k, generator=g))
    s = torch.exp(torch.randn(k, generator=g))               # an AWQ-like scale spanning ~e^±2
    return W, x, s


def test_scale_hessian_is_the_hessian_of_scaled_inputs():
    _, x, s = _setup()
    H, _ = accumulate_hessian(None, x, 0)
    Hs, _ = accumulate_hessian(None, x / s, 0)
    torch.testing.assert_close(scale_hessian(H, s), Hs, rtol=1e-4, atol=1e-5)


def test_joint_equals_gptq_on_prescaled_model_and_differs_from_wrong_coordinates():
    W, x, s = _setup()
    H, _ = accumulate_hessian(None, x, 0)
    Hs, _ = accumulate_hessian(None, x / s, 0)               # re-captured after folding
    kw = dict(bits=3, group_size=32, symmetric=False, act_order="static")
    qj, sj = joint_quantize(W, H, s, **kw)
    qp, sp = gptq_quantize(W * s, Hs, **kw)
    qw, _ = wrong_coordinates_quantize(W, H, s, **kw)
    same = (qj.codes() == qp.codes()).float().mean()
    assert same > 0.995, same
    assert abs(sj.loss - sp.loss) <= 1e-3 * sp.loss
    differ = (qj.codes() != qw.codes()).float().mean()
    assert differ > 0.05, differ
    # judged by the true output error in the scaled model, the wrong coordinates are worse
    wrong_loss = layer_loss(W * s, qw.dequantize(), Hs)
    assert sj.loss < wrong_loss


def test_block_recipe_uses_scaled_coordinates():
    """awq+gptq on a real block: q_proj's codes equal GPTQ run on a copy of the block whose recorded AWQ
    scales were folded first and whose Hessian was captured afterwards."""
    block, rope = tiny_llama_block(seed=3)
    inputs = block_inputs((block, rope), n_batches=2)
    original = copy.deepcopy(block)
    quant = dict(method="awq+gptq", bits=3, group_size=32, act_order="static")
    ctx = make_ctx(block, inputs, **quant)
    res = recipes.quantize_block(ctx)
    rec = res.scales["model.layers.0.awq"][0]
    assert rec["prev"] == "model.layers.0.input_layernorm" and rec["folded"]
    s = torch.tensor(rec["scales"])
    assert not torch.allclose(s, torch.ones_like(s))          # AWQ did scale this group

    ctx2 = make_ctx(original, inputs, **quant)
    grp = ctx2.groups[0]
    _fold(grp, [l for _, l in grp.linears], s)
    acc = {}

    def hook(mod, args, kwargs, out):
        Hc, n = acc.get("h", (None, 0))
        acc["h"] = accumulate_hessian(Hc, args[0] if args else kwargs["hidden_states"], n)
    ctx2.run({original.self_attn.q_proj: hook})
    q_ref, _ = gptq_quantize(original.self_attn.q_proj.weight.detach(), acc["h"][0], 3, 32, False, "static",
                             mse_grid=10)
    q_got = res.weights["model.layers.0.self_attn.q_proj"]
    assert (q_got.codes() == q_ref.codes()).float().mean() > 0.995
    # and the weight left in the block is the dequantized quantized weight (in folded coordinates)
    torch.testing.assert_close(block.self_attn.q_proj.weight.detach(), q_got.dequantize(), rtol=0, atol=1e-6)
