"""Seedance-style dual-branch video diffusion transformer (DiT): config, model and calibration adapter.

Architecture (from the Seedance 2.0 seed documents; every choice below that the seeds leave open says why):

    x [B, T, C, H, W] latents ──patchify per frame (ViT-style, p×p)──► tokens [B, T, h, w, D] (+ sincos pos)
    t [B] ─sinusoid─► t_embed MLP ─┐
    c [B, cond_dim] ─► c_embed MLP ─┴─► y [B, D] ─► adaln (SiLU, Linear D→n_mod·D) ─► mod [B, n_mod, D]
    for each block (mod + the block's own learned table, PixArt-α "adaLN-single"):
        x_s = x + g1 · SpatialAttn(norm_s(x))            attention inside each frame (h·w tokens)
        x_t = x + g2 · TemporalAttn(norm_t(x))           attention along time per location, keys at a stride
              [+ g3 · WindowAttn3D(norm_w(x_t))]          optional 3D local windows (the "joint" form)
        h   = CGF(x_s, x_t) = g ⊙ x_s + (1 − g) ⊙ x_t,   g = sigmoid(Linear(cat(x_s, x_t)))   (float32)
        out = h + g4 · SwiGLU(norm_m(h))
    final: modulated norm + Linear(D → p·p·C) ─unpatchify─► velocity [B, T, C, H, W]

The denoiser predicts the flow-matching velocity v = ε − x0 (see seedance_sampler.py). With T < 3 frames the
temporal branch and the fusion are skipped (spatial-only mode, logged); ``set_temporal(False)`` does the same
at inference for any T.

Hidden states between blocks are 5-D [B, T, h, w, D]: every Linear acts on the last dim, and the attention
modules read the frame/grid structure from the shape, so no block needs an integer argument.
"""
from __future__ import annotations

import difflib
import logging
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sdquant.errors import ConfigError, ShapeError

logger = logging.getLogger(__name__)

MIN_TEMPORAL_FRAMES = 3  # the seeds: "T < 3 frames => spatial-only mode"


# ------------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class SeedanceConfig:
    """The ``config.json`` schema. Every field is validated on construction (ConfigError names the field)."""
    in_channels: int = 4            # latent channels C
    patch_size: int = 2             # p: per-frame p×p patches
    hidden_size: int = 256          # D
    depth: int = 4                  # number of dual-branch blocks
    num_heads: int = 4
    mlp_hidden_size: Optional[int] = None   # SwiGLU width; None -> 8/3·D rounded up to a multiple of 128
    cond_dim: int = 16              # width of the text/class conditioning embedding c
    stride_t: int = 1               # temporal keys at frames j % stride_t == 0 (keyframe anchors) + the query frame
    window_3d: Optional[tuple] = None   # (wt, wh, ww) 3D local-window attention in the temporal branch; None = off
    qk_norm: bool = True            # RMSNorm on q and k per head (keeps attention logits bounded in bf16)
    temporal: bool = True           # default state of the temporal branch (can be switched off at inference)
    freq_dim: int = 256             # sinusoidal timestep features
    norm_eps: float = 1e-6
    model_type: str = "seedance"

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("qk_norm", "temporal"):
                if not isinstance(v, bool):
                    raise ConfigError(f.name, f"must be true or false, got {v!r}")
            elif f.name == "norm_eps":
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
                    raise ConfigError(f.name, f"must be a number in (0, 1), got {v!r}")
            elif f.name == "model_type":
                if v != "seedance":
                    raise ConfigError(f.name, f"must be 'seedance', got {v!r}")
            elif f.name == "window_3d":
                if v is not None:
                    if (not isinstance(v, (list, tuple)) or len(v) != 3
                            or any(isinstance(a, bool) or not isinstance(a, int) or a < 1 for a in v)):
                        raise ConfigError(f.name, f"must be null or three positive integers [wt, wh, ww], got {v!r}")
                    object.__setattr__(self, "window_3d", tuple(v))
            elif f.name == "mlp_hidden_size" and v is None:
                object.__setattr__(self, "mlp_hidden_size", 128 * math.ceil(8 * self.hidden_size / 3 / 128))
            elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f.name, f"must be a positive integer, got {v!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError("hidden_size", f"{self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.hidden_size % 4:
            raise ConfigError("hidden_size", f"{self.hidden_size} must be a multiple of 4 (2-D sincos positions)")
        if self.freq_dim % 2:
            raise ConfigError("freq_dim", f"must be even, got {self.freq_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def n_mod(self) -> int:
        """Modulation vectors per block: (shift, scale, gate) for each of its 3 or 4 sub-layers."""
        return 3 * (4 if self.window_3d else 3)

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> "SeedanceConfig":
        """Build from a parsed config.json; ``where`` (e.g. a file name) prefixes the field in errors."""
        pre = f"{where}:" if where else ""
        if not isinstance(d, dict):
            raise ConfigError(where or "config", f"must be a JSON object, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        for k in d:
            if k not in names:
                close = difflib.get_close_matches(k, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"{pre}{k}", f"unknown key{hint}")
        try:
            return cls(**d)
        except ConfigError as e:
            raise ConfigError(f"{pre}{e.field}", e.problem) from None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["window_3d"] = list(self.window_3d) if self.window_3d else None
        return d


# ------------------------------------------------------------------------------------------------ helpers
def sincos_1d(n: int, dim: int, device=None) -> torch.Tensor:
    """[n, dim] fixed sin/cos positions (float32); computed per call so T, h, w stay dynamic."""
    pos = torch.arange(n, device=device, dtype=torch.float32)
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, device=device, dtype=torch.float32) / (dim // 2))
    ang = pos[:, None] * freqs[None]                                  # [n, dim/2]
    return torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1)


def pos_embed_3d(t: int, h: int, w: int, dim: int, device=None) -> torch.Tensor:
    """[t, h, w, dim]: 2-D spatial sincos (half the channels for rows, half for columns) + 1-D temporal."""
    rows = sincos_1d(h, dim // 2, device)[:, None, :].expand(h, w, dim // 2)
    cols = sincos_1d(w, dim // 2, device)[None, :, :].expand(h, w, dim // 2)
    spatial = torch.cat([rows, cols], dim=-1)                          # [h, w, dim]
    return spatial[None] + sincos_1d(t, dim, device)[:, None, None, :]


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t in [0, 1] (flow-matching time) [B] -> [B, dim] sinusoidal features of 1000·t (float32)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    ang = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Norm statistics in at least float32 (float64 stays float64 for reference runs)."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = _upcast(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(xf.dtype)).to(x.dtype)


class ModulatedNorm(nn.Module):
    """LayerNorm (no affine) -> adaLN modulation -> learnable per-channel ``weight``.

    Why the weight sits *after* the modulation: AWQ folds its per-input-channel scale s into the op that feeds
    the scaled linears. With y = w ⊙ (LN(x)·(1+scale) + shift), dividing ``weight`` by s divides the whole
    output (shift included) by s, so the fold is exact and the engine treats this norm like an RMSNorm
    (``weight /= s``, no bias). A weight placed before the modulation would leave ``shift`` unscaled.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, shift, scale):  # x [B, ..., D]; shift, scale broadcastable to x
        y = F.layer_norm(_upcast(x), (x.shape[-1],), eps=self.eps)
        y = y * (1 + scale.to(y.dtype)) + shift.to(y.dtype)
        return (y * self.weight.to(y.dtype)).to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): gated, so AWQ can fold up -> down exactly (a GELU MLP could not)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


# ---------------------------------------------------------------------------------------------- attention
class _MHA(nn.Module):
    """q/k/v/o projections + optional per-head QK RMSNorm; subclasses decide which tokens see each other."""

    def __init__(self, dim: int, heads: int, qk_norm: bool):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()

    def attend(self, seq: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, L, D = seq.shape                                            # [n, L, D]
        def split(z):
            return z.view(n, L, self.heads, self.head_dim).transpose(1, 2)   # [n, H, L, hd]
        q, k, v = self.q_norm(split(self.q(seq))), self.k_norm(split(self.k(seq))), split(self.v(seq))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [n, H, L, hd]
        return self.o(out.transpose(1, 2).reshape(n, L, D))


class SpatialAttention(_MHA):
    """Full attention among the h·w tokens of each frame; frames are independent."""

    def forward(self, x):  # [B, T, h, w, D]
        B, T, h, w, D = x.shape
        return self.attend(x.reshape(B * T, h * w, D)).view(B, T, h, w, D)


def temporal_mask(T: int, stride: int, device=None) -> Optional[torch.Tensor]:
    """[T, T] bool: frame i attends to the anchors j % stride == 0 and to itself. None when stride == 1."""
    if stride == 1:
        return None
    j = torch.arange(T, device=device)
    return (j[None, :] % stride == 0) | (j[:, None] == j[None, :])


class TemporalAttention(_MHA):
    """Axial attention along time at each spatial location; with stride_t > 1 the keys are the keyframe
    anchors (the seeds' sparse form), which makes the cost O(T · T/stride) instead of O(T²)."""

    def __init__(self, dim, heads, qk_norm, stride: int = 1):
        super().__init__(dim, heads, qk_norm)
        self.stride = stride

    def forward(self, x):  # [B, T, h, w, D]
        B, T, h, w, D = x.shape
        seq = x.permute(0, 2, 3, 1, 4).reshape(B * h * w, T, D)       # [B·h·w, T, D]
        out = self.attend(seq, temporal_mask(T, self.stride, x.device))
        return out.view(B, h, w, T, D).permute(0, 3, 1, 2, 4)


class WindowAttention3D(_MHA):
    """Attention inside non-overlapping (wt, wh, ww) windows of the video. Sizes that do not divide are
    zero-padded; padded keys are masked out, padded queries are cropped (every window keeps ≥1 real key)."""

    def __init__(self, dim, heads, qk_norm, window: tuple):
        super().__init__(dim, heads, qk_norm)
        self.window = tuple(window)

    def forward(self, x):  # [B, T, h, w, D]
        B, T, h, w, D = x.shape
        wt, wh, ww = self.window
        pt, ph, pw = (-T) % wt, (-h) % wh, (-w) % ww
        xp = F.pad(x, (0, 0, 0, pw, 0, ph, 0, pt))                     # [B, Tp, hp, wp, D]
        valid = F.pad(x.new_ones(1, T, h, w, 1, dtype=torch.bool), (0, 0, 0, pw, 0, ph, 0, pt))
        Tp, hp, wp = T + pt, h + ph, w + pw
        nt, nh, nw = Tp // wt, hp // wh, wp // ww

        def part(z):  # [b, Tp, hp, wp, d] -> [b·nW, wt·wh·ww, d]
            b, d = z.shape[0], z.shape[-1]
            z = z.reshape(b, nt, wt, nh, wh, nw, ww, d).permute(0, 1, 3, 5, 2, 4, 6, 7)
            return z.reshape(b * nt * nh * nw, wt * wh * ww, d)

        keys_ok = part(valid)[..., 0]                                   # [nW, L]
        mask = keys_ok[None].expand(B, -1, -1).reshape(B * nt * nh * nw, 1, 1, wt * wh * ww)
        out = self.attend(part(xp), mask)                               # [B·nW, L, D]
        out = out.view(B, nt, nh, nw, wt, wh, ww, D).permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(B, Tp, hp, wp, D)
        return out[:, :T, :h, :w]


class CrossGateFusion(nn.Module):
    """g = sigmoid(gate(cat(x_s, x_t))), out = g·x_s + (1−g)·x_t — always computed in float32.

    The gate's parameters stay float32 through ``model.to(dtype)`` / ``.half()`` (see ``_apply``) and the gate
    runs with autocast disabled: a sigmoid gate in bf16 has ~3 significant digits, and the seeds' deployment
    advice is to keep CGF in FP32. The output is returned in the input dtype.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.gate = nn.Linear(2 * dim, dim)

    def _apply(self, fn, recurse=True):
        keep = {n: p.detach() for n, p in self.named_parameters()}
        super()._apply(fn, recurse)
        for n, p in self.named_parameters():
            # undo only a *downcast* (fp16/bf16/fp8); float64 is allowed (reference computations)
            if p.is_floating_point() and torch.finfo(p.dtype).bits < 32:
                p.data = keep[n].to(device=p.device, dtype=torch.float32)
        return self

    def forward(self, xs, xt):  # [B, T, h, w, D] each
        with torch.autocast(device_type=xs.device.type, enabled=False):
            w = getattr(self.gate, "weight", None)   # (a user may have quantized the gate anyway)
            wdt = torch.float64 if w is not None and w.dtype == torch.float64 else torch.float32
            xs32, xt32 = xs.to(wdt), xt.to(wdt)
            g = torch.sigmoid(self.gate(torch.cat([xs32, xt32], dim=-1)))
            out = xt32 + g * (xs32 - xt32)
        return out.to(xs.dtype)


# ------------------------------------------------------------------------------------------------- blocks
class SeedanceBlock(nn.Module):
    """One dual-branch block. ``forward(x, mod)``: x [B, T, h, w, D], mod [B, n_mod, D] (shared adaLN output)."""

    def __init__(self, cfg: SeedanceConfig):
        super().__init__()
        D, H, qk = cfg.hidden_size, cfg.num_heads, cfg.qk_norm
        self.norm_s, self.attn_s = ModulatedNorm(D, cfg.norm_eps), SpatialAttention(D, H, qk)
        self.norm_t, self.attn_t = ModulatedNorm(D, cfg.norm_eps), TemporalAttention(D, H, qk, cfg.stride_t)
        if cfg.window_3d:
            self.norm_w, self.attn_w = ModulatedNorm(D, cfg.norm_eps), WindowAttention3D(D, H, qk, cfg.window_3d)
        self.cgf = CrossGateFusion(D)
        self.norm_m, self.mlp = ModulatedNorm(D, cfg.norm_eps), SwiGLU(D, cfg.mlp_hidden_size)
        self.table = nn.Parameter(torch.zeros(cfg.n_mod, D))           # per-block offsets to the shared adaLN
        self.has_window = bool(cfg.window_3d)
        self.temporal_enabled = cfg.temporal                            # set by SeedanceDiT.set_temporal

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        m = (mod + self.table.to(mod.dtype))[:, :, None, None, None, :]  # [B, n_mod, 1, 1, 1, D]
        m = m.to(x.dtype)
        xs = x + m[:, 2] * self.attn_s(self.norm_s(x, m[:, 0], m[:, 1]))
        if self.temporal_enabled and x.shape[1] >= MIN_TEMPORAL_FRAMES:
            xt = x + m[:, 5] * self.attn_t(self.norm_t(x, m[:, 3], m[:, 4]))
            if self.has_window:
                xt = xt + m[:, 11] * self.attn_w(self.norm_w(xt, m[:, 9], m[:, 10]))
            h = self.cgf(xs, xt)
        else:  # spatial-only mode: the temporal branch and the fusion are skipped
            h = xs
        return h + m[:, 8] * self.mlp(self.norm_m(h, m[:, 6], m[:, 7]))


class MLPEmbed(nn.Module):
    def __init__(self, din: int, dout: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(din, dout), nn.Linear(dout, dout)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x)))


class FinalLayer(nn.Module):
    def __init__(self, cfg: SeedanceConfig):
        super().__init__()
        D, p = cfg.hidden_size, cfg.patch_size
        self.norm = ModulatedNorm(D, cfg.norm_eps)
        self.linear = nn.Linear(D, p * p * cfg.in_channels)
        self.table = nn.Parameter(torch.zeros(2, D))

    def forward(self, x, y):  # x [B, T, h, w, D], y [B, D]
        m = (y[:, None] + self.table.to(y.dtype))[:, :, None, None, None, :].to(x.dtype)
        return self.linear(self.norm(x, m[:, 0], m[:, 1]))


# -------------------------------------------------------------------------------------------------- model
class SeedanceDiT(nn.Module):
    """``forward(x [B,T,C,H,W], t [B] in [0,1], cond [B, cond_dim] | None) -> velocity [B,T,C,H,W]``."""

    def __init__(self, cfg: SeedanceConfig):
        super().__init__()
        self.config = cfg
        D, p = cfg.hidden_size, cfg.patch_size
        self.patch_embed = nn.Linear(cfg.in_channels * p * p, D)   # == a stride-p Conv2d, as a Linear
        self.t_embed = MLPEmbed(cfg.freq_dim, D)
        self.c_embed = MLPEmbed(cfg.cond_dim, D)
        self.adaln = nn.Linear(D, cfg.n_mod * D)                    # shared by all blocks (adaLN-single)
        self.blocks = nn.ModuleList(SeedanceBlock(cfg) for _ in range(cfg.depth))
        self.final = FinalLayer(cfg)
        self._logged_spatial_only = False
        if not self.adaln.weight.is_meta:  # on the meta device (checkpoint loading) there is nothing to init
            self.init_weights(0)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> "SeedanceDiT":
        """Deterministic init from a private generator (the global RNG is left alone)."""
        g = torch.Generator().manual_seed(seed)
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear):
                w = torch.empty(mod.weight.shape)
                nn.init.xavier_uniform_(w, generator=g)
                if name.endswith("cgf.gate") or name == "adaln":
                    w.mul_(0.1)      # start near g = 0.5 and near-constant modulation
                mod.weight.copy_(w)
                if mod.bias is not None:
                    mod.bias.zero_()
        for blk in self.blocks:
            blk.table.copy_(torch.randn(blk.table.shape, generator=g) / math.sqrt(self.config.hidden_size))
        self.final.table.zero_()
        for mod in self.modules():
            if isinstance(mod, (RMSNorm, ModulatedNorm)):
                mod.weight.fill_(1.0)
        return self

    def set_temporal(self, enabled: bool) -> "SeedanceDiT":
        """Switch the temporal branch (and the fusion) on or off for inference."""
        for blk in self.blocks:
            blk.temporal_enabled = bool(enabled)
        return self

    @property
    def temporal_enabled(self) -> bool:
        return all(b.temporal_enabled for b in self.blocks)

    # --- pieces the calibration adapter reuses --------------------------------------------------------
    def check_inputs(self, x, t, cond):
        cfg = self.config
        if x.ndim != 5 or x.shape[2] != cfg.in_channels:
            raise ShapeError(f"seedance input x: expected [B, T, {cfg.in_channels}, H, W], got {list(x.shape)}")
        if x.shape[3] % cfg.patch_size or x.shape[4] % cfg.patch_size:
            raise ShapeError(f"seedance input x: H, W = {x.shape[3]}, {x.shape[4]} not divisible by "
                             f"patch_size {cfg.patch_size}")
        if t.ndim > 1 or (t.ndim == 1 and t.shape[0] not in (1, x.shape[0])):
            raise ShapeError(f"seedance timestep t: expected [B={x.shape[0]}] or a scalar, got {list(t.shape)}")
        if cond is not None and (cond.ndim != 2 or cond.shape[1] != cfg.cond_dim
                                 or cond.shape[0] not in (1, x.shape[0])):
            raise ShapeError(f"seedance cond: expected [B={x.shape[0]}, {cfg.cond_dim}], got {list(cond.shape)}")

    def embed(self, x, t, cond):
        """Everything before block 0: -> (tokens [B,T,h,w,D], y [B,D], mod [B,n_mod,D])."""
        cfg = self.config
        self.check_inputs(x, t, cond)
        B, T, C, H, W = x.shape
        p, h, w = cfg.patch_size, H // cfg.patch_size, W // cfg.patch_size
        patches = x.reshape(B, T, C, h, p, w, p).permute(0, 1, 3, 5, 2, 4, 6).reshape(B, T, h, w, C * p * p)
        tok = self.patch_embed(patches)                                            # [B, T, h, w, D]
        tok = tok + pos_embed_3d(T, h, w, cfg.hidden_size, x.device).to(tok.dtype)
        t = t.reshape(-1).expand(B) if t.ndim else t.reshape(1).expand(B)
        tf = timestep_features(t.to(x.device), cfg.freq_dim).to(self.t_embed.fc1.weight.dtype)
        y = self.t_embed(tf)                                                       # [B, D]
        if cond is None:
            cond = torch.zeros(B, cfg.cond_dim, device=x.device)                   # the "null" condition
        y = y + self.c_embed(cond.to(y.dtype).expand(B, -1))
        mod = self.adaln(F.silu(y)).view(B, cfg.n_mod, cfg.hidden_size)
        if (T < MIN_TEMPORAL_FRAMES and self.temporal_enabled and not self._logged_spatial_only
                and not torch.compiler.is_compiling()):
            logger.info("seedance: %d frame(s) < %d: spatial-only mode (temporal branch and CGF skipped)",
                        T, MIN_TEMPORAL_FRAMES)
            self._logged_spatial_only = True
        return tok, y, mod

    def head(self, tok, y, out_shape):
        B, T, C, H, W = out_shape
        p = self.config.patch_size
        out = self.final(tok, y)                                                   # [B, T, h, w, p·p·C]
        h, w = H // p, W // p
        return out.reshape(B, T, h, w, C, p, p).permute(0, 1, 4, 2, 5, 3, 6).reshape(B, T, C, H, W)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Optional[torch.Tensor] = None) -> torch.Tensor:
        tok, y, mod = self.embed(x, t, cond)
        for blk in self.blocks:
            tok = blk(tok, mod)
        return self.head(tok, y, x.shape)


def build_seedance(config: "SeedanceConfig | dict", seed: int = 0) -> SeedanceDiT:
    """A randomly initialised model (deterministic for ``seed``); load weights with seedance_io.load_seedance."""
    cfg = config if isinstance(config, SeedanceConfig) else SeedanceConfig.from_dict(config)
    return SeedanceDiT(cfg).init_weights(seed)


def build_empty(arch: "SeedanceConfig | dict", dtype: Optional[torch.dtype] = None) -> SeedanceDiT:
    """A model on the meta device (no memory, no init) for loaders that assign tensors afterwards.
    The CGF gates stay float32 whatever ``dtype`` is."""
    cfg = arch if isinstance(arch, SeedanceConfig) else SeedanceConfig.from_dict(arch, where="arch_config")
    with torch.device("meta"):
        model = SeedanceDiT(cfg)
    return model.to(dtype) if dtype is not None else model


def load_pretrained(path, dtype: Optional[torch.dtype] = torch.float32, device="cpu") -> SeedanceDiT:
    """A checkpoint folder (config.json + sharded safetensors) -> eval-mode model (see seedance_io)."""
    from sdquant.models.seedance_io import load_seedance
    return load_seedance(path, device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------------ adapter
# Layers kept in high precision by default, and why:
#  - cgf.gate: the seeds' advice (gate precision); it is also computed in float32 at run time.
#  - t_embed / c_embed / adaln: they run once per sample on a [B, D] vector, so quantizing them saves no time,
#    and their error shifts the modulation of every token of every block.
#  - final: the velocity head; its error goes straight into every sampler step.
#  - patch_embed: tiny (C·p·p inputs, not a multiple of any useful group size).
SEEDANCE_KEEP_HIGH_PRECISION = [r"(^|\.)cgf\.gate$", r"^t_embed\.", r"^c_embed\.", r"^adaln$", r"^final\.",
                                r"^patch_embed$"]


def seedance_batch(batch: Any):
    """A calibration batch -> (x, t, cond). Accepts {"x", "t", "cond"} (cond optional) or a tuple."""
    if isinstance(batch, dict):
        if "x" not in batch or "t" not in batch:
            raise ShapeError(f"seedance batch: needs keys 'x' and 't' (and optionally 'cond'), got {sorted(batch)}")
        return batch["x"], batch["t"], batch.get("cond")
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return batch[0], batch[1], batch[2] if len(batch) == 3 else None
    raise ShapeError(f"seedance batch: expected a dict with x, t, cond or a tuple, got {type(batch).__name__}")


def seedance_pre_block(model: SeedanceDiT, batch) -> tuple:
    """Runs patch embedding and the timestep/conditioning embeddings: -> (block-0 input, block kwargs)."""
    x, t, cond = seedance_batch(batch)
    p = next(model.parameters())
    tok, _, mod = model.embed(x.to(p.device, p.dtype), t.to(p.device), None if cond is None else cond.to(p.device))
    return tok, {"mod": mod}


def seedance_forward(model: SeedanceDiT, batch) -> torch.Tensor:
    """Whole-model forward on a calibration batch (for full-model checks)."""
    x, t, cond = seedance_batch(batch)
    p = next(model.parameters())
    return model(x.to(p.device, p.dtype), t.to(p.device), None if cond is None else cond.to(p.device))


def seedance_scaling_groups(window: bool = True) -> list:
    """AWQ scaling groups of one block. ``prev`` is always foldable: ModulatedNorm has a post-modulation
    ``weight`` (see its docstring), v -> o is linear per head, and the MLP is gated so up -> down is exact."""
    groups = []
    branches = ["s", "t"] + (["w"] if window else [])
    for b in branches:
        groups.append({"prev": f"norm_{b}", "linears": [f"attn_{b}.q", f"attn_{b}.k", f"attn_{b}.v"],
                       "inspect": f"attn_{b}", "fold": "norm"})
        groups.append({"prev": f"attn_{b}.v", "linears": [f"attn_{b}.o"], "inspect": f"attn_{b}.o",
                       "fold": "linear"})
    groups.append({"prev": "norm_m", "linears": ["mlp.gate", "mlp.up"], "inspect": "mlp", "fold": "norm"})
    groups.append({"prev": "mlp.up", "linears": ["mlp.down"], "inspect": "mlp.down", "fold": "linear"})
    return groups


def seedance_adapter(model: Optional[SeedanceDiT] = None) -> dict:
    """Architecture adapter as plain data for the generic block walker.

    Pass the model to get exactly its groups (the window-attention groups exist only when ``window_3d`` is
    set); without it the groups of the full (windowed) form are listed and absent modules must be skipped.
    """
    window = True if model is None else bool(model.config.window_3d)
    return {
        "kind": "seedance",
        "blocks": "blocks",
        "pre_block": seedance_pre_block,
        "scaling_groups": seedance_scaling_groups(window),
        "keep_high_precision": list(SEEDANCE_KEEP_HIGH_PRECISION),
        "forward": seedance_forward,
    }


def seedance_export_spec(model: SeedanceDiT, batch: int = 2, frames: int = 4, height: int = 8, width: int = 8):
    """Example inputs and dynamic axes for torch.export / ONNX: batch and time are dynamic (time ≥ 3: the
    exported graph is the dual-branch one; spatial-only needs its own export). -> (args, dynamic_shapes,
    input_names, output_names)."""
    cfg = model.config
    p = next(model.parameters())
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(batch, max(frames, MIN_TEMPORAL_FRAMES), cfg.in_channels, height, width, generator=g),
            torch.rand(batch, generator=g), torch.randn(batch, cfg.cond_dim, generator=g))
    args = tuple(a.to(p.device) for a in args)
    B = torch.export.Dim("batch", min=1, max=1024)
    T = torch.export.Dim("time", min=MIN_TEMPORAL_FRAMES, max=1024)
    dynamic = {"x": {0: B, 1: T}, "t": {0: B}, "cond": {0: B}}
    return args, dynamic, ["x", "t", "cond"], ["velocity"]
