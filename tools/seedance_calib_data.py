#!/usr/bin/env python3
"""Capture Seedance calibration inputs (x_t, t, cond) by sampling over conditioning embeddings.

    python tools/seedance_calib_data.py --model tests/fixtures/seedance_small \
        --cond tests/fixtures/seedance_small/cond.safetensors --n-samples 64 --out calib.safetensors

The output is a safetensors file with x [n, T, C, H, W], t [n], cond [n, cond_dim] that
``data.kind: diffusion`` (or ``tensors``) reads directly. Timesteps are stratified across the schedule.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sdquant.errors import SdquantError  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--model", required=True, help="Seedance folder (config.json + safetensors)")
    ap.add_argument("--cond", required=True, help="safetensors file with 'cond' [M, cond_dim]")
    ap.add_argument("--key", default="cond")
    ap.add_argument("--n-samples", type=int, default=64)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--height", type=int, default=32)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shift", type=float, default=1.0)
    ap.add_argument("--guidance", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from sdquant.models.seedance import load_pretrained
    from sdquant.models.seedance_io import load_conditioning
    from sdquant.models.seedance_sampler import diffusion_calibration_data, save_calibration_tensors
    try:
        t0 = time.time()
        model = load_pretrained(a.model, device=a.device)
        cond = load_conditioning(a.cond, key=a.key, cond_dim=model.config.cond_dim)
        data = diffusion_calibration_data(model, cond, a.n_samples, a.frames, a.height, a.width,
                                          num_steps=a.steps, seed=a.seed, shift=a.shift, guidance=a.guidance)
        save_calibration_tensors(data, a.out)
    except SdquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: x {list(data['x'].shape)}, t in [{data['t'].min():.3f}, {data['t'].max():.3f}], "
          f"{time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
