"""Seedance end to end: the shipped templates run through the unchanged calibration engine (calibrate ->
.sd2 -> load -> sample) on a tiny model, calibration data from conditioning files, the tools, and the trained
fixture under tests/fixtures/seedance_small."""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import sdquant
from sdquant.config import load_config
from sdquant.models.seedance import SeedanceConfig, build_seedance, load_pretrained
from sdquant.models.seedance_eval import seedance_fidelity
from sdquant.models.seedance_io import save_seedance
from sdquant.models.seedance_sampler import (diffusion_calibration_data, diffusion_inputs, load_calibration_tensors,
                                             sample, save_calibration_tensors)

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "seedance_small"
TINY = SeedanceConfig(in_channels=3, hidden_size=64, depth=2, num_heads=2, cond_dim=8, stride_t=2,
                      window_3d=(2, 2, 2))


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("seedance")
    model = build_seedance(TINY, seed=1).eval()
    save_seedance(model, d / "model", max_shard_bytes=300_000)
    cond = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    save_file({"cond": cond}, str(d / "cond.safetensors"), metadata={"frames": "4", "height": "8", "width": "8",
                                                                     "num_steps": "6"})
    data = diffusion_calibration_data(model, cond, 6, 4, 8, 8, num_steps=6)
    save_calibration_tensors(data, d / "calib.safetensors")
    return d, model, cond


def test_templates_validate_against_the_fixture(tiny_setup):
    d, _, _ = tiny_setup
    for name in ("seedance-w4", "seedance-fp8"):
        cfg = load_config(REPO / "templates" / f"{name}.yaml",
                          {"model.path": str(FIXTURE), "data.path": str(d / "calib.safetensors")})
        assert cfg.model.kind == "seedance" and cfg.data.kind == "diffusion" and cfg.report.prompt is None
        assert cfg.quant.method == ("fp8" if name == "seedance-fp8" else "awq+gptq")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seedance-w4", "seedance-fp8"])
def test_template_runs_end_to_end(tiny_setup, tmp_path, name):
    d, model, cond = tiny_setup
    over = {"model.path": str(d / "model"), "data.path": str(d / "calib.safetensors"), "data.n_samples": 6,
            "device": "cpu", "dtype": "float32", "pipeline.batch_size": 3, "output": str(tmp_path / "q.sd2")}
    if name == "seedance-w4":
        over.update({"quant.group_size": 32, "quant.awq.grid": 4, "quant.awq.clip_search": False})
    cfg = load_config(REPO / "templates" / f"{name}.yaml", over)
    res = sdquant.calibrate(config=cfg)
    names = set(res.weights)
    assert len(names) == 2 * 5 * 3 and not any(k in n for n in names for k in ("cgf", "adaln", "embed", "final"))
    pkg = sdquant.export(res, tmp_path / "q.sd2")
    q = sdquant.load(pkg, device="cpu", dtype=torch.float32)
    assert type(q.blocks[0].attn_t.q).__name__ == ("Fp8Linear" if name == "seedance-fp8" else "QuantLinear")
    assert q.blocks[1].cgf.gate.weight.dtype == torch.float32
    out = sample(q, cond[:2], 4, 8, 8, num_steps=3, seed=0)
    assert out.shape == (2, 4, 3, 8, 8) and torch.isfinite(out).all()
    rep = seedance_fidelity(model, q, cond[:2], 4, 8, 8, num_steps=3, seed=0)
    assert 0 < rep["mean_rel_err"] < 0.2 and rep["latents"]["psnr_db"] > 20


def test_diffusion_inputs_from_cond_file_or_tensors(tiny_setup):
    d, model, cond = tiny_setup
    gen = diffusion_inputs(model, d / "cond.safetensors", n_samples=6, seed=0)
    assert gen["x"].shape == (6, 4, 3, 8, 8)                      # frames/height/width from the file metadata
    given = load_calibration_tensors(d / "calib.safetensors")
    for k in given:                                                 # same seed/settings as the fixture file
        torch.testing.assert_close(gen[k], given[k], rtol=1e-5, atol=1e-5)
    assert diffusion_inputs(model, d / "calib.safetensors", n_samples=4)["x"].shape[0] == 4
    with pytest.raises(sdquant.ConfigError, match="data.n_samples"):
        diffusion_inputs(model, d / "calib.safetensors", n_samples=60)


def test_calib_tool(tiny_setup, tmp_path, capsys):
    import importlib.util
    d, _, _ = tiny_setup
    spec = importlib.util.spec_from_file_location("seedance_calib_data", REPO / "tools" / "seedance_calib_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "c.safetensors"
    rc = tool.main(["--model", str(d / "model"), "--cond", str(d / "cond.safetensors"), "--n-samples", "4",
                    "--frames", "3", "--height", "8", "--width", "8", "--steps", "4", "--out", str(out)])
    assert rc == 0 and load_calibration_tensors(out)["x"].shape == (4, 3, 3, 8, 8)
    rc = tool.main(["--model", str(tmp_path / "none"), "--cond", str(d / "cond.safetensors"), "--out", str(out)])
    assert rc == 2 and "not a directory" in capsys.readouterr().err


def test_train_script_smoke(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_seedance", REPO / "tools" / "train_seedance.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["--device", "cpu", "--steps", "3", "--batch", "2", "--hidden", "32", "--depth", "1", "--heads", "2",
               "--frames", "3", "--size", "8", "--window", "none", "--log-every", "1", "--warmup", "2",
               "--out", str(tmp_path / "run")])
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert log["steps"] == 3 and len(log["curve"]) == 3 and all(math.isfinite(p["loss"]) for p in log["curve"])
    m = load_pretrained(tmp_path / "run")
    assert m.config.hidden_size == 32 and m.config.window_3d is None


@pytest.mark.skipif(not (FIXTURE / "config.json").is_file(), reason="trained fixture not present")
def test_trained_fixture_denoises_better_than_random():
    from sdquant.models.seedance_data import synthetic_videos
    log = json.loads((FIXTURE / "train_log.json").read_text())
    assert log["curve"][-1]["loss"] < 0.1 * log["curve"][0]["loss"]
    trained = load_pretrained(FIXTURE)
    assert sum(p.numel() for p in trained.parameters()) == log["params"]
    untrained = build_seedance(trained.config, seed=0).eval()
    x0, cond = synthetic_videos(1, 8, 32, seed=31337)
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.5])
    xt = 0.5 * x0 + 0.5 * eps
    with torch.no_grad():
        err_trained = torch.mean((trained(xt, t, cond) - (eps - x0)) ** 2).item()
        err_random = torch.mean((untrained(xt, t, cond) - (eps - x0)) ** 2).item()
    assert err_trained < 0.2 < err_random


def test_calibrate_samples_inputs_from_a_conditioning_file(tiny_setup, tmp_path):
    """data.kind: diffusion with a file holding only 'cond': the engine captures denoiser inputs along sampler
    trajectories itself, exactly as diffusion_inputs() does; a bf16 load keeps the FP32 gate's values."""
    d, model, cond = tiny_setup
    cfg = load_config(REPO / "templates" / "seedance-w4.yaml",
                      {"model.path": str(d / "model"), "data.path": str(d / "cond.safetensors"), "data.n_samples": 6,
                       "device": "cpu", "dtype": "float32", "pipeline.batch_size": 3, "quant.method": "rtn",
                       "quant.group_size": 32})
    res = sdquant.calibrate(config=cfg)
    expect = diffusion_inputs(load_pretrained(d / "model"), d / "cond.safetensors", n_samples=6, seed=0)
    assert res.data_fingerprint and len(res.weights) == 2 * 5 * 3
    pkg = sdquant.export(res, tmp_path / "q.sd2")
    q = sdquant.load(pkg, device="cpu", dtype=torch.bfloat16)
    gate = dict(res.model.named_parameters())["blocks.0.cgf.gate.weight"]
    assert q.blocks[0].cgf.gate.weight.dtype == torch.float32
    assert torch.equal(q.blocks[0].cgf.gate.weight, gate)       # not rounded through bf16
    # the engine calibrated on exactly the sampler's inputs: same data fingerprint as passing them directly
    again = sdquant.calibrate(config=cfg, data=expect)
    assert again.data_fingerprint == res.data_fingerprint
