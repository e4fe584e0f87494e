"""Seedance denoiser step latency at a realistic size: bf16 vs INT4 (W4A16 g128) vs FP8 (W8A8), temporal
branch on and off. Random weights (latency does not depend on their values).

    python bench/seedance_latency.py --out $OUT/seedance_latency.json      # H200: hidden 1152, 28 blocks,
                                                                           # 16 frames of 32x32 latent patches
    python bench/seedance_latency.py --tiny                                # CPU smoke test

One denoiser forward (batch 1) per step; CUDA events, median of --iters after warm-up. Quantized layers are
the adapter's targets (CGF gates, timestep/cond MLPs, adaLN, final layer and patch embedding stay bf16/FP32),
RTN-quantized (latency only), run through QuantLinear/Fp8Linear.prepare(kernels="auto").
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch
from torch import nn


def quantize(model, kind: str, device, dtype):
    from sdquant.calibrate.rtn import rtn_quantize
    from sdquant.models.hf import replace_linears
    from sdquant.models.seedance import seedance_adapter
    from sdquant.quant.qtensor import quantize_fp8_weight

    keep = seedance_adapter(model)["keep_high_precision"]
    weights = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.startswith("blocks.") and not any(re.search(p, name) for p in keep):
            w = mod.weight.detach().float()
            weights[name] = quantize_fp8_weight(w) if kind == "fp8" else rtn_quantize(w, 4, 128, False)
    replace_linears(model, weights, dtype=dtype)
    for m in model.modules():
        if hasattr(m, "prepare") and m is not model:
            m.prepare(device=device, dtype=dtype, kernels="auto")
    return len(weights)


def time_forward(model, x, t, cond, iters: int, device) -> float:
    with torch.no_grad():
        for _ in range(3):
            model(x, t, cond)
        if device.type != "cuda":
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                model(x, t, cond)
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts)
        ts = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            model(x, t, cond)
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from sdquant.models.seedance import SeedanceConfig, build_seedance

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.tiny:
        cfg = SeedanceConfig(in_channels=4, hidden_size=128, depth=2, num_heads=4, cond_dim=16, stride_t=2,
                             window_3d=(2, 4, 4))
        frames, hw = 4, 16
    else:
        cfg = SeedanceConfig(in_channels=4, patch_size=2, hidden_size=1152, depth=28, num_heads=16,
                             cond_dim=1152, stride_t=2, window_3d=(2, 8, 8))
        frames, hw = 16, 64                       # 16 frames of 32x32 patches = 16384 tokens
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, frames, cfg.in_channels, hw, hw, generator=g).to(device, dtype)
    t = torch.full((1,), 0.5, device=device)
    cond = torch.randn(1, cfg.cond_dim, generator=g).to(device, dtype)
    rows = []
    for kind in ("bf16", "int4", "fp8"):
        model = build_seedance(cfg, seed=0).to(dtype).eval()
        n_q = quantize(model, kind, device, dtype) if kind != "bf16" else 0
        model.to(device)
        wbytes = sum(b.numel() * b.element_size() for b in list(model.parameters()) + list(model.buffers()))
        for temporal in (True, False):
            model.set_temporal(temporal)
            ms = time_forward(model, x, t, cond, args.iters, device)
            rows.append({"variant": kind, "temporal": temporal, "ms": ms, "quantized_linears": n_q,
                         "weights_gb_allocated": wbytes / 1e9})
        del model
        if cuda:
            torch.cuda.empty_cache()
    base = {r["temporal"]: r["ms"] for r in rows if r["variant"] == "bf16"}
    for r in rows:
        r["speedup_vs_bf16"] = base[r["temporal"]] / r["ms"]
    on = {r["variant"]: r["ms"] for r in rows if r["temporal"]}
    for r in rows:
        if not r["temporal"]:
            r["temporal_off_saving"] = 1 - r["ms"] / on[r["variant"]]
    rep = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "config": cfg.to_dict(), "frames": frames, "latent_hw": hw, "tokens": frames * (hw // cfg.patch_size) ** 2,
           "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
    print(f"{'variant':8} {'temporal':8} {'ms/step':>9} {'x bf16':>7} {'off saves':>9}")
    for r in rows:
        print(f"{r['variant']:8} {str(r['temporal']):8} {r['ms']:9.2f} {r['speedup_vs_bf16']:7.2f} "
              f"{r.get('temporal_off_saving', float('nan')) * 100:8.1f}%")


if __name__ == "__main__":
    main()
