"""Triton small-M W4A16 kernels on one GPU, in ONE device call: check every config, time it against the old
Triton split-K kernel, sdquant's CUDA kernel and cuBLAS bf16 in the same process, pick a plan per M bucket.

    SDQUANT_COMMIT=<hash> python bench/triton_small_m.py --out $OUT [--budget-s 200]
    python bench/triton_small_m.py --dry          # CPU: Triton's interpreter, tiny shapes (what CI runs)

1. In the background, a child process builds sdquant's CUDA extension (int4_cuda, cache $SDQUANT_CACHE_DIR,
   default /tmp/sdq_ext) and checks one call; the parent then uses the CUDA kernel only if that child succeeded
   (a failed build or a crash is printed and skipped, never aborts the run).
2. Correctness on the GPU of every Triton config (tensor-core "tc" and GEMV "gemv" kernels of
   sdquant.kernels.int4_triton_gemv, and the old kernel) against x @ W.T in float64 with W =
   QuantizedWeight.dequantize(): symmetric/asymmetric, groups 32/64/128/per-channel, act-order, fp16/bf16, M = 1..16,
   automatic and forced split-K; ||y - ref|| / ||ref|| <= 1e-2 (bf16) / 2e-3 (fp16); output memory poisoned with
   NaN first; every call twice and bit-identical. The default configs get every case, the others a subset. A
   config that fails (or does not compile) is not timed.
3. Timing, K x N in SHAPES x M in MS: weights copied until the copies exceed 3x the 60 MB L2, calls rotate through
   them, back-to-back calls captured in one CUDA graph, median of 5 replays, CUDA events (bench/gemm.py's
   time_rotating); every timed config's first call is checked against the float64 reference too. bf16
   activations, random codes, symmetric, group 128.
4. A table (us, TB/s, x bf16, Triton / CUDA speed) and the proposed int4_triton.SMALL_M_PLAN / SHAPE_PLAN (per M
   bucket the config with the best geometric-mean time over the shapes, kept only where it beats the old kernel
   in this run); $OUT/triton_small_m.json (saved after every shape) and $OUT/triton_small_m.log.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import provenance  # noqa: E402

T0 = time.time()
LOG: list = []
SHAPES = [(8192, 28672), (4096, 28672), (14336, 4096), (4096, 4096), (28672, 8192), (8192, 10240), (4096, 6144)]
MS = [1, 2, 4, 8, 16, 32]
GS = 128

# Triton configs of int4_triton_gemv.run. "tc" serves M <= 16, "gemv" M <= 4.
TC_CONFIGS = {
    "tc128": {"kernel": "tc", "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0},
    "tc128w4": {"kernel": "tc", "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "waves": 4.0},
    "tc128w1": {"kernel": "tc", "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 1.0},
    "tc128n8": {"kernel": "tc", "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "waves": 2.0},
    "tc256": {"kernel": "tc", "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "waves": 2.0},
    "tc256w1": {"kernel": "tc", "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "waves": 1.0},
    "tc64": {"kernel": "tc", "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 4.0},
    "tc128k64": {"kernel": "tc", "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 6, "waves": 2.0},
    "tc128ns": {"kernel": "tc", "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0,
                "SWAP": False},
    "tc128u1": {"kernel": "tc", "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0,
                "UNPACK": 1},
    "tc128u3": {"kernel": "tc", "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "waves": 2.0,
                "UNPACK": 3, "SWAP": False},
}
def _gv(bn: int, bk: int, warps: int, waves: float, stages: int = 1) -> dict:
    """A GEMV config of int4_triton_gemv.run."""
    return {"kernel": "gemv", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "waves": waves}


# (the "z" names date from 2026-12-01, when the folded zero point was an option; it is now the only form)
GEMV_CONFIGS = {
    "gv512k32": _gv(512, 32, 4, 3.0),
    "gv256k32": _gv(256, 32, 2, 6.0),
    "gv512k64z": _gv(512, 64, 4, 3.0),
    "gv512k128z": _gv(512, 128, 4, 3.0),
    "gv256k64z": _gv(256, 64, 2, 6.0),
    "gv512k64zw4": _gv(512, 64, 4, 4.0),
    # after ncu_triton (2026-12-01): the GEMV waits on its loads (long scoreboard ~40% of the stall cycles)
    "gv512k64zs2": _gv(512, 64, 4, 4.0, stages=2),
    "gv512k64zs3": _gv(512, 64, 4, 4.0, stages=3),
    "gv512k128zw4": _gv(512, 128, 4, 4.0),
    "gv256k64zw8": _gv(256, 64, 2, 8.0),
    # 2026-12-02: more programs and narrower tiles for the K >> N shapes, where the GEMV is below 75% of the CUDA op
    "gv128k64w16": _gv(128, 64, 1, 16.0),
    "gv256k128w8": _gv(256, 128, 2, 8.0),
    "gv256k64w12": _gv(256, 64, 2, 12.0),
    "gv512k64w6": _gv(512, 64, 4, 6.0),
    "gv512k128w6": _gv(512, 128, 4, 6.0),
}
FULL_CHECK = {"tc128", "gv512k32", "gv512k64z"}
# (K, N, group, symmetric, act_order, dtype name, Ms, forced splits)
CHECK_CASES = [
    (4096, 4096, 128, True, False, "bfloat16", (1, 3, 8, 16), (0, 2)),
    (2048, 1024, 128, False, False, "float16", (1, 4, 13), (0,)),
    (1536, 512, 32, False, True, "bfloat16", (1, 2, 9), (0, 3)),
    (1536, 512, 64, True, True, "float16", (2, 16), (0,)),
    (2048, 1024, -1, False, False, "bfloat16", (1, 4, 7), (0,)),
    (8192, 1024, 128, True, False, "float16", (1, 3, 16), (0,)),
]
SUBSET = (0, 2)   # cases the non-default configs are checked on


def log(*a):
    s = " ".join(str(x) for x in a)
    LOG.append(s)
    print(s, flush=True)


def elapsed() -> float:
    return time.time() - T0


# ---------------------------------------------------------------------------------------------- CUDA child
CHILD = r"""
import sys, time, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
t = time.time()
from sdquant.kernels import int4_cuda, int4_layout
import gemm
ok = int4_cuda.available()
print("BUILD", ok, int4_cuda._STATE.get("reason"), f"{{time.time() - t:.1f}}s", flush=True)
if ok:
    qw = gemm.random_int4(1024, 4096, device="cuda", seed=1)
    lay = int4_layout.repack_cuda(qw, torch.bfloat16)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.ops.sdquant.w4a16_cuda(x, lay["qweight"], lay["scales"], lay["zeros"], None, lay["locks"], None)
    ref = (x.double() @ qw.dequantize(torch.float64).t()).float()
    print("CHECK", gemm.rel_err(y, ref), flush=True)
"""


def start_cuda_child():
    code = CHILD.format(root=str(ROOT), bench=str(ROOT / "bench"))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=str(ROOT))


def finish_cuda_child(proc, timeout: float) -> tuple:
    """(usable, summary line)."""
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return False, "CUDA child timed out: " + (out or "")[-500:]
    build = next((ln for ln in out.splitlines() if ln.startswith("BUILD")), "BUILD ?")
    chk = next((ln for ln in out.splitlines() if ln.startswith("CHECK")), None)
    if proc.returncode != 0 or chk is None:
        return False, f"CUDA child rc={proc.returncode}: {build}; tail: " + " | ".join(out.splitlines()[-8:])[-800:]
    err = float(chk.split()[1])
    return err == err and err < 1e-2, f"{build}; check rel err {err:.2e}"


# ------------------------------------------------------------------------------------------------ checks
def check_layout_configs(dev, configs: dict, cases, run, skip, log_fn, guard=None, none_splits: bool = False) -> tuple:
    """Every config against the float64 reference on the Triton layout of each case; each call twice into a
    NaN-poisoned allocator and required bit-identical. ``cases``: (K, N, group, sym, act-order, dtype name, Ms,
    splits); ``run(x, layout, group, cfg, split)`` computes y (``cfg`` None: the op's own path, run with split 0
    only unless ``none_splits``); ``skip(name, cfg, m, case_index)`` leaves a point out; ``guard(case_index)`` True
    skips a whole case.
    Shared by bench/triton_small_m.py and bench/triton_mid_m.py. Returns (passing names, rows, summary)."""
    import torch

    import gemm
    from sdquant.kernels import int4_layout
    bound = {"bfloat16": 1e-2, "float16": 2e-3}
    rows, failed = [], set()
    dry = dev.type == "cpu"
    for ci, (k, n, gs, sym, act, dtn, ms, splits) in enumerate(cases):
        if guard is not None and guard(ci):
            continue
        dt = getattr(torch, dtn)
        qw = gemm.random_int4(n, k, gs, sym, act, device=dev, seed=k + n + gs)
        w = qw.dequantize(torch.float64)
        lay = int4_layout.repack_triton(qw, dt)
        g = k // lay["scales"].shape[0]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = (x.double() @ w.t()).float()
            for name, cfg in configs.items():
                if name in failed or skip(name, cfg, m, ci):
                    continue
                for sp in (splits if cfg is not None or none_splits else (0,)):
                    try:
                        ys = []
                        for _ in range(2):
                            if not dry:   # poison the allocator's next blocks
                                torch.full((m, n), float("nan"), device=dev, dtype=dt)
                            ys.append(run(x, lay, g, cfg, sp))
                        if not dry:
                            torch.cuda.synchronize()
                        err = gemm.rel_err(ys[0], ref)
                        same = bool(torch.equal(ys[0], ys[1]))
                        ok = err == err and err <= bound[dtn] and same
                        note = ""
                    except Exception as ex:  # noqa: BLE001 - reported; the config is then not timed
                        err, same, ok, note = float("nan"), False, False, f"{type(ex).__name__}: {str(ex)[:400]}"
                    rows.append({"config": name, "K": k, "N": n, "gs": gs, "sym": sym, "act": act, "dtype": dtn,
                                 "M": m, "splits": sp, "rel_err": err, "deterministic": same, "pass": ok,
                                 "note": note})
                    if not ok:
                        log_fn(f"  FAIL {name} K={k} N={n} gs={gs} sym={sym} act={act} {dtn} M={m} split={sp}: "
                               f"err={err:.3g} same={same} {note}")
                        failed.add(name)
                        break
    summary = {}
    for r in rows:
        d = summary.setdefault(r["config"], {"n": 0, "pass": 0, "worst": {}})
        d["n"] += 1
        d["pass"] += bool(r["pass"])
        e = r["rel_err"] if r["rel_err"] == r["rel_err"] else 1e9
        d["worst"][r["dtype"]] = max(d["worst"].get(r["dtype"], 0.0), e)
    for name, d in summary.items():
        log_fn(f"  check {name}: {d['pass']}/{d['n']} pass, worst " +
               ", ".join(f"{kk} {v:.2e}" for kk, v in sorted(d["worst"].items())))
    passing = [c for c in configs if c in summary and c not in failed]
    return passing, rows, summary


def check_configs(dev, configs: dict, dry: bool, locks: bool = False) -> tuple:
    """locks (--locks): the configs run with the layout's split-K counters, as QuantLinear calls them (the GEMV at
    M = 1 then sums its splits in the kernel); without: the second pass. The same for ``sweep``."""
    from sdquant.kernels import int4_triton
    from sdquant.kernels import int4_triton_gemv as G
    cases = CHECK_CASES if not dry else [(256, 128, 64, False, True, "bfloat16", (1, 3, 16), (0, 2)),
                                         (256, 64, -1, True, False, "float16", (2,), (0,))]

    def run(x, lay, g, cfg, sp):
        if cfg is None:
            return int4_triton.w4a16_triton_impl(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], None,
                                                 force_path="splitk", config={"SPLIT_K": sp} if sp else None)
        return G.run(x, lay["qweight"], lay["scales"], lay["zs"], lay["perm"], g, {**cfg, "SPLIT_K": sp},
                     lay["locks"] if locks else None)

    def skip(name, cfg, m, ci):
        return (cfg is not None and cfg["kernel"] == "gemv" and m > 4) or \
            (not dry and name not in FULL_CHECK and ci not in SUBSET)

    return check_layout_configs(dev, configs, cases, run, skip, log, none_splits=True)


def time_cpu(call, n_rot: int, trials: int = 3) -> float:
    import gemm  # (lazily, as the rest of this module: gemm imports torch)
    return gemm.time_cpu(call, n_rot, trials)


def shape_setup(k: int, n: int, dev, dtype, dry: bool) -> tuple:
    """One timed shape's random int4 weight (group GS) and the copies the timings rotate through (past 3x the L2
    on a GPU, 2 in --dry): (qw, w_ref, int4_bytes, Triton layouts, bf16 weights, copies per int4 layout)."""
    import gemm
    from sdquant.kernels import int4_layout
    qw = gemm.random_int4(n, k, GS, device=dev, seed=k + n)
    w_ref = qw.dequantize(dtype)
    int4_bytes = n * k // 2 + n * (k // GS) * 2 * 2
    n_int4 = 2 if dry else gemm.n_copies(int4_bytes)
    base = int4_layout.repack_triton(qw, dtype)
    tlays = [base] + [{kk: (None if v is None else v.clone()) for kk, v in base.items()} for _ in range(n_int4 - 1)]
    n_bf = 2 if dry else gemm.n_copies(n * k * 2)
    wcopies = [w_ref] + [w_ref.clone() for _ in range(n_bf - 1)]
    return qw, w_ref, int4_bytes, tlays, wcopies, n_int4


def time_calls(calls: dict, ref, k: int, n: int, m: int, timer, copy_bw: float, rows: list, split_of) -> dict:
    """Each call (name -> (call(i), copies, weight bytes)) checked against ``ref`` (rel. error <= 1e-2, else not
    timed), then timed; one row per timed call appended to ``rows`` (``split_of(name)``: its split-K or None).
    Returns {name: us}."""
    import gemm
    res = {}
    for name, (call, nrot, wbytes) in calls.items():
        try:
            err = gemm.rel_err(call(0), ref)
            if not (err == err and err <= 1e-2):
                log(f"  {name} {k}x{n} M={m}: WRONG rel err {err:.3g}; not timed")
                continue
            us = timer(call, nrot)
            tbs = (wbytes + m * k * 2 + m * n * 2) / (us * 1e-6) / 1e12
            res[name] = us
            rows.append({"K": k, "N": n, "M": m, "kernel": name, "us": round(us, 3), "rel_err": err,
                         "TBps": round(tbs, 3), "pct_copy": round(100 * tbs / copy_bw, 1),
                         "TFLOPs": round(2 * m * n * k / (us * 1e-6) / 1e12, 1), "split": split_of(name)})
        except Exception as ex:  # noqa: BLE001
            log(f"  {name} {k}x{n} M={m}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
    return res


def sweep(dev, shapes, ms, configs: dict, use_cuda: bool, copy_bw: float, budget_s: float, dry: bool,
          on_shape=None, locks: bool = False) -> list:
    import torch

    import gemm
    from sdquant.kernels import int4_layout, int4_triton
    from sdquant.kernels import int4_triton_gemv as G
    dtype = torch.bfloat16
    timer = (lambda call, n: time_cpu(call, n)) if dry else \
        (lambda call, n: gemm.time_rotating(call, n, trials=5, target_ms=2.0, max_calls=60))
    rows = []
    for (k, n) in shapes:
        if elapsed() > budget_s:
            log(f"time guard: stop before {k}x{n} at {elapsed():.0f} s")
            break
        t_shape = time.time()
        qw, w_ref, int4_bytes, tlays, wcopies, n_int4 = shape_setup(k, n, dev, dtype, dry)
        clays = []
        if use_cuda:
            try:
                cb = int4_layout.repack_cuda(qw, dtype)
                clays = [cb] + [{kk: (None if v is None else v.clone()) for kk, v in cb.items()} for _ in range(n_int4 - 1)]
            except Exception as ex:  # noqa: BLE001
                log(f"  repack_cuda failed: {type(ex).__name__}: {str(ex)[:200]}")
        for m in ms:
            if elapsed() > budget_s:
                log(f"time guard: stop at {k}x{n} M={m} ({elapsed():.0f} s)")
                break
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = (x.double() @ w_ref.double().t()).float()
            calls = {"bf16": (lambda i: torch.nn.functional.linear(x, wcopies[i % len(wcopies)]), len(wcopies),
                              n * k * 2)}
            if clays:
                def cuda_call(i):
                    c = clays[i % len(clays)]
                    return torch.ops.sdquant.w4a16_cuda(x, c["qweight"], c["scales"], c["zeros"], None, c["locks"], None)
                calls["cuda"] = (cuda_call, len(clays), int4_bytes)

            def old_call(i):
                c = tlays[i % len(tlays)]
                return int4_triton.w4a16_triton_impl(x, c["qweight"], c["scales"], c["zs"], None, None,
                                                     force_path="splitk")
            if "old" in configs:
                calls["old"] = (old_call, len(tlays), int4_bytes)
            for name, cfg in configs.items():
                if cfg is None or (cfg["kernel"] == "gemv" and m > 4) or m > 16:
                    continue

                def new_call(i, cfg=cfg):
                    c = tlays[i % len(tlays)]
                    return G.run(x, c["qweight"], c["scales"], c["zs"], None, GS, cfg, c["locks"] if locks else None)
                calls[name] = (new_call, len(tlays), int4_bytes)
            sms = G.num_sms(dev)
            res = time_calls(calls, ref, k, n, m, timer, copy_bw, rows,
                             lambda name: G.resolve(configs[name], m, n, k, GS, sms)["SPLIT_K"]
                             if configs.get(name) is not None else None)
            new = {kk: v for kk, v in res.items() if kk in configs and configs[kk] is not None}
            best = min(new, key=new.get) if new else None
            f = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
            log(f"  {k}x{n} M={m}: bf16 {f(res.get('bf16'))} cuda {f(res.get('cuda'))} old {f(res.get('old'))} "
                f"best new {best} {f(new.get(best))} us  [{elapsed():.0f} s]")
        log(f"shape {k}x{n} done in {time.time() - t_shape:.1f} s")
        del tlays, wcopies, clays, w_ref
        if not dry:
            torch.cuda.empty_cache()
        if on_shape is not None:
            on_shape(rows)
    return rows


# ------------------------------------------------------------------------------------------------ choose
def bucket(m: int) -> int:
    b = 1
    while b < m:
        b *= 2
    return b


def choose(rows, configs: dict, tol: float = 0.02) -> dict:
    """Per M bucket (<= 16): the new config with the best geometric-mean time ratio to each point's fastest new
    config; kept only if it beats the old kernel at most points of the bucket (else None = old kernel). Per
    (K, N, bucket): the point's fastest new config where it beats the bucket default by more than tol."""
    pts = {}
    for r in rows:
        pts.setdefault((r["K"], r["N"], r["M"]), {})[r["kernel"]] = r["us"]
    by_b = {}
    for (k, n, m), d in pts.items():
        if m <= 16:
            by_b.setdefault(bucket(m), []).append(((k, n, m), d))
    plan, shape_plan, scores = {}, {}, {}
    for b, items in sorted(by_b.items()):
        news = [set(kk for kk in d if kk in configs and configs[kk] is not None) for _, d in items]
        common = set.intersection(*news) if news else set()
        sc = {}
        for c in common:
            sc[c] = math.exp(statistics.fmean(
                math.log(d[c] / min(d[kk] for kk in d if kk in common)) for _, d in items))
        scores[b] = {c: round(v, 4) for c, v in sorted(sc.items(), key=lambda t: t[1])}
        if not sc:
            plan[b] = None
            continue
        best = min(sc, key=sc.get)
        wins = sum(1 for _, d in items if "old" not in d or d[best] < d["old"])
        plan[b] = best if wins * 2 > len(items) else None
        for (k, n, m), d in items:
            cand = {c: d[c] for c in d if c in common or (c in configs and configs[c] is not None)}
            if not cand:
                continue
            w = min(cand, key=cand.get)
            base = d.get(plan[b]) if plan[b] else d.get("old")
            if base is not None and w != plan[b] and cand[w] * (1 + tol) < base and cand[w] < d.get("old", 1e30):
                shape_plan[(k, n, b)] = w
    return {"SMALL_M_PLAN": plan, "SHAPE_PLAN": shape_plan, "scores": scores}


def plan_time(d: dict, k: int, n: int, m: int, chosen: dict) -> tuple:
    b = bucket(m)
    name = chosen["SHAPE_PLAN"].get((k, n, b), chosen["SMALL_M_PLAN"].get(b)) if m <= 16 else None
    name = name if name in d else "old"
    return name, d.get(name)


def table(rows, chosen) -> str:
    pts = {}
    for r in rows:
        pts.setdefault((r["K"], r["N"], r["M"]), {})[r["kernel"]] = r
    out = ["| K×N | M | bf16 | CUDA | old Triton | **new Triton (plan)** | best new (config) | ×bf16 | ×old | "
           "Triton ÷ CUDA speed | TB/s (% copy) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {s: i for i, s in enumerate(SHAPES)}
    for (k, n, m) in sorted(pts, key=lambda t: (order.get((t[0], t[1]), 99), t[2])):
        d = pts[(k, n, m)]
        us = {kk: r["us"] for kk, r in d.items()}
        name, t = plan_time(us, k, n, m, chosen)
        news = {kk: v for kk, v in us.items() if kk not in ("bf16", "cuda", "old")}
        best = min(news, key=news.get) if news else None
        f = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
        bf, cu, old = us.get("bf16"), us.get("cuda"), us.get("old")
        r = d.get(name)
        bw = "–" if r is None else f"{r['TBps']:.2f} ({r['pct_copy']:.0f}%)"
        xbf = "–" if not (bf and t) else f"{bf / t:.2f}"
        xold = "–" if not (old and t) else f"{old / t:.2f}"
        xcu = "–" if not (cu and t) else f"{cu / t:.2f}"
        bnew = f"{f(news.get(best))} ({best})" if best else "–"
        out.append(f"| {k}×{n} | {m} | {f(bf)} | {f(cu)} | {f(old)} | **{f(t)}** ({name}) | {bnew} | {xbf} | "
                   f"{xold} | {xcu} | {bw} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU only: Triton's interpreter, tiny shapes, no CUDA kernel")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop timing this many seconds after start")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--no-cuda", action="store_true")
    ap.add_argument("--configs", default="", help="comma-separated config names to check and time (default: all)")
    ap.add_argument("--locks", action="store_true", help="pass the layout's split-K counters (the op's default use)")
    a = ap.parse_args(argv)
    if a.dry:
        os.environ["TRITON_INTERPRET"] = "1"       # before triton is imported (the library's @jit helpers)
    os.environ.setdefault("SDQUANT_CACHE_DIR", "/tmp/sdq_ext")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    child = None if (a.dry or a.no_cuda) else start_cuda_child()
    import torch
    import triton

    import gemm
    from sdquant.kernels import int4_triton  # noqa: F401  (registers the op)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.ms.split(",")]
    configs = {"old": None, **TC_CONFIGS, **GEMV_CONFIGS}
    if a.configs:
        unknown = [c for c in a.configs.split(",") if c not in configs]
        if unknown:
            sys.exit(f"error: --configs: unknown {unknown}; known: {sorted(configs)}")
        configs = {c: configs[c] for c in a.configs.split(",")}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "triton": triton.__version__, "commit": os.environ.get("SDQUANT_COMMIT", "unknown"),
            "src_digest": provenance.source_digest(), "dtype": "bfloat16",
            "group_size": GS, "configs": configs, "dry": a.dry, "locks": a.locks, "python": sys.version.split()[0]}
    if a.dry:
        dev, copy_bw = torch.device("cpu"), 4.3
        shapes, ms = [(256, 128)], [1, 2, 16]   # (CI: one shape, one M a bucket)
        meta["device"] = "cpu (dry run, Triton interpreter)"
        configs = {"old": None, "tc128": TC_CONFIGS["tc128"], "tc64": TC_CONFIGS["tc64"],
                   "gv512k32": GEMV_CONFIGS["gv512k32"], "gv512k64z": GEMV_CONFIGS["gv512k64z"]}
    else:
        dev = torch.device("cuda")
        meta["device"] = torch.cuda.get_device_name()
        meta["sms"] = torch.cuda.get_device_properties(dev).multi_processor_count
        copy_bw = gemm.copy_bandwidth(dev)
    meta["copy_TBps"] = copy_bw
    log(f"device {meta['device']} torch {torch.__version__} triton {triton.__version__} commit {meta['commit']} "
        f"copy {copy_bw:.2f} TB/s [{elapsed():.0f} s]")
    passing, crows, csum = check_configs(dev, configs, a.dry, a.locks)
    log(f"passing configs: {passing} [{elapsed():.0f} s]")
    use_cuda = False
    if child is not None:
        use_cuda, line = finish_cuda_child(child, 150 - elapsed())
        log(f"CUDA kernel: {'used' if use_cuda else 'NOT used'} -- {line} [{elapsed():.0f} s]")
        if use_cuda:
            from sdquant.kernels import int4_cuda
            use_cuda = int4_cuda.available()
            if not use_cuda:
                log(f"  (parent could not load it: {int4_cuda._STATE.get('reason')})")
    meta["cuda_kernel"] = use_cuda
    timed = {kk: v for kk, v in configs.items() if kk in passing}

    def save(rows, chosen=None):
        tmp = out / "triton_small_m.json.tmp"
        ch = None
        if chosen is not None:
            ch = {"SMALL_M_PLAN": chosen["SMALL_M_PLAN"], "scores": chosen["scores"],
                  "SHAPE_PLAN": {f"{k}x{n}:M{b}": c for (k, n, b), c in chosen["SHAPE_PLAN"].items()}}
        tmp.write_text(json.dumps({"meta": meta, "check": crows, "check_summary": csum, "rows": rows,
                                   "chosen": ch}, indent=1, default=str))
        os.replace(tmp, out / "triton_small_m.json")
        (out / "triton_small_m.log").write_text("\n".join(LOG) + "\n")
    save([])
    rows = []
    try:
        rows = sweep(dev, shapes, ms, timed, use_cuda, copy_bw, a.budget_s, a.dry, on_shape=save, locks=a.locks)
    except Exception as ex:  # noqa: BLE001 - keep what was measured
        import traceback
        log(f"sweep aborted: {type(ex).__name__}: {str(ex)[:300]}\n{traceback.format_exc()[-1500:]}")
    chosen = choose(rows, configs)
    log(f"scores (geo-mean time / best new, per M bucket): {json.dumps(chosen['scores'])}")
    log(f"proposed SMALL_M_PLAN = {chosen['SMALL_M_PLAN']}")
    log(f"proposed SHAPE_PLAN = {chosen['SHAPE_PLAN']}")
    log(table(rows, chosen))
    log(f"total {elapsed():.0f} s")
    save(rows, chosen)


if __name__ == "__main__":
    main()
