"""Round trips of the .sd2 package: identical tensors, identical QuantLinear outputs, zero-copy loading,
verification modes, atomic and deterministic writes, interoperability with standard ZIP/safetensors tools."""
from __future__ import annotations

import hashlib
import io
import json
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load

from sd2_testutil import tiny_model, write_tiny
from sdquant.errors import PackageError
from sdquant.export.sd2 import format_inspect, inspect_sd2, open_sd2, verify_sd2, write_sd2
from sdquant.export.sd2_reader import read_members
from sdquant.kernels.linear import Fp8Linear, QuantLinear
from sdquant.quant.qtensor import QuantizedWeight


def _eq(a, b):
    return (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype
                                         and a.shape == b.shape
                                         and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("verify", ["full", "lazy", "none"])
def test_roundtrip_identical_tensors_and_outputs(tmp_path, verify):
    path, floats, quant = write_tiny(tmp_path / "m.sd2")
    with open_sd2(path, verify=verify) as pkg:
        assert pkg.family == "llama" and pkg.arch_config["hidden_size"] == 64
        assert pkg.high_precision == ["lm_head"]
        ft = pkg.float_tensors()
        assert list(ft) == [n for n, _ in floats]
        for name, t in floats:
            assert _eq(ft[name], t), name
        ql = pkg.quant_layers()
        assert list(ql) == [q[0] for q in quant]
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
        for name, w, bias, smooth in quant:
            w2, b2, s2 = ql[name]
            assert type(w2) is type(w) and _eq(b2, bias) and _eq(s2, smooth), name
            if isinstance(w, QuantizedWeight):
                for f in ("qweight", "scales", "zeros", "g_idx"):
                    assert _eq(getattr(w2, f), getattr(w, f)), (name, f)
                assert (w2.bits, w2.group_size, w2.in_features) == (w.bits, w.group_size, w.in_features)
                mod, mod2 = QuantLinear(w, bias, smooth), QuantLinear(w2, b2, s2)
            else:
                for f in ("weight", "weight_scale", "input_scale"):
                    assert _eq(getattr(w2, f), getattr(w, f)), (name, f)
                mod, mod2 = Fp8Linear(w, bias, smooth), Fp8Linear(w2, b2, s2)
            assert torch.equal(mod(x), mod2(x)), name
        assert pkg.file("model.onnx") == bytes(range(256)) * 3
        assert pkg.files() == ["tokenizer.json", "model.onnx"]
        assert pkg.verify() == []


def test_tensors_are_zero_copy_views_of_the_file(tmp_path):
    path, floats, _ = write_tiny(tmp_path / "m.sd2")
    with open_sd2(path) as pkg:
        emb = pkg.tensor("model.embed_tokens.weight")
        w, _, _ = pkg.layer("l.int4_g32_asym")
        # the tensor's storage is the mapping itself: its bytes sit exactly where the member's data is
        raw = path.read_bytes()
        base = pkg._headers[pkg.manifest["float_tensors"]["model.embed_tokens.weight"]["member"]][0]
        assert bytes(emb.view(torch.uint8).reshape(-1)) == raw[base:base + emb.numel() * 2]
        # no copy: the tensor's memory *is* the mapping, at the tensor's offset in the file
        map_start = torch.frombuffer(pkg._mm, dtype=torch.uint8, count=1).data_ptr()
        assert emb.data_ptr() - map_start == base
        qbase, qhdr = pkg._headers[pkg.manifest["layers"]["l.int4_g32_asym"]["member"]]
        assert w.qweight.data_ptr() - map_start == qbase + qhdr["qweight"][2]
        # every tensor is aligned to its element size, member data to 64 bytes
        for m in pkg.members.values():
            assert m.data_offset % 64 == 0
    # tensors outlive the package; writing to them never touches the file (private mapping)
    before = path.read_bytes()
    emb.zero_()
    assert path.read_bytes() == before


def test_device_argument_moves_tensors(tmp_path):
    path, floats, _ = write_tiny(tmp_path / "m.sd2")
    with open_sd2(path) as pkg:
        t = pkg.float_tensors(device=torch.device("cpu"))["model.norm.weight"]
        assert t.device.type == "cpu" and torch.equal(t, floats[1][1])
        w, bias, _ = pkg.quant_layers(device="cpu")["l.int4_g32_asym"]
        assert w.qweight.device.type == "cpu" and bias.device.type == "cpu"


def test_lazy_verification_is_per_member(tmp_path):
    path, _, _ = write_tiny(tmp_path / "m.sd2")
    with open_sd2(path, verify="none") as pkg:
        member = pkg.members[pkg.manifest["layers"]["l.int3_g32"]["member"]]
    data = bytearray(path.read_bytes())
    data[member.data_offset + member.size - 1] ^= 0x01  # last byte of that layer's tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(PackageError, match=r"q000002.safetensors'.*sha256 mismatch"):
        open_sd2(path, verify="full")
    with open_sd2(path, verify="lazy") as pkg:  # other members load fine
        pkg.layer("l.int4_g32_asym")
        pkg.float_tensors()
        with pytest.raises(PackageError, match="sha256 mismatch"):
            pkg.layer("l.int3_g32")
    with open_sd2(path, verify="none") as pkg:  # explicitly unverified: loads, verify() reports
        pkg.quant_layers()
        problems = pkg.verify()
        assert any("q000002" in p and "CRC-32" in p for p in problems)
        assert any("q000002" in p and "sha256" in p for p in problems)
    assert verify_sd2(path) == problems


def test_standard_tools_read_the_package(tmp_path):
    """An .sd2 is a plain ZIP: stdlib zipfile extracts it, and each weights member is a safetensors file."""
    path, floats, quant = write_tiny(tmp_path / "m.sd2")
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        names = zf.namelist()
        assert names[-1] == "manifest.json" and all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
        man = json.loads(zf.read("manifest.json"))
        for n, info in man["members"].items():
            assert hashlib.sha256(zf.read(n)).hexdigest() == info["sha256"]
        emb_member = man["float_tensors"]["model.embed_tokens.weight"]["member"]
        assert torch.equal(st_load(zf.read(emb_member))["model.embed_tokens.weight"], floats[0][1])
        q = st_load(zf.read(man["layers"]["l.int4_g32_asym"]["member"]))
        assert torch.equal(q["qweight"], quant[0][1].qweight)


def test_writes_are_deterministic(tmp_path):
    a, _, _ = write_tiny(tmp_path / "a.sd2")
    b, _, _ = write_tiny(tmp_path / "b.sd2")
    assert a.read_bytes() == b.read_bytes()


def test_failed_write_is_atomic(tmp_path):
    path, _, _ = write_tiny(tmp_path / "m.sd2")
    before = path.read_bytes()
    floats, quant = tiny_model()

    def exploding():
        yield quant[0]
        raise RuntimeError("calibration crashed")
    with pytest.raises(RuntimeError, match="calibration crashed"):
        write_sd2(path, family="llama", arch_config={}, float_tensors=floats, quant_layers=exploding())
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.sd2"]  # no temp file left behind


def test_writer_streams_items_one_at_a_time(tmp_path):
    """The writer must not drain the iterators before writing: each item is on disk before the next
    is produced."""
    floats, quant = tiny_model()
    seen = []

    def gen():
        for q in quant:
            tmp = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
            seen.append(tmp[0].stat().st_size if tmp else 0)
            yield q
    write_sd2(tmp_path / "m.sd2", family="x", arch_config={}, float_tensors=floats, quant_layers=gen())
    assert seen == sorted(seen) and len(set(seen)) == len(seen)  # the temp file grows between items


def test_calibration_report_is_sanitised(tmp_path):
    path, _, _ = write_tiny(tmp_path / "m.sd2", calibration={
        "method": "gptq", "metrics": {"loss": float("inf"), "t": torch.tensor(1.5)},
        "per_layer": {"a": torch.tensor([1.0, 2.0])}})
    with open_sd2(path) as pkg:
        cal = pkg.calibration
    assert cal["metrics"] == {"loss": None, "t": 1.5} and cal["per_layer"]["a"] == [1.0, 2.0]


@pytest.mark.parametrize("bad, match", [
    (dict(family=""), "family"),
    (dict(extra_files={"../x": b""}), r"'\.\.'"),
    (dict(extra_files={"/abs": b""}), "absolute"),
    (dict(float_tensors=[("a", torch.ones(2)), ("a", torch.ones(2))]), "duplicate"),
    (dict(quant_layers=[("x", torch.ones(2, 2), None, None)]), "QuantizedWeight or Fp8Weight"),
    (dict(calibration={"x": object()}), "not JSON"),
    (dict(float_tensors=[("c", torch.ones(2, dtype=torch.complex64))]), "cannot be stored"),
])
def test_writer_rejects_bad_input(tmp_path, bad, match):
    floats, quant = tiny_model()
    args = dict(family="llama", arch_config={}, float_tensors=floats, quant_layers=quant[:1])
    args.update(bad)
    with pytest.raises(PackageError, match=match):
        write_sd2(tmp_path / "m.sd2", **args)
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_a_folder_as_target(tmp_path):
    floats, quant = tiny_model()
    with pytest.raises(PackageError, match="is a folder"):
        write_sd2(tmp_path, family="x", arch_config={}, float_tensors=floats, quant_layers=quant)


def test_bias_shape_checked(tmp_path):
    floats, quant = tiny_model()
    name, w, _, _ = quant[0]
    with pytest.raises(PackageError, match="bias must be"):
        write_sd2(tmp_path / "m.sd2", family="x", arch_config={}, float_tensors=[],
                  quant_layers=[(name, w, torch.ones(3), None)])


def test_extra_file_streamed_from_path(tmp_path):
    src = tmp_path / "big.onnx"
    src.write_bytes(b"onnx" * 100_000)
    path, _, _ = write_tiny(tmp_path / "m.sd2", extra_files={"model.onnx": src})
    with open_sd2(path) as pkg:
        assert pkg.file("model.onnx") == src.read_bytes()


def test_inspect_and_verify(tmp_path):
    path, _, _ = write_tiny(tmp_path / "m.sd2")
    info = inspect_sd2(path)
    assert info["n_layers"] == 7 and info["family"] == "llama" and info["format_version"] == 1
    assert info["schemes"]["int4 g32 asym"] == 1 and info["schemes"]["fp8 e4m3 static"] == 1
    row = next(r for r in info["layers"] if r["name"] == "l.int4_g32_asym")
    assert row["shape"] == [48, 64] and row["loss"] == 0.25
    assert info["calibration"]["metrics"]["ppl"] == 12.5
    assert info["compression_ratio"] > 1.0
    text = format_inspect(info)
    assert "int4 g16 sym act-order" in text and "l.int3_g32" in text and "ppl: 12.5" in text
    assert verify_sd2(path) == []
    assert verify_sd2(tmp_path / "missing.sd2")[0].endswith("cannot open (No such file or directory)")


def test_large_offsets_use_zip64_records():
    """ZIP64 records appear exactly when a field overflows; the reader checks them byte for byte."""
    from sdquant.export import sd2_format as F
    hdr = F.local_header(b"a", 5 << 30, 0, 0)
    assert len(hdr) % 64 == 0 and b"\x01\x00\x10\x00" in hdr  # ZIP64 extra with both sizes
    assert F.central_extra(10, 1 << 33) == b"\x01\x00\x08\x00" + (1 << 33).to_bytes(8, "little")
    end = F.end_records(3, 1 << 33, 100)
    assert end[:4] == b"PK\x06\x06" and len(end) == 56 + 20 + 22
    assert F.end_records(3, 100, 100)[:4] == b"PK\x05\x06"


def test_read_members_on_bytes(tmp_path):
    path, _, _ = write_tiny(tmp_path / "m.sd2")
    members = read_members(path.read_bytes())
    assert list(members)[-1] == "manifest.json" and len(members) == 3 + 7 + 2 + 1


layer_spec = st.tuples(st.sampled_from([2, 3, 4, 8, "fp8"]), st.integers(1, 12), st.sampled_from([8, 16, 32, 48]),
                       st.sampled_from([-1, 8, 16]), st.booleans(), st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(layer_spec, min_size=0, max_size=4),
       float_shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), max_size=3))
def test_roundtrip_property(tmp_path, specs, float_shapes):
    """Random schemes, shapes (incl. empty and scalar tensors), optional bias/smooth: read == written."""
    from sd2_testutil import rtn
    from sdquant.quant.qtensor import quantize_fp8_weight
    g = torch.Generator().manual_seed(len(specs))
    quant = []
    for i, (bits, n, k, gs, sym, act, has_bias, has_smooth) in enumerate(specs):
        w = torch.randn(n, k, generator=g)
        if bits == "fp8":
            qw = quantize_fp8_weight(w, torch.tensor(0.1) if sym else None)
        else:
            qw = rtn(w, bits, gs if gs == -1 or k % gs == 0 else -1, sym, act_order=act, seed=i)
        quant.append((f"layer{i}", qw, torch.randn(n) if has_bias else None,
                      torch.rand(k) + 0.5 if has_smooth else None))
    floats = [(f"t{i}", torch.randn(tuple(s), generator=g).to(torch.bfloat16)) for i, s in enumerate(float_shapes)]
    path = write_sd2(tmp_path / f"p{len(specs)}.sd2", family="x", arch_config={}, float_tensors=floats,
                     quant_layers=quant)
    with open_sd2(path) as pkg:
        ft, ql = pkg.float_tensors(), pkg.quant_layers()
        for name, t in floats:
            assert _eq(ft[name], t)
        for name, w, bias, smooth in quant:
            w2, b2, s2 = ql[name]
            assert _eq(b2, bias) and _eq(s2, smooth)
            fields = ("qweight", "scales", "zeros", "g_idx") if isinstance(w, QuantizedWeight) else \
                ("weight", "weight_scale", "input_scale")
            for f in fields:
                assert _eq(getattr(w2, f), getattr(w, f)), (name, f)
        assert pkg.verify() == []


def test_zip64_paths_with_lowered_limits(tmp_path, monkeypatch):
    """Exercise every ZIP64 branch (local/central extras, ZIP64 end record + locator) without writing 4 GB:
    the overflow limits are lowered so that sizes, offsets and the member count of a tiny package overflow.
    (A real >4 GB package is covered by bench/package.py --layers 32, which opens it with verify='full'.)"""
    from sdquant.export import sd2_format as F
    monkeypatch.setattr(F, "U32", 3000)
    monkeypatch.setattr(F, "U16", 5)
    path, floats, quant = write_tiny(tmp_path / "m.sd2")
    raw = path.read_bytes()
    assert b"PK\x06\x06" in raw and b"PK\x06\x07" in raw
    with open_sd2(path) as pkg:
        assert _eq(pkg.tensor("model.embed_tokens.weight"), floats[0][1])
        assert _eq(pkg.layer("l.int4_g32_asym")[0].qweight, quant[0][1].qweight)
    bad = tmp_path / "bad.sd2"
    for i in list(range(len(raw) - 200, len(raw))) + list(range(0, 200)):  # end records, first headers
        b = bytearray(raw)
        b[i] ^= 0x01
        bad.write_bytes(bytes(b))
        with pytest.raises(PackageError):
            with open_sd2(bad) as pkg:
                pkg.quant_layers()


def test_file_mode_follows_umask(tmp_path):
    import os
    import stat
    path, _, _ = write_tiny(tmp_path / "m.sd2")
    old = os.umask(0o022)
    os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~old
