"""The M = 1 direct kernel at forced split-K factors (H200, one device call): does a grid finer than one wave balance
the SMs better than the automatic choice?

ncu (docs/benchmarks/int4-cuda.md, "M = 1: what bounds the direct kernel") found v10 issue-bound rather than DRAM-bound and its
grid of 224 CTAs on 264 slots (2 a SM) uneven: 92 SMs run two CTAs, 40 run one. More, shorter CTAs let the block
scheduler even that out, at the price of more fp32 partials and more prologues.

    SDQUANT_COMMIT=<hash> python bench/m1_splits.py --out $OUT

bench/gemm.py's method (weights rotated past 3x the L2, one CUDA graph, median of 5 replays); every forced split's
output is compared with the automatic one's (relative difference; the sums differ only in order). Writes
$OUT/m1_splits.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gemm  # noqa: E402

from sdquant.kernels import int4_cuda, int4_layout  # noqa: E402

SHAPES = [(8192, 28672), (4096, 28672), (28672, 8192), (14336, 4096), (8192, 10240), (4096, 6144), (4096, 4096)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ms", default="1")
    ap.add_argument("--splits", default="0,1,2,3,4,6,8")
    ap.add_argument("--configs", default="-1", help="CUDA configs (-1: the shipped choice for the shape)")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN,... (default: all seven)")
    ap.add_argument("--floor", action="store_true",
                    help="also time a one-element kernel the same way: what a launch costs in the graph by itself")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    assert torch.cuda.is_available() and int4_cuda.available(), "needs a GPU and the CUDA extension"
    dev, dt = torch.device("cuda"), torch.bfloat16
    op = torch.ops.sdquant.w4a16_cuda
    rows = []
    t0 = time.time()
    if args.floor:  # back-to-back one-element kernels in one CUDA graph, the GEMMs' method: the per-launch floor
        bufs = [torch.zeros(1, device=dev) for _ in range(8)]
        us = gemm.time_rotating(lambda i: bufs[i].add_(1.0), len(bufs))
        r = {"K": 0, "N": 0, "M": 0, "config": "one-element add_", "splits": 0, "auto": True, "us": round(us, 2)}
        rows.append(r)
        print(json.dumps(r), flush=True)
    for (k, n) in shapes:
        qw = gemm.random_int4(n, k, device=dev, seed=k + n)
        one = int4_layout.repack_cuda(qw, dt)
        lays = [{kk: (None if v is None else v.clone()) for kk, v in one.items()}
                for _ in range(gemm.n_copies(one["qweight"].numel() * 4))]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=dt)
            for cfg in [int(v) for v in args.configs.split(",")]:
                c = int4_cuda.auto_config(m, n, k, dt) if cfg < 0 else cfg
                auto = int4_cuda.auto_splits(m, n, k, gemm.GS, c, dt)
                ref = None
                for s in [int(v) for v in args.splits.split(",")]:
                    call = lambda i, s=s: op(x, lays[i]["qweight"], lays[i]["scales"], lays[i]["zeros"], None,  # noqa: E731
                                             lays[i]["locks"], None, s, False, c)
                    y = call(0).float()
                    if ref is None:
                        ref = y
                    rel = ((y - ref).norm() / ref.norm()).item()
                    us = gemm.time_rotating(call, len(lays))
                    r = {"K": k, "N": n, "M": m, "config": c, "splits": s or auto, "auto": s == 0, "us": round(us, 2),
                         "rel_vs_auto": rel}
                    rows.append(r)
                    print(json.dumps(r), flush=True)
        del lays
        torch.cuda.empty_cache()
    gemm.save_rows(args.out, "m1_splits", rows)
    print("\n| K×N | M | config | auto splits: µs | best forced: splits, µs |")
    print("|---|---|---|---|---|")
    keys = sorted({(r["K"], r["N"], r["M"], r["config"]) for r in rows if r["K"]}, key=lambda t: shapes.index(t[:2]))
    for key in keys:
        rs = [r for r in rows if (r["K"], r["N"], r["M"], r["config"]) == key]
        a = next(r for r in rs if r["auto"])
        b = min((r for r in rs if not r["auto"]), key=lambda r: r["us"])
        print(f"| {key[0]}×{key[1]} | {key[2]} | v{key[3]} | {a['splits']}: {a['us']:.2f} | {b['splits']}: {b['us']:.2f} |")
    print(f"wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
