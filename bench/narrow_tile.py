"""Experiment: the M <= 8 INT4 decode GEMM over 16-feature tiles with no split-K (bench/narrow/w4a16_narrow.cu), against
the shipped CUDA op, on the H200.

    python bench/narrow_tile.py --out DIR        # one device call: builds the experiment, checks it, times it

Why (docs/benchmarks/int4-cuda.md, "What a small M = 1 GEMM costs besides its bytes"): the shipped tight kernel's 64-feature
blocks leave N = 4096 only 64 of them, so o (4096x4096), down (14336x4096) and qkv (4096x6144) run 8-16 splits and pay
the split-K tail (~1.4 us of ~4.7 us fixed cost a GEMM). 16-feature tiles give 4x the tiles, so a CTA owns a tile's
whole K and its K-warps sum in shared memory. The layout is a permutation of the shipped one (``narrow_from_cuda``);
it is not wired into sdquant: a layer holds one layout, and every other kernel reads the shipped one.

Checks, per shape, M and variant: the experiment against an fp64 evaluation of the dequantized weight and against the
shipped op (same arithmetic, another K order), and twice the same bits. Times: bench/gemm.py's ``time_rotating``
(weights rotated past 3x the L2, CUDA graph of back-to-back calls, median), cuBLAS bf16 and the shipped op in the same
process, both ops also with programmatic dependent launch (the decode pipeline's launch mode).
``--compile-only``: nvcc the kernel for sm_90a here (CI), no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import cuda_exp  # noqa: E402

SRC = ROOT / "bench" / "narrow"
# variant -> (tiles a CTA, K-warps, ring depth, CTAs a SM in __launch_bounds__); must match w4a16_narrow.cu
VARIANTS = {0: (1, 8, 8, 2), 1: (1, 8, 4, 3), 2: (1, 4, 8, 4), 3: (2, 4, 8, 2), 4: (1, 16, 4, 1), 5: (4, 2, 8, 2),
            6: (8, 1, 8, 2), 7: (1, 8, 8, 3)}
SHAPES = [(4096, 4096), (4096, 6144), (14336, 4096), (4096, 28672), (8192, 10240), (8192, 28672)]


# ------------------------------------------------------------------------------------------- the layout (CPU too)
def narrow_from_cuda(layout: dict) -> dict:
    """int4_layout.repack_cuda's layout -> the narrow one: qweight [N/16, K/64, 32, 4], scales / zeros
    [G, N/16, 8, 2]."""
    q = layout["qweight"]                                                     # [NB, K/16, 32, 4 w]
    nb, kb = q.shape[0], q.shape[1]
    if kb % 4:
        raise ValueError(f"narrow layout: K = {kb * 16} is not a multiple of 64")
    qn = q.view(nb, kb // 4, 4, 32, 4).permute(0, 4, 1, 3, 2).reshape(nb * 4, kb // 4, 32, 4)

    def sz(t):                                                                # [G, NB, 8 g8, 8 j] -> [G, NB*4, 8, 2]
        g = t.shape[0]
        return t.view(g, nb, 8, 4, 2).permute(0, 1, 3, 2, 4).reshape(g, nb * 4, 8, 2).contiguous()
    return {"qweight": qn.contiguous(), "scales": sz(layout["scales"]), "zeros": sz(layout["zeros"])}


def dequantize_narrow(nl: dict) -> "torch.Tensor":
    """W [N, K] fp32 from the narrow layout by its own definition (lane 4 g8 + t4, word kk of (tile t, chunk c) holds
    K step kk of row tile t in int4_layout's nibble order), for the CPU test."""
    import torch

    from sdquant.kernels.int4_layout import _CUDA_NIBBLES, _words_to_nibbles
    q = nl["qweight"]
    nt, nch = q.shape[0], q.shape[1]
    nib = _words_to_nibbles(q).view(nt, nch, 8, 4, 4, 8).long()               # [t, c, g8, t4, kk, p]
    w = torch.empty(nt * 16, nch * 64, dtype=torch.float32)
    t = torch.arange(nt).view(nt, 1, 1, 1, 1, 1)
    c = torch.arange(nch).view(1, nch, 1, 1, 1, 1)
    g8 = torch.arange(8).view(1, 1, 8, 1, 1, 1)
    t4 = torch.arange(4).view(1, 1, 1, 4, 1, 1)
    kk = torch.arange(4).view(1, 1, 1, 1, 4, 1)
    joff = torch.tensor([a for a, _ in _CUDA_NIBBLES]).view(1, 1, 1, 1, 1, 8)
    krow = torch.tensor([b for _, b in _CUDA_NIBBLES]).view(1, 1, 1, 1, 1, 8)
    rows = (16 * t + 8 * joff + g8).expand_as(nib)
    cols = (64 * c + 16 * kk + 2 * t4 + krow).expand_as(nib)
    w[rows.reshape(-1), cols.reshape(-1)] = nib.reshape(-1).float()
    g = nl["scales"].shape[0]
    gs = nch * 64 // g
    # scales / zeros [G, t, g8, h]: row 16 t + g8 + 8 h
    s = nl["scales"].float().permute(1, 3, 2, 0).reshape(nt * 16, g).repeat_interleave(gs, 1)
    z = nl["zeros"].float().permute(1, 3, 2, 0).reshape(nt * 16, g).repeat_interleave(gs, 1)
    return (w - z) * s


# ------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--variants", default=",".join(str(v) for v in VARIANTS))
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN,...")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.compile_only:
        return cuda_exp.compile_only(SRC / "w4a16_narrow.cu", out)
    t0 = time.time()
    ext, torch = cuda_exp.build("sdquant_narrow_exp", [SRC / "narrow_binding.cpp", SRC / "w4a16_narrow.cu"],
                                "narrow_tile")
    print(f"built in {time.time() - t0:.0f} s", flush=True)
    import gemm
    import provenance
    from sdquant.kernels import int4_layout
    dev, dt = torch.device("cuda"), torch.bfloat16
    variants = [int(v) for v in a.variants.split(",")]
    ms = [int(v) for v in a.ms.split(",")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    checks, rows = [], []

    def op(lay, x):
        return torch.ops.sdquant.w4a16_cuda(x, lay["qweight"], lay["scales"], lay["zeros"], None, lay["locks"], None)

    # 1. correctness: asymmetric / symmetric, groups 64 / 128 / per channel on one shape, then every timed shape
    cases = [(4096, 4096, gs, sym) for gs in (64, 128, -1) for sym in (False, True)]
    cases += [(k, n, 128, False) for k, n in shapes if (k, n) != (4096, 4096)]
    for (k, n, gs, sym) in cases:
        qw = gemm.random_int4(n, k, gs, sym, False, device=dev, seed=k + n + gs)
        lay = int4_layout.repack_cuda(qw, dt)
        nl = narrow_from_cuda(lay)
        wd = qw.dequantize(torch.float64)
        for m in ms + ([3] if k == 4096 and n == 4096 else []):
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = (x.double() @ wd.t()).float()
            yb = op(lay, x)
            for v in variants:
                y1 = ext.narrow(x, nl["qweight"], nl["scales"], nl["zeros"], v, 0)
                y2 = ext.narrow(x, nl["qweight"], nl["scales"], nl["zeros"], v, 2)
                c = {"K": k, "N": n, "gs": gs, "sym": sym, "M": m, "variant": v, "rel_ref": gemm.rel_err(y1, ref),
                     "rel_shipped_ref": gemm.rel_err(yb, ref), "rel_vs_shipped": gemm.rel_err(y1, yb.float()),
                     "deterministic": bool(torch.equal(y1, y2))}
                c["pass"] = c["rel_ref"] <= 5e-3 and c["rel_vs_shipped"] <= 5e-3 and c["deterministic"]
                checks.append(c)
                if not c["pass"]:
                    print("FAIL", json.dumps(c), flush=True)
        torch.cuda.synchronize()
    print(f"checks: {sum(c['pass'] for c in checks)}/{len(checks)} pass ({time.time() - t0:.0f} s)", flush=True)

    # 2. timing, symmetric g128 (the arithmetic is the same either way)
    for (k, n) in shapes:
        qw = gemm.random_int4(n, k, 128, True, False, device=dev, seed=k * 7 + n)
        lay = int4_layout.repack_cuda(qw, dt)
        copies = gemm.n_copies(n * k // 2)
        lays = [lay] + [{kk: (None if v is None else v.clone()) for kk, v in lay.items()} for _ in range(copies - 1)]
        nls = [narrow_from_cuda(L) for L in lays]
        w_ref = qw.dequantize(torch.float32).to(dt)
        wrs = [w_ref] + [w_ref.clone() for _ in range(gemm.n_copies(n * k * 2) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dt)
            r = {"K": k, "N": n, "M": m}
            r["bf16"] = round(gemm.time_rotating(lambda i: torch.nn.functional.linear(x, wrs[i]), len(wrs)), 2)
            r["shipped"] = round(gemm.time_rotating(lambda i: op(lays[i], x), len(lays)), 2)
            with cuda_exp.pdl_on():
                r["shipped_pdl"] = round(gemm.time_rotating(lambda i: op(lays[i], x), len(lays)), 2)
            for v in variants:
                def call(i, v=v):
                    L = nls[i]
                    return ext.narrow(x, L["qweight"], L["scales"], L["zeros"], v, 0)
                r[f"n{v}"] = round(gemm.time_rotating(call, len(nls)), 2)
            best = min(variants, key=lambda v: r[f"n{v}"])
            r["best"] = best

            def call_pdl(i):
                L = nls[i]
                return ext.narrow(x, L["qweight"], L["scales"], L["zeros"], best, 2)
            r["best_pdl"] = round(gemm.time_rotating(call_pdl, len(nls)), 2)
            r["shipped_2"] = round(gemm.time_rotating(lambda i: op(lays[i], x), len(lays)), 2)
            r["ratio"] = round(r[f"n{best}"] / min(r["shipped"], r["shipped_2"]), 3)
            r["ratio_pdl"] = round(r["best_pdl"] / r["shipped_pdl"], 3)
            rows.append(r)
            print(json.dumps(r), flush=True)
        del lays, nls, wrs
        torch.cuda.empty_cache()

    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("SDQUANT_COMMIT"),
            "src_digest": provenance.source_digest(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "dtype": "bfloat16", "variants": VARIANTS}
    tmp = out / "narrow_tile.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "checks": checks, "rows": rows}, indent=1))
    os.replace(tmp, out / "narrow_tile.json")
    vs = " | ".join(f"n{v}" for v in variants)
    print(f"\n| K×N | M | bf16 | shipped (2nd) | shipped PDL | {vs} | best | best PDL | best ÷ shipped | ÷, PDL |")
    print("|---|---|---|---|---|" + "---|" * len(variants) + "---|---|---|---|")
    for r in rows:
        vv = " | ".join(str(r[f"n{v}"]) for v in variants)
        print(f"| {r['K']}×{r['N']} | {r['M']} | {r['bf16']} | {r['shipped']} ({r['shipped_2']}) | "
              f"{r['shipped_pdl']} | "
              f"{vv} | n{r['best']} | {r['best_pdl']} | {r['ratio']} | {r['ratio_pdl']} |")
    print(f"checks: {sum(c['pass'] for c in checks)}/{len(checks)} pass; wall {time.time() - t0:.0f} s")
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
