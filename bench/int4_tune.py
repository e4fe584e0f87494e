"""Tune the sm_90a W4A16 decode kernel's variants in ONE device call: build, check every variant, time, pick.

    python bench/int4_tune.py [--out DIR] [--budget-s 300] [--shapes 8192x28672,...] [--ms 1,2,4,8,16,32]
    python bench/int4_tune.py --dry          # no GPU, no build: the Python logic on tiny CPU tensors

Steps (each guarded: a failure is reported and skipped, never aborts the run):
1. build the extension (cache under $SDQUANT_CACHE_DIR, default /tmp/sdq_ext) in a child process that then
   checks every config of CONFIGS on fresh random inputs against x @ W.T in float64 (W from
   QuantizedWeight.dequantize): symmetric/asymmetric, groups 32/64/128/per-channel, act-order, fp16/bf16,
   M from 1 to 32, automatic and forced split-K; ||y - ref|| / ||ref|| <= 1e-2 (bf16) / 2e-3 (fp16), the
   output memory poisoned with NaN before each call, each call run twice and required bit-identical, split-K
   locks back at zero. A config that fails (or crashes the child: it is then re-run without it) is not timed.
2. time (weights rotated past the 60 MB L2, back-to-back calls in a CUDA graph, median of 5 replays, CUDA
   events) every passing config and, in the same process, cuBLAS bf16 F.linear and torch's int4 tinygemm, over
   K x N in SHAPES x M in MS (the shapes with issue-4 targets first). A global guard stops timing once
   --budget-s seconds have passed since the start.
3. print the per-(shape, M) winners and the proposed int4_cuda.DEFAULT_CONFIGS / SHAPE_CONFIGS; write
   $OUT/int4_tune.json and $OUT/int4_tune.log.
A config is variant + 64 * target (int4_cuda's docstring; target = CTAs per SM x 2 for automatic split-K; run 4
wrote variant + 16 * target).
Run 5 adds the stream-K variants 13-18 and, at M = 1 and 16, the read-bandwidth probes (not GEMMs): "lin" reads
the whole qweight buffer in order with a grid-stride kernel (the plain read ceiling for this many bytes), "P1@v13"
/ "P2@v15" / "P4@v19" / "P5@v23" / "P6@v26" issue exactly the loads of variants 13 / 15 / 19 / 23 / 26 on their
grids without the arithmetic, "P3" the register-ring pattern 8 stages deep.
Run 6 adds the lean direct variants 28-44 and 46-49 (csrc/w4a16_lean.cuh), stream-K with raw codes (45) and the
lm_head shape 4096x128256; the "prev default"
column is run 5's auto_config (PREV_*), timed in the same process.
Run 7 adds the bulk-copy variants 50-61 (csrc/w4a16_bulk.cuh, read probes P7@v50 / P8@v58, checked first with a
bounded child: --check-timeout) and M = 17-32 for the variants instantiated at four token tiles
(int4_cuda.NT4_VARIANTS): the sweep times them there, and the proposal and confirm pass cover that bucket.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gemm  # noqa: E402
import provenance  # noqa: E402
from sdquant.kernels import int4_layout  # noqa: E402

T0 = time.time()
LOG: list = []
BOUND = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
RUN_ORDER = [(8192, 28672), (4096, 28672), (14336, 4096), (4096, 4096), (28672, 8192), (8192, 10240), (4096, 6144),
             (4096, 128256)]
MS = [1, 2, 4, 8, 16, 32]
# variant ids: csrc/w4a16_kernel.cuh. 0 = the run-3 kernel (its own 2.5 CTAs/SM split rule); target 0 = the
# variant's default (every resident slot); 16 * t: aim at t / 2 CTAs per SM.
CONFIGS = [0, 0 + 64 * 8, 1, 2, 2 + 64 * 4, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 9 + 64 * 2,
           13, 14, 15, 16, 17, 18, 13 + 64 * 4, 14 + 64 * 6, 16 + 64 * 8, 19, 20, 21, 22, 19 + 64 * 6, 23, 24, 25,
           26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49,
           50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]
NAMES = {0: "4x1 s5", 1: "4x1 s5 pre", 2: "4x2 s5 pre", 3: "4x2 s8 pre", 4: "2x2 s8 pre", 5: "8x1 s4 pre",
         6: "4x1 s8 pre", 7: "2x4 s8 pre", 8: "direct 4x2 d4", 9: "direct 4x2 d2", 10: "direct 2x4 d2",
         11: "direct 4x1 d4", 12: "direct 8x1 d2", 13: "sk 4 d3", 14: "sk 4 d2 ws", 15: "sk 4 d2 ws ts",
         16: "sk 2 d2 ts", 17: "sk 8 d2 ws", 18: "sk 2 d3 ws ts", 19: "sk 4 ring8", 20: "sk 4 ring8 ws",
         21: "sk 8 ring6", 22: "sk 4 ring12 ws", 23: "sk 4 d2 ws pf8", 24: "sk 4 d3 pf8", 25: "sk 2 d2 ts pf8",
         26: "sk 1x4i d2", 27: "sk 1x8i d2 ws", 28: "lean 4x1 r4 ws", 29: "lean 4x1 r4", 30: "lean 1x8 r4 ws",
         31: "lean 1x4 r4 ws", 32: "lean 2x2 r4 ws", 33: "lean 4x1 r8 ws", 34: "lean 4x1 r2 ws", 35: "lean 2x4 r4 ws",
         36: "lean 1x8 r2 ws", 37: "lean 1x8 r4 ws nocl", 38: "tight 2x4 d2", 39: "tight 4x2 d2", 40: "tight 4x1 d2",
         41: "tight 8x1 d2", 42: "lean 4x1 r4 ws nocl", 43: "tight raw 2x4 d2", 44: "tight raw 4x2 d2", 45: "sk 4 d2 raw",
         46: "flat 4w r4 raw", 47: "flat 8w r4 raw", 48: "flat 4w r8 raw", 49: "flat 4w r4 ws",
         50: "bulk 2x4 c4 r6", 51: "bulk 2x4 c8 r3", 52: "bulk 4x1 c4 r6", 53: "bulk 1x8 c4 r6", 54: "bulk 2x4 c2 r12",
         55: "bulk 2x2 c2 r12", 56: "bulk 4x2 c4 r6", 57: "bulk 2x4 c4 r6 noev", 58: "bulk flat 4w c4 r6",
         59: "bulk flat 8w c4 r6", 60: "feed 16w k4 s6", 61: "feed 16w k2 s12"}
# the defaults before this sweep, the "prev default" of its table: int4_cuda.DEFAULT_CONFIGS / SHAPE_CONFIGS as of run
# 6's first sweep (run 5's, commit aa746fb, plus the lm_head shape at M = 1-2 -> v17, which that sweep's confirm pass
# set; bench/results/int4_tune_h200_run6.* compared against run 5's, without those two points)
PREV_DEFAULTS = {1: 10, 2: 10, 4: 10, 8: 10, 16: 2}
PREV_SHAPE = {(8192, 28672, 1): 17, (28672, 8192, 1): 5, (28672, 8192, 2): 5, (4096, 6144, 1): 11,
              (8192, 28672, 16): 5, (4096, 28672, 16): 5, (28672, 8192, 16): 5, (4096, 4096, 16): 10,
              (8192, 10240, 16): 0, (4096, 6144, 16): 4, (4096, 128256, 1): 17, (4096, 128256, 2): 17}
PROBE_MS = (1, 16)
RISKY_VARIANTS = (23, 24, 25, *range(50, 62))  # first use on this GPU: cp.async.bulk.prefetch.L2; bulk copies + mbarriers
CHECK_CASES = [  # (K, N, group, symmetric, act_order, dtype, Ms)
    (4096, 4096, 128, True, False, torch.bfloat16, (1, 3, 8, 16, 32)),
    (4096, 4096, 128, False, False, torch.float16, (1, 5, 16)),
    (8192, 1024, 128, True, False, torch.bfloat16, (1, 12)),
    (1536, 320, 64, False, True, torch.bfloat16, (1, 9)),
    (1536, 320, 32, True, True, torch.float16, (2, 16)),
    (2048, 1024, -1, False, False, torch.bfloat16, (4, 13)),
    (2048, 1024, 64, False, True, torch.float16, (1, 7)),
    (8192, 28672, 128, True, False, torch.bfloat16, (1, 16)),  # a timed shape: the grids and indices of the sweep
]
# run 6, lean variants only (older variants were never checked there): fewer K steps x blocks than a flat grid has
# warps (its extra warps idle), and a block count that no tile width divides
LEAN_CHECK_CASES = [
    (64, 64, 64, True, False, torch.float16, (1, 2)),
    (128, 192, 32, False, False, torch.bfloat16, (1, 9)),
]


def prev_config(k: int, n: int, m: int) -> int:
    from sdquant.kernels.int4_cuda import m_bucket
    b = m_bucket(m)
    return 0 if b > 16 else PREV_SHAPE.get((k, n, b), PREV_DEFAULTS.get(b, 0))


def cfg_name(c: int) -> str:
    v, t = c % 64, c // 64
    return f"v{v}[{NAMES.get(v, '?')}]" + (f"@{t / 2:g}/SM" if t else "")


def log(*a):
    s = " ".join(str(x) for x in a)
    LOG.append(s)
    print(s, flush=True)


def elapsed() -> float:
    return time.time() - T0


# ------------------------------------------------------------------------------------------- correctness
def check_configs(dev, configs, cases, progress=None) -> list:
    """Run every config on every case; returns rows with pass/fail. ``progress(cfg)`` is called before each
    config's first launch (the parent uses it to find a config that crashed the process)."""
    rows = []
    on_gpu = dev.type == "cuda"
    for (k, n, gs, sym, act, dt, ms) in cases:
        qw = gemm.random_int4(n, k, gs, sym, act, device=dev, seed=k + 3 * n + gs)
        w = qw.dequantize(torch.float64)
        lay = int4_layout.repack_cuda(qw, dt)
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = (x.double() @ w.t()).float()
            for c in configs:
                if progress is not None:
                    progress(c)
                for sp in (0, 3):
                    try:
                        ys = []
                        for _ in range(2):
                            if on_gpu:  # the op's output block comes from the allocator: poison what it will reuse
                                torch.full((m, n), float("nan"), device=dev, dtype=dt)
                            ys.append(torch.ops.sdquant.w4a16_cuda(x, lay["qweight"], lay["scales"], lay["zeros"],
                                                                   lay["perm"], lay["locks"], None, sp, False, c))
                        if on_gpu:
                            torch.cuda.synchronize()
                        err = gemm.rel_err(ys[0], ref)
                        same = bool(torch.equal(ys[0], ys[1]))
                        locks0 = int(lay["locks"].abs().sum()) == 0
                        ok = err == err and err <= BOUND[dt] and same and locks0
                        note = ""
                    except Exception as ex:  # noqa: BLE001 - reported, the config is then skipped
                        err, same, locks0, ok, note = float("nan"), False, False, False, f"{type(ex).__name__}: {ex}"[:300]
                        if on_gpu and progress is not None and not context_alive():
                            print(f"DEAD {c}: {note}", flush=True)  # sticky error: the parent re-runs without c
                            os._exit(7)
                    rows.append({"config": c, "K": k, "N": n, "gs": gs, "sym": sym, "act": act,
                                 "dtype": str(dt).replace("torch.", ""), "M": m, "splits": sp, "rel_err": err,
                                 "deterministic": same, "locks_zero": locks0, "pass": ok, "note": note})
                    if not ok:
                        log(f"  FAIL {cfg_name(c)} K={k} N={n} gs={gs} sym={sym} act={act} {dt} M={m} splits={sp}: "
                            f"err={err:.3g} same={same} locks0={locks0} {note}")
    return rows


def context_alive() -> bool:
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False


def summarize_checks(rows) -> dict:
    per = {}
    for r in rows:
        d = per.setdefault(r["config"], {"n": 0, "pass": 0, "worst": {}})
        d["n"] += 1
        d["pass"] += bool(r["pass"])
        e = r["rel_err"] if r["rel_err"] == r["rel_err"] else 1e9
        d["worst"][r["dtype"]] = max(d["worst"].get(r["dtype"], 0.0), e)
    return per


def child_check(configs, cases=None, occ_ms=(1, 16)) -> None:
    """Entry of the checking child: build, then print the occupancy at occ_ms, a START line before each config and
    the check rows (``cases``: CHECK_CASES, plus LEAN_CHECK_CASES for the lean variants) as one JSON line."""
    dev = torch.device("cuda")
    from sdquant.kernels import int4_cuda
    t = time.time()
    ok = int4_cuda.available()
    print(f"BUILD {ok} {int4_cuda._STATE.get('reason')} {time.time() - t:.1f}s", flush=True)
    if not ok:
        return
    print("OCC " + json.dumps({c: [int4_cuda.occupancy(m, 128, c) for m in occ_ms] for c in configs}), flush=True)
    rows = check_configs(dev, configs, cases or CHECK_CASES, progress=lambda c: print(f"START {c}", flush=True))
    lean = [c for c in configs if 28 <= c % 64 < 62] if cases is None else []
    if lean:
        rows += check_configs(dev, lean, LEAN_CHECK_CASES, progress=lambda c: print(f"START {c}", flush=True))
    print("ROWS " + json.dumps(rows), flush=True)


def run_checks_in_child(configs, timeout=300) -> tuple:
    """(passing configs, check rows, build line, occupancy). Re-runs without a config that killed the child."""
    # configs with instructions not yet seen on this GPU (the L2 bulk prefetch) are checked first, so a config that
    # kills the child costs little; each crash re-runs the child without it
    risky = [c for c in configs if c % 64 in RISKY_VARIANTS]
    remaining, rows, build, occ = risky + [c for c in configs if c not in risky], [], "", {}
    for attempt in range(2 + len(risky)):
        code = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import int4_tune as t; "
                f"t.child_check({remaining!r})")
        t = time.time()
        try:
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT),
                               timeout=timeout)
            out, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as ex:
            out, rc = (ex.stdout or b"").decode() if isinstance(ex.stdout, bytes) else (ex.stdout or ""), -9
        lines = out.splitlines()
        build = next((ln for ln in lines if ln.startswith("BUILD")), build)
        log(f"check child (attempt {attempt + 1}) rc={rc} in {time.time() - t:.1f} s; {build}")
        for ln in lines:
            if ln.startswith("OCC "):
                occ = json.loads(ln[4:])
                log("  resident CTAs/SM at M=1/16 (group 128): " +
                    ", ".join(f"{cfg_name(int(c))}: {v}" for c, v in occ.items()))
        got = next((ln for ln in lines if ln.startswith("ROWS ")), None)
        if got is not None:
            rows += json.loads(got[5:])
            break
        if not build.startswith("BUILD True"):
            log("  build failed:\n" + "\n".join(lines[-40:]))
            return [], rows, build, occ
        started = [int(ln.split()[1]) for ln in lines if ln.startswith("START ")]
        bad = started[-1] if started else None
        log(f"  child died (last config started: {bad}); tail:\n" + "\n".join(lines[-15:]))
        if bad is None or bad not in remaining:
            return [], rows, build, occ
        rows.append({"config": bad, "pass": False, "rel_err": float("nan"), "dtype": "?", "note": "crashed the process"})
        remaining.remove(bad)
    per = summarize_checks(rows)
    passing = [c for c in configs if c in per and per[c]["pass"] == per[c]["n"]]
    for c in configs:
        d = per.get(c)
        if d is None:
            log(f"  {cfg_name(c)}: not checked")
        else:
            log(f"  {cfg_name(c)}: {d['pass']}/{d['n']} pass, worst " +
                ", ".join(f"{k} {v:.2e}" for k, v in sorted(d["worst"].items())))
    return passing, rows, build, occ


# ------------------------------------------------------------------------------------------------ timing
time_cpu = gemm.time_cpu  # --dry: host clock, no graph


# (name, kind, variant whose resident-slot grid the probe uses: None = the probe kernel's own)
PROBES = [("lin", 0, None), ("P1@v13", 1, 13), ("P2@v15", 2, 15), ("P3", 3, None), ("P4@v19", 4, 19),
          ("P5@v23", 5, 23), ("P6@v26", 6, 26), ("P7@v50", 7, 50),
          ("P8@v58", 8, 58)]


def sweep(dev, dtype, shapes, ms, configs, budget_s, copy_bw, dry=False, full=True, tag=1) -> list:
    """Time configs (a list, or {(K, N): list} per shape) at every shape x M; full: also cuBLAS bf16, tinygemm and
    the read probes. Rows carry pass=tag."""
    rows = []
    all_configs = configs
    passing_variants = {c % 64 for c in (configs if isinstance(configs, list) else [])}
    from sdquant.kernels import int4_cuda as ic
    sms = 0 if dry else torch.cuda.get_device_properties(dev).multi_processor_count
    timer = (lambda call, n: time_cpu(call, n)) if dry else \
        (lambda call, n: gemm.time_rotating(call, n, trials=5, target_ms=2.0, max_calls=60))
    for (k, n) in shapes:
        if elapsed() > budget_s:
            log(f"time guard: stop before {k}x{n} at {elapsed():.0f} s")
            break
        t_shape = time.time()
        configs = all_configs.get((k, n), []) if isinstance(all_configs, dict) else all_configs
        qw = gemm.random_int4(n, k, device=dev, seed=k + n)
        w_ref = qw.dequantize(dtype)
        int4_bytes = n * k // 2 + n * (k // gemm.GS) * 2 * 2
        qbytes = n * k // 2
        n_int4 = 2 if dry else gemm.n_copies(int4_bytes)
        base = int4_layout.repack_cuda(qw, dtype)
        lays = [base] + [{kk: (None if v is None else v.clone()) for kk, v in base.items()} for _ in range(n_int4 - 1)]
        provs = {"bf16": (2 if dry else gemm.n_copies(n * k * 2), lambda i: w_ref.clone(),
                          lambda w, x: torch.nn.functional.linear(x, w), n * k * 2)} if full else {}
        if not dry and full:
            try:
                tw, tsz = gemm.tinygemm_pack(qw, dtype)
                provs["tinygemm"] = (n_int4, lambda i: (tw.clone(), tsz.clone()),
                                     lambda c, x: torch._weight_int4pack_mm(x, c[0], gemm.GS, c[1]), int4_bytes)
            except Exception as ex:  # noqa: BLE001
                log(f"  tinygemm unavailable: {type(ex).__name__}: {str(ex)[:200]}")
        ctx = {name: [p[1](i) for i in range(p[0])] for name, p in provs.items()}
        for m in ms:
            if elapsed() > budget_s:
                log(f"time guard: stop at {k}x{n} M={m} ({elapsed():.0f} s)")
                break
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = (x.double() @ w_ref.double().t()).float()
            res = {}
            for name, p in provs.items():
                cs = ctx[name]
                try:
                    err = gemm.rel_err(p[2](cs[0], x), ref)
                    us = timer(lambda i: p[2](cs[i % len(cs)], x), len(cs))
                    res[name] = (us, err, p[3])
                except Exception as ex:  # noqa: BLE001
                    log(f"  {name} {k}x{n} M={m}: FAILED {type(ex).__name__}: {str(ex)[:200]}")
            if not dry and full and m in PROBE_MS:
                for pname, kind, grid_of in PROBES:
                    if grid_of is not None and grid_of not in passing_variants:
                        continue  # its variant failed the check: the probe shares its instructions
                    try:
                        ctas = 0 if grid_of is None else sms * ic.occupancy(m, gemm.GS, grid_of, dtype)
                        us = timer(lambda i, kind=kind, ctas=ctas: ic.read_probe(x, lays[i % len(lays)], kind, ctas),
                                   len(lays))
                        res["probe_" + pname] = (us, float("nan"), qbytes if kind == 0 else int4_bytes)
                    except Exception as ex:  # noqa: BLE001
                        log(f"  probe {pname} {k}x{n} M={m}: FAILED {type(ex).__name__}: {str(ex)[:200]}")
            for c in (configs if m <= 16 else [cc for cc in configs if cc % 64 in (0, *ic.NT4_VARIANTS)]):
                def call(i, c=c):
                    lay = lays[i % len(lays)]
                    return torch.ops.sdquant.w4a16_cuda(x, lay["qweight"], lay["scales"], lay["zeros"], None,
                                                        lay["locks"], None, 0, False, c)
                try:
                    err = gemm.rel_err(call(0), ref)
                    res[c] = (timer(call, len(lays)), err, int4_bytes)
                except Exception as ex:  # noqa: BLE001
                    log(f"  {cfg_name(c)} {k}x{n} M={m}: FAILED {type(ex).__name__}: {str(ex)[:200]}")
            for key, (us, err, wbytes) in res.items():
                nbytes = wbytes if str(key).startswith("probe_") else wbytes + m * k * 2 + m * n * 2
                tbs = nbytes / (us * 1e-6) / 1e12
                rows.append({"pass": tag, "K": k, "N": n, "M": m, "kernel": key if isinstance(key, str) else f"cfg{key}",
                             "config": None if isinstance(key, str) else key, "us": round(us, 3),
                             "rel_err": err, "TBps": round(tbs, 3), "pct_copy": round(100 * tbs / copy_bw, 1)})
            sd = {kk: v[0] for kk, v in res.items() if not isinstance(kk, str)}
            if sd:
                best = min(sd, key=sd.get)
                sk = {c: v for c, v in sd.items() if c % 64 >= 28}
                skb = min(sk, key=sk.get) if sk else None
                prb = " ".join(f"{kk[6:]} {v[0]:.1f}" for kk, v in res.items() if str(kk).startswith("probe_"))
                log(f"  {k}x{n} M={m}: bf16 {res.get('bf16', (float('nan'),))[0]:.1f} tinygemm "
                    f"{res.get('tinygemm', (float('nan'),))[0]:.1f} v0 {sd.get(0, float('nan')):.1f} "
                    f"prev-default {sd.get(prev_config(k, n, m), float('nan')):.1f} "
                    f"best {cfg_name(best)} {sd[best]:.1f}"
                    + (f" best-lean {cfg_name(skb)} {sk[skb]:.1f}" if skb is not None else "")
                    + (f" | probes {prb}" if prb else "") + f" us  [{elapsed():.0f} s]")
        log(f"shape {k}x{n} done in {time.time() - t_shape:.1f} s")
        del lays, ctx, provs, w_ref
        if not dry:
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ choose
def _chosen_config(chosen, k, n, m) -> int:
    """The proposal's config at (K, N, M); above M = 16 only variant 0 and int4_cuda.NT4_VARIANTS exist."""
    from sdquant.kernels.int4_cuda import NT4_VARIANTS, m_bucket
    b = m_bucket(m)
    c = chosen["SHAPE_CONFIGS"].get((k, n, b), chosen["DEFAULT_CONFIGS"].get(b, 0))
    return c if b <= 16 or c % 64 in NT4_VARIANTS else 0


def confirm(dev, dtype, rows, chosen, passing, budget_s, copy_bw, dry) -> list:
    want = {}
    ms = sorted({r["M"] for r in rows if r["M"] <= 32})
    pts = {}
    for r in rows:
        if r["config"] is not None and r["M"] <= 32:
            pts.setdefault((r["K"], r["N"], r["M"]), {})[r["config"]] = r["us"]
    for (k, n, m), d in pts.items():
        s = want.setdefault((k, n), set())
        s.update(c for c in (_chosen_config(chosen, k, n, m), prev_config(k, n, m), min(d, key=d.get)) if c in passing)
    shapes = [kn for kn in RUN_ORDER if kn in want] + [kn for kn in want if kn not in RUN_ORDER]
    log(f"confirm pass over {sum(len(v) for v in want.values())} (shape, config) pairs [{elapsed():.0f} s]")
    conf = sweep(dev, dtype, shapes, ms, {kn: sorted(v) for kn, v in want.items()}, budget_s, copy_bw, dry=dry,
                 full=False, tag=2)
    c2 = {(r["K"], r["N"], r["M"], r["config"]): r["us"] for r in conf}
    for (k, n, m) in pts:
        c, old = _chosen_config(chosen, k, n, m), prev_config(k, n, m)
        if c != old and (k, n, m, c) in c2 and (k, n, m, old) in c2 and c2[(k, n, m, c)] > c2[(k, n, m, old)]:
            from sdquant.kernels.int4_cuda import m_bucket
            chosen["SHAPE_CONFIGS"][(k, n, m_bucket(m))] = old
            chosen["guarded"].append(f"confirm {k}x{n}:M{m} {cfg_name(c)} -> {cfg_name(old)} "
                                     f"({c2[(k, n, m, c)]:.1f} > {c2[(k, n, m, old)]:.1f} us)")
    return conf


def confirm_table(rows, chosen) -> str:
    by = {}
    for r in rows:
        if r["config"] is not None:
            by.setdefault((r["K"], r["N"], r["M"], r["config"]), {})[r.get("pass", 1)] = r["us"]
    keys = sorted({(r["K"], r["N"], r["M"]) for r in rows if r.get("pass") == 2},
                  key=lambda t: (RUN_ORDER.index((t[0], t[1])) if (t[0], t[1]) in RUN_ORDER else 99, t[2]))
    out = ["| K×N | M | prev default µs (pass 1 / 2) | final default µs (pass 1 / 2) | final ÷ prev (both passes) |",
           "|---|---|---|---|---|"]
    f = lambda d, p: f"{d[p]:.1f}" if p in d else "–"  # noqa: E731
    for (k, n, m) in keys:
        c, old = _chosen_config(chosen, k, n, m), prev_config(k, n, m)
        dn, do = by.get((k, n, m, c), {}), by.get((k, n, m, old), {})
        rat = " / ".join(f"{dn[p] / do[p]:.3f}" for p in (1, 2) if p in dn and p in do)
        out.append(f"| {k}×{n} | {m} | {f(do, 1)} / {f(do, 2)} ({cfg_name(old)}) | {f(dn, 1)} / {f(dn, 2)} "
                   f"({cfg_name(c)}) | {rat} |")
    return "\n".join(out)


def choose(rows, tol: float = 0.03) -> dict:
    """Per M bucket: the config with the best geometric-mean time ratio to each point's fastest config, over
    the shapes measured (ties to the previous default within tol); per (K, N, M): overrides where the shape's winner
    beats that default by more than tol. Last, no measured point may get slower than the previous default measured in
    the same run: where the choice is, the point's fastest config overrides it."""
    from sdquant.kernels.int4_cuda import m_bucket
    pts = {}
    for r in rows:
        if r["config"] is not None and r.get("pass", 1) == 1:
            pts.setdefault((r["K"], r["N"], r["M"]), {})[r["config"]] = r["us"]
    buckets = {}
    for (k, n, m), d in pts.items():
        buckets.setdefault(m_bucket(m), []).append(((k, n, m), d))
    defaults, overrides, score_log = {}, {}, {}
    for b, items in sorted(buckets.items()):  # bucket 32: the sweep timed only the configs that exist there
        common = set.intersection(*(set(d) for _, d in items))
        scores = {c: math.exp(statistics.fmean(math.log(d[c] / min(d.values())) for _, d in items)) for c in common}
        if not scores:
            continue
        best = min(scores, key=scores.get)
        old = PREV_DEFAULTS.get(b, 0)
        if old in scores and scores[old] <= scores[best] * (1 + tol):
            best = old
        defaults[b] = best
        score_log[b] = {cfg_name(c): round(s, 4) for c, s in sorted(scores.items(), key=lambda t: t[1])}
        for (k, n, m), d in items:
            w = min(d, key=d.get)
            if w != best and best in d and d[w] * (1 + tol) < d[best]:
                overrides[(k, n, b)] = w
    guarded = []
    for (k, n, m), d in pts.items():
        b = m_bucket(m)
        c = overrides.get((k, n, b), defaults.get(b, 0))
        old = prev_config(k, n, m)
        if old in d and (c not in d or d[c] > d[old]):
            w = min(d, key=d.get)
            overrides[(k, n, b)] = w
            guarded.append(f"{k}x{n}:M{m} {cfg_name(c)} -> {cfg_name(w)}")
    return {"DEFAULT_CONFIGS": defaults, "SHAPE_CONFIGS": overrides, "scores": score_log, "guarded": guarded}


def table(rows, chosen) -> str:
    cells = {}
    for r in rows:
        cells[(r["K"], r["N"], r["M"], r["kernel"])] = r
    keys = sorted({(r["K"], r["N"], r["M"]) for r in rows},
                  key=lambda t: (RUN_ORDER.index((t[0], t[1])) if (t[0], t[1]) in RUN_ORDER else 99, t[2]))
    from sdquant.kernels.int4_cuda import m_bucket
    out = ["| K×N | M | bf16 | tinygemm | prev default | new default | best of sweep | ×bf16 | ×tinygemm | ×prev | "
           "TB/s (% of 4.3) | floor µs | read probe lin / P1@v13 / P2@v15 / P3 / P4@v19 / P5@v23 / P6@v26 µs |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
    for (k, n, m) in keys:
        def us(name):
            r = cells.get((k, n, m, name))
            return None if r is None else r["us"]
        sdq = {r["config"]: r for (kk, nn, mm, _), r in cells.items() if (kk, nn, mm) == (k, n, m) and r["config"] is not None}
        if not sdq:
            continue
        best = min(sdq, key=lambda c: sdq[c]["us"])
        b = m_bucket(m)
        dflt = _chosen_config(chosen, k, n, m)
        dflt = dflt if dflt in sdq else best
        old = prev_config(k, n, m)
        d_us, o_us = sdq[dflt]["us"], (sdq[old]["us"] if old in sdq else None)
        bf, tg = us("bf16"), us("tinygemm")
        floor = (n * k // 2 + n * (k // gemm.GS) * 4 + m * k * 2 + m * n * 2) / 4.3e12 * 1e6
        probes = [us("probe_" + p[0]) for p in PROBES]
        ratio = lambda a, bb: "–" if not a or not bb else f"{a / bb:.2f}"  # noqa: E731
        out.append(f"| {k}×{n} | {m} | {f(bf)} | {f(tg)} | {f(o_us)} (v{old % 64}) | **{d_us:.1f}** ({cfg_name(dflt)}) | "
                   f"{sdq[best]['us']:.1f} ({cfg_name(best)}) | {ratio(bf, d_us)} | {ratio(tg, d_us)} | "
                   f"{ratio(o_us, d_us)} | {sdq[dflt]['TBps']:.2f} ({100 * sdq[dflt]['TBps'] / 4.3:.0f}%) | "
                   f"{floor:.1f} | {' / '.join(f(p) for p in probes) if any(probes) else '–'} |")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ ncu
NCU_POINTS = [(8192, 28672, 1), (8192, 28672, 16), (4096, 4096, 1)]


def ncu_child(items) -> None:
    """Run under ncu: each item (K, N, M, config or 'probeK') launched twice (warm-up + the one to read)."""
    from sdquant.kernels import int4_cuda as ic
    dev = torch.device("cuda")
    assert ic.available(), ic._STATE.get("reason")
    cache = {}
    for i, (k, n, m, c) in enumerate(items):
        if (k, n) not in cache:
            cache.clear()
            cache[(k, n)] = int4_layout.repack_cuda(gemm.random_int4(n, k, device=dev, seed=k + n), torch.bfloat16)
        lay = cache[(k, n)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        print(f"ITEM {i}: {k}x{n} M={m} {c if isinstance(c, str) else cfg_name(c)}", flush=True)
        for _ in range(2):
            if isinstance(c, str):
                kind = int(c[5:])
                ctas = 0 if kind in (0, 3) else \
                    torch.cuda.get_device_properties(dev).multi_processor_count * ic.occupancy(m, gemm.GS, {1: 13, 2: 15, 4: 19, 5: 23, 6: 26}[kind])
                ic.read_probe(x, lay, kind, ctas)
            else:
                torch.ops.sdquant.w4a16_cuda(x, lay["qweight"], lay["scales"], lay["zeros"], None, lay["locks"], None,
                                             0, False, c)
        torch.cuda.synchronize()


def run_ncu(items, report: Path, kernel_regex: str, sections, keep, timeout: float, width: int = 220,
            extra=()) -> None:
    """Profile ncu_child(items) under ncu (kernels matching kernel_regex, the given sections, clocks not locked,
    ``extra`` ncu arguments); the full report to ``report``, the lines containing any of ``keep`` to the log."""
    import shutil
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import int4_tune as t; "
            f"t.ncu_child({items!r})")
    cmd = [ncu, "--clock-control", "none", "--kernel-name", f"regex:{kernel_regex}",
           *[a for sec in sections for a in ("--section", sec)], *extra, sys.executable, "-c", code]
    t = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), timeout=timeout)
        txt, rc = r.stdout + "\n" + r.stderr, r.returncode
    except Exception as ex:  # noqa: BLE001
        txt, rc = f"ncu failed: {type(ex).__name__}: {ex}", -1
    report.write_text(txt)
    log(f"ncu rc={rc} in {time.time() - t:.0f} s; report in {report.name}")
    for ln in txt.splitlines():
        if any(kw in ln for kw in keep):
            log(ln.rstrip()[:width])


def ncu_main(json_path, out, timeout: float = 400) -> None:
    d = json.loads(Path(json_path).read_text())
    ch = d.get("chosen") or {}
    dflt = {int(b): c for b, c in (ch.get("DEFAULT_CONFIGS") or {}).items()}
    shp = {}
    for key, c in (ch.get("SHAPE_CONFIGS") or {}).items():
        kn, b = key.split(":M")
        k, n = (int(v) for v in kn.split("x"))
        shp[(k, n, int(b))] = c
    from sdquant.kernels.int4_cuda import m_bucket
    items = []
    for (k, n, m) in NCU_POINTS:
        b = m_bucket(m)
        for c in dict.fromkeys([shp.get((k, n, b), dflt.get(b, 0)), prev_config(k, n, m)]):
            items.append((k, n, m, c))
        if m == 1:
            items += [(k, n, m, "probe0"), (k, n, m, "probe4")]
    log("ncu items: " + "; ".join(f"{i}: {it}" for i, it in enumerate(items)))
    run_ncu(items, out / "int4_ncu.txt", "w4a16|probe",
            ("SpeedOfLight", "Occupancy", "LaunchStats", "SchedulerStats", "WarpStateStats", "MemoryWorkloadAnalysis"),
            ("ITEM", "w4a16", "probe", "DRAM Throughput", "Memory Throughput", "Duration", "Achieved Occupancy",
             "Registers Per", "Grid Size", "Block Size", "Issue Slots Busy", "No Eligible", "Active Warps Per",
             "Eligible Warps", "Warp Cycles Per Issued", "Theoretical Occupancy", "L2 Hit", "Mem Busy",
             "Max Bandwidth"), timeout, width=160)
    (out / "int4_ncu.log").write_text("\n".join(LOG) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU only: no build, tiny shapes, the op's PyTorch path")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop timing this many seconds after start")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in RUN_ORDER))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--configs", default=",".join(map(str, CONFIGS)))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--check-timeout", type=float, default=300.0, help="seconds for the build + check child")
    ap.add_argument("--then-ncu", type=float, default=0.0, help="after the sweep, profile its defaults with ncu if "
                    "this many seconds since the start leave >= 60 s for it (0: no)")
    ap.add_argument("--ncu", default="", help="a sweep's int4_tune.json: profile its final defaults, the previous ones and the "
                                              "read probes with Nsight Compute (ncu --clock-control none)")
    a = ap.parse_args(argv)
    os.environ.setdefault("SDQUANT_CACHE_DIR", "/tmp/sdq_ext")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.ncu:
        return ncu_main(a.ncu, out)
    dtype = getattr(torch, a.dtype)
    configs = [int(c) for c in a.configs.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.ms.split(",")]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "commit": os.environ.get("SDQUANT_COMMIT", "?"), "src_digest": provenance.source_digest(),
            "dtype": a.dtype, "group_size": gemm.GS, "configs": {c: cfg_name(c) for c in configs}, "dry": a.dry}
    from sdquant.kernels import int4_cuda  # noqa: F401  (registers the op)
    if a.dry:
        dev, copy_bw = torch.device("cpu"), 4.3
        shapes = [(256, 128), (128, 192)]
        ms = [1, 16, 32]
        crows = check_configs(dev, configs[:3], [(256, 128, 64, False, True, torch.bfloat16, (1, 5)),
                                                 (128, 64, -1, True, False, torch.float16, (2,))])
        passing = configs
        meta["device"] = "cpu (dry run)"
    else:
        dev = torch.device("cuda")
        meta["device"] = torch.cuda.get_device_name()
        passing, crows, build, occ = run_checks_in_child(configs, timeout=a.check_timeout)
        meta.update(build=build, occupancy=occ)
        from sdquant.kernels import int4_cuda as ic
        if not ic.available():
            log(f"extension unavailable in the parent: {ic._STATE.get('reason')}")
            passing = []
        copy_bw = gemm.copy_bandwidth(dev)
    meta["copy_TBps"] = copy_bw
    log(f"device {meta['device']} torch {torch.__version__} copy {copy_bw:.2f} TB/s; passing configs: "
        f"{[cfg_name(c) for c in passing]} [{elapsed():.0f} s]")

    def save(rows, chosen=None):
        tmp = out / "int4_tune.json.tmp"
        tmp.write_text(json.dumps({"meta": meta, "check": crows, "rows": rows, "chosen": chosen}, indent=1,
                                  default=str))
        os.replace(tmp, out / "int4_tune.json")
    rows = []
    try:
        rows = sweep(dev, dtype, shapes, ms, passing, a.budget_s, copy_bw, dry=a.dry)
    except Exception as ex:  # noqa: BLE001 - keep what was measured
        log(f"sweep aborted: {type(ex).__name__}: {str(ex)[:300]}")
    chosen = choose(rows)
    save(rows, None)
    # confirm pass: the proposed default, the previous default and the point's fastest config timed again in the same
    # process; a point whose new default is slower than the previous one in either pass gets the previous config back
    conf_rows = []
    try:
        conf_rows = confirm(dev, dtype, rows, chosen, passing, a.budget_s + 60, copy_bw, a.dry)
    except Exception as ex:  # noqa: BLE001
        log(f"confirm pass aborted: {type(ex).__name__}: {str(ex)[:300]}")
    rows += conf_rows
    save(rows, {"DEFAULT_CONFIGS": chosen["DEFAULT_CONFIGS"], "scores": chosen["scores"], "guarded": chosen["guarded"],
                "SHAPE_CONFIGS": {f"{k}x{n}:M{b}": c for (k, n, b), c in chosen["SHAPE_CONFIGS"].items()}})
    (out / "int4_tune.log").write_text("\n".join(LOG) + "\n")
    log(f"scores (geo-mean time / best, per M bucket): {json.dumps(chosen['scores'])}")
    log(f"proposed DEFAULT_CONFIGS = {chosen['DEFAULT_CONFIGS']}")
    log(f"proposed SHAPE_CONFIGS = {chosen['SHAPE_CONFIGS']}")
    log(f"guarded (choice was slower than the previous default there): {chosen['guarded']}")
    log(table([r for r in rows if r.get("pass", 1) == 1], chosen))
    log(confirm_table(rows, chosen))
    (out / "int4_tune.log").write_text("\n".join(LOG) + "\n")
    if a.then_ncu and not a.dry:
        left = a.then_ncu - elapsed()
        if left >= 60:
            LOG.clear()
            ncu_main(str(out / "int4_tune.json"), out, timeout=left - 5)
        else:
            log(f"no time left for ncu ({left:.0f} s)")


if __name__ == "__main__":
    main()
