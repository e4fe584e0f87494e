"""Where a warp-specialized wgmma launch spends its time, CTA by CTA (variant 63's TMA kernel, w4a16_wgmma.cuh).

The CUDA extension is built a second time with -DSDQ_WS_TRACE=1 (bench/ab_build.py's build, its own module). In that
build every CTA of the warp-specialized kernel writes clock64 / globaltimer stamps at its phase boundaries into a
buffer set with ``set_ws_trace`` (32 u64 a CTA, slots listed in w4a16_wgmma.cuh above ``ws_trace``). For each point
(K x N x M, optional forced splits) this script
1. times the default build's op beside cuBLAS bf16 (bench/gemm.py's method: weights rotated past 3x the L2, CUDA
   graph, median) and the traced build's op the same way, trace off, so the cost of the instrumentation is visible;
2. runs the traced op once more after an L2 flush with the trace on (or, with --warm N, traces the last of N
   back-to-back calls over the rotating weights: the steady state the timing sees, activations in L2 and each launch
   overlapping the previous one's tail), checks its output is bit-identical to the default build's, and prints
   per-phase medians / 90th percentiles over the CTAs in microseconds:
   start skew (globaltimer at entry after the first CTA's), init (barrier setup), first (until the first stage is
   in shared memory), loop (the main loop after it; "waiting" = the part spent on full barriers, "late" = the part of
   that from the ring's third pass on, past the prologue's requests; "late1" the same for the second consumer
   warpgroup), age (a late stage's mean time from the producer's request to the end of consumer 0's wait for it),
   age_w (the same over the late stages it did wait for: how long those copies took to land), pwait (the producer's
   time waiting for free slots), sync (the first
   cluster barrier: waiting for the slowest split; at one split the whole epilogue), sum (the cluster sum and the stores), cta (entry to end), and the
   launch's span (first entry to last end).

    python bench/ws_trace.py --points 4096x4096x128,4096x6144x128,14336x4096x128 --out $OUT
    python bench/ws_trace.py --points 4096x4096x128:4,4096x4096x256 --nocl --out $OUT   # 4 forced splits; no cluster
    python bench/ws_trace.py --points 8192x28672x1024 --warm 20 --out $OUT   # the steady state
    python bench/ws_trace.py --points 8192x28672x128 --warm 20 --defines=-DNAME=VALUE --out $OUT   # an experiment
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm  # noqa: E402

SLOTS = 32
PHASES = ("skew", "init", "first", "loop", "waiting", "late", "late1", "age", "age_w", "pwait", "sync", "sum", "cta")


def log(*a):
    print(*a, flush=True)


def parse_points(spec: str) -> list:
    """"KxNxM[:splits],..." -> [(k, n, m, splits)]; splits 0 = the launcher's choice."""
    out = []
    for item in spec.split(","):
        shape, _, sp = item.partition(":")
        k, n, m = (int(v) for v in shape.split("x"))
        out.append((k, n, m, int(sp or 0)))
    return out


def _pct(vals: list, q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def analyse(trace, n_ctas: int) -> dict:
    """Per-phase statistics (µs) of one traced launch. ``trace``: the 32-u64-a-CTA rows (any int sequence of
    sequences, one per CTA of the grid, in launch order; rows of 16, as builds before slot 16 wrote, give "late" 0).
    Rows with no entry stamp are CTAs that did not run the
    warp-specialized kernel (an error: reported as ``missing``). Clock cycles are turned into µs with the SM clock
    each CTA measured against the globaltimer over its own life."""
    rows = [list(map(int, r)) for r in trace[:n_ctas]]
    ran = [r for r in rows if r[0] and r[1] and r[6] and r[7] > r[0]]
    if not ran:
        return {"missing": n_ctas}
    mhz = statistics.median((r[6] - r[1]) * 1e3 / (r[7] - r[0]) for r in ran)  # cycles per µs
    g0 = min(r[0] for r in ran)
    per = {name: [] for name in PHASES}
    for r in ran:
        per["skew"].append((r[0] - g0) / 1e3)
        per["init"].append((r[2] - r[1]) / mhz)
        per["first"].append((r[3] - r[2]) / mhz)
        per["loop"].append((r[4] - r[3]) / mhz)
        per["waiting"].append(r[12] / mhz)
        per["late"].append((r[16] if len(r) > 16 else 0) / mhz)
        x = r + [0] * (SLOTS - len(r))  # (rows of older builds: the later slots read 0)
        per["late1"].append(x[22] / mhz)
        per["age"].append(x[17] / max(x[18], 1) / mhz)
        per["age_w"].append(x[19] / max(x[20], 1) / mhz)
        per["pwait"].append(x[21] / mhz)
        per["sync"].append((r[5] - r[4]) / mhz)
        per["sum"].append((r[6] - r[5]) / mhz)
        per["cta"].append((r[6] - r[1]) / mhz)
    stages = sorted({r[11] for r in ran})
    out = {"ctas": len(ran), "missing": n_ctas - len(ran), "sm_mhz": round(mhz, 1),
           "sms": len({r[8] for r in ran}), "stages": stages,
           "span_us": round((max(r[7] for r in ran) - g0) / 1e3, 2)}
    for name, vals in per.items():
        out[name] = {"med": round(statistics.median(vals), 2), "p90": round(_pct(vals, 0.9), 2),
                     "max": round(max(vals), 2)}
    return out


def line(p: dict) -> str:
    """One table row: median (p90) of each phase."""
    cells = [f"{p[ph]['med']:.2f} ({p[ph]['p90']:.2f})" for ph in PHASES]
    return " | ".join(cells)


def run_point(ext_t, k: int, n: int, m: int, splits: int, dev, warm: int = 0) -> dict:
    from sdquant.kernels import int4_cuda, int4_layout
    dtype = torch.bfloat16
    qw = gemm.random_int4(n, k, device=dev, seed=k + n)
    ncopy = gemm.n_copies(n * k // 2 + n * (k // gemm.GS) * 4)
    lays = [int4_layout.repack_cuda(qw, dtype) for _ in range(ncopy)]
    dense = [qw.dequantize(dtype) for _ in range(gemm.n_copies(n * k * 2))]
    x = torch.randn(m, k, device=dev, dtype=dtype)
    cfg = 63  # the config of the op (variant 63, automatic split-K)
    v, t = int4_cuda.split_config(cfg)

    def default(i):
        la = lays[i]
        return torch.ops.sdquant.w4a16_cuda(x, la["qweight"], la["scales"], la["zeros"], la["perm"], la["locks"], None,
                                            splits, False, cfg)

    def traced(i):
        la = lays[i]
        return ext_t.w4a16(x, la["qweight"], la["scales"], la["zeros"], la["locks"], splits, False, v, t, 0, 0)

    row = {"K": k, "N": n, "M": m, "splits_forced": splits, "warm": warm,
           "path": int4_cuda.wgmma_path(m, n, k, gemm.GS, cfg, dtype, splits),
           "splits": splits or int4_cuda.auto_splits(m, n, k, gemm.GS, cfg, dtype)}
    row["bf16_us"] = round(gemm.time_rotating(lambda i: torch.nn.functional.linear(x, dense[i % len(dense)]),
                                              len(dense)), 2)
    row["op_us"] = round(gemm.time_rotating(default, ncopy), 2)
    ext_t.set_ws_trace(0)
    row["traced_build_us"] = round(gemm.time_rotating(traced, ncopy), 2)
    ctas = ((m + 127) // 128) * (n // 256) * max(1, row["splits"])
    buf = torch.zeros(ctas * SLOTS + SLOTS, dtype=torch.int64, device=dev)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    last = (warm - 1) % ncopy if warm > 0 else 0
    y_ref = default(last)
    flush.fill_(1)
    torch.cuda.synchronize()
    built = ext_t.set_ws_trace(buf.data_ptr())
    for i in range(warm - 1):  # back to back, no sync: each launch overwrites the trace, the last one's stays
        traced(i % ncopy)
    y = traced(last)
    torch.cuda.synchronize()
    ext_t.set_ws_trace(0)
    row["identical"] = bool(torch.equal(y, y_ref))
    if not built:
        raise SystemExit("the traced build does not write the trace (SDQ_WS_TRACE not set in it)")
    trace = buf[: ctas * SLOTS].view(ctas, SLOTS).cpu().tolist()
    row["trace"] = analyse(trace, ctas)
    row["raw"] = trace
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="4096x4096x128,4096x6144x128,14336x4096x128,8192x28672x128")
    ap.add_argument("--nocl", action="store_true", help="the split-K sum by a second kernel, not in a cluster")
    ap.add_argument("--warm", type=int, default=0, help="trace the last of this many back-to-back calls (0: one call "
                                                         "after an L2 flush)")
    ap.add_argument("--defines", default="", help="comma-separated extra nvcc defines for the traced build (trace an "
                                                   "experiment's build)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    import ab_build
    from sdquant.kernels import int4_cuda
    dev = torch.device("cuda")
    t0 = time.time()
    extra = [d for d in args.defines.split(",") if d]
    ext_t = ab_build.build("sdq_ws_trace" + "".join("_" + re.sub(r"\W", "_", d) for d in extra),
                           Path(int4_cuda.__file__).parent / "csrc", ["-DSDQ_WS_TRACE=1", *extra])
    if int4_cuda.extension() is None:
        raise SystemExit("the default CUDA extension did not build")
    if args.nocl:
        int4_cuda.set_wgmma_cluster(False)
        ext_t.set_wg_cluster(0)
    rows = []
    for (k, n, m, sp) in parse_points(args.points):
        row = run_point(ext_t, k, n, m, sp, dev, args.warm)
        rows.append(row)
        tr = row["trace"]
        log(f"{k}x{n} M={m} path {row['path']} splits {row['splits']}: bf16 {row['bf16_us']} op {row['op_us']} "
            f"traced build {row['traced_build_us']} us; identical {row['identical']}; {json.dumps(tr)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("SDQUANT_COMMIT"),
            "defines": extra,
            "device": torch.cuda.get_device_name(0), "nocl": args.nocl, "wall_s": round(time.time() - t0, 1)}
    tmp = out / "ws_trace.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}))
    os.replace(tmp, out / "ws_trace.json")
    log(f"\n{meta['device']}; µs, median (90th percentile) over the CTAs")
    log("| K×N | M | path | splits | stages | bf16 | op | traced | span | " + " | ".join(PHASES) + " |")
    log("|" + "---|" * (9 + len(PHASES)))
    for r in rows:
        tr = r["trace"]
        if "cta" not in tr:
            log(f"| {r['K']}×{r['N']} | {r['M']} | {r['path']} | {r['splits']} | – | {r['bf16_us']} | {r['op_us']} | "
                f"{r['traced_build_us']} | no trace ({tr.get('missing')} CTAs) |")
            continue
        log(f"| {r['K']}×{r['N']} | {r['M']} | {r['path']} | {r['splits']} | {tr['stages']} | {r['bf16_us']} | "
            f"{r['op_us']} | {r['traced_build_us']} | {tr['span_us']} | {line(tr)} |")


if __name__ == "__main__":
    main()
