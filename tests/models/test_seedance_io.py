"""Seedance checkpoint folders: round trips (single file and sharded) and one-line errors for every way a
folder can be wrong (names, shapes, shards, index, config, corrupt files)."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdquant.errors import ConfigError, PackageError
from sdquant.models.seedance import SeedanceConfig, build_seedance, load_pretrained
from sdquant.models.seedance_io import (INDEX_NAME, SINGLE_NAME, load_conditioning, load_seedance, read_config,
                                        save_seedance)

CFG = SeedanceConfig(in_channels=3, hidden_size=32, depth=2, num_heads=2, cond_dim=8, stride_t=2,
                     window_3d=(2, 2, 2))


@pytest.fixture()
def model():
    return build_seedance(CFG, seed=5).eval()


@pytest.fixture()
def single(tmp_path, model):
    return save_seedance(model, tmp_path / "single")


@pytest.fixture()
def sharded(tmp_path, model):
    return save_seedance(model, tmp_path / "sharded", max_shard_bytes=60_000)


def _io(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 3, 8, 8, generator=g), torch.rand(2, generator=g), torch.randn(2, 8, generator=g)


def _one_line(err):
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 400
    return msg


def test_roundtrip_single_and_sharded(model, single, sharded):
    assert (single / SINGLE_NAME).is_file() and not (single / INDEX_NAME).exists()
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (sharded / SINGLE_NAME).exists()
    idx = json.loads((sharded / INDEX_NAME).read_text())
    assert set(idx["weight_map"]) == set(model.state_dict()) and set(idx["weight_map"].values()) == set(shards)
    x, t, c = _io()
    y = model(x, t, c)
    for folder in (single, sharded):
        m2 = load_seedance(folder)
        assert m2.config == CFG and not m2.training
        torch.testing.assert_close(m2(x, t, c), y, rtol=0, atol=0)
    assert oct(os.stat(single / SINGLE_NAME).st_mode)[-3:] != "600"      # not left with mkstemp's mode


def test_half_precision_storage_keeps_gate_fp32(tmp_path, model):
    folder = save_seedance(model, tmp_path / "h", dtype=torch.float16)
    raw = load_file(str(folder / SINGLE_NAME))
    assert raw["blocks.0.cgf.gate.weight"].dtype == torch.float32 and raw["blocks.0.mlp.up.weight"].dtype == torch.float16
    m = load_pretrained(folder, dtype=torch.bfloat16)
    assert m.blocks[0].cgf.gate.weight.dtype == torch.float32 and m.blocks[0].mlp.up.weight.dtype == torch.bfloat16
    torch.testing.assert_close(m.blocks[0].cgf.gate.weight, model.blocks[0].cgf.gate.weight, rtol=0, atol=0)


def _rewrite_single(folder, edit):
    sd = load_file(str(folder / SINGLE_NAME))
    edit(sd)
    save_file(sd, str(folder / SINGLE_NAME))


def test_missing_tensor(single):
    _rewrite_single(single, lambda sd: sd.pop("blocks.1.attn_t.q.weight"))
    with pytest.raises(PackageError, match=r"missing 1 tensor\(s\): blocks.1.attn_t.q.weight") as e:
        load_seedance(single)
    _one_line(e)


def test_unexpected_tensor(single):
    _rewrite_single(single, lambda sd: sd.update({"blocks.7.extra": torch.zeros(3)}))
    with pytest.raises(PackageError, match=r"unexpected tensor\(s\).*blocks.7.extra"):
        load_seedance(single)


def test_shape_mismatch_names_tensor_and_shapes(single):
    _rewrite_single(single, lambda sd: sd.update({"blocks.0.mlp.down.weight": torch.zeros(32, 64)}))
    with pytest.raises(PackageError, match=r"'blocks.0.mlp.down.weight' has shape \[32, 64\], the config expects "
                                           r"\[32, 128\]") as e:
        load_seedance(single)
    _one_line(e)


def test_integer_tensor_rejected(single):
    _rewrite_single(single, lambda sd: sd.update({"final.table": torch.zeros(2, 32, dtype=torch.int32)}))
    with pytest.raises(PackageError, match="'final.table' has dtype torch.int32"):
        load_seedance(single)


def test_many_missing_are_summarised(single):
    _rewrite_single(single, lambda sd: [sd.pop(k) for k in list(sd) if k.startswith("blocks.1.")])
    with pytest.raises(PackageError, match=r"\(\+\d+ more\)") as e:
        load_seedance(single)
    _one_line(e)


def test_missing_shard(sharded):
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(PackageError, match=f"{victim.name}: shard listed in {INDEX_NAME} is missing"):
        load_seedance(sharded)


def test_index_entry_not_in_shard(sharded):
    idx = json.loads((sharded / INDEX_NAME).read_text())
    name = next(iter(idx["weight_map"]))
    other = sorted(set(idx["weight_map"].values()))[-1]
    idx["weight_map"][name] = other
    (sharded / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(PackageError, match="not in this shard|not listed in"):
        load_seedance(sharded)


@pytest.mark.parametrize("bad", ["../evil.safetensors", "/etc/x.safetensors", "model.bin", 7, ".hidden.safetensors"])
def test_index_rejects_paths_outside_the_folder(sharded, bad):
    idx = json.loads((sharded / INDEX_NAME).read_text())
    idx["weight_map"]["final.table"] = bad
    (sharded / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(PackageError, match=r"weight_map\['final.table'\].*is not a .safetensors file name"):
        load_seedance(sharded)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"weight_map": {}}'])
def test_bad_index(sharded, text):
    (sharded / INDEX_NAME).write_text(text)
    with pytest.raises(PackageError, match=INDEX_NAME):
        load_seedance(sharded)


def test_corrupt_safetensors(single):
    data = (single / SINGLE_NAME).read_bytes()
    (single / SINGLE_NAME).write_bytes(data[:50])
    with pytest.raises(PackageError, match="not a readable safetensors file") as e:
        load_seedance(single)
    _one_line(e)


def test_both_forms_or_none(single, sharded):
    shutil.copy(single / SINGLE_NAME, sharded / SINGLE_NAME)
    with pytest.raises(PackageError, match="both model.safetensors and"):
        load_seedance(sharded)
    (single / SINGLE_NAME).unlink()
    with pytest.raises(PackageError, match="no weights"):
        load_seedance(single)


def test_config_problems(tmp_path, single):
    with pytest.raises(PackageError, match="not a directory"):
        read_config(tmp_path / "nope")
    (single / "config.json").write_text("{bad")
    with pytest.raises(PackageError, match="config.json: not valid JSON"):
        load_seedance(single)
    d = CFG.to_dict()
    d["num_haeds"] = 2
    (single / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=r"config.json:num_haeds: unknown key \(did you mean 'num_heads'\?\)"):
        load_seedance(single)
    d = CFG.to_dict()
    d["hidden_size"] = 48                           # valid config, wrong for these weights
    (single / "config.json").write_text(json.dumps(d))
    with pytest.raises(PackageError, match="has shape"):
        load_seedance(single)
    (single / "config.json").unlink()
    with pytest.raises(PackageError, match="config.json: missing"):
        load_seedance(single)


def test_load_conditioning(tmp_path):
    p = tmp_path / "c.safetensors"
    save_file({"cond": torch.randn(5, 8), "ids": torch.zeros(3, dtype=torch.int64)}, str(p))
    assert load_conditioning(p, cond_dim=8).shape == (5, 8)
    with pytest.raises(PackageError, match="no tensor 'emb'"):
        load_conditioning(p, key="emb")
    with pytest.raises(PackageError, match="must be a non-empty float tensor"):
        load_conditioning(p, key="ids")
    with pytest.raises(ConfigError, match="width 8, the model expects 16"):
        load_conditioning(p, cond_dim=16)
    with pytest.raises(PackageError, match="not found"):
        load_conditioning(tmp_path / "none.safetensors")
