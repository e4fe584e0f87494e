"""AWQ properties: the searched scale never loses to no scale, folding is exact in full precision, clipping
and the per-channel ratio only ever lower their losses, config errors name the field."""
import copy

import pytest
import torch

from blocks import block_inputs, make_ctx, tiny_llama_block
from sdquant.calibrate import awq
from sdquant.calibrate.recipes import _fold
from sdquant.errors import ConfigError


def _group(seed=0, n=32, k=64, t=256):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, k, generator=g)
    scale = torch.ones(k)
    scale[:4] = 10.0                                   # outlier input channels
    x = torch.randn(t, k, generator=g) * scale
    ref = x @ W.t()

    def loss_fn(ws):
        return ((x @ ws[0].t()) - ref).pow(2).mean()
    return W, x, loss_fn


@pytest.mark.parametrize("bits,gs,sym", [(4, 32, False), (3, 64, True), (2, 32, False)])
def test_awq_loss_not_above_unscaled(bits, gs, sym):
    W, x, loss_fn = _group()
    r = awq.awq_search_scales(awq.channel_absmean(x), [W], loss_fn, bits, gs, sym, grid=10)
    assert r.loss <= r.loss_unscaled
    assert r.scales.shape == (64,) and bool((r.scales > 0).all())
    # with outlier channels AWQ should find a real improvement
    assert r.loss < 0.95 * r.loss_unscaled
    # the reported loss is the loss of the returned scale
    eff = awq.scaled_fake_quant(W, r.scales, bits, gs, sym)
    assert float(loss_fn([eff])) == pytest.approx(r.loss, rel=1e-5)


def test_ratio_refinement_stays_in_range_and_never_worse():
    W, x, loss_fn = _group(seed=2)
    xm = awq.channel_absmean(x)
    r = awq.awq_search_scales(xm, [W], loss_fn, 3, 32, False, grid=10)
    for method in ("ste", "bucket"):
        s2, loss, ratio = awq.refine_channel_ratio(r.scales, xm, [W], loss_fn, 3, 32, False, r.loss,
                                                   ratio_range=(0.8, 1.2), method=method, steps=6)
        assert loss <= r.loss
        assert float(ratio.min()) >= 0.8 - 1e-6 and float(ratio.max()) <= 1.2 + 1e-6
        eff = awq.scaled_fake_quant(W, s2, 3, 32, False)
        assert float(loss_fn([eff])) == pytest.approx(loss, rel=1e-5)


def test_ratio_config_errors_name_the_field():
    W, x, loss_fn = _group()
    s = torch.ones(64)
    with pytest.raises(ConfigError, match="ratio_range"):
        awq.refine_channel_ratio(s, s, [W], loss_fn, 4, 32, False, 1.0, ratio_range=(0.5, 1.2))
    with pytest.raises(ConfigError, match="init_ratio"):
        awq.refine_channel_ratio(s, s, [W], loss_fn, 4, 32, False, 1.0, init_ratio=1.3)
    with pytest.raises(ConfigError, match="granularity.*group_size 32"):
        awq.refine_channel_ratio(s, s, [W], loss_fn, 4, 32, False, 1.0, granularity=24)


def test_clip_search_lowers_output_error():
    W, x, _ = _group(seed=4)
    W[:, 7] *= 6                                       # a weight outlier in one group
    ratios = awq.clip_search(W, x, 3, 32, False, grid=10)
    assert ratios.shape == (32, 2) and float(ratios.min()) >= 0.5 and float(ratios.max()) <= 1.0
    from sdquant.calibrate.gptq import rtn_dequant
    err_clip = ((x @ (rtn_dequant(W, 3, 32, False, ratios) - W).t()) ** 2).mean()
    err_plain = ((x @ (rtn_dequant(W, 3, 32, False) - W).t()) ** 2).mean()
    assert err_clip <= err_plain


def test_folded_block_equals_unfolded_in_full_precision():
    block, rope = tiny_llama_block()
    inputs = block_inputs((block, rope), n_batches=1)
    ref = make_ctx(block, inputs, method="awq").run()
    folded = copy.deepcopy(block)
    ctx = make_ctx(folded, inputs, method="awq")
    g = torch.Generator().manual_seed(0)
    assert len(ctx.groups) == 4                        # norm->qkv, v->o, norm->gate/up, up->down
    for grp in ctx.groups:
        s = 0.25 + 2 * torch.rand(grp.linears[0][1].in_features, generator=g)
        _fold(grp, [l for _, l in grp.linears], s)
    out = ctx.run()
    assert not torch.equal(folded.input_layernorm.weight, block.input_layernorm.weight)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
