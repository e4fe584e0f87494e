"""Triton mid-M W4A16 GEMM (sdquant.kernels.int4_triton_midm) on one GPU, in ONE device call: check every config,
time it against cuBLAS bf16, the old Triton kernels, dequantize+cuBLAS and torch's tinygemm in the same process,
and propose int4_triton.MID_M_PLAN / MID_SHAPE_PLAN.

    SDQUANT_COMMIT=<hash> python bench/triton_mid_m.py --out $OUT [--budget-s 200]
    python bench/triton_mid_m.py --dry          # CPU: Triton's interpreter, tiny shapes

1. Correctness on the GPU of every mid-M config and of the dispatched op (``w4a16_triton_impl`` with no forced
   path) against x @ W.T in float64, W = QuantizedWeight.dequantize(): symmetric/asymmetric, groups
   32/64/128/per-channel, act-order, fp16/bf16, M = 17..300, automatic and forced split-K;
   ||y - ref|| / ||ref|| <= 1e-2 (bf16) / 2e-3 (fp16); output memory poisoned with NaN first; every call twice and
   bit-identical. The default configs get every case, the others a subset. A config that fails is not timed.
2. Timing, K x N in SHAPES x M in MS (bf16 activations, random codes, symmetric, group 128): weights copied until
   the copies exceed 3x the 60 MB L2, calls rotate through them, back-to-back calls captured in one CUDA graph,
   median of 5 replays, CUDA events (bench/gemm.py's time_rotating). Kernels: "bf16" cuBLAS F.linear; "old" the
   Triton path before the mid-M kernel (``_splitk_kernel`` at M <= 32, ``_gemm_kernel`` above; "old_gemm" also
   at M <= 32); "small" the small-M plan at M = 16; "dequant" = sdquant::w4a16_dequant_triton (the Triton layout
   dequantized by a Triton kernel, then cuBLAS: what a layer holding that layout runs at large M); "tinygemm" =
   torch._weight_int4pack_mm (M <= 256); the mid-M configs of CONFIGS; "dispatch" the op as routed now. Every
   timed config's first call is checked against the float64 reference (<= 1e-2).
3. A table (us, x bf16) and the proposed plan (per M bucket the config with the best geometric-mean time, kept
   only where it beats the old kernels; per shape the point's winner where it beats the bucket's choice by > 3%);
   $OUT/triton_mid_m.json (saved after every shape) and $OUT/triton_mid_m.log.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# shared with the small-M sweep, including its logger: the shared helpers log there, so this script's log file holds
# their lines too
from triton_small_m import LOG, bucket, check_layout_configs, elapsed, log, shape_setup, time_calls, time_cpu  # noqa: E402

SHAPES = [(8192, 28672), (14336, 4096), (4096, 28672), (4096, 4096), (8192, 10240), (28672, 8192), (4096, 6144)]
MS = [16, 32, 64, 128, 256, 512, 1024]
GS = 128

# int4_triton_midm.run configs (BLOCK_M is clipped to what M needs; duplicates after clipping are timed once)
CONFIGS = {
    "m32": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    "n64m32": {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 6},
    "m32s": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SCALE_ACC": True},
    "m64": {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    "m64k64": {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    "m64w8": {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4},
    "m64sw8": {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "SCALE_ACC": True},
    "m128": {"BLOCK_N": 128, "BLOCK_M": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    "m128k64": {"BLOCK_N": 128, "BLOCK_M": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
    "m256": {"BLOCK_N": 128, "BLOCK_M": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    "n256m32": {"BLOCK_N": 256, "BLOCK_M": 32, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    "n64m64": {"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    "n256m64": {"BLOCK_N": 256, "BLOCK_M": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    "n256m128": {"BLOCK_N": 256, "BLOCK_M": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    "m256k128": {"BLOCK_N": 128, "BLOCK_M": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 2},
    "m32x2": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0},
    "m64k64x2": {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "waves": 2.0},
    # run 2: fewer, longer K steps; a register cap for more programs per SM; shallower pipelines
    "m32k256w8": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 256, "num_warps": 8, "num_stages": 3},
    "m32r128": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "maxnreg": 128},
    "m32s3": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    "m32w8": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4},
    # after ncu_triton (2026-12-01): m32w8 ran 224 programs on 8192x28672 (no split-K; 21% occupancy achieved)
    "m32w8x2": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "waves": 2.0},
    "m32w8x4": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "waves": 4.0},
    "n64m32x2": {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0},
    "n64m32x4": {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 4.0},
    # SCALE_ACC (exact BIAS + code into the MMA, the scale once a tile on the fp32 product) with split-K
    "m32w8x4s": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "waves": 4.0,
                 "SCALE_ACC": True},
    "n64m32x2s": {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0,
                  "SCALE_ACC": True},
    "n64m32x4s": {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 4.0,
                  "SCALE_ACC": True},
    "m32x4s": {"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 4.0,
               "SCALE_ACC": True},
    "m64k256w8": {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 256, "num_warps": 8, "num_stages": 3},
    "m64r168": {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "maxnreg": 168},
    "m128s4": {"BLOCK_N": 128, "BLOCK_M": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    "m256s4": {"BLOCK_N": 128, "BLOCK_M": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
}
# the M range each config is timed at (BLOCK_M far below or above M only wastes the run's time)
CONFIG_MS = {"m32": (1, 64), "n64m32": (17, 64), "m32s": (17, 64), "m64": (17, 256), "m64k64": (17, 256),
             "m64w8": (33, 256), "m64sw8": (33, 128), "m128": (64, 1024), "m128k64": (64, 1024),
             "m256": (128, 1024), "n256m32": (17, 64), "n64m64": (33, 256), "n256m64": (33, 256),
             "n256m128": (128, 1024),
             "m256k128": (256, 1024), "m32x2": (1, 64), "m64k64x2": (33, 128),
             "m32k256w8": (16, 64), "m32r128": (16, 64), "m32s3": (16, 64), "m32w8": (1, 64),
             "m64k256w8": (33, 128), "m64r168": (33, 128), "m128s4": (64, 1024), "m256s4": (128, 1024)}
FULL_CHECK = {"m64", "m32s"}
# (K, N, group, symmetric, act_order, dtype name, Ms, forced splits)
# the last case (what is timed: bf16, group 128) is checked last, after the compile children had time to build it
CHECK_CASES = [
    (2048, 1024, 128, False, False, "float16", (33, 100), (0,)),
    (1536, 512, 32, False, True, "bfloat16", (24, 77), (0, 3)),
    (1536, 512, 64, True, True, "float16", (64,), (0,)),
    (2048, 1024, -1, False, False, "bfloat16", (40, 300), (0,)),
    (8192, 1024, 128, True, False, "float16", (129,), (0, 4)),
    (4096, 4096, 128, True, False, "bfloat16", (17, 64, 200), (0, 2)),
]
SUBSET = (5,)   # cases the non-default configs are checked on
BASELINES = ("bf16", "old", "old_gemm", "small", "dequant", "tinygemm")


# ------------------------------------------------------------------------------------------------ checks
def check_configs(dev, configs: dict, dry: bool) -> tuple:
    """Every config (and "dispatch", the op as routed) against the float64 reference; (passing, rows, summary)."""
    from sdquant.kernels import int4_triton
    from sdquant.kernels import int4_triton_midm as MM
    cases = CHECK_CASES if not dry else [(256, 128, 64, False, True, "bfloat16", (17, 40), (0, 2)),
                                         (256, 64, -1, True, False, "float16", (33,), (0,))]

    def run(x, lay, g, cfg, sp):
        if cfg is None:
            return int4_triton.w4a16_triton_impl(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], None)
        return MM.run(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], g, {**cfg, "SPLIT_K": sp})

    def skip(name, cfg, m, ci):
        return not dry and name not in FULL_CHECK and name != "dispatch" and ci not in SUBSET

    def guard(ci):
        if elapsed() > 120 and not dry and ci not in SUBSET:
            log(f"  check time guard: case {ci} skipped ({elapsed():.0f} s)")
            return True
        return False

    return check_layout_configs(dev, {"dispatch": None, **configs}, cases, run, skip, log, guard)


# ------------------------------------------------------------------------------------------------ timing
def sweep(dev, shapes, ms, configs: dict, copy_bw: float, budget_s: float, dry: bool, dispatch_ok: bool,
          on_shape=None) -> list:
    import torch

    import gemm
    from sdquant.kernels import int4_triton
    from sdquant.kernels import int4_triton_midm as MM
    from sdquant.kernels import layout_dequant  # noqa: F401  (registers sdquant::w4a16_dequant_triton)
    dtype = torch.bfloat16
    timer = (lambda call, n: time_cpu(call, n)) if dry else \
        (lambda call, n: gemm.time_rotating(call, n, trials=5, target_ms=2.0, max_calls=60))
    sms = 132 if dry else torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for (k, n) in shapes:
        if elapsed() > budget_s:
            log(f"time guard: stop before {k}x{n} at {elapsed():.0f} s")
            break
        t_shape = time.time()
        qw, w_ref, int4_bytes, tlays, wcopies, n_int4 = shape_setup(k, n, dev, dtype, dry)
        tiny = []
        if not dry:
            try:
                tw, tsz = gemm.tinygemm_pack(qw, dtype)
                tiny = [(tw, tsz)] + [(tw.clone(), tsz.clone()) for _ in range(n_int4 - 1)]
            except Exception as ex:  # noqa: BLE001
                log(f"  tinygemm pack failed: {type(ex).__name__}: {str(ex)[:200]}")
        for m in ms:
            if elapsed() > budget_s:
                log(f"time guard: stop at {k}x{n} M={m} ({elapsed():.0f} s)")
                break
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = (x.double() @ w_ref.double().t()).float()

            def lay_call(fn):
                return lambda i: fn(tlays[i % len(tlays)])
            calls = {"bf16": (lambda i: torch.nn.functional.linear(x, wcopies[i % len(wcopies)]), len(wcopies),
                              n * k * 2)}
            old_path = "splitk" if m <= 32 else "gemm"
            calls["old"] = (lay_call(lambda c: int4_triton.w4a16_triton_impl(
                x, c["qweight"], c["scales"], c["zs"], None, None, force_path=old_path)), len(tlays), int4_bytes)
            if m <= 32:
                calls["old_gemm"] = (lay_call(lambda c: int4_triton.w4a16_triton_impl(
                    x, c["qweight"], c["scales"], c["zs"], None, None, force_path="gemm")), len(tlays), int4_bytes)
            if m <= 16:
                calls["small"] = (lay_call(lambda c: int4_triton.w4a16_triton_impl(
                    x, c["qweight"], c["scales"], c["zs"], None, None, force_path="small")), len(tlays), int4_bytes)
            calls["dequant"] = (lay_call(lambda c: torch.ops.sdquant.w4a16_dequant_triton(
                x, c["qweight"], c["scales"], c["zs"], None, None)), len(tlays), int4_bytes)
            if tiny and m <= 256:
                calls["tinygemm"] = (lambda i: torch._weight_int4pack_mm(x, tiny[i % len(tiny)][0], GS,
                                                                        tiny[i % len(tiny)][1]), len(tiny), int4_bytes)
            seen, alias = {}, {}
            for name, cfg in configs.items():
                lo, hi = CONFIG_MS.get(name, (0, 1 << 30))
                if not lo <= m <= hi:
                    continue
                r = MM.resolve({**MM.default_config(m), **cfg}, m, n, k, GS, sms)
                key = json.dumps(r, sort_keys=True)
                if key in seen:
                    alias[name] = seen[key]
                    continue
                seen[key] = name
                calls[name] = (lay_call(lambda c, cfg=cfg: MM.run(x, c["qweight"], c["scales"], c["zs"], None, GS,
                                                                 cfg)), len(tlays), int4_bytes)
            if dispatch_ok:
                calls["dispatch"] = (lay_call(lambda c: int4_triton.w4a16_triton_impl(
                    x, c["qweight"], c["scales"], c["zs"], None, None)), len(tlays), int4_bytes)
            res = time_calls(calls, ref, k, n, m, timer, copy_bw, rows,
                             lambda name: MM.resolve({**MM.default_config(m), **configs[name]}, m, n, k, GS,
                                                     sms)["SPLIT_K"] if name in configs else None)
            for name, same in alias.items():   # the same launch as an earlier config: its time, marked
                if same in res:
                    res[name] = res[same]
                    rows.append({**next(r for r in reversed(rows) if r["kernel"] == same), "kernel": name,
                                 "alias_of": same})
            new = {kk: v for kk, v in res.items() if kk in configs}
            best = min(new, key=new.get) if new else None
            f = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
            log(f"  {k}x{n} M={m}: bf16 {f(res.get('bf16'))} old {f(res.get('old'))} dequant "
                f"{f(res.get('dequant'))} tinygemm {f(res.get('tinygemm'))} dispatch {f(res.get('dispatch'))} "
                f"best new {best} {f(new.get(best))} us  [{elapsed():.0f} s]  " +
                " ".join(f"{kk}={v:.1f}" for kk, v in sorted(new.items(), key=lambda t: t[1])))
        log(f"shape {k}x{n} done in {time.time() - t_shape:.1f} s")
        del tlays, wcopies, tiny, w_ref
        if not dry:
            torch.cuda.empty_cache()
        if on_shape is not None:
            on_shape(rows)
    return rows


# ------------------------------------------------------------------------------------------------ choose
def _points(rows) -> dict:
    pts = {}
    for r in rows:
        pts.setdefault((r["K"], r["N"], r["M"]), {})[r["kernel"]] = r["us"]
    return pts


def _old_best(d: dict):
    olds = [d[kk] for kk in ("old", "old_gemm", "small") if kk in d]
    return min(olds) if olds else None


def choose(rows, configs: dict, tol: float = 0.03) -> dict:
    """Per M bucket (M > 2): the config with the best geometric-mean time (a config missing at a point, as a
    duplicate after BLOCK_M clipping, counts with the time of its duplicate there... so only configs timed at
    every point of the bucket compete); kept only where it beats the old kernels at most points (else None).
    Per (K, N, bucket): the point's fastest config where it beats the bucket's choice by more than tol, or None
    where the old kernels beat every config."""
    by_b = {}
    for (k, n, m), d in _points(rows).items():
        if m > 2:   # M <= 2 belongs to the GEMV of the small-M plan; from M = 3 the mid-M kernel competes
            by_b.setdefault(bucket(m), []).append(((k, n, m), d))
    plan, shape_plan, scores = {}, {}, {}
    for b, items in sorted(by_b.items()):
        common = set.intersection(*[set(kk for kk in d if kk in configs) for _, d in items])
        sc = {c: math.exp(statistics.fmean(math.log(d[c] / min(d[kk] for kk in common)) for _, d in items))
              for c in common}
        scores[b] = {c: round(v, 4) for c, v in sorted(sc.items(), key=lambda t: t[1])}
        if not sc:
            plan[b] = None
            continue
        best = min(sc, key=lambda c: (sc[c], list(configs).index(c)))   # ties (the same launch): first listed
        wins = sum(1 for _, d in items if _old_best(d) is None or d[best] < _old_best(d))
        plan[b] = best if wins * 2 > len(items) else None
        for (k, n, m), d in items:
            cand = {c: d[c] for c in d if c in configs}
            if not cand:
                continue
            w = min(cand, key=cand.get)
            old = _old_best(d)
            base = d.get(plan[b]) if plan[b] else old
            if old is not None and cand[w] >= old:
                if plan[b] is not None:
                    shape_plan[(k, n, b)] = None
            elif base is not None and w != plan[b] and cand[w] * (1 + tol) < base:
                shape_plan[(k, n, b)] = w
    return {"MID_M_PLAN": plan, "MID_SHAPE_PLAN": shape_plan, "scores": scores}


def table(rows, chosen) -> str:
    pts = _points(rows)
    out = ["| K×N | M | bf16 | old Triton | dequant+cuBLAS | tinygemm | **mid-M (plan)** | best config | dispatch | "
           "×bf16 (plan) | ×old | TFLOP/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {s: i for i, s in enumerate(SHAPES)}
    f = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
    for (k, n, m) in sorted(pts, key=lambda t: (order.get((t[0], t[1]), 99), t[2])):
        d = pts[(k, n, m)]
        b = bucket(m)
        name = chosen["MID_SHAPE_PLAN"].get((k, n, b), chosen["MID_M_PLAN"].get(b)) if m > 2 else None
        t = d.get(name) if name else None
        news = {kk: v for kk, v in d.items() if kk in CONFIGS}
        best = min(news, key=news.get) if news else None
        bf, old = d.get("bf16"), _old_best(d)
        eff = t if t is not None else old
        xbf = "–" if not (bf and eff) else f"{bf / eff:.2f}"
        xold = "–" if not (old and eff) else f"{old / eff:.2f}"
        tf = "–" if not eff else f"{2 * m * n * k / (eff * 1e-6) / 1e12:.0f}"
        out.append(f"| {k}×{n} | {m} | {f(bf)} | {f(old)} | {f(d.get('dequant'))} | {f(d.get('tinygemm'))} | "
                   f"**{f(t)}** ({name or 'old'}) | {f(news.get(best))} ({best}) | {f(d.get('dispatch'))} | {xbf} | "
                   f"{xold} | {tf} |")
    return "\n".join(out)


def precompile(names) -> None:
    """Child process: compile the timed variants (bf16, group 128, no act-order, with and without split-K) of the
    given configs into Triton's on-disk cache, at every BLOCK_M the sweep clips them to, so the parent's sweep
    finds them compiled (the parent runs its checks meanwhile)."""
    import torch

    import gemm
    from sdquant.kernels import int4_layout
    from sdquant.kernels import int4_triton_midm as MM
    k, n = 1024, 512
    lay = int4_layout.repack_triton(gemm.random_int4(n, k, GS, device="cuda", seed=1), torch.bfloat16)
    for name in names:
        lo, hi = CONFIG_MS[name]
        for bm in sorted({MM.resolve({**MM.default_config(m), **CONFIGS[name]}, m, n, k, GS, 132)["BLOCK_M"]
                          for m in MS if lo <= m <= hi}):
            x = torch.randn(bm, k, device="cuda", dtype=torch.bfloat16)
            for split in (1, 2):
                try:
                    MM.run(x, lay["qweight"], lay["scales"], lay["zs"], None, GS, {**CONFIGS[name], "SPLIT_K": split})
                except Exception as ex:  # noqa: BLE001 - the parent compiles (and reports) it again
                    print(f"precompile {name} BM={bm} split={split}: {type(ex).__name__}: {str(ex)[:200]}")
    torch.cuda.synchronize()


def start_precompile(configs: dict, procs: int = 8) -> list:
    import subprocess
    names = [c for c in configs if c in CONFIG_MS]
    chunks = [names[i::procs] for i in range(procs) if names[i::procs]]
    return [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--precompile", ",".join(c)],
                             cwd=str(ROOT)) for c in chunks]


def routed_name(k: int, n: int, m: int) -> str:
    """The sweep's name for what ``w4a16_triton_impl`` runs now at this point: "small", "old" or a CONFIGS name."""
    from sdquant.kernels import int4_triton
    cfg = int4_triton.mid_m_plan(m, n, k)
    if cfg is None:
        return "small" if m <= 16 and int4_triton.small_m_plan(m, n, k) is not None else "old"
    names = [c for c, v in CONFIGS.items() if v == cfg]
    if not names:
        raise ValueError(f"the mid-M plan at K={k} N={n} M={m} is no CONFIGS entry: {cfg}")
    return names[0]


def update_table(results: Path, table_path: Path) -> list:
    """Write the times measured in a run for what the op routes to now (``routed_name``: the plan's config, or
    the old / small-M kernels) into the "triton" column of the int4 entries of a crossover table, at the buckets
    equal to a measured M; returns the changes made."""
    from sdquant.kernels import dispatch
    res = json.loads(results.read_text())
    table = json.loads(table_path.read_text())
    pts = _points(res["rows"])
    changes = []
    for e in table["entries"]:
        if e["kind"] != "int4":
            continue
        for i, b in enumerate(table["buckets"]):
            d = pts.get((e["K"], e["N"], b))
            name = routed_name(e["K"], e["N"], b)
            if d is None or d.get(name) is None:
                continue
            changes.append((e["K"], e["N"], b, e["us"]["triton"][i], d[name], name))
            e["us"]["triton"][i] = d[name]
    table["meta"]["int4_triton_mid_m"] = {"source": str(results.name), "commit": res["meta"]["commit"],
                                          "date": res["meta"]["date"], "column": "triton",
                                          "buckets": sorted({c[2] for c in changes}),
                                          "how": "time of the kernel/config the op routes to now, same run"}
    dispatch.write_table(table, table_path)
    return changes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU only: Triton's interpreter, tiny shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop timing this many seconds after start")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="mid-M configs to check and time")
    ap.add_argument("--update-table", metavar="RESULTS_JSON", help="no run: write that run's dispatch times into "
                    "the int4 'triton' columns of --table, then exit")
    ap.add_argument("--table", default=str(ROOT / "sdquant" / "kernels" / "crossover_h200.json"))
    ap.add_argument("--precompile", help=argparse.SUPPRESS)
    ap.add_argument("--no-precompile", action="store_true", help="compile in the main process only")
    a = ap.parse_args(argv)
    if a.precompile:
        precompile(a.precompile.split(","))
        return
    if a.update_table:
        for k, n, b, old, new, name in update_table(Path(a.update_table), Path(a.table)):
            print(f"int4 {k}x{n} M<={b}: triton {old if old is None else round(old, 1)} -> {new:.1f} us ({name})")
        return
    if a.dry:
        os.environ["TRITON_INTERPRET"] = "1"       # before triton is imported (the library's @jit helpers)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import triton

    import gemm
    from sdquant.kernels import int4_triton
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.ms.split(",")]
    configs = {kk: CONFIGS[kk] for kk in a.configs.split(",") if kk}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "triton": triton.__version__, "commit": os.environ.get("SDQUANT_COMMIT", "unknown"), "dtype": "bfloat16",
            "group_size": GS, "configs": configs, "dry": a.dry, "python": sys.version.split()[0],
            "plan_at_run": {"MID_M_PLAN": {str(b): c for b, c in int4_triton.MID_M_PLAN.items()},
                            "MID_SHAPE_PLAN": {f"{k}x{n}:M{b}": c for (k, n, b), c in
                                               int4_triton.MID_SHAPE_PLAN.items()}}}
    if a.dry:
        dev, copy_bw = torch.device("cpu"), 4.3
        shapes, ms = [(256, 128), (512, 64)], [16, 17, 64]
        meta["device"] = "cpu (dry run, Triton interpreter)"
        configs = {kk: configs[kk] for kk in ("m32", "m64", "m128") if kk in configs}
    else:
        dev = torch.device("cuda")
        meta["device"] = torch.cuda.get_device_name()
        meta["sms"] = torch.cuda.get_device_properties(dev).multi_processor_count
        copy_bw = gemm.copy_bandwidth(dev)
    meta["copy_TBps"] = copy_bw
    kids = [] if (a.dry or a.no_precompile) else start_precompile(configs)
    log(f"device {meta['device']} torch {torch.__version__} triton {triton.__version__} commit {meta['commit']} "
        f"copy {copy_bw:.2f} TB/s [{elapsed():.0f} s]")
    passing, crows, csum = check_configs(dev, configs, a.dry)
    log(f"passing: {passing} [{elapsed():.0f} s]")
    timed = {kk: v for kk, v in configs.items() if kk in passing}
    for p in kids:   # the compile children: give them a little longer, then go on regardless
        try:
            p.wait(timeout=max(1.0, 60 - elapsed()))
        except Exception:  # noqa: BLE001
            pass
    log(f"compile children: {[p.poll() for p in kids]} [{elapsed():.0f} s]")

    def save(rows, chosen=None):
        tmp = out / "triton_mid_m.json.tmp"
        ch = None
        if chosen is not None:
            ch = {"MID_M_PLAN": {str(b): c for b, c in chosen["MID_M_PLAN"].items()}, "scores": chosen["scores"],
                  "MID_SHAPE_PLAN": {f"{k}x{n}:M{b}": c for (k, n, b), c in chosen["MID_SHAPE_PLAN"].items()}}
        tmp.write_text(json.dumps({"meta": meta, "check": crows, "check_summary": csum, "rows": rows,
                                   "chosen": ch}, indent=1, default=str))
        os.replace(tmp, out / "triton_mid_m.json")
        (out / "triton_mid_m.log").write_text("\n".join(LOG) + "\n")
    save([])
    rows = []
    try:
        rows = sweep(dev, shapes, ms, timed, copy_bw, a.budget_s, a.dry, "dispatch" in passing, on_shape=save)
    except Exception as ex:  # noqa: BLE001 - keep what was measured
        import traceback
        log(f"sweep aborted: {type(ex).__name__}: {str(ex)[:300]}\n{traceback.format_exc()[-1500:]}")
    chosen = choose(rows, timed)
    log(f"scores (geo-mean time / best config, per M bucket): {json.dumps(chosen['scores'])}")
    log(f"proposed MID_M_PLAN = {chosen['MID_M_PLAN']}")
    log(f"proposed MID_SHAPE_PLAN = {chosen['MID_SHAPE_PLAN']}")
    log(table(rows, chosen))
    log(f"total {elapsed():.0f} s")
    save(rows, chosen)


if __name__ == "__main__":
    main()
