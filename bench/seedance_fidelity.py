#!/usr/bin/env python3
"""Fidelity of RTN, AWQ, GPTQ, AWQ+GPTQ (W4) and FP8 on the trained small Seedance model (CPU).

Calibration: denoiser inputs captured by sampling over the fixture's conditioning embeddings
(tests/fixtures/seedance_small/cond.safetensors), timesteps stratified over a 20-step schedule.
Evaluation: held-out conditions (synthetic_videos seed 2024, never used for calibration or training), fixed
noise seed; per-timestep relative error of the denoiser output along the FP trajectory, and PSNR / SSIM /
relative error of the latents after N Euler steps against FP.

    python bench/seedance_fidelity.py --out bench/results/seedance_fidelity.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sdquant  # noqa: E402
from sdquant.models.seedance import load_pretrained  # noqa: E402
from sdquant.models.seedance_data import synthetic_videos  # noqa: E402
from sdquant.models.seedance_eval import seedance_fidelity  # noqa: E402
from sdquant.models.seedance_io import load_conditioning  # noqa: E402
from sdquant.models.seedance_sampler import calibration_batches, diffusion_calibration_data  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "seedance_small")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=FIXTURE)
    ap.add_argument("--methods", default="rtn,awq,gptq,awq+gptq,fp8")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--n-calib", type=int, default=16)
    ap.add_argument("--calib-steps", type=int, default=20)
    ap.add_argument("--eval-videos", type=int, default=2)
    ap.add_argument("--eval-steps", type=int, default=10)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    fp = load_pretrained(a.model)
    cond = load_conditioning(os.path.join(a.model, "cond.safetensors"), cond_dim=fp.config.cond_dim)
    t0 = time.time()
    calib = diffusion_calibration_data(fp, cond, a.n_calib, a.frames, a.size, a.size, num_steps=a.calib_steps,
                                       seed=0, batch_size=a.batch)
    print(f"calibration data {list(calib['x'].shape)} in {time.time() - t0:.0f}s", flush=True)
    _, eval_cond = synthetic_videos(a.eval_videos, a.frames, a.size, seed=2024)
    ev = dict(frames=a.frames, height=a.size, width=a.size, num_steps=a.eval_steps, seed=123)
    rows = []
    for method in a.methods.split(","):
        fp8 = method == "fp8"
        cfg = {"model": {"kind": "seedance", "path": a.model},
               "quant": {"method": method, "bits": 8 if fp8 else a.bits, "group_size": -1 if fp8 else a.group_size},
               "pipeline": {"batch_size": a.batch, "progress": False}, "device": "cpu", "dtype": "float32",
               "report": {"prompt": None}}
        t0 = time.time()
        res = sdquant.calibrate(load_pretrained(a.model), cfg, list(calibration_batches(calib, a.batch)))
        cal_s = time.time() - t0
        q = res.quantized_model() if hasattr(res, "quantized_model") else res.model
        rep = seedance_fidelity(fp, q.eval(), eval_cond, **ev)
        row = {"method": method, "bits": 8 if fp8 else a.bits, "group_size": -1 if fp8 else a.group_size,
               "layers": len(res.weights), "calib_s": round(cal_s, 1), "mean_rel_err": rep["mean_rel_err"],
               "per_timestep": [r["rel_err"] for r in rep["per_timestep"]], **rep["latents"]}
        rows.append(row)
        print(f"{method:9s} layers {row['layers']:3d}  denoiser rel_err {row['mean_rel_err']:.4%}  "
              f"latents PSNR {row['psnr_db']:.2f} dB  SSIM {row['ssim']:.4f}  rel_err {row['rel_err']:.4%}  "
              f"({cal_s:.0f}s)", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "device": "cpu", "torch": torch.__version__,
           "settings": vars(a), "rows": rows}
    print("\n| method | W | g | denoiser rel. err (mean over steps) | latent PSNR dB | latent SSIM | latent rel. err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['bits']} | {r['group_size']} | {r['mean_rel_err']:.3%} | {r['psnr_db']:.2f} | "
              f"{r['ssim']:.4f} | {r['rel_err']:.3%} |")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
