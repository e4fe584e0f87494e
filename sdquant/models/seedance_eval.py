"""Fidelity of a (quantized) Seedance model against its full-precision reference, with fixed seeds.

Two views, both deterministic for a seed:
  * per-timestep: walk the *reference* sampler trajectory and, at every step, feed the same (x_t, t, c) to
    both models: relative error ‖v_q − v_ref‖ / ‖v_ref‖ of the denoiser output. This isolates the denoiser's
    error at each noise level (no accumulation).
  * end to end: sample N Euler steps from the same noise with each model and compare the final latents:
    PSNR (peak = the reference latents' range), an SSIM computed per (frame, channel) map with a Gaussian
    window (the "SSIM-style" error: latents are not images, so it measures structural agreement of the
    latent maps), and the relative error.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from sdquant.eval import psnr, relative_error  # noqa: F401  (re-exported for fidelity reports)
from sdquant.models.seedance_sampler import flow_schedule, initial_noise, sample, velocity


# relative error and PSNR are the generic helpers of sdquant.eval (one definition for every model kind)


def _gauss(win: int, sigma: float, device) -> torch.Tensor:
    c = torch.arange(win, dtype=torch.float64, device=device) - (win - 1) / 2
    g = torch.exp(-c ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]                     # [1, 1, win, win]


def ssim(x: torch.Tensor, ref: torch.Tensor, data_range: Optional[float] = None, win: int = 7,
         sigma: float = 1.5) -> float:
    """Mean SSIM over all (batch, frame, channel) maps of [..., H, W] tensors (Gaussian window, valid region).

    The window shrinks (odd) to fit maps smaller than ``win``. Constants K1 = 0.01, K2 = 0.03 of the range.
    """
    ref = ref.double()
    x = x.double().to(ref.device)
    H, W = ref.shape[-2:]
    win = min(win, H, W)
    win -= (win + 1) % 2                                              # odd
    rng = float(ref.max() - ref.min()) if data_range is None else float(data_range)
    rng = rng if rng > 0 else 1.0
    c1, c2 = (0.01 * rng) ** 2, (0.03 * rng) ** 2
    a, b = x.reshape(-1, 1, H, W), ref.reshape(-1, 1, H, W)
    k = _gauss(win, sigma, ref.device)

    def blur(z):
        return F.conv2d(z, k)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a ** 2
    var_b = blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return float(s.mean())


@torch.no_grad()
def per_timestep_error(ref_model, test_model, cond: Optional[torch.Tensor], frames: int, height: int, width: int,
                       num_steps: int = 20, seed: int = 0, shift: float = 1.0, guidance: float = 1.0,
                       batch: Optional[int] = None) -> list:
    """[{"step", "t", "rel_err"}] along the reference trajectory (both models see identical inputs)."""
    rows = []

    def probe(step, t, x, v_ref):
        v_q = velocity(test_model, x, t, cond, guidance)
        rows.append({"step": step, "t": round(float(t[0]), 6), "rel_err": relative_error(v_q.cpu(), v_ref.cpu())})

    sample(ref_model, cond, frames, height, width, num_steps=num_steps, seed=seed, guidance=guidance, shift=shift,
           batch=batch, callback=probe)
    return rows


@torch.no_grad()
def sample_fidelity(ref_model, test_model, cond: Optional[torch.Tensor], frames: int, height: int, width: int,
                    num_steps: int = 20, seed: int = 0, shift: float = 1.0, guidance: float = 1.0,
                    batch: Optional[int] = None) -> dict:
    """Latents after ``num_steps`` Euler steps from the same noise: {"psnr_db", "ssim", "rel_err", "mse"}."""
    B = cond.shape[0] if cond is not None else (batch or 1)
    noise = initial_noise(B, (frames, ref_model.config.in_channels, height, width), seed)
    kw = dict(num_steps=num_steps, shift=shift, guidance=guidance, noise=noise, batch=batch)
    ref = sample(ref_model, cond, frames, height, width, **kw).cpu()
    out = sample(test_model, cond, frames, height, width, **kw).cpu()
    return {"psnr_db": psnr(out, ref), "ssim": ssim(out, ref), "rel_err": relative_error(out, ref),
            "mse": float(((out.double() - ref.double()) ** 2).mean())}


def seedance_fidelity(ref_model, test_model, cond: Optional[torch.Tensor], frames: int, height: int, width: int,
                      num_steps: int = 20, seed: int = 0, shift: float = 1.0, guidance: float = 1.0,
                      batch: Optional[int] = None) -> dict:
    """Both views in one report (what ``sdquant eval`` prints for a DiT)."""
    kw = dict(num_steps=num_steps, seed=seed, shift=shift, guidance=guidance, batch=batch)
    steps = per_timestep_error(ref_model, test_model, cond, frames, height, width, **kw)
    lat = sample_fidelity(ref_model, test_model, cond, frames, height, width, **kw)
    return {"per_timestep": steps, "mean_rel_err": sum(r["rel_err"] for r in steps) / len(steps),
            "latents": lat, "settings": {"frames": frames, "height": height, "width": width, **kw}}


def format_fidelity(report: dict) -> str:
    """A short plain-text table of a seedance_fidelity report."""
    lines = ["step      t   rel_err(v)"]
    lines += [f"{r['step']:4d}  {r['t']:.3f}   {r['rel_err']:.4%}" for r in report["per_timestep"]]
    lat = report["latents"]
    lines.append(f"mean denoiser rel_err {report['mean_rel_err']:.4%} | latents after "
                 f"{report['settings']['num_steps']} steps: PSNR {lat['psnr_db']:.2f} dB, SSIM {lat['ssim']:.4f}, "
                 f"rel_err {lat['rel_err']:.4%}")
    return "\n".join(lines)
