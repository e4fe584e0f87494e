"""Per-block recipes on a real (tiny) Llama block through the walker's BlockContext: every method lowers the
block error against RTN, leaves dequantized weights in place, fills the per-layer table; FP8 static/dynamic
with and without SmoothQuant migration; unfoldable scales come back as explicit ``smooth`` divisors."""
import copy

import pytest
import torch

from blocks import block_inputs, make_ctx, tiny_llama_block
from sdquant.calibrate import recipes
from sdquant.config import ActivationScalingConfig, AwqConfig, Fp8Config
from sdquant.quant.qtensor import Fp8Weight, QuantizedWeight

FAST = dict(awq=AwqConfig(grid=8, clip_grid=8, max_tokens=512))


@pytest.fixture(scope="module")
def setup():
    block, rope = tiny_llama_block(seed=5)
    inputs = block_inputs((block, rope), n_batches=3)
    ref = make_ctx(block, inputs, method="rtn").run()
    return block, inputs, ref


def _run(setup, **quant):
    block, inputs, ref = setup
    b = copy.deepcopy(block)
    ctx = make_ctx(b, inputs, **quant)
    res = recipes.quantize_block(ctx)
    out = ctx.run()
    err = sum(float((o - r).pow(2).mean()) for o, r in zip(out, ref)) / len(ref)
    return b, res, err


def test_methods_beat_rtn_on_block_output(setup):
    errs = {}
    for m in ("rtn", "awq", "gptq", "awq+gptq"):
        b, res, errs[m] = _run(setup, method=m, bits=3, group_size=32, **FAST)
        assert isinstance(res, recipes.BlockResult)
        assert set(res.weights) == {f"model.layers.0.{n}" for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        for name, qw in res.weights.items():
            assert isinstance(qw, QuantizedWeight) and qw.bits == 3
            lin = b.get_submodule(name[len("model.layers.0."):])
            torch.testing.assert_close(lin.weight.detach(), qw.dequantize(), rtol=0, atol=1e-6)
        rows = {r["layer"]: r for r in res.rows}
        assert len(rows) == 7 and all("seconds" in r for r in rows.values())
        if m in ("gptq", "awq+gptq"):
            assert all(r["loss"] <= r["rtn_loss"] and r["escalations"] == 0 for r in rows.values())
    assert errs["awq"] < errs["rtn"] and errs["gptq"] < errs["rtn"]
    assert errs["awq+gptq"] < errs["rtn"]


def test_awq_scales_are_plain_replayable_data(setup):
    _, res, _ = _run(setup, method="awq", bits=4, group_size=32, **FAST)
    recs = res.scales["model.layers.0.awq"]
    assert [r["inspect"] for r in recs] == ["model.layers.0.self_attn", "model.layers.0.self_attn.o_proj",
                                            "model.layers.0.mlp", "model.layers.0.mlp.down_proj"]
    assert all(isinstance(r["scales"], list) and len(r["scales"]) in (64, 128) for r in recs)


def test_per_channel_ratio_off_matches_plain_awq_loss_order(setup):
    on = _run(setup, method="awq", bits=3, group_size=32, **FAST)[1]
    off = _run(setup, method="awq", bits=3, group_size=32,
               activation_scaling=ActivationScalingConfig(per_channel=False), **FAST)[1]
    for a, b in zip(on.rows, off.rows):
        assert a["awq_loss"] == pytest.approx(b["awq_loss"], rel=1e-5)      # same grid search
        assert a["awq_ratio_loss"] <= a["awq_loss"]                          # ratio never hurts
        assert b["awq_ratio_loss"] is None


def test_unfoldable_group_becomes_explicit_smooth(setup):
    block, inputs, ref = setup
    b = copy.deepcopy(block)
    ctx = make_ctx(b, inputs, method="awq", bits=3, group_size=32, **FAST)
    ctx.groups[0].prev = None                          # pretend the input norm cannot absorb the scale
    ctx.groups[0].prev_name = None
    norm_before = b.input_layernorm.weight.detach().clone()
    res = recipes.quantize_block(ctx)
    assert torch.equal(b.input_layernorm.weight, norm_before)
    assert set(res.smooth) == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                               "model.layers.0.self_attn.v_proj"}
    # the module holds Q(W·s)/s, i.e. the package's weight applied to x / smooth
    name = "model.layers.0.self_attn.q_proj"
    eff = res.weights[name].dequantize() / res.smooth[name][None, :]
    torch.testing.assert_close(b.self_attn.q_proj.weight.detach(), eff, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activations,smoothing,weights", [("dynamic", False, "channel"), ("static", False, "channel"),
                                                            ("static", True, "channel"), ("static", True, "tensor")])
def test_fp8_block(setup, activations, smoothing, weights):
    b, res, err = _run(setup, method="fp8", fp8=Fp8Config(activations=activations, smoothing=smoothing,
                                                         weights=weights))
    assert all(isinstance(w, Fp8Weight) for w in res.weights.values()) and len(res.weights) == 7
    # per-tensor weights: one scale per matrix (stored repeated); per-channel: they differ across channels
    assert all(bool(torch.all(w.weight_scale == w.weight_scale[0])) == (weights == "tensor")
               for w in res.weights.values())
    assert all((w.input_scale is not None) == (activations == "static") for w in res.weights.values())
    assert err < 1e-3
    assert bool(smoothing) == ("model.layers.0.fp8_smooth" in res.scales)
    if activations == "static":
        # the static scale covers the calibrated range of the (smoothed) input
        assert all(float(w.input_scale) > 0 for w in res.weights.values())
