"""Flow-matching Euler sampler, diffusion calibration data, fidelity metrics and the synthetic video data."""
import math

import pytest
import torch
from torch import nn

from sdquant.errors import ConfigError, PackageError, ShapeError
from sdquant.models.seedance import SeedanceConfig, build_seedance
from sdquant.models.seedance_data import COND_DIM, synthetic_videos
from sdquant.models.seedance_eval import (format_fidelity, per_timestep_error, psnr, relative_error,
                                          sample_fidelity, seedance_fidelity, ssim)
from sdquant.models.seedance_sampler import (calibration_batches, diffusion_calibration_data, flow_schedule,
                                             load_calibration_tensors, sample, save_calibration_tensors,
                                             stratified_steps, validate_calibration_tensors)

CFG = SeedanceConfig(in_channels=3, hidden_size=32, depth=1, num_heads=2, cond_dim=8, stride_t=2)


@pytest.fixture(scope="module")
def model():
    return build_seedance(CFG, seed=2).eval()


def cond(n=3, seed=0):
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


def test_schedule():
    s = flow_schedule(4)
    torch.testing.assert_close(s, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    s3 = flow_schedule(4, shift=3.0)
    assert s3[0] == 1 and s3[-1] == 0 and torch.all(s3[1:-1] > s[1:-1])       # shift spends steps at high noise
    with pytest.raises(ConfigError, match="num_steps"):
        flow_schedule(0)


class _DeltaData(nn.Module):
    """The exact velocity field of a data distribution concentrated at x0: v = (x_t − x0) / t."""

    def __init__(self, x0):
        super().__init__()
        self.x0 = nn.Parameter(x0, requires_grad=False)
        self.config = CFG

    def forward(self, x, t, cond=None):
        return (x - self.x0) / t.clamp_min(1e-12)[:, None, None, None, None]


def test_euler_follows_the_straight_flow_exactly():
    x0 = torch.randn(2, 3, 3, 4, 4)
    out = sample(_DeltaData(x0), None, 3, 4, 4, num_steps=5, seed=1, batch=2)
    torch.testing.assert_close(out, x0, rtol=1e-5, atol=1e-5)


def test_sampler_determinism(model):
    c = cond()
    a = sample(model, c, 3, 8, 8, num_steps=4, seed=11)
    b = sample(model, c, 3, 8, 8, num_steps=4, seed=11)
    assert a.shape == (3, 3, 3, 8, 8) and torch.equal(a, b)
    assert not torch.allclose(a, sample(model, c, 3, 8, 8, num_steps=4, seed=12))
    g = sample(model, c, 3, 8, 8, num_steps=4, seed=11, guidance=3.0)
    assert torch.isfinite(g).all() and not torch.allclose(g, a)
    with pytest.raises(ShapeError, match="sampler noise"):
        sample(model, c, 3, 8, 8, num_steps=2, noise=torch.randn(1, 3, 3, 8, 8))


def test_stratified_steps_cover_the_schedule():
    s = stratified_steps(20, 20, seed=0)
    assert sorted(s.tolist()) == list(range(20))                # one per stratum = every step once
    s = stratified_steps(5, 20, seed=3)
    assert sorted((s // 4).tolist()) == [0, 1, 2, 3, 4]          # one in each quarter... fifth
    assert torch.equal(stratified_steps(5, 20, seed=3), s)


def test_calibration_data_from_real_trajectories(model):
    c = cond(3)
    data = diffusion_calibration_data(model, c, n_samples=8, frames=3, height=8, width=8, num_steps=8, seed=4,
                                      batch_size=3)
    assert data["x"].shape == (8, 3, 3, 8, 8) and data["t"].shape == (8,) and data["cond"].shape == (8, 8)
    sched = flow_schedule(8)
    steps = [int((sched - t).abs().argmin()) for t in data["t"]]
    assert sorted(steps) == list(range(8))                      # stratified: every step of the schedule
    torch.testing.assert_close(data["cond"][3], c[0])           # conditioning cycles through the file
    # sample 5's input is exactly what the sampler feeds the denoiser at its step
    from sdquant.models.seedance_sampler import initial_noise
    noise = initial_noise(8, (3, 3, 8, 8), 5)
    seen = {}
    sample(model, data["cond"], 3, 8, 8, num_steps=8, noise=noise, callback=lambda i, t, x, v: seen.setdefault(i, x[5].clone()))
    torch.testing.assert_close(data["x"][5], seen[steps[5]])
    again = diffusion_calibration_data(model, c, n_samples=8, frames=3, height=8, width=8, num_steps=8, seed=4)
    for k in data:                                              # batch size does not matter (up to GEMM rounding)
        torch.testing.assert_close(again[k], data[k], rtol=1e-5, atol=1e-5)
    batches = list(calibration_batches(data, 3))
    assert [b["x"].shape[0] for b in batches] == [3, 3, 2]
    with pytest.raises(ShapeError, match=r"expected \[M, 8\]"):
        diffusion_calibration_data(model, torch.randn(2, 5), 4, 3, 8, 8)


def test_calibration_tensors_file(tmp_path, model):
    data = diffusion_calibration_data(model, cond(2), n_samples=4, frames=3, height=8, width=8, num_steps=4)
    p = save_calibration_tensors(data, tmp_path / "calib.safetensors")
    back = load_calibration_tensors(p, CFG)
    assert all(torch.equal(back[k], data[k]) for k in data)
    with pytest.raises(ShapeError, match="'t' must be"):
        validate_calibration_tensors({"x": data["x"], "t": data["t"][:2]})
    with pytest.raises(ShapeError, match=r"'t' must lie in \[0, 1\]"):
        validate_calibration_tensors({"x": data["x"], "t": data["t"] + 2})
    with pytest.raises(ShapeError, match="does not fit the model"):
        validate_calibration_tensors({"x": data["x"][:, :, :2], "t": data["t"]}, CFG)
    with pytest.raises(ShapeError, match="cond_dim"):
        validate_calibration_tensors({**data, "cond": torch.randn(4, 3)}, CFG)
    with pytest.raises(PackageError, match="not found"):
        load_calibration_tensors(tmp_path / "none.safetensors")


# ------------------------------------------------------------------------------------------- metrics
def test_metric_values():
    ref = torch.linspace(-1, 1, 2 * 8 * 8).reshape(2, 8, 8)
    assert psnr(ref, ref) == math.inf and ssim(ref, ref) == pytest.approx(1.0) and relative_error(ref, ref) == 0
    noisy = ref + 0.1
    # range 2, MSE 0.01 -> 10·log10(4 / 0.01) = 26.02 dB
    assert psnr(noisy, ref) == pytest.approx(10 * math.log10(400), rel=1e-5)
    assert relative_error(-ref, ref) == pytest.approx(2.0)
    g = torch.Generator().manual_seed(0)
    assert ssim(ref + 0.5 * torch.randn(ref.shape, generator=g), ref) < 0.9 < ssim(noisy, ref)


def test_fidelity_report(model):
    import copy
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    c = cond(2)
    same = seedance_fidelity(model, model, c, 3, 8, 8, num_steps=3, seed=1)
    assert same["mean_rel_err"] == 0 and same["latents"]["psnr_db"] == math.inf
    rep = seedance_fidelity(model, other, c, 3, 8, 8, num_steps=3, seed=1)
    assert [r["step"] for r in rep["per_timestep"]] == [0, 1, 2]
    assert all(0 < r["rel_err"] < 1 for r in rep["per_timestep"])
    assert 0 < rep["latents"]["ssim"] < 1 and 0 < rep["latents"]["psnr_db"] < math.inf
    assert rep == seedance_fidelity(model, other, c, 3, 8, 8, num_steps=3, seed=1)      # fixed seeds
    assert "PSNR" in format_fidelity(rep)
    assert per_timestep_error(model, other, c, 3, 8, 8, num_steps=3, seed=1) == rep["per_timestep"]
    assert sample_fidelity(model, other, c, 3, 8, 8, num_steps=2, seed=2) != \
        sample_fidelity(model, other, c, 3, 8, 8, num_steps=2, seed=3)


# ----------------------------------------------------------------------------------------------- data
def test_synthetic_videos_deterministic_and_described_by_cond():
    v, c = synthetic_videos(6, frames=4, size=16, seed=3)
    assert v.shape == (6, 4, 3, 16, 16) and c.shape == (6, COND_DIM)
    assert v.min() >= -1 and v.max() <= 1
    v2, c2 = synthetic_videos(6, frames=4, size=16, seed=3)
    assert torch.equal(v, v2) and torch.equal(c, c2)
    assert not torch.equal(v, synthetic_videos(6, frames=4, size=16, seed=4)[0])
    assert torch.all(c[:, :3].sum(1) == 1) and torch.all(c[:, 8:11].sum(1) == 1)   # one-hot shape / texture
    assert (v[:, 1:] - v[:, :-1]).abs().amax() > 0.1                                 # things move
