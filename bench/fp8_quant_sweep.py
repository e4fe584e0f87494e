"""Launch sweep of sdquant's FP8 per-token activation quantize kernel (fp8_triton.quantize_act) on one GPU.

    python bench/fp8_quant_sweep.py [--out DIR]

Why: at M >= 1024 the fp8 layer (quantize kernel + rowwise ``_scaled_mm``) was 13-49% slower than the GEMM alone
on K = 14336 and 28672 (bench/fp8_fast_accum.py, 2026-12-01), far more than the bytes the kernel moves. This times
the kernel over (BLOCK_K, num_warps) for K in {4096, 8192, 14336, 28672} and M in {16, 1024, 4096}, beside the
shipped heuristic and torch's eager per-token quantization, and checks every output against the shipped one
(bit-identical codes and scales). CUDA graph of back-to-back calls, median (crossover.time_graph). Table last;
DIR/fp8_quant_sweep.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sdquant.kernels import crossover, fp8_triton  # noqa: E402
from sdquant.kernels.ops import quantize_fp8_per_token  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for k in (4096, 8192, 14336, 28672):
        for m in (16, 1024, 4096):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            q0, s0 = fp8_triton.quantize_act(x)
            gb = (m * k * 3 + m * 4) / 1e9
            r = {"K": k, "M": m, "GB": gb}
            r["shipped"] = crossover.time_graph([lambda: fp8_triton.quantize_act(x)])
            r["torch"] = crossover.time_graph([lambda: quantize_fp8_per_token(x)])
            nxt = 1 << (k - 1).bit_length()
            for blk in sorted({nxt, 8192, 4096, 2048}):
                if blk > nxt:
                    continue
                for nw in (4, 8, 16, 32):
                    if blk // (32 * nw) < 1 or blk // (32 * nw) > 128:
                        continue
                    key = f"b{blk}w{nw}"
                    try:
                        q, s = fp8_triton.quantize_act(x, launch=(blk, nw))
                        same = bool(torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0))
                        r[key] = crossover.time_graph([lambda blk=blk, nw=nw: fp8_triton.quantize_act(x, launch=(blk, nw))])
                        r[key + "_same"] = same
                    except Exception as ex:  # noqa: BLE001
                        r[key] = float("nan")
                        print(f"  K={k} M={m} {key}: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
            best = min((kk for kk in r if kk.startswith("b") and not kk.endswith("_same")), key=lambda kk: r[kk])
            r["best"] = best
            rows.append(r)
            print(f"K={k} M={m}: shipped {r['shipped']:.1f} torch {r['torch']:.1f} best {best} {r[best]:.1f} us "
                  f"(same={r.get(best + '_same')}) floor {gb / 4.3e-3 * 1e0:.1f} us | " +
                  " ".join(f"{kk} {v:.1f}" for kk, v in r.items() if kk.startswith("b") and isinstance(v, float)),
                  flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_quant_sweep.json"), "w") as f:
        json.dump({"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "commit": os.environ.get("SDQUANT_COMMIT", "?"),
                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, "rows": rows}, f, indent=1)
    print("| K | M | shipped µs | torch eager µs | best (BLOCK_K, warps) µs | identical | floor µs |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['K']} | {r['M']} | {r['shipped']:.1f} | {r['torch']:.1f} | {r['best']} {r[r['best']]:.1f} | "
              f"{r.get(r['best'] + '_same')} | {r['GB'] / 4.3e-3:.1f} |")


if __name__ == "__main__":
    main()
