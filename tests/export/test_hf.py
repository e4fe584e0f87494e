"""GPTQ / AWQ checkpoint interop.

AWQ: tested against AutoAWQ's own packer (WQLinear_GEMM.from_linear) and dequantizer (dequantize_gemm) when
autoawq is installed (0.2.9 installs with --no-deps; its package __init__ needs `datasets`, so the two
modules are imported directly). GPTQ: auto-gptq does not import with transformers 5, so the GPTQ layout is
checked against fixtures written by hand from the layout definition (literal words, and an independent
big-integer bit-stream model), never against sdquant's own packer."""
from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import types

import pytest
import torch

from sd2_testutil import rtn
from sdquant.errors import PackageError, ShapeError
from sdquant.export.hf import (export_hf_checkpoint, from_awq, from_gptq, import_hf_checkpoint, to_awq,
                               to_gptq)
from sdquant.export.sd2 import open_sd2, write_sd2
from sdquant.quant.qtensor import QuantizedWeight, quantize_fp8_weight


def _same(a: QuantizedWeight, b: QuantizedWeight):
    assert (a.bits, a.group_size, a.in_features) == (b.bits, b.group_size, b.in_features)
    for f in ("qweight", "scales", "zeros", "g_idx"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), f


def _w(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ GPTQ, by hand
def _words(codes_along, bits):
    """Independent model of GPTQ packing: concatenate codes as one little-endian integer, cut 32-bit words."""
    v = 0
    for i, c in enumerate(codes_along):
        v |= int(c) << (bits * i)
    nwords = len(codes_along) * bits // 32
    return [((v >> (32 * j)) & 0xFFFFFFFF) for j in range(nwords)]


def _signed(u):
    return u - (1 << 32) if u >= 1 << 31 else u


def test_gptq_literal_words():
    # 4-bit, N=8, K=8: column n holds codes k=0..7 in nibbles k (low to high)
    codes = torch.tensor([[(k + n) % 16 for k in range(8)] for n in range(8)], dtype=torch.uint8)
    qw = QuantizedWeight.from_codes(codes, torch.ones(8, 1).half(), torch.full((8, 1), 8, dtype=torch.uint8), 4, -1)
    g = to_gptq(qw, "gptq")
    assert g["qweight"].shape == (1, 8) and g["qweight"].dtype == torch.int32
    assert g["qweight"][0, 0].item() == 0x76543210 and g["qweight"][0, 1].item() == _signed(0x87654321)
    assert g["qzeros"].tolist() == [[0x77777777]]               # v1 stores zero - 1
    assert to_gptq(qw, "gptq_v2")["qzeros"].tolist() == [[_signed(0x88888888)]]
    assert g["scales"].shape == (1, 8) and g["g_idx"].tolist() == [0] * 8


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_matches_bitstream_model(bits):
    n, k, gs = 32, 64, 32
    qw = rtn(_w(n, k), bits, gs, symmetric=False)
    codes, zeros = qw.codes(), qw.zeros
    g = to_gptq(qw, "gptq_v2")
    assert g["qweight"].shape == (k * bits // 32, n) and g["qzeros"].shape == (k // gs, n * bits // 32)
    for col in (0, 5, n - 1):
        expect = [_signed(w) for w in _words(codes[col].tolist(), bits)]
        assert g["qweight"][:, col].tolist() == expect
    for grp in range(k // gs):
        assert g["qzeros"][grp].tolist() == [_signed(w) for w in _words(zeros[:, grp].tolist(), bits)]
    assert torch.equal(g["scales"], qw.scales.t())


def _gptq_reference_dequant(g, bits, v1):
    """W[k, n] = scale[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]) with q, zero read with shifts/masks."""
    qw, qz = g["qweight"].to(torch.int64) & 0xFFFFFFFF, g["qzeros"].to(torch.int64) & 0xFFFFFFFF
    kw, n = qw.shape
    big_q = [sum(int(qw[j, c]) << (32 * j) for j in range(kw)) for c in range(n)]
    k = kw * 32 // bits
    q = torch.tensor([[(big_q[c] >> (bits * i)) & ((1 << bits) - 1) for c in range(n)] for i in range(k)])
    zr = []
    for row in qz.tolist():
        v = sum(int(w) << (32 * j) for j, w in enumerate(row))
        zr.append([((v >> (bits * c)) & ((1 << bits) - 1)) + (1 if v1 else 0) for c in range(n)])
    z = torch.tensor(zr)
    gi = g["g_idx"].long()
    return (q - z[gi]).float() * g["scales"].float()[gi]


@pytest.mark.parametrize("bits,gs,sym,act,fmt", [(4, 32, False, False, "gptq"), (4, 16, True, True, "gptq"),
                                                 (3, 32, False, True, "gptq_v2"), (8, -1, True, False, "gptq"),
                                                 (2, 32, False, False, "gptq_v2")])
def test_gptq_dequant_and_roundtrip(bits, gs, sym, act, fmt):
    qw = rtn(_w(32, 64, 1), bits, gs, sym, act_order=act)
    if fmt == "gptq" and qw.zeros is not None and bool((qw.zeros == 0).any()):
        qw.zeros.clamp_(min=1)  # v1 cannot hold zero 0 (tested separately)
    g = to_gptq(qw, fmt)
    assert torch.equal(_gptq_reference_dequant(g, bits, fmt == "gptq"), qw.dequantize().t())
    back = from_gptq(g["qweight"], g["qzeros"], g["scales"], g["g_idx"], bits, gs, sym, fmt)
    _same(back, qw)


def test_gptq_v1_zero_point_zero():
    qw = rtn(_w(32, 64).abs(), 4, 32, symmetric=False)  # all-positive groups: zero point 0
    assert bool((qw.zeros == 0).any())
    with pytest.raises(ShapeError, match="gptq_v2"):
        to_gptq(qw, "gptq")
    g = to_gptq(qw, "gptq_v2")
    _same(from_gptq(g["qweight"], g["qzeros"], g["scales"], g["g_idx"], 4, 32, False, "gptq_v2"), qw)
    # a v1 file whose field is all ones means zero 16 to v1 kernels: imported as exactly that
    ones = torch.full((2, 4), -1, dtype=torch.int32)
    w = from_gptq(g["qweight"], ones, g["scales"], None, 4, 32, False, "gptq")
    assert int(w.zeros.max()) == 16


def test_gptq_import_rejects_bad_shapes():
    g = to_gptq(rtn(_w(32, 64), 4, 32, False), "gptq")
    with pytest.raises(PackageError, match="shapes disagree"):
        from_gptq(g["qweight"], g["qzeros"][:1], g["scales"], g["g_idx"], 4, 32, False)
    with pytest.raises(PackageError, match="g_idx"):
        from_gptq(g["qweight"], g["qzeros"], g["scales"], g["g_idx"][:5], 4, 32, False)
    with pytest.raises(PackageError, match="int32"):
        from_gptq(g["qweight"].float(), g["qzeros"], g["scales"], g["g_idx"], 4, 32, False)


# ------------------------------------------------------------------------------------ AWQ
def test_awq_literal_order():
    # K=1 row, N=8: channel j has code j -> nibble i holds channel ORDER[i] = 0,2,4,6,1,3,5,7
    codes = torch.arange(8, dtype=torch.uint8).reshape(8, 1).repeat(1, 8)  # code[n, k] = n
    qw = QuantizedWeight.from_codes(codes, torch.ones(8, 1).half(), torch.full((8, 1), 3, dtype=torch.uint8), 4, 8)
    a = to_awq(qw)
    assert a["qweight"].shape == (8, 1) and a["qweight"][0, 0].item() == 0x75316420
    assert a["qzeros"].tolist() == [[0x33333333]]
    _same(from_awq(a["qweight"], a["qzeros"], a["scales"], 8), qw)


@pytest.fixture(scope="module")
def autoawq():
    spec = importlib.util.find_spec("awq")
    if spec is None:
        pytest.skip("autoawq not installed (pip install autoawq --no-deps)")
    saved = sys.modules.get("awq")
    pkg = types.ModuleType("awq")  # bypass awq/__init__.py, which imports `datasets` for its model zoo
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["awq"] = pkg
    try:
        yield (importlib.import_module("awq.modules.linear.gemm"), importlib.import_module("awq.utils.packing_utils"))
    finally:
        for name in [m for m in sys.modules if m == "awq" or m.startswith("awq.")]:
            del sys.modules[name]
        if saved is not None:
            sys.modules["awq"] = saved


@pytest.mark.parametrize("n,k,gs,sym", [(64, 128, 32, False), (96, 64, 64, True), (32, 256, 128, False)])
def test_awq_matches_autoawq(autoawq, n, k, gs, sym):
    gemm, packing = autoawq
    qw = rtn(_w(n, k, 2), 4, gs, sym)
    zeros = qw.zeros if qw.zeros is not None else torch.full(qw.scales.shape, 8, dtype=torch.uint8)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = qw.dequantize()
    ref = gemm.WQLinear_GEMM.from_linear(lin, 4, gs, scales=qw.scales.t().contiguous(),
                                         zeros=zeros.t().contiguous().to(torch.int32))
    mine = to_awq(qw)
    for key in ("qweight", "qzeros", "scales"):
        assert torch.equal(getattr(ref, key), mine[key]), key
    deq = packing.dequantize_gemm(ref.qweight, ref.qzeros, ref.scales, 4, gs)
    assert torch.equal(deq.float().t(), qw.dequantize(torch.float16).float())
    _same(from_awq(ref.qweight, ref.qzeros, ref.scales, gs), qw)


def test_awq_rejects_what_it_cannot_hold():
    for qw in (rtn(_w(32, 64), 4, 16, True, act_order=True), rtn(_w(32, 64), 3, 32, False),
               rtn(_w(32, 64), 4, -1, False)):
        with pytest.raises(ShapeError, match="export as GPTQ"):
            to_awq(qw)


# ------------------------------------------------------------------------------------ folders
def _layers(bits, gs, sym, act):
    return [(f"model.layers.{i}.mlp.{p}", rtn(_w(32, 64, i * 3 + j), bits, gs, sym, act_order=act, seed=i),
             torch.randn(32) if j == 0 else None, None)
            for i in range(2) for j, p in enumerate(("up_proj", "down_proj"))]


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}


@pytest.mark.parametrize("fmt,ckpt,bits,gs,sym,act", [("gptq", "gptq", 4, 16, True, True),
                                                      ("gptq", "gptq_v2", 3, 32, False, False),
                                                      ("awq", "gptq", 4, 32, False, False),
                                                      ("awq", "gptq", 4, 32, True, False)])
def test_folder_roundtrip_via_sd2(tmp_path, fmt, ckpt, bits, gs, sym, act):
    """sdquant -> GPTQ/AWQ folder -> sdquant -> .sd2 -> identical tensors."""
    layers = _layers(bits, gs, sym, act)
    if ckpt == "gptq" and not sym:
        for _, w, _, _ in layers:
            w.zeros.clamp_(min=1)
    floats = [("model.embed_tokens.weight", torch.randn(10, 64).half()), ("model.norm.weight", torch.ones(64))]
    out = export_hf_checkpoint(tmp_path / "ckpt", fmt=fmt, config=HF_CONFIG, float_tensors=floats,
                               quant_layers=layers, checkpoint_format=ckpt, high_precision=["lm_head"],
                               extra_files={"tokenizer.json": b"{}"}, max_shard_bytes=4000)
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files and "tokenizer.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == fmt and qc["bits"] == bits and qc["group_size"] == gs
    if fmt == "gptq":
        assert qc["desc_act"] == act and qc["sym"] == sym and qc["checkpoint_format"] == ckpt
    else:
        assert qc["version"] == "gemm" and qc["zero_point"] is True
    ck = import_hf_checkpoint(out)
    assert set(ck.quant_layers) == {n for n, *_ in layers}
    write_sd2(tmp_path / "m.sd2", family="llama", arch_config=ck.config, float_tensors=ck.float_tensors.items(),
              quant_layers=[(n, *v) for n, v in ck.quant_layers.items()])
    with open_sd2(tmp_path / "m.sd2") as pkg:
        ql, ft = pkg.quant_layers(), pkg.float_tensors()
        for name, w, bias, _ in layers:
            _same(ql[name][0], w)
            assert (bias is None and ql[name][1] is None) or torch.equal(ql[name][1], bias)
        for name, t in floats:
            assert torch.equal(ft[name], t)


def test_transformers_accepts_the_quantization_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    for fmt in ("gptq", "awq"):
        out = export_hf_checkpoint(tmp_path / fmt, fmt=fmt, config=HF_CONFIG, float_tensors=[],
                                   quant_layers=_layers(4, 32, True, False))
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        cls = transformers.GPTQConfig if fmt == "gptq" else transformers.AwqConfig
        cfg = cls.from_dict(qc).to_dict()
        assert cfg["bits"] == 4 and cfg["group_size"] == 32


def test_export_refuses(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    lay = _layers(4, 32, True, False)
    with pytest.raises(PackageError, match="not empty"):
        export_hf_checkpoint(tmp_path / "full", fmt="gptq", config={}, float_tensors=[], quant_layers=lay)
    with pytest.raises(ShapeError, match="only integer"):
        export_hf_checkpoint(tmp_path / "a", fmt="gptq", config={}, float_tensors=[],
                             quant_layers=[("x", quantize_fp8_weight(_w(32, 64)), None, None)])
    with pytest.raises(ShapeError, match="one bits/group_size"):
        export_hf_checkpoint(tmp_path / "b", fmt="gptq", config={}, float_tensors=[],
                             quant_layers=lay + [("y", rtn(_w(32, 64), 8, 32, True), None, None)])
    with pytest.raises(ShapeError, match="smooth"):
        export_hf_checkpoint(tmp_path / "c", fmt="awq", config={}, float_tensors=[],
                             quant_layers=[(lay[0][0], lay[0][1], None, torch.ones(64))])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # nothing half-written


def test_import_refuses(tmp_path):
    with pytest.raises(PackageError, match="config.json"):
        import_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(PackageError, match="'gptq' or 'awq'"):
        import_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
    with pytest.raises(PackageError, match="unreadable safetensors"):
        import_hf_checkpoint(tmp_path)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_export_from_calibration_result_and_loaded_model(tmp_path, fmt):
    """The entry points sdquant.export(format=gptq|awq) and `sdquant export pkg.sd2 --format gptq` use."""
    from types import SimpleNamespace

    from sdquant.export.hf import export_checkpoint, export_model
    from sdquant.models.hf import replace_linears
    model = _tiny_llama()
    weights = {n: rtn(m.weight.detach(), 4, 32, symmetric=True) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    out = export_checkpoint(SimpleNamespace(model=model, weights=weights, smooth={}, tokenizer=None),
                            tmp_path / "from_result", format=fmt)
    ck = import_hf_checkpoint(out)
    assert set(ck.quant_layers) == set(weights)
    for n, w in weights.items():
        _same(ck.quant_layers[n][0], w)
    assert torch.equal(ck.float_tensors["lm_head.weight"], model.lm_head.weight)
    assert ck.config["model_type"] == "llama" and ck.config["quantization_config"]["quant_method"] == fmt
    qmodel = replace_linears(model, weights)
    out2 = export_model(qmodel, tmp_path / "from_model", format=fmt)
    ck2 = import_hf_checkpoint(out2)
    for n, w in weights.items():
        _same(ck2.quant_layers[n][0], w)
    assert set(ck2.float_tensors) == set(ck.float_tensors)


@pytest.fixture(scope="module")
def autogptq_qlinear():
    """AutoGPTQ 0.7.1's own packer (nn_modules/qlinear/qlinear_cuda.py, pure numpy/torch). The package does
    not import with transformers 5, so the one module file is loaded directly, from an installed auto_gptq or
    from $AUTOGPTQ_PATH (e.g. `pip install --no-deps --target DIR auto-gptq==0.7.1`)."""
    import os
    from pathlib import Path
    spec = importlib.util.find_spec("auto_gptq") if not os.environ.get("AUTOGPTQ_PATH") else None
    roots = list(spec.submodule_search_locations) if spec else \
        [str(Path(os.environ["AUTOGPTQ_PATH"]) / "auto_gptq")] if os.environ.get("AUTOGPTQ_PATH") else []
    f = next((Path(r) / "nn_modules" / "qlinear" / "qlinear_cuda.py" for r in roots
              if (Path(r) / "nn_modules" / "qlinear" / "qlinear_cuda.py").exists()), None)
    if f is None:
        pytest.skip("auto-gptq not available (set AUTOGPTQ_PATH to a --target install of auto-gptq 0.7.1)")
    mspec = importlib.util.spec_from_file_location("_autogptq_qlinear_cuda", f)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod.QuantLinear


@pytest.mark.parametrize("bits,gs,sym,act", [(4, 32, False, False), (4, 16, True, True), (3, 32, False, True),
                                             (2, 32, True, False), (8, 64, False, False)])
def test_gptq_matches_autogptq_pack(autogptq_qlinear, bits, gs, sym, act):
    n, k = 64, 128
    qw = rtn(_w(n, k, 4), bits, gs, sym, act_order=act, seed=3)
    if qw.zeros is not None:
        qw.zeros.clamp_(min=1)  # AutoGPTQ's v1 packer corrupts neighbours for a zero of 0 (zero-1 wraps)
    zeros = (qw.zeros if qw.zeros is not None else torch.full(qw.scales.shape, 1 << (bits - 1))).float()
    g_idx = qw.g_idx if qw.g_idx is not None else (torch.arange(k) // gs).to(torch.int32)
    ref = autogptq_qlinear(bits, gs, k, n, False)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = qw.dequantize()
    ref.pack(lin, qw.scales.float(), zeros, g_idx)
    mine = to_gptq(qw, "gptq")
    assert torch.equal(ref.qweight, mine["qweight"])
    assert torch.equal(ref.qzeros, mine["qzeros"])
    assert torch.equal(ref.scales.half(), mine["scales"]) and torch.equal(ref.g_idx.int(), mine["g_idx"])
    _same(from_gptq(ref.qweight, ref.qzeros, ref.scales.half(), ref.g_idx, bits, gs, sym, "gptq"), qw)


def test_import_legacy_side_config_files(tmp_path):
    """AutoGPTQ's quantize_config.json / AutoAWQ's quant_config.json (w_bit, q_group_size) next to a
    config.json without quantization_config."""
    lay = _layers(4, 32, False, False)
    for _, w, _, _ in lay:
        w.zeros.clamp_(min=1)
    for fmt, side, qc in (("gptq", "quantize_config.json", {"bits": 4, "group_size": 32, "sym": False,
                                                             "desc_act": False}),
                          ("awq", "quant_config.json", {"w_bit": 4, "q_group_size": 32, "zero_point": True,
                                                        "version": "GEMM"})):
        out = export_hf_checkpoint(tmp_path / fmt, fmt=fmt, config=HF_CONFIG, float_tensors=[], quant_layers=lay)
        (out / "config.json").write_text(json.dumps(HF_CONFIG))
        (out / side).write_text(json.dumps(qc))
        ck = import_hf_checkpoint(out)
        for name, w, _, _ in lay:
            _same(ck.quant_layers[name][0], w)
