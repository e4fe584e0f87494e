"""Tied tensors in .sd2 packages (docs/FORMAT.md §5.3.1, format_version 2): the writer stores a tied pair once
and records an alias, the reader and sdquant.load restore the tie (the lm_head Parameter IS the embedding),
malformed alias tables are refused with one line naming the alias, packages without ties stay version 1, and
the GPTQ/AWQ exports still write both keys."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdquant.errors import PackageError
from sdquant.export import sd2_manifest
from sdquant.export.sd2 import (declared_ties, format_inspect, inspect_sd2, open_sd2, package_aliases, verify_sd2,
                                write_sd2)
from sdquant.quant.qtensor import QuantizedWeight

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures" / "hostile"))
import make_hostile  # noqa: E402  (the hostile-file generator: its re-signing helpers)


def _qw(n=16, k=64):
    codes = (torch.arange(n * k) % 16).reshape(n, k).to(torch.uint8)
    scales = torch.full((n, k // 32), 0.01).half()
    return QuantizedWeight.from_codes(codes, scales, None, 4, 32)


def _manifest(path):
    with open_sd2(path, verify="none") as pkg:
        return pkg.manifest


def _tiny(family: str):
    import sdquant
    cfg = {"model": {"kind": "builtin", "name": f"tiny-{family}"}, "data": {"kind": "builtin", "n_samples": 4,
                                                                            "seq_len": 32},
           "quant": {"method": "rtn", "bits": 4, "group_size": 32}, "device": "cpu", "dtype": "float32"}
    return sdquant.calibrate(config=cfg)


# ------------------------------------------------------------------------------------------- writer
def test_shared_memory_is_stored_once_and_read_back_as_one_tensor(tmp_path):
    emb = torch.randn(300, 64)
    floats = [("model.embed_tokens.weight", emb), ("model.norm.weight", torch.ones(64)),
              ("lm_head.weight", emb.detach())]  # what state_dict() yields for a tied model: a new view, same memory
    tied = write_sd2(tmp_path / "tied.sd2", family="llama", arch_config={}, float_tensors=floats,
                     quant_layers=[("model.layers.0.mlp.down_proj", _qw(), None, None)])
    copied = write_sd2(tmp_path / "copy.sd2", family="llama", arch_config={},
                       float_tensors=[(n, t.clone()) for n, t in floats],
                       quant_layers=[("model.layers.0.mlp.down_proj", _qw(), None, None)])
    # equal values alone are not a tie (a fresh model's norms are all ones): the copy stores both, as v1
    assert copied.stat().st_size - tied.stat().st_size >= emb.numel() * 4
    assert _manifest(copied)["format_version"] == 1 and "aliases" not in _manifest(copied)
    man = _manifest(tied)
    assert man["format_version"] == 2 and set(man["float_tensors"]) == {"model.embed_tokens.weight",
                                                                        "model.norm.weight"}
    assert man["aliases"] == {"lm_head.weight": {"target": "model.embed_tokens.weight", "dtype": "F32",
                                                 "shape": [300, 64]}}
    with open_sd2(tied) as pkg:
        assert pkg.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
        ft = pkg.float_tensors()
        assert list(ft) == [n for n, _ in floats[:2]] + ["lm_head.weight"]
        assert ft["lm_head.weight"] is ft["model.embed_tokens.weight"] and torch.equal(ft["lm_head.weight"], emb)
        assert torch.equal(pkg.tensor("lm_head.weight"), emb)
        moved = pkg.float_tensors(device="cpu")
        assert moved["lm_head.weight"] is moved["model.embed_tokens.weight"]
    assert verify_sd2(tied) == [] and package_aliases(tied) == {"lm_head.weight": "model.embed_tokens.weight"}


def test_views_that_differ_and_freed_memory_are_not_ties(tmp_path):
    base = torch.arange(128.0)
    ptrs = []

    def stream():  # a streamed model frees each tensor: its address may be reused by the next, unrelated one
        for i in range(3):
            t = torch.full((4096,), float(i))
            ptrs.append(t.data_ptr())
            yield f"t{i}", t
            del t
        yield "half_a", base[:64]
        yield "half_b", base[64:]
        yield "strided", base[::2]
        yield "empty_a", base[:0]
        yield "empty_b", base[:0]

    p = write_sd2(tmp_path / "s.sd2", family="x", arch_config={}, float_tensors=stream(), quant_layers=[])
    with open_sd2(p) as pkg:
        assert pkg.aliases == {} and pkg.manifest["format_version"] == 1
        ft = pkg.float_tensors()
        for i in range(3):
            assert torch.equal(ft[f"t{i}"], torch.full((4096,), float(i)))
        assert torch.equal(ft["half_b"], base[64:]) and torch.equal(ft["strided"], base[::2])


def test_declared_ties_in_either_order_and_refused_when_values_differ(tmp_path):
    emb, norm = torch.randn(40, 8), ("n.weight", torch.ones(8))
    for order in ([("emb.weight", emb), norm, ("head.weight", emb.clone())],
                  [("head.weight", emb.clone()), norm, ("emb.weight", emb)]):
        p = write_sd2(tmp_path / "d.sd2", family="x", arch_config={}, float_tensors=order, quant_layers=[],
                      tied={"head.weight": "emb.weight"})
        with open_sd2(p) as pkg:
            first, second = order[0][0], order[2][0]
            assert pkg.aliases == {second: first} and list(pkg.manifest["float_tensors"]) == [first, "n.weight"]
            assert torch.equal(pkg.tensor(second), emb)
    bad = emb.clone()
    bad[3, 3] += 1
    with pytest.raises(PackageError, match=r"^float tensor 'head.weight': declared tied to 'emb.weight'"):
        write_sd2(tmp_path / "bad.sd2", family="x", arch_config={}, quant_layers=[], tied={"head.weight": "emb.weight"},
                  float_tensors=[("emb.weight", emb), ("head.weight", bad)])
    for tied, needle in (({"a": "a"}, "two different"), ({"a": ""}, "two different"),
                         ({"a": "b", "c": "a"}, "declared tied to both")):
        with pytest.raises(PackageError, match=needle):
            write_sd2(tmp_path / "t.sd2", family="x", arch_config={}, float_tensors=[], quant_layers=[], tied=tied)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.sd2"]  # nothing half-written


def test_writer_refuses_an_alias_that_would_shadow_a_quantized_layer(tmp_path):
    w = torch.randn(16, 64)
    with pytest.raises(PackageError, match="alias 'lm_head.weight': shadows quantized layer 'lm_head'"):
        write_sd2(tmp_path / "x.sd2", family="x", arch_config={}, quant_layers=[("lm_head", _qw(), None, None)],
                  float_tensors=[("emb.weight", w), ("lm_head.weight", w)])
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------- reader
def _aliased_package(tmp_path, table, version=2):
    members = make_hostile.base_package(tmp_path)

    def fn(m):
        m["format_version"] = version
        m["aliases"] = table
    p = tmp_path / "h.sd2"
    p.write_bytes(make_hostile.build(make_hostile.edit_manifest(members, fn)))
    return p


def test_reader_accepts_a_valid_hand_made_alias(tmp_path):
    p = _aliased_package(tmp_path, {"model.final_norm.weight": {"target": "model.norm.weight", "dtype": "F32",
                                                                "shape": [64]}})
    with open_sd2(p) as pkg:
        ft = pkg.float_tensors()
        assert ft["model.final_norm.weight"] is ft["model.norm.weight"]


@pytest.mark.parametrize("table,needle", [
    ({"x.weight": {"target": "model.norm.weight", "dtype": "F32", "shape": [64]}, "y": 3}, "alias 'y': entry is not"),
    ({"": {"target": "model.norm.weight", "dtype": "F32", "shape": [64]}}, "alias '': name must be non-empty"),
    ({"x.weight": {"target": 7, "dtype": "F32", "shape": [64]}}, "alias 'x.weight'.target: expected str"),
    ({"x.weight": {"target": "model.norm.weight", "dtype": "O", "shape": [64]}}, "alias 'x.weight': unknown dtype"),
    ({f"a{i}": {"target": f"a{i + 1}", "dtype": "F32", "shape": [64]} for i in range(500)}
     | {"a500": {"target": "a0", "dtype": "F32", "shape": [64]}}, "alias 'a0': aliases form a cycle (a0 -> a1"),
    ([], "aliases: expected dict"),
])
def test_reader_refuses_bad_alias_tables(tmp_path, table, needle):
    with pytest.raises(PackageError) as e:
        open_sd2(_aliased_package(tmp_path, table))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_hostile_alias_fixtures_exist():
    expected = json.loads((Path(make_hostile.__file__).parent / "EXPECTED.json").read_text())
    names = {n for n in expected if n.startswith("alias_")}
    assert {"alias_missing_target.sd2", "alias_to_itself.sd2", "alias_cycle.sd2", "alias_shape_mismatch.sd2",
            "alias_dtype_mismatch.sd2", "alias_shadows_tensor.sd2"} <= names
    for n in names:  # every message names the alias key (or the field, for the version-level cases)
        assert expected[n].startswith("alias '") or "'aliases'" in expected[n] or "shadows" in expected[n]


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                           max_leaves=12)
names = st.sampled_from(["a", "b", "n.weight", "L.weight", ""])
entries = st.fixed_dictionaries({"target": names | json_values, "dtype": st.sampled_from(["F32", "F16", "X"]),
                                 "shape": st.sampled_from([[4], [5], [-1], "4"])}) | json_values


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(names, entries, max_size=5) | json_values)
def test_alias_validator_fuzz(table):
    """Alias-shaped garbage: refused with PackageError or accepted as a table of valid aliases, nothing else."""
    floats = {"n.weight": {"member": "weights/f.safetensors", "dtype": "F32", "shape": [4]}}
    try:
        out = sd2_manifest.check_aliases(table, floats, {"L": {}})
    except PackageError as e:
        assert "\n" not in str(e)
        return
    assert all(t == "n.weight" and a not in floats for a, t in out.items())


# ------------------------------------------------------------------------------------------- through the API
@pytest.mark.parametrize("family", ["gemma", "gpt2"])
def test_tied_model_package_is_smaller_and_loads_tied(tmp_path, family):
    import sdquant
    res = _tiny(family)
    model = res.model
    emb = model.get_input_embeddings().weight
    assert declared_ties(model) and model.get_output_embeddings().weight is emb
    path = sdquant.export(res, tmp_path / "t.sd2")
    info = inspect_sd2(path)
    lm = next(iter(info["aliases"]))
    assert info["aliases"] == declared_ties(model) and info["format_version"] == 2
    assert f"  {lm} -> {info['aliases'][lm]}" in format_inspect(info)
    # the same package with the tie broken in memory is bigger by the embedding (and stays version 1)
    with open_sd2(path) as pkg:
        floats = [(n, t.clone()) for n, t in pkg.float_tensors().items()]
        quant = [(n, *v) for n, v in pkg.quant_layers().items()]
        untied = write_sd2(tmp_path / "u.sd2", family=pkg.family, arch_config=pkg.arch_config,
                           float_tensors=floats, quant_layers=quant)
    assert inspect_sd2(untied)["float_bytes"] - info["float_bytes"] >= emb.numel() * emb.element_size()
    assert inspect_sd2(untied)["format_version"] == 1
    ids = torch.tensor([[1, 5, 9, 33, 2, 71]])
    with torch.no_grad():
        want = res.quantized_model()(ids).logits
        for dtype in (torch.float32, torch.bfloat16):
            loaded = sdquant.load(path, dtype=dtype, kernels="reference")
            assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
            n_params = sum(p.numel() for p in loaded.parameters())
            assert n_params == sum(p.numel() for _, p in loaded.named_parameters(remove_duplicate=False)) - emb.numel()
            if dtype == torch.float32:
                assert torch.equal(loaded(ids).logits, want)


def test_cli_verify_and_inspect_show_aliases(tmp_path, capsys):
    import sdquant
    from sdquant.cli import main
    path = sdquant.export(_tiny("gemma"), tmp_path / "t.sd2")
    assert main(["verify", str(path)]) == 0
    assert "tied: lm_head.weight -> model.embed_tokens.weight (stored once)" in capsys.readouterr().out
    assert main(["inspect", str(path)]) == 0
    assert "lm_head.weight -> model.embed_tokens.weight" in capsys.readouterr().out


def test_export_refuses_a_declared_tie_whose_values_differ(tmp_path):
    import sdquant
    res = _tiny("gemma")
    head = res.model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach() * 2)  # config still says tie_word_embeddings
    with pytest.raises(PackageError, match="'lm_head.weight': declared tied to 'model.embed_tokens.weight'"):
        sdquant.export(res, tmp_path / "t.sd2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_gptq_awq_exports_of_a_tied_model_write_both_keys(tmp_path, fmt):
    import sdquant
    from sdquant.export.hf import export_model, import_hf_checkpoint
    res = _tiny("gemma")
    path = sdquant.export(res, tmp_path / "t.sd2")
    emb = res.model.get_input_embeddings().weight.detach()
    for src, out in ((res, tmp_path / "from_result"), (None, tmp_path / "from_package")):
        if src is None:  # `sdquant export t.sd2 --format gptq` path: a loaded (tied) model
            export_model(sdquant.load(path, kernels="reference"), out, format=fmt)
        else:
            sdquant.export(src, out, format=fmt)
        ck = import_hf_checkpoint(out)
        assert torch.equal(ck.float_tensors["lm_head.weight"], emb)
        assert torch.equal(ck.float_tensors["model.embed_tokens.weight"], emb)
