"""SeedanceDiT on tiny random configs: config validation, T < 3 fallback, temporal switch, FP32 Cross-Gate
Fusion, sparse temporal / 3D-window attention structure, adapter data (exact folds through the real walker
helpers)."""
import logging
import re

import pytest
import torch

from sdquant.errors import ConfigError, ShapeError
from sdquant.models.seedance import (SeedanceConfig, TemporalAttention, WindowAttention3D, build_empty,
                                     build_seedance, seedance_adapter, seedance_forward, seedance_pre_block)

TINY = dict(in_channels=3, patch_size=2, hidden_size=32, depth=2, num_heads=2, cond_dim=8, stride_t=2)


def tiny(**kw):
    return build_seedance(SeedanceConfig(**{**TINY, **kw}), seed=1).eval()


def inputs(B=2, T=4, H=8, W=6, C=3, cd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, C, H, W, generator=g), torch.rand(B, generator=g), torch.randn(B, cd, generator=g)


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("kw, field", [
    (dict(hidden_size=30, num_heads=4), "hidden_size"),
    (dict(hidden_size=18, num_heads=3), "hidden_size"),          # divisible by heads, not by 4
    (dict(depth=0), "depth"),
    (dict(depth=True), "depth"),
    (dict(num_heads=2.0), "num_heads"),
    (dict(stride_t=-1), "stride_t"),
    (dict(window_3d=(2, 2)), "window_3d"),
    (dict(window_3d=(2, 0, 2)), "window_3d"),
    (dict(qk_norm="yes"), "qk_norm"),
    (dict(norm_eps=0), "norm_eps"),
    (dict(model_type="llama"), "model_type"),
    (dict(freq_dim=255), "freq_dim"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError) as e:
        SeedanceConfig(**{**TINY, **kw})
    assert e.value.field == field and "\n" not in str(e.value)


def test_config_unknown_key_suggests_and_roundtrips():
    with pytest.raises(ConfigError, match=r"^cfg.json:hiden_size: unknown key \(did you mean 'hidden_size'\?\)"):
        SeedanceConfig.from_dict({"hiden_size": 64}, where="cfg.json")
    with pytest.raises(ConfigError, match="cfg.json:depth"):
        SeedanceConfig.from_dict({"depth": "4"}, where="cfg.json")
    cfg = SeedanceConfig(**TINY, window_3d=[1, 2, 2])
    assert cfg.window_3d == (1, 2, 2) and cfg.mlp_hidden_size == 128
    assert SeedanceConfig.from_dict(cfg.to_dict()) == cfg


def test_forward_shapes_and_input_errors():
    m = tiny(window_3d=(2, 2, 2))
    x, t, c = inputs()
    assert m(x, t, c).shape == x.shape
    assert m(x, t[0], None).shape == x.shape             # scalar t, unconditional
    with pytest.raises(ShapeError, match="patch_size"):
        m(torch.randn(1, 4, 3, 7, 6), t[:1], c[:1])
    with pytest.raises(ShapeError, match=r"\[B, T, 3, H, W\]"):
        m(torch.randn(1, 4, 5, 8, 6), t[:1], c[:1])
    with pytest.raises(ShapeError, match="cond"):
        m(x, t, torch.randn(2, 9))


# --------------------------------------------------------------------------------- spatial-only mode
def _calls(m, names):
    seen = []
    hs = [m.get_submodule(n).register_forward_hook(lambda mod, a, o, n=n: seen.append(n)) for n in names]
    return seen, hs


def test_fewer_than_three_frames_is_spatial_only_and_logged(caplog):
    m = tiny()
    x, t, c = inputs(T=2)
    seen, hs = _calls(m, ["blocks.0.attn_t", "blocks.0.cgf", "blocks.0.attn_s"])
    with caplog.at_level(logging.INFO, logger="sdquant.models.seedance"):
        y = m(x, t, c)
        m(x, t, c)
    assert seen.count("blocks.0.attn_s") == 2 and "blocks.0.attn_t" not in seen and "blocks.0.cgf" not in seen
    msgs = [r.getMessage() for r in caplog.records if "spatial-only" in r.getMessage()]
    assert len(msgs) == 1 and "2 frame(s)" in msgs[0]          # logged once, not at every sampler step
    # spatial-only = what the model computes with the temporal branch switched off
    torch.testing.assert_close(y, m.set_temporal(False)(x, t, c), rtol=0, atol=0)
    for h in hs:
        h.remove()


def test_temporal_switch_at_inference():
    m = tiny(window_3d=(2, 2, 2))
    x, t, c = inputs(T=4)
    y_on = m(x, t, c)
    seen, _ = _calls(m, ["blocks.1.attn_t", "blocks.1.attn_w", "blocks.1.cgf"])
    y_off = m.set_temporal(False)(x, t, c)
    assert seen == [] and not m.temporal_enabled
    assert (y_on - y_off).abs().max() > 1e-3                   # the branch does something when on
    # frames are independent without the temporal branch: changing frame 3 leaves frames 0-2 alone
    x2 = x.clone()
    x2[:, 3] += 1.0
    torch.testing.assert_close(m(x2, t, c)[:, :3], y_off[:, :3])
    assert m.set_temporal(True).temporal_enabled
    torch.testing.assert_close(m(x, t, c), y_on)


# ----------------------------------------------------------------------------------- Cross-Gate Fusion
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cgf_kept_fp32(dtype):
    m = tiny()
    ref_w = m.blocks[0].cgf.gate.weight.detach().clone()
    m.to(dtype)
    for blk in m.blocks:
        assert blk.cgf.gate.weight.dtype == torch.float32 and blk.cgf.gate.bias.dtype == torch.float32
        assert blk.attn_s.q.weight.dtype == dtype
    assert torch.equal(m.blocks[0].cgf.gate.weight, ref_w)       # restored exactly, not round-tripped
    m.half() if dtype == torch.bfloat16 else m.bfloat16()
    assert m.blocks[1].cgf.gate.weight.dtype == torch.float32
    m.to(dtype)
    gate_out = []
    m.blocks[0].cgf.gate.register_forward_hook(lambda mod, a, o: gate_out.append((a[0].dtype, o.dtype)))
    x, t, c = inputs(T=3)
    with torch.autocast("cpu", dtype=dtype):
        y = m(x.to(dtype), t, c)
    assert gate_out == [(torch.float32, torch.float32)]           # the gate ran in fp32 under autocast
    assert y.dtype == dtype and torch.isfinite(y).all()
    m.double()                                                    # a float64 reference may go higher
    assert m.blocks[0].cgf.gate.weight.dtype == torch.float64


# ------------------------------------------------------------------------------ attention structure
def test_temporal_stride_attends_to_anchors_only():
    attn = TemporalAttention(16, 2, True, stride=2).eval()
    x = torch.randn(1, 5, 2, 2, 16)
    y = attn(x)
    x1 = x.clone()
    x1[:, 1] += 3.0                  # frame 1 is not an anchor: only frame 1 itself sees it
    d = (attn(x1) - y).abs().amax(dim=(0, 2, 3, 4))
    assert d[1] > 1e-3 and torch.all(d[[0, 2, 3, 4]] == 0)
    x2 = x.clone()
    x2[:, 2] += 3.0                  # frame 2 is an anchor: every frame sees it
    assert torch.all((attn(x2) - y).abs().amax(dim=(0, 2, 3, 4)) > 1e-4)


def test_window_attention_is_local_and_handles_padding():
    torch.manual_seed(0)
    attn = WindowAttention3D(16, 2, False, (2, 2, 2)).eval()
    x = torch.randn(2, 3, 3, 5, 16)                               # no size divisible by the window
    y = attn(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    x1 = x.clone()
    x1[:, 0, 0, 0] += 3.0
    changed = (attn(x1) - y).abs().amax(dim=(0, 4)) > 0          # [T, h, w]
    inside = torch.zeros(3, 3, 5, dtype=torch.bool)
    inside[:2, :2, :2] = True
    assert torch.equal(changed, inside)
    # the last (padded) window equals attention over its real tokens only
    last = x[:, 2:3, 2:3, 4:5]                                     # a window holding a single real token
    torch.testing.assert_close(y[:, 2:3, 2:3, 4:5], attn.attend(last.reshape(2, 1, 16)).view(2, 1, 1, 1, 16))


# ------------------------------------------------------------------------------------------- adapter
def test_adapter_is_plain_data_and_names_resolve():
    m = tiny(window_3d=(2, 2, 2))
    ad = seedance_adapter(m)
    assert set(ad) >= {"blocks", "pre_block", "scaling_groups", "keep_high_precision", "forward"}
    blk = m.get_submodule(ad["blocks"])[0]
    for g in ad["scaling_groups"]:
        for name in [g["prev"], g["inspect"], *g["linears"]]:
            blk.get_submodule(name)
        assert g["fold"] in ("norm", "linear")
    assert len(seedance_adapter(tiny())["scaling_groups"]) == 6    # no window groups without windows
    linears = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
    kept = {n for n in linears if any(re.search(p, n) for p in ad["keep_high_precision"])}
    assert {"blocks.0.cgf.gate", "blocks.1.cgf.gate", "t_embed.fc1", "t_embed.fc2", "adaln", "final.linear",
            "patch_embed"} <= kept
    assert not any(".attn_" in n or ".mlp." in n for n in kept)


def test_pre_block_blocks_head_equal_forward():
    m = tiny()
    x, t, c = inputs()
    batch = {"x": x, "t": t, "cond": c}
    h, kw = seedance_pre_block(m, batch)
    assert h.shape == (2, 4, 4, 3, 32) and set(kw) == {"mod"}
    for blk in m.blocks:
        h = blk(h, **kw)
    _, y, _ = m.embed(x, t, c)
    torch.testing.assert_close(m.head(h, y, x.shape), m(x, t, c))
    torch.testing.assert_close(seedance_forward(m, batch), m(x, t, c))
    with pytest.raises(ShapeError, match="'x' and 't'"):
        seedance_pre_block(m, {"x": x})


def test_scaling_groups_fold_exactly_through_the_walker():
    """Fold random scales with the lead's walker helpers: the float64 model must compute the same function."""
    from sdquant.models.adapters import adapter_from_dict, get_adapter, resolve_groups
    m = tiny(window_3d=(2, 2, 2)).double()
    assert get_adapter(m).family == "seedance"
    ad = adapter_from_dict("seedance", seedance_adapter(m))
    x, t, c = inputs(T=4)
    x, c = x.double(), c.double()
    with torch.no_grad():
        for blk in m.blocks:   # non-trivial norm weights and modulation first
            for mod in blk.modules():
                if hasattr(mod, "weight") and mod.weight.ndim == 1:
                    mod.weight.uniform_(0.5, 1.5)
        y0 = m(x, t, c)
        g = torch.Generator().manual_seed(0)
        for i, blk in enumerate(m.blocks):
            prefix = f"blocks.{i}."
            targets = {prefix + n: mod for n, mod in blk.named_modules() if isinstance(mod, torch.nn.Linear)
                       and not n.endswith("cgf.gate")}
            groups = resolve_groups(blk, prefix, ad, targets)
            assert len(groups) == 8
            for grp in groups:
                grp.fold(torch.rand(grp.linears[0][1].in_features, generator=g, dtype=torch.float64) + 0.5)
        # the walker folds in float32 (ScalingGroup.fold), hence 1e-6 and not 1e-12; a fold that missed the
        # adaLN shift (a norm weight placed before the modulation) would be off by O(1)
        torch.testing.assert_close(m(x, t, c), y0, rtol=1e-5, atol=1e-6)


def test_build_empty_is_meta_and_keeps_gate_fp32():
    m = build_empty({**TINY, "window_3d": [1, 2, 2]}, dtype=torch.bfloat16)
    assert m.blocks[0].attn_w.q.weight.is_meta and m.blocks[0].attn_w.q.weight.dtype == torch.bfloat16
    assert m.blocks[0].cgf.gate.weight.dtype == torch.float32
    with pytest.raises(ConfigError, match="arch_config:depth"):
        build_empty({**TINY, "depth": 0})
