"""Flow-matching Euler sampler for SeedanceDiT, and diffusion calibration data captured from it.

Why flow matching + Euler (not DDPM/DDIM): the path x_t = (1 − t)·x0 + t·ε with the velocity target
v = ε − x0 is what current video DiTs train with; its ODE is nearly straight, so a plain Euler step
x ← x + (t_next − t)·v needs few steps, has no noise-schedule tables to get wrong, and is deterministic given
the initial noise — which makes "same seed, full precision vs quantized" comparisons exact.

Timesteps go from t = 1 (pure noise) to t = 0 (data). ``shift`` > 1 spends more steps at high noise
(SD3-style: t' = shift·t / (1 + (shift − 1)·t)); 1.0 = uniform.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import torch

from sdquant.errors import ConfigError, PackageError, ShapeError


def flow_schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """[num_steps + 1] float32 times from 1 to 0."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ConfigError("num_steps", f"must be a positive integer, got {num_steps!r}")
    if not shift > 0:
        raise ConfigError("shift", f"must be > 0, got {shift!r}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def initial_noise(n: int, shape: tuple, seed: int) -> torch.Tensor:
    """[n, *shape] standard normal from a private CPU generator: identical on every device for a seed."""
    return torch.randn((n, *shape), generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float32)


def _model_device_dtype(model):
    p = next(model.parameters())
    return p.device, p.dtype


@torch.no_grad()
def velocity(model, x: torch.Tensor, t: torch.Tensor, cond: Optional[torch.Tensor], guidance: float = 1.0):
    """The denoiser output in float32, with classifier-free guidance when ``guidance`` != 1 (null cond = 0)."""
    device, dtype = _model_device_dtype(model)
    xin, tin = x.to(device, dtype), t.to(device)
    c = None if cond is None else cond.to(device, dtype)
    if guidance == 1.0 or c is None:
        return model(xin, tin, c).float()
    v = model(torch.cat([xin, xin]), torch.cat([tin, tin]), torch.cat([c, torch.zeros_like(c)])).float()
    vc, vu = v.chunk(2)
    return vu + guidance * (vc - vu)


@torch.no_grad()
def sample(model, cond: Optional[torch.Tensor], frames: int, height: int, width: int, num_steps: int = 20,
           seed: int = 0, guidance: float = 1.0, shift: float = 1.0, noise: Optional[torch.Tensor] = None,
           batch: Optional[int] = None, callback: Optional[Callable] = None) -> torch.Tensor:
    """Noise + conditioning -> latents [B, T, C, H, W] (float32, on the model's device).

    ``cond`` [B, cond_dim] (None = unconditional, then ``batch`` gives B). The noise comes from ``seed`` on
    the CPU unless given. ``callback(step, t [B], x [B,...], v [B,...])`` sees every denoiser call.
    """
    cfg = model.config
    device, _ = _model_device_dtype(model)
    B = cond.shape[0] if cond is not None else (batch or 1)
    if noise is None:
        noise = initial_noise(B, (frames, cfg.in_channels, height, width), seed)
    if noise.shape != (B, frames, cfg.in_channels, height, width):
        raise ShapeError(f"sampler noise: expected {[B, frames, cfg.in_channels, height, width]}, "
                         f"got {list(noise.shape)}")
    x = noise.to(device, torch.float32)
    ts = flow_schedule(num_steps, shift)
    for i in range(num_steps):
        t = ts[i].expand(B).to(device)
        v = velocity(model, x, t, cond, guidance)
        if callback is not None:
            callback(i, t, x, v)
        x = x + (ts[i + 1] - ts[i]).item() * v
    return x


# -------------------------------------------------------------------------------------- calibration data
def stratified_steps(n: int, num_steps: int, seed: int) -> torch.Tensor:
    """[n] sampler step indices, one per stratum of the schedule (n strata of width num_steps/n), in random
    order: every part of the noise range is covered however small n is."""
    g = torch.Generator().manual_seed(int(seed))
    u = torch.rand(n, generator=g, dtype=torch.float64)
    steps = ((torch.arange(n, dtype=torch.float64) + u) * num_steps / n).floor().long().clamp_(0, num_steps - 1)
    return steps[torch.randperm(n, generator=g)]


@torch.no_grad()
def diffusion_calibration_data(model, cond: torch.Tensor, n_samples: int, frames: int, height: int, width: int,
                               num_steps: int = 20, seed: int = 0, shift: float = 1.0, guidance: float = 1.0,
                               batch_size: int = 16) -> dict:
    """Denoiser inputs captured along real sampling trajectories.

    Sample i uses conditioning ``cond[i % M]`` and its own noise, runs the sampler (with ``guidance``) and
    records the exact input (x_t, t, cond) of the conditional denoiser call at its stratified step.
    Returns {"x": [n, T, C, H, W] float32, "t": [n] float32, "cond": [n, cond_dim] float32} on the CPU.
    """
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ConfigError("data.n_samples", f"must be a positive integer, got {n_samples!r}")
    if cond.ndim != 2 or cond.shape[0] == 0 or cond.shape[1] != model.config.cond_dim:
        raise ShapeError(f"calibration cond: expected [M, {model.config.cond_dim}], got {list(cond.shape)}")
    steps = stratified_steps(n_samples, num_steps, seed)
    conds = cond.float()[torch.arange(n_samples) % cond.shape[0]]
    noise = initial_noise(n_samples, (frames, model.config.in_channels, height, width), seed + 1)
    xs, ts = [None] * n_samples, torch.zeros(n_samples)
    for lo in range(0, n_samples, batch_size):
        idx = list(range(lo, min(lo + batch_size, n_samples)))
        want = steps[idx]

        def grab(step, t, x, v, idx=idx, want=want):
            for j, i in enumerate(idx):
                if want[j] == step:
                    xs[i], ts[i] = x[j].detach().cpu().clone(), float(t[j])

        # run only as far as the latest step this batch needs
        _partial_sample(model, conds[idx], noise[idx], num_steps, int(want.max()) + 1, shift, guidance, grab)
    return {"x": torch.stack(xs), "t": ts, "cond": conds}


def _partial_sample(model, cond, noise, num_steps, stop, shift, guidance, callback):
    device, _ = _model_device_dtype(model)
    x, ts = noise.to(device), flow_schedule(num_steps, shift)
    for i in range(stop):
        t = ts[i].expand(x.shape[0]).to(device)
        v = velocity(model, x, t, cond, guidance)
        callback(i, t, x, v)
        x = x + (ts[i + 1] - ts[i]).item() * v


def validate_calibration_tensors(data: dict, cfg=None, where: str = "data") -> dict:
    """Check a {"x", "t", "cond"} dict (e.g. given directly as tensors); one-line errors naming the key."""
    if not isinstance(data, dict) or "x" not in data or "t" not in data:
        raise ShapeError(f"{where}: diffusion calibration tensors need 'x' [n,T,C,H,W] and 't' [n] "
                         f"(and optionally 'cond' [n,cond_dim])")
    x, t, c = data["x"], data["t"], data.get("cond")
    if x.ndim != 5 or x.shape[0] == 0 or not x.is_floating_point():
        raise ShapeError(f"{where}: 'x' must be a float tensor [n, T, C, H, W], got {x.dtype} {list(x.shape)}")
    n = x.shape[0]
    if t.ndim != 1 or t.shape[0] != n:
        raise ShapeError(f"{where}: 't' must be [n={n}], got {list(t.shape)}")
    if not bool(((t >= 0) & (t <= 1)).all()):
        raise ShapeError(f"{where}: 't' must lie in [0, 1] (flow-matching time)")
    if c is not None and (c.ndim != 2 or c.shape[0] != n):
        raise ShapeError(f"{where}: 'cond' must be [n={n}, cond_dim], got {list(c.shape)}")
    if cfg is not None:
        if x.shape[2] != cfg.in_channels or x.shape[3] % cfg.patch_size or x.shape[4] % cfg.patch_size:
            raise ShapeError(f"{where}: 'x' {list(x.shape)} does not fit the model (C={cfg.in_channels}, "
                             f"H and W multiples of {cfg.patch_size})")
        if c is not None and c.shape[1] != cfg.cond_dim:
            raise ShapeError(f"{where}: 'cond' width {c.shape[1]} != model cond_dim {cfg.cond_dim}")
    return {"x": x.float(), "t": t.float(), **({"cond": c.float()} if c is not None else {})}


def load_calibration_tensors(path: Union[str, Path], cfg=None) -> dict:
    """{"x", "t", "cond"} from a safetensors file (as written by save_calibration_tensors)."""
    from safetensors import safe_open
    path = Path(path)
    if not path.is_file():
        raise PackageError(f"{path}: calibration tensor file not found")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            data = {k: f.get_tensor(k) for k in f.keys() if k in ("x", "t", "cond")}
    except Exception as e:
        raise PackageError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    return validate_calibration_tensors(data, cfg, where=str(path))


def save_calibration_tensors(data: dict, path: Union[str, Path]) -> Path:
    import os
    import tempfile
    from safetensors.torch import save_file
    path = Path(path)
    data = validate_calibration_tensors(data)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in data.items()}, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def calibration_batches(data: dict, batch_size: int) -> Iterator[dict]:
    """Split {"x", "t", "cond"} into batches the adapter's pre_block/forward take."""
    n = data["x"].shape[0]
    for lo in range(0, n, batch_size):
        yield {k: v[lo:lo + batch_size] for k, v in data.items()}


# settings of a conditioning-only file (safetensors metadata, all strings) and their defaults
SAMPLER_METADATA = {"frames": 8, "height": 32, "width": 32, "num_steps": 20, "shift": 1.0, "guidance": 1.0}


def diffusion_inputs(model, path: Union[str, Path], n_samples: int, seed: int = 0, key: str = "cond",
                     batch_size: int = 16) -> dict:
    """Calibration inputs for ``data.kind: diffusion`` from one safetensors file:

    * a file with ``x`` and ``t`` (and ``cond``) is taken as given (the first ``n_samples``), validated;
    * a file with only ``cond`` [M, cond_dim] (e.g. pooled text embeddings of M prompts) is run through the
      sampler (``diffusion_calibration_data``, stratified timesteps) with the settings in the file's metadata
      (frames, height, width, num_steps, shift, guidance; defaults in SAMPLER_METADATA).
    """
    from safetensors import safe_open
    from sdquant.models.seedance_io import load_conditioning
    path = Path(path)
    if not path.is_file():
        raise PackageError(f"{path}: diffusion calibration file not found")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys, meta = set(f.keys()), f.metadata() or {}
    except Exception as e:
        raise PackageError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    if {"x", "t"} <= keys:
        data = load_calibration_tensors(path, model.config)
        n = data["x"].shape[0]
        if n < n_samples:
            raise ConfigError("data.n_samples", f"{path} holds {n} samples but data.n_samples asks for {n_samples}")
        return {k: v[:n_samples] for k, v in data.items()}
    cond = load_conditioning(path, key=key, cond_dim=model.config.cond_dim)
    opts = {}
    for k, default in SAMPLER_METADATA.items():
        raw = meta.get(k, default)
        try:
            opts[k] = type(default)(raw)
        except ValueError:
            raise PackageError(f"{path}: metadata {k}={raw!r} is not a {type(default).__name__}") from None
    return diffusion_calibration_data(model, cond, n_samples, opts["frames"], opts["height"], opts["width"],
                                      num_steps=opts["num_steps"], seed=seed, shift=opts["shift"],
                                      guidance=opts["guidance"], batch_size=batch_size)
