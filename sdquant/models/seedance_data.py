"""Deterministic synthetic videos for training a small Seedance model: moving, coloured, textured shapes.

Each video: a vertical two-colour gradient background, one primary shape and (half the time) a second one.
A shape is a circle, square or triangle with a colour, a texture (plain, stripes at an angle, checker) that
moves with it, and a constant velocity with bounces off the borders. Everything is vectorised torch on the
requested device, and a video depends only on (seed, index) — the same seed gives the same tensors on any
device up to float rounding.

The conditioning vector c [COND_DIM] describes the primary shape (the "prompt"):
    0-2 shape one-hot · 3-5 colour · 6-7 velocity ×10 · 8-10 texture one-hot · 11 radius ×4
    12 second shape present · 13-15 its colour (0 if absent)
"""
from __future__ import annotations

import math

import torch

COND_DIM = 16
SHAPES = ("circle", "square", "triangle")
TEXTURES = ("plain", "stripes", "checker")


def _u(g, n, lo, hi, k=1):
    return lo + (hi - lo) * torch.rand(n, k, generator=g, dtype=torch.float64).float().squeeze(-1)


def _params(n: int, seed: int) -> dict:
    """Random scene parameters from a private CPU generator (device-independent)."""
    g = torch.Generator().manual_seed(int(seed))
    p = {"bg_top": _u(g, n, 0.0, 0.5, 3), "bg_bot": _u(g, n, 0.0, 0.5, 3)}
    for s in range(2):
        r = _u(g, n, 0.12, 0.24)
        p[f"r{s}"] = r
        p[f"kind{s}"] = torch.randint(0, 3, (n,), generator=g)
        p[f"col{s}"] = _u(g, n, 0.35, 1.0, 3)
        p[f"pos{s}"] = torch.rand(n, 2, generator=g) * (1 - 2 * r[:, None]) + r[:, None]
        p[f"vel{s}"] = _u(g, n, -0.07, 0.07, 2)
        p[f"tex{s}"] = torch.randint(0, 3, (n,), generator=g)
        p[f"freq{s}"] = _u(g, n, 1.5, 3.0)
        p[f"ang{s}"] = _u(g, n, 0.0, math.pi)
    p["present1"] = (torch.rand(n, generator=g) < 0.5).float()
    return p


def _bounce(p0, v, r, t):
    """Position at frame t moving at v and reflecting inside [r, 1 − r] (a triangle wave)."""
    L = (1 - 2 * r)[:, None]
    u = torch.remainder(p0 - r[:, None] + v * t, 2 * L)
    return r[:, None] + torch.where(u > L, 2 * L - u, u)


def _render_shape(img, p, s, t, yy, xx, size):
    n = img.shape[0]
    r = p[f"r{s}"]
    c = _bounce(p[f"pos{s}"], p[f"vel{s}"], r, t)                      # [n, 2] (x, y)
    dx = xx[None] - c[:, 0, None, None]                                  # [n, S, S]
    dy = yy[None] - c[:, 1, None, None]
    rr = r[:, None, None]
    kind = p[f"kind{s}"][:, None, None]
    circle = torch.sqrt(dx ** 2 + dy ** 2) - rr
    square = torch.maximum(dx.abs(), dy.abs()) - 0.85 * rr
    # equilateral triangle as the max of three half-planes (inradius 0.55 r), pointing up
    tri = torch.stack([-dy, 0.866 * dx + 0.5 * dy, -0.866 * dx + 0.5 * dy]).amax(0) - 0.55 * rr
    sdf = torch.where(kind == 0, circle, torch.where(kind == 1, square, tri))
    mask = (0.5 - sdf * size).clamp(0, 1)                                # ~1 pixel anti-aliased edge
    ang, freq = p[f"ang{s}"][:, None, None], p[f"freq{s}"][:, None, None]
    along = (dx * torch.cos(ang) + dy * torch.sin(ang)) / rr
    across = (-dx * torch.sin(ang) + dy * torch.cos(ang)) / rr
    stripes = (torch.sin(2 * math.pi * freq * along) > 0).float()
    checker = ((torch.sin(2 * math.pi * freq * along) > 0) ^ (torch.sin(2 * math.pi * freq * across) > 0)).float()
    tex = p[f"tex{s}"][:, None, None]
    shade = torch.where(tex == 0, torch.ones_like(dx), 0.5 + 0.5 * torch.where(tex == 1, stripes, checker))
    colour = p[f"col{s}"][:, :, None, None] * shade[:, None]             # [n, 3, S, S]
    if s == 1:
        mask = mask * p["present1"][:, None, None]
    m = mask[:, None]
    return img * (1 - m) + colour * m


def synthetic_videos(n: int, frames: int = 8, size: int = 32, seed: int = 0, device="cpu"):
    """-> (videos [n, frames, 3, size, size] in [-1, 1], cond [n, COND_DIM]) float32 on ``device``."""
    p = {k: v.to(device) for k, v in _params(n, seed).items()}
    coords = (torch.arange(size, device=device, dtype=torch.float32) + 0.5) / size
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")              # [S, S]
    bg = p["bg_top"][:, :, None, None] * (1 - yy) + p["bg_bot"][:, :, None, None] * yy   # [n, 3, S, S]
    out = []
    for t in range(frames):
        img = bg
        for s in range(2):
            img = _render_shape(img, p, s, float(t), yy, xx, size)
        out.append(img)
    video = torch.stack(out, dim=1) * 2 - 1                              # [n, T, 3, S, S]
    onehot = torch.nn.functional.one_hot
    cond = torch.cat([onehot(p["kind0"], 3).float(), p["col0"], p["vel0"] * 10, onehot(p["tex0"], 3).float(),
                      p["r0"][:, None] * 4, p["present1"][:, None], p["col1"] * p["present1"][:, None]], dim=1)
    return video, cond
