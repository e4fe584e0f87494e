"""Issue 4's targets, read from one bench/gemm.py run: each target, the measured value, met or by how much missed.

    python bench/issue4_targets.py gemm.json [--markdown]

Every ratio compares numbers of the same run (same process, same GPU). The targets (issue 4, "Shown by"):
- INT4 at M = 1-16 (the CUDA op): 8192x28672 <= 37 us, 4096x28672 <= 18, 14336x4096 <= 10, 4096x4096 <= 7; read
  for the op as launched by default and, as a line of its own, for the op launched with programmatic dependent launch
  (sdq_cuda_pdl, the decode runtime's mode);
- INT4 at M = 32-64 >= 2x bf16 on the large shapes (N or K = 28672); at M = 128 >= 1.3x (the same shapes);
- the dispatched INT4 layer (sdq_int4_layer) >= 1.0x bf16 at every M;
- the Triton INT4 op >= 75% of the CUDA op's speed at M <= 16;
- FP8 at M >= 1024: the dispatched layer within 5% of torch._scaled_mm tensorwise and >= 1.6x bf16, read for the
  default layer (sdq_fp8_layer: dynamic per-token activations) and for the per-tensor recipe (sdq_fp8_tensor_layer:
  static activation scale), each as a target line of its own;
- FP8 on 14336x4096 at M <= 64: the layer >= 1.3x faster than rowwise torch._scaled_mm.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

LIMITS_US = {(8192, 28672): 37.0, (4096, 28672): 18.0, (14336, 4096): 10.0, (4096, 4096): 7.0}
LARGE = ((8192, 28672), (4096, 28672), (28672, 8192))


def _cells(rows):
    return {(r["K"], r["N"], r["M"], r["kernel"]): r["us"] for r in rows if r.get("us")}


def verdicts(rows) -> list:
    """[(target, where, measured, ok)], one per target and point that the run measured (points it lacks are
    skipped, so a partial run reports what it has)."""
    c = _cells(rows)
    pts = sorted({(k, n, m) for (k, n, m, _kn) in c})
    out = []
    for (k, n, m) in pts:
        bf = c.get((k, n, m, "bf16"))
        cu = c.get((k, n, m, "sdq_cuda"))
        if (k, n) in LIMITS_US and m <= 16 and cu:
            lim = LIMITS_US[(k, n)]
            out.append((f"INT4 M 1-16 <= {lim:g} us", f"{k}x{n} M={m}", f"{cu:.1f} us", cu <= lim))
        cp = c.get((k, n, m, "sdq_cuda_pdl"))
        if (k, n) in LIMITS_US and m <= 16 and cp:
            lim = LIMITS_US[(k, n)]
            out.append((f"INT4 M 1-16 <= {lim:g} us, PDL launch", f"{k}x{n} M={m}", f"{cp:.1f} us", cp <= lim))
        if (k, n) in LARGE and bf and cu and m in (32, 64, 128):
            want = 2.0 if m < 128 else 1.3
            out.append((f"INT4 M {'32-64' if m < 128 else '128'} >= {want:g}x bf16", f"{k}x{n} M={m}",
                        f"{bf / cu:.2f}x", bf / cu >= want))
        lay = c.get((k, n, m, "sdq_int4_layer"))
        if bf and lay:
            out.append(("INT4 layer >= 1.0x bf16", f"{k}x{n} M={m}", f"{bf / lay:.2f}x", bf / lay >= 1.0))
        tr = c.get((k, n, m, "sdq_triton"))
        if m <= 16 and tr and cu:
            out.append(("Triton >= 75% of CUDA", f"{k}x{n} M={m}", f"{cu / tr:.2f}", cu / tr >= 0.75))
        f8 = c.get((k, n, m, "sdq_fp8_layer"))
        tw = c.get((k, n, m, "fp8_tensorwise"))
        if m >= 1024 and f8 and tw:
            out.append(("FP8 layer within 5% of tensorwise", f"{k}x{n} M={m}", f"{f8 / tw:.3f}", f8 <= 1.05 * tw))
        if m >= 1024 and f8 and bf:
            out.append(("FP8 layer >= 1.6x bf16", f"{k}x{n} M={m}", f"{bf / f8:.2f}x", bf / f8 >= 1.6))
        ft = c.get((k, n, m, "sdq_fp8_tensor_layer"))
        if m >= 1024 and ft and tw:
            out.append(("FP8 per-tensor layer within 5% of tensorwise", f"{k}x{n} M={m}", f"{ft / tw:.3f}",
                        ft <= 1.05 * tw))
        if m >= 1024 and ft and bf:
            out.append(("FP8 per-tensor layer >= 1.6x bf16", f"{k}x{n} M={m}", f"{bf / ft:.2f}x", bf / ft >= 1.6))
        rw = c.get((k, n, m, "fp8_rowwise"))
        if (k, n) == (14336, 4096) and m <= 64 and f8 and rw:
            out.append(("FP8 14336x4096 M<=64 >= 1.3x rowwise", f"M={m}", f"{rw / f8:.2f}x", rw / f8 >= 1.3))
    return out


def summary(vs) -> list:
    """[(target, met, points, the worst point)] in first-seen order."""
    by: dict = {}
    for t, where, val, ok in vs:
        by.setdefault(t, []).append((where, val, ok))
    return [(t, sum(ok for _w, _v, ok in v), len(v), next(((w, x) for w, x, ok in v if not ok), None))
            for t, v in by.items()]


def gpu_line(rows) -> str:
    """The GPU's state over the run's timed points (rows' "gpu", bench/gpu_clocks.py), e.g. "SM clock 1980 MHz
    median (lowest 1755), power up to 690 W, clock-event reasons 0x4"; "" where the run logged none."""
    st = [r["gpu"] for r in rows if r.get("gpu")]
    if not st:
        return ""
    sm = sorted(g["sm_mhz"] for g in st)
    line = f"SM clock {sm[len(sm) // 2]} MHz median (lowest {min(g['sm_mhz_min'] for g in st)})"
    pw = [g["power_w_max"] for g in st if g.get("power_w_max") is not None]
    if pw:
        line += f", power up to {max(pw):g} W"
    reasons = 0
    for g in st:
        reasons |= int(g.get("reasons") or "0x0", 16)
    return line + f", clock-event reasons {hex(reasons)}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gemm_json")
    ap.add_argument("--markdown", action="store_true", help="every point as a Markdown table")
    a = ap.parse_args(argv)
    d = json.loads(Path(a.gemm_json).read_text())
    vs = verdicts(d["rows"])
    meta = d.get("meta", {})
    print(f"{meta.get('device')} {meta.get('date')} commit {meta.get('commit')}")
    line = gpu_line(d["rows"])
    if line:
        print(line)
    if a.markdown:
        print("| target | point | measured | met |\n|---|---|---|---|")
        for t, where, val, ok in vs:
            print(f"| {t} | {where} | {val} | {'yes' if ok else '**no**'} |")
    for t, met, n, first_miss in summary(vs):
        miss = "" if first_miss is None else f"; first miss {first_miss[0]}: {first_miss[1]}"
        print(f"{t}: {met}/{n} points{miss}")


if __name__ == "__main__":
    main()
