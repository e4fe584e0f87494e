"""Dequantize + cuBLAS at large M (the INT4 layer's path at M >= 1024), whole or in L2-sized chunks (H200).

The shipped large-M path (``sdquant::w4a16_dequant_cuda``) writes the whole dequantized weight (N x K x 2 bytes, 470 MB
for 8192x28672) to DRAM, then cuBLAS reads it back. ``layout_dequant.linear_chunked_cuda`` dequantizes a chunk of
64-feature blocks into one reused buffer and runs that chunk's GEMM into its columns of y, so the chunk's writes and
reads can stay in L2. In one process, per shape and M: cuBLAS bf16 ``F.linear`` (baseline), the shipped op, its two
parts alone (the dequantization; the GEMM on an already dequantized weight), and the chunked path at several chunk
sizes (MB of bf16 weight a chunk). Every path's output is first compared with the shipped op's (relative error).
Method as bench/gemm.py: weight copies rotated past 3x the L2, CUDA graph of back-to-back calls, median of 5 replays.

    python bench/dequant_chunks.py --out $OUT [--ms 1024,4096] [--chunks-mb 16,32,48]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm  # noqa: E402

from sdquant.kernels import int4_layout, layout_dequant  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ms", default="1024,4096")
    ap.add_argument("--chunks-mb", default="16,32,48")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in gemm.RUN_ORDER))
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    dt = torch.bfloat16
    rows = []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        qw = gemm.random_int4(n, k, device=dev, seed=k + n)
        lays = [int4_layout.repack_cuda(qw, dt) for _ in range(gemm.n_copies(n * k // 2))]
        w16 = qw.dequantize().to(dt)
        dense = [w16] + [w16.clone() for _ in range(gemm.n_copies(n * k * 2) - 1)]
        del w16
        pre = layout_dequant.dequant_cuda_layout(lays[0]["qweight"], lays[0]["scales"], lays[0]["zeros"], dt)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=dt)

            def op(i):
                L = lays[i]
                return torch.ops.sdquant.w4a16_dequant_cuda(x, L["qweight"], L["scales"], L["zeros"], None, None)

            paths = {
                "bf16": lambda i: F.linear(x, dense[i % len(dense)]),
                "dequant_op": op,
                "dequant_only": lambda i: layout_dequant.dequant_cuda_layout(
                    lays[i]["qweight"], lays[i]["scales"], lays[i]["zeros"], dt),
                "gemm_only": lambda i: F.linear(x, pre),
            }
            for mb in [int(v) for v in args.chunks_mb.split(",")]:
                blocks = max(1, (mb << 20) // (64 * k * 2))
                paths[f"chunked_{mb}mb"] = (lambda i, b=blocks: layout_dequant.linear_chunked_cuda(
                    x, lays[i]["qweight"], lays[i]["scales"], lays[i]["zeros"], b))
            ref = op(0).float()
            for name, call in paths.items():
                err = None
                if name not in ("dequant_only",):
                    y = call(0).float()
                    err = ((y - ref).norm() / ref.norm()).item()
                nrot = len(dense) if name == "bf16" else (1 if name == "gemm_only" else len(lays))
                us = gemm.time_rotating(call, nrot)
                row = {"K": k, "N": n, "M": m, "path": name, "us": round(us, 2),
                       "rel_err_vs_op": None if err is None else round(err, 6)}
                rows.append(row)
                print(row, flush=True)
            del x
        del lays, dense, pre
        torch.cuda.empty_cache()
    path = gemm.save_rows(args.out, "dequant_chunks", rows)
    print(f"wrote {path}")
    base = {(r["K"], r["N"], r["M"]): r["us"] for r in rows if r["path"] == "bf16"}
    names = list(dict.fromkeys(r["path"] for r in rows))
    print("\n| K×N | M | " + " | ".join(names) + " | best chunked ÷ bf16 | op ÷ bf16 |")
    print("|---|---|" + "---|" * (len(names) + 2))
    for key in base:
        rs = {r["path"]: r["us"] for r in rows if (r["K"], r["N"], r["M"]) == key}
        best = min(v for p, v in rs.items() if p.startswith("chunked"))
        print(f"| {key[0]}×{key[1]} | {key[2]} | " + " | ".join(f"{rs[p]:.1f}" for p in names)
              + f" | {base[key] / best:.3f}× | {base[key] / rs['dequant_op']:.3f}× |")


if __name__ == "__main__":
    main()
