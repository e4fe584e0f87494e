#!/usr/bin/env python3
"""Train a small Seedance DiT on deterministic synthetic videos (sdquant.models.seedance_data).

Flow matching: x_t = (1 − t)·x0 + t·ε, target v = ε − x0, t ~ logit-normal(0, 1) (SD3: more weight on the
middle of the path, where the velocity is hardest to predict). 10% of conditions are dropped to the null
(zero) vector so classifier-free guidance works. AdamW, linear warm-up then cosine decay, bf16 autocast on
CUDA, an EMA of the weights (saved). Data are generated on the fly on the device: step k uses video seed
``seed·10⁶ + k``, so a run is reproducible given --steps.

``--steps auto`` times 20 steps after warm-up and picks the number of steps that fits ``--time-budget``.

    python tools/train_seedance.py --device cuda --steps auto --time-budget 130 --out $OUT/seedance_small
    python tools/train_seedance.py --device cpu --steps 3 --batch 2 --hidden 32 --depth 1 --out /tmp/s   (smoke)
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sdquant.models.seedance import SeedanceConfig, build_seedance  # noqa: E402
from sdquant.models.seedance_data import COND_DIM, synthetic_videos  # noqa: E402
from sdquant.models.seedance_io import save_seedance  # noqa: E402
from sdquant.models.seedance_sampler import sample  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", default="auto", help="number of optimizer steps, or 'auto' (fit --time-budget)")
    ap.add_argument("--time-budget", type=float, default=130.0, help="seconds of training (auto and hard stop)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--stride-t", type=int, default=2)
    ap.add_argument("--window", default="2,4,4", help="3D window 'wt,wh,ww' or 'none'")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--ema", type=float, default=0.998)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--shard-mb", type=float, default=8.0, help="max shard size of the saved weights (MiB)")
    ap.add_argument("--out", required=True, help="output folder (config.json + safetensors + train_log.json)")
    return ap.parse_args(argv)


def flow_loss(model, x0, cond, g, device):
    B = x0.shape[0]
    t = torch.sigmoid(torch.randn(B, generator=g)).to(device)                 # logit-normal time
    eps = torch.randn(x0.shape, generator=g).to(device)
    drop = (torch.rand(B, generator=g) < 0.1).to(device)
    cond = torch.where(drop[:, None], torch.zeros_like(cond), cond)
    tt = t[:, None, None, None, None]
    xt = (1 - tt) * x0 + tt * eps
    return F.mse_loss(model(xt, t, cond).float(), eps - x0)


@torch.no_grad()
def val_loss(model, device, frames, size, ts=(0.1, 0.3, 0.5, 0.7, 0.9), n=64):
    """Held-out loss at fixed times on fixed videos/noise (seed 987654, never used for training)."""
    x0, cond = synthetic_videos(n, frames, size, seed=987654, device=device)
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1)).to(device)
    out = {}
    for t in ts:
        tt = torch.full((n,), t, device=device)
        xt = (1 - t) * x0 + t * eps
        ac = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
        with ac:
            out[f"{t:.1f}"] = round(F.mse_loss(model(xt, tt, cond).float(), eps - x0).item(), 5)
    return out


def main(argv=None):
    a = parse_args(argv)
    device = torch.device(a.device)
    window = None if a.window.lower() == "none" else tuple(int(v) for v in a.window.split(","))
    cfg = SeedanceConfig(in_channels=3, patch_size=2, hidden_size=a.hidden, depth=a.depth, num_heads=a.heads,
                         cond_dim=COND_DIM, stride_t=a.stride_t, window_3d=window)
    model = build_seedance(cfg, seed=a.seed).to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"config {json.dumps(cfg.to_dict())}\nparams {n_params / 1e6:.2f} M on {device}", flush=True)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.01)
    g = torch.Generator().manual_seed(a.seed)
    autocast = (torch.autocast("cuda", torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True    # a training script, not the library: fine to set here

    total = None if a.steps == "auto" else int(a.steps)
    curve, window_losses = [], []
    t_start = time.time()
    t_probe = None
    step = 0
    while True:
        if total is not None and step >= total:
            break
        if time.time() - t_start > a.time_budget * 1.05:
            print(f"time budget reached at step {step}", flush=True)
            break
        sched_total = total or 10 ** 9
        lr = a.lr * min(1.0, (step + 1) / a.warmup)
        if step >= a.warmup and total is not None:
            lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - a.warmup) / max(1, sched_total - a.warmup)))
        for pg in opt.param_groups:
            pg["lr"] = lr
        x0, cond = synthetic_videos(a.batch, a.frames, a.size, seed=a.seed * 10 ** 6 + step, device=device)
        with autocast:
            loss = flow_loss(model, x0, cond, g, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            d = min(a.ema, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - d)
        window_losses.append(loss.item() if step % 10 == 0 or step < 50 else None)
        step += 1
        # --steps auto: time steps 30..50 and fit the rest of the budget
        if total is None and step == 30:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_probe = time.time()
        if total is None and step == 50:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per = (time.time() - t_probe) / 20
            total = max(60, int(50 + (a.time_budget - (time.time() - t_start)) / per))
            print(f"auto: {per * 1000:.1f} ms/step -> {total} steps", flush=True)
        if step % a.log_every == 0:
            vals = [v for v in window_losses if v is not None]
            curve.append({"step": step, "loss": round(sum(vals) / len(vals), 5), "lr": lr,
                          "elapsed_s": round(time.time() - t_start, 1)})
            window_losses = []
            print(f"step {step:6d}  loss {curve[-1]['loss']:.4f}  lr {lr:.2e}  {curve[-1]['elapsed_s']:.0f}s", flush=True)
    train_s = time.time() - t_start

    vl_model = val_loss(model.eval(), device, a.frames, a.size)
    vl_ema = val_loss(ema, device, a.frames, a.size)
    print(f"val loss (t: mse)  raw {vl_model}\n                   ema {vl_ema}", flush=True)
    # sample quality proxy: distance of EMA samples (20 Euler steps) to the real videos of the same prompts
    x_real, cond = synthetic_videos(8, a.frames, a.size, seed=424242, device=device)
    with torch.no_grad():
        x_gen = sample(ema, cond, a.frames, a.size, a.size, num_steps=20, seed=7)
    mse_gen = F.mse_loss(x_gen, x_real).item()
    mse_mean = F.mse_loss(x_real.mean(0, keepdim=True).expand_as(x_real), x_real).item()
    print(f"samples: mse to same-prompt videos {mse_gen:.4f} (mean-video baseline {mse_mean:.4f}), "
          f"range [{x_gen.min().item():.2f}, {x_gen.max().item():.2f}]", flush=True)

    os.makedirs(a.out, exist_ok=True)
    save_seedance(ema.float().cpu(), a.out, max_shard_bytes=int(a.shard_mb * 2 ** 20), dtype=torch.float16)
    from safetensors.torch import save_file
    _, cond_file = synthetic_videos(64, a.frames, a.size, seed=555, device="cpu")
    save_file({"cond": cond_file.contiguous()}, os.path.join(a.out, "cond.safetensors"))
    log = {"params": n_params, "steps": step, "batch": a.batch, "train_seconds": round(train_s, 1),
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "curve": curve, "val_loss_raw": vl_model, "val_loss_ema": vl_ema,
           "sample_mse": mse_gen, "mean_video_mse": mse_mean, "args": vars(a)}
    with open(os.path.join(a.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(f"done: {step} steps in {train_s:.0f}s, weights in {a.out}", flush=True)


if __name__ == "__main__":
    main()
