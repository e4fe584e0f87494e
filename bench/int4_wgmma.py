"""The wgmma W4A16 kernel (CUDA variants 62-63, csrc/w4a16_wgmma.cuh) on the H200, in one call (issue 4: M = 17-256).

1. A child process builds the extension and checks every config against a float64 reference (symmetric and
   asymmetric, groups 32/64/96/128/per-channel, act-order, fp16/bf16, M = 1-300 with several launches past 256,
   automatic and forced split-K; output poisoned with NaN, each call twice and bit-identical, locks back at zero).
   A config that fails is not timed.
2. Times, per Llama-3-8B shape and M, in one process: cuBLAS bf16 ``F.linear``; the op's routes before this kernel
   (the Triton W4A16 op, whose mid-M GEMM serves M = 17-256 today, and the CUDA decode kernels' default config at
   M <= 32); torch's tinygemm (M <= 64); and every passing wgmma config with its automatic split-K. Weights copied
   past 3x the 60 MB L2 and rotated, back-to-back calls in one CUDA graph, median of 5 replays (bench/gemm.py).
   Every timed call is checked against the reference too.

    python bench/int4_wgmma.py --out $OUT                  # on the GPU machine; table last, JSON in $OUT
    python bench/int4_wgmma.py --dry                       # CPU: the op's PyTorch path on tiny shapes (CI)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm  # noqa: E402
import gpu_clocks  # noqa: E402
import int4_tune  # noqa: E402
import provenance  # noqa: E402

from sdquant.kernels import int4_layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [62, 63]
MS = [16, 32, 64, 128, 256]
SHAPES = gemm.RUN_ORDER
CHECK_CASES = [  # (K, N, group, symmetric, act_order, dtype, Ms); N % 256 == 0 (the kernel's tile)
    (4096, 4096, 128, True, False, torch.bfloat16, (1, 5, 16, 17, 33, 64, 100, 128, 256, 300)),
    (4096, 4096, 128, False, False, torch.float16, (1, 16, 64, 130)),
    (1024, 512, 32, False, False, torch.bfloat16, (3, 40)),
    (2048, 768, 64, True, True, torch.bfloat16, (7, 70)),
    (1536, 1280, -1, False, False, torch.bfloat16, (9, 65)),
    (1536, 256, 96, False, False, torch.float16, (2, 33)),      # a group boundary inside a 64-K stage
    (14336, 4096, 128, True, False, torch.bfloat16, (32, 128)),  # a timed shape: long K, split-K
    # more tiles than SMs at a short K: stream-K ranges ("wssk") that hold whole tiles as well as parts
    (1024, 17920, 128, True, False, torch.bfloat16, (200, 256)),
    # M > 256 where the warp-specialized kernel takes every row in one launch (wgmma_rows), with and without split-K
    (4096, 6144, 128, True, False, torch.bfloat16, (520, 1100)),
    (4096, 6144, 128, False, False, torch.float16, (600,)),
    (4096, 6144, -1, False, False, torch.bfloat16, (777,)),
]
DRY_CASES = [(128, 256, 32, False, False, torch.bfloat16, (1, 40)), (256, 512, 64, True, True, torch.float16, (17,)),
             (192, 256, -1, True, False, torch.bfloat16, (5,))]


def log(*a):
    print(*a, flush=True)


def label(config: int, mode: str) -> str:
    """A timed kernel: config 62 / 63 with the automatic schedule of the 128-token tile ("62") or with one forced
    (int4_cuda.set_wgmma_schedule: "62-split", "62-stream", "63-ws")."""
    return str(config) if mode == "auto" else f"{config}-{mode}"


def parse_label(lab: str) -> tuple:
    c, _, mode = str(lab).partition("-")
    return int(c), mode or "auto"


class schedule_set:
    """Run a block with int4_cuda.set_wgmma_schedule(mode) in force (launches and the split / grid choice read it);
    mode "r256" is the automatic schedule with 256-row launches at M > 256 (int4_cuda.set_wgmma_rows(256), the rule
    before the warp-specialized kernel took every row in one launch); "k<K>" the automatic schedule with every row of
    M > 256 in one launch wherever K <= <K> (int4_cuda.set_wgmma_one_launch_k; "k4096" the default since 2026-12-07,
    "k0" none: the fill test alone); "nocl" the automatic schedule with the warp-specialized split-K summed by a second
    kernel, not inside a cluster (int4_cuda.set_wgmma_cluster(False)); "cr<N>" that cluster sum from N rows of the
    128-token tile up (int4_cuda.set_wgmma_cluster_rows; 65 the default since 2026-12-07, "cr97" the rule before);
    "nowave" the automatic schedule without two splits in clusters where one launch's last wave is part-empty
    (int4_cuda.set_wgmma_wave_splits(False); "wave" forces them on, the default since int4_wgmma run 39); "wc<N>"
    those splits' rule charging the cluster sum N stages (int4_cuda.set_wgmma_wave_cost; 4 the default since
    2026-12-07, "wc0" the fill rule alone); "nosk" no stream-K above 256 rows
    (int4_cuda.set_wgmma_stream_k_above_256(False)); "1wg" / "2wg" one / two warpgroups at the 16- (raw), 32- and
    64-token tiles everywhere (int4_cuda.set_wgmma_two_warpgroups("never" / "always"); "auto" has two only where the
    one-warpgroup grid holds at most one CTA a SM); "rem32" / "rem64" the
    automatic schedule with a last 128-token tile of at most 32 / 64 rows run as a small-M launch of its own wherever
    it occurs, "rem0" with no such launch even where the automatic rules split one off (int4_cuda.set_wgmma_remainder;
    "auto" keeps its rules, and the op here gets no plan's tail, so at M = 129-256 "auto" equals "rem0"). Modes join
    with "+" ("k0+wc0": the automatic schedule as it was before 2026-12-07)."""

    def __init__(self, mode: str):
        self.modes = [m for m in mode.split("+") if m]
        self.undo = []

    @staticmethod
    def _set(mode: str):
        """Apply one mode; returns the call that restores what it changed (None for "auto")."""
        from sdquant.kernels import int4_cuda as c
        if mode in ("rem0", "rem32", "rem64"):
            old = c.set_wgmma_remainder(int(mode[3:]))
            return lambda: c.set_wgmma_remainder(old)
        if mode == "r256":
            old = c.set_wgmma_rows(256)
            return lambda: c.set_wgmma_rows(old)
        if mode.startswith("k") and mode[1:].isdigit():
            old = c.set_wgmma_one_launch_k(int(mode[1:]))
            return lambda: c.set_wgmma_one_launch_k(old)
        if mode.startswith("wc") and mode[2:].isdigit():
            old = c.set_wgmma_wave_cost(int(mode[2:]))
            return lambda: c.set_wgmma_wave_cost(old)
        if mode.startswith("cr") and mode[2:].isdigit():
            old = c.set_wgmma_cluster_rows(int(mode[2:]))
            return lambda: c.set_wgmma_cluster_rows(old)
        if mode == "nocl":
            old = c.set_wgmma_cluster(False)
            return lambda: c.set_wgmma_cluster(old)
        if mode in ("1wg", "2wg"):
            old = c.set_wgmma_two_warpgroups("never" if mode == "1wg" else "always")
            return lambda: c.set_wgmma_two_warpgroups(old)
        if mode == "nosk":
            old = c.set_wgmma_stream_k_above_256(False)
            return lambda: c.set_wgmma_stream_k_above_256(old)
        if mode in ("wave", "nowave"):
            old = c.set_wgmma_wave_splits(mode == "wave")
            return lambda: c.set_wgmma_wave_splits(old)
        if mode != "auto":
            old = c.set_wgmma_schedule(mode)
            return lambda: c.set_wgmma_schedule(old)
        return None

    def __enter__(self):
        self.undo = [u for u in (self._set(m) for m in self.modes) if u is not None]
        return self

    def __exit__(self, *exc):
        for u in reversed(self.undo):
            u()
        self.undo = []
        return False


def child_check(configs, modes=("auto",)) -> None:
    """Entry of the checking child (run_checks): int4_tune's checks with this kernel's cases, once per stream-K
    mode; rows and occupancy are labelled "62", "62-on", ..."""
    from sdquant.kernels import int4_cuda
    t = time.time()
    ok = int4_cuda.available()
    print(f"BUILD {ok} {int4_cuda._STATE.get('reason')} {time.time() - t:.1f}s", flush=True)
    if not ok:
        return
    dev = torch.device("cuda")
    occ, rows = {}, []
    for mode in modes:
        with schedule_set(mode):
            for c in configs:
                occ[label(c, mode)] = [int4_cuda.occupancy(m, 128, c) for m in (16, 32, 64, 128)]
            got = int4_tune.check_configs(dev, configs, CHECK_CASES,
                                          progress=lambda c, mode=mode: print(f"START {label(c, mode)}", flush=True))
        for r in got:
            r["config"] = label(r["config"], mode)
        rows += got
    occ["max_clusters_2_8"] = [int4_cuda.wgmma_max_clusters(sz) for sz in range(2, 9)]
    print("OCC " + json.dumps(occ), flush=True)
    print("ROWS " + json.dumps(rows), flush=True)


def run_checks(configs, timeout: float, modes=("auto",)) -> tuple:
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import int4_wgmma as t; "
            f"t.child_check({configs!r}, {tuple(modes)!r})")
    t = time.time()
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=timeout)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as ex:
        out = ex.stdout.decode() if isinstance(ex.stdout, bytes) else (ex.stdout or "")
        rc = -9
    lines = out.splitlines()
    build = next((ln for ln in lines if ln.startswith("BUILD")), "")
    log(f"check child rc={rc} in {time.time() - t:.1f} s; {build}")
    occ = next((json.loads(ln[4:]) for ln in lines if ln.startswith("OCC ")), {})
    if occ:
        log("  resident CTAs/SM at M = 16/32/64/128: " + ", ".join(f"v{c}: {v}" for c, v in occ.items()))
    got = next((ln for ln in lines if ln.startswith("ROWS ")), None)
    if got is None:
        log("  no check rows; tail:\n" + "\n".join(lines[-40:]))
        return [], [], build, occ
    rows = json.loads(got[5:])
    per = int4_tune.summarize_checks(rows)
    labels = [label(c, mode) for mode in modes for c in configs]
    passing = [c for c in labels if c in per and per[c]["pass"] == per[c]["n"]]
    for c in labels:
        d = per.get(c, {"n": 0, "pass": 0, "worst": {}})
        log(f"  v{c}: {d['pass']}/{d['n']} pass, worst " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(d["worst"].items())))
    return passing, rows, build, occ


def timed_names(configs, splits=(0,)) -> list:
    """Row keys of the timed wgmma calls: "v62", "v63-on", ... with the automatic split-K / grid, "v63s8" with 8
    forced splits (or a stream-K grid of 8)."""
    return [f"v{lab}" + (f"s{sp}" if sp else "") for lab in configs for sp in splits]


def time_shapes(dev, shapes, ms, configs, dry: bool, budget_s: float, t_start: float, splits=(0,),
                rounds: int = 1, skip=()) -> list:
    from sdquant.kernels import int4_cuda
    dtype = torch.bfloat16
    rows = []
    timer = (lambda call, n: gemm.time_cpu(call, n)) if dry else (lambda call, n: gemm.time_rotating(call, n))
    for (k, n) in shapes:
        if time.time() - t_start > budget_s:
            log(f"budget reached before {k}x{n}")
            break
        t0 = time.time()
        qw = gemm.random_int4(n, k, device=dev, seed=k + n)
        w_ref = qw.dequantize(dtype)
        wbytes = n * k // 2 + n * (k // gemm.GS) * 4
        ncopy = 1 if dry else gemm.n_copies(wbytes)
        lay_c = [int4_layout.repack_cuda(qw, dtype) for _ in range(ncopy)]
        lay_t = [int4_layout.repack_triton(qw, dtype) for _ in range(ncopy)]
        dense = [w_ref.clone() for _ in range(1 if dry else gemm.n_copies(n * k * 2))]
        tiny = None
        if not dry:
            w4, sz = gemm.tinygemm_pack(qw, dtype)
            tiny = [(w4.clone(), sz.clone()) for _ in range(ncopy)]
        cop, top = torch.ops.sdquant.w4a16_cuda, torch.ops.sdquant.w4a16_triton
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = (x.double() @ w_ref.double().t()).float()
            provs = {"bf16": (lambda i: torch.nn.functional.linear(x, dense[i]), len(dense)),
                     "triton": (lambda i: top(x, lay_t[i]["qweight"], lay_t[i]["scales"], lay_t[i]["zs"],
                                              lay_t[i]["perm"], None), ncopy)}
            if m <= 32:  # the CUDA op's choice before the wgmma kernel (auto_config without it)
                prev = int4_cuda.auto_config(m, n, k, dtype, wgmma=False)
                provs["cuda_default"] = (lambda i: cop(x, lay_c[i]["qweight"], lay_c[i]["scales"], lay_c[i]["zeros"],
                                                       lay_c[i]["perm"], lay_c[i]["locks"], None, 0, False, prev),
                                         ncopy)
            if m > 256:  # the layer's other path there: dequantize the CUDA layout, then cuBLAS
                provs["dequant"] = (lambda i: torch.ops.sdquant.w4a16_dequant_cuda(
                    x, lay_c[i]["qweight"], lay_c[i]["scales"], lay_c[i]["zeros"], lay_c[i]["perm"], None), ncopy)
            if tiny is not None and m <= 64:
                provs["tinygemm"] = (lambda i: torch._weight_int4pack_mm(x, tiny[i][0], gemm.GS, tiny[i][1]), ncopy)
            for name in skip:
                provs.pop(name, None)
            mode_of = {}
            for lab in configs:  # labels: "62", "63-on", ...
                c, mode = parse_label(lab)
                for sp in splits:
                    name = f"v{lab}" + (f"s{sp}" if sp else "")
                    mode_of[name] = mode
                    provs[name] = (lambda i, c=c, sp=sp: cop(x, lay_c[i]["qweight"], lay_c[i]["scales"],
                                                             lay_c[i]["zeros"], lay_c[i]["perm"], lay_c[i]["locks"],
                                                             None, sp, False, c), ncopy)
            row = {"K": k, "N": n, "M": m,
                   "v63_rows_a_launch": int4_cuda.launch_rows(m, n, k, gemm.GS, 63, dtype) if not dry else None}
            if not dry:  # the path of the (first) launch under each timed mode
                for lab in configs:
                    c, mode = parse_label(lab)
                    with schedule_set(mode):
                        r_m = min(m, int4_cuda.launch_rows(m, n, k, gemm.GS, c, dtype))
                        row[f"v{lab}_path"] = int4_cuda.wgmma_path(r_m, n, k, gemm.GS, c, dtype)
            t_row = time.monotonic()
            ok = []
            for name, (call, nrot) in provs.items():  # each output checked once, then the timing rounds
                try:
                    with schedule_set(mode_of.get(name, "auto")):
                        row[name + "_err"] = gemm.rel_err(call(0), ref)
                    ok.append(name)
                except Exception as ex:  # noqa: BLE001 - reported in the row
                    log(f"  {name} {k}x{n} M={m}: FAILED {type(ex).__name__}: {str(ex)[:200]}")
                    row[name] = None
            times = {name: [] for name in ok}
            for rnd in range(max(1, rounds)):  # round robin, each round starting one kernel later
                for name in ok[rnd % len(ok):] + ok[:rnd % len(ok)] if ok else []:
                    call, nrot = provs[name]
                    with schedule_set(mode_of.get(name, "auto")):
                        times[name].append(timer(call, nrot))
            for name, ts in times.items():
                row[name] = round(statistics.median(ts), 2)
                if rounds > 1:
                    row[name + "_rounds"] = [round(t, 2) for t in ts]
            if not dry:  # the clocks and power while this row's kernels ran (bench/gpu_clocks.py)
                row["gpu"] = gemm.gpu_state(t_row, time.monotonic())
            rows.append(row)
            log("  " + json.dumps(row))
        log(f"shape {k}x{n} done in {time.time() - t0:.1f} s")
        del lay_c, lay_t, dense, tiny
        if not dry:
            torch.cuda.empty_cache()
    return rows


NCU_ITEMS = [(8192, 28672, 32, 62), (8192, 28672, 128, 63)]


def ncu(out: Path, items, timeout: float = 300) -> None:
    """Profile the items (K, N, M, config) with ncu (int4_tune.ncu_child launches each twice); key lines to the log."""
    int4_tune.run_ncu(items, out / "int4_wgmma_ncu.txt", "wgmma",
                      ("SpeedOfLight", "Occupancy", "SchedulerStats", "WarpStateStats", "LaunchStats",
                       "ComputeWorkloadAnalysis"),
                      ("ITEM", "Duration", "DRAM Throughput", "Compute (SM)", "Achieved Occupancy", "Registers Per",
                       "Grid Size", "Issue Slots Busy", "No Eligible", "Eligible Warps", "Warp Cycles Per Issued",
                       "stalled", "L2 Cache Thr"), timeout)
    # the stall reasons (the section's body: warp cycles per issued instruction spent in each state)
    int4_tune.run_ncu(items, out / "int4_wgmma_ncu_stalls.txt", "wgmma", ("WarpStateStats",),
                      ("ITEM", "Stall", "stall"), timeout, extra=("--print-details", "all"))


def table(rows, names) -> str:
    head = ["K×N", "M", "bf16", "Triton op", "CUDA before", "tinygemm", "dequant + cuBLAS", *names,
            "best wgmma ×bf16", "÷ best before", "SM MHz (min)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        new = [r.get(c) for c in names if r.get(c) is not None]
        old = [r.get(k) for k in ("triton", "cuda_default") if r.get(k) is not None]
        best = min(new) if new else None
        fmt = (lambda v: "–" if v is None else f"{v:.1f}")
        out.append("| " + " | ".join([f"{r['K']}×{r['N']}", str(r["M"]), fmt(r.get("bf16")), fmt(r.get("triton")),
                                       fmt(r.get("cuda_default")), fmt(r.get("tinygemm")), fmt(r.get("dequant")),
                                       *[fmt(r.get(c)) for c in names],
                                       "–" if best is None or not r.get("bf16") else f"{r['bf16'] / best:.2f}",
                                       "–" if best is None or not old else f"{min(old) / best:.2f}",
                                       gpu_clocks.mhz(r.get("gpu"))]) + " |")
    return "\n".join(out)


def update_table(json_path: str, table_path: str) -> None:
    """Write the wgmma kernel's times into the crossover table's "cuda" column at the buckets where the op now runs
    it (auto_config -> a WGMMA variant), for the table's int4 entries that the run measured."""
    from sdquant.kernels import dispatch, int4_cuda
    d = json.loads(Path(json_path).read_text())
    tab = json.loads(Path(table_path).read_text())
    buckets = tab["buckets"]
    changed = []
    for r in d["rows"]:
        k, n, m = r["K"], r["N"], r["M"]
        c = int4_cuda.auto_config(m, n, k)
        if m not in buckets or c % 64 not in int4_cuda.WGMMA_VARIANTS or r.get(f"v{c}") is None:
            continue
        for e in tab["entries"]:
            if e["kind"] == "int4" and e["N"] == n and e["K"] == k and e["dtype"] == "bfloat16":
                e["us"]["cuda"][buckets.index(m)] = r[f"v{c}"]
                changed.append(f"{k}x{n}@M{m}")
    note = (f"cuda column at {', '.join(changed)}: the wgmma kernel (auto_config), bench/int4_wgmma.py "
            f"{d.get('date')} commit {d.get('commit')}")
    meta = tab.setdefault("meta", {})
    prev = meta.get("int4_cuda_wgmma")  # earlier runs' notes stay: each names the cells it wrote, the last one wins
    meta["int4_cuda_wgmma"] = [*([prev] if isinstance(prev, str) else prev or []), note]
    dispatch.write_table(tab, table_path)
    log(f"updated {len(changed)} cells: {', '.join(changed)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--configs", default=",".join(map(str, CONFIGS)))
    ap.add_argument("--schedule", default="auto", help="schedules of the 128-token tile to check and time, each config "
                                                        "in each (auto,split,stream,ws,wssk: int4_cuda.set_wgmma_schedule; r256: auto "
                                                        "with 256-row launches, int4_cuda.set_wgmma_rows; nocl: "
                                                        "no cluster split-K sum, int4_cuda.set_wgmma_cluster; cr97: "
                                                        "that sum from 97 rows up (the rule before 2026-12-07), "
                                                        "int4_cuda.set_wgmma_cluster_rows; nowave "
                                                        "/ wave: without / with two splits at M > 256 where "
                                                        "waves gain, int4_cuda.set_wgmma_wave_splits; rem32 / "
                                                        "rem64: a last tile of <= 32 / 64 rows as a launch of its "
                                                        "own, rem0: never, int4_cuda.set_wgmma_remainder; k4096 / k0: M > 256 "
                                                        "in one launch wherever K <= 4096, "
                                                        "int4_cuda.set_wgmma_one_launch_k; 1wg / 2wg: one / two "
                                                        "warpgroups at the 16- (raw), 32- and 64-token tiles, "
                                                        "int4_cuda.set_wgmma_two_warpgroups)")
    ap.add_argument("--splits", default="0", help="split-K factors (stream-K grids) to time each config at; "
                                                  "0 = automatic")
    ap.add_argument("--rounds", type=int, default=1, help="time each point's kernels round robin this many times, each "
                                                          "round starting one kernel later; each keeps its median "
                                                          "(<name>_rounds lists them)")
    ap.add_argument("--skip", default="", help="baselines not to time, comma-separated (triton, dequant, tinygemm, "
                                               "cuda_default); bf16 is always timed")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new shapes after this many seconds")
    ap.add_argument("--check-timeout", type=float, default=300.0)
    ap.add_argument("--update-table", nargs=2, metavar=("RUN_JSON", "TABLE"),
                    help="write a run's wgmma times into a crossover table (no GPU needed) and exit")
    ap.add_argument("--ncu", action="store_true", help="after the timing, profile NCU_ITEMS with ncu")
    ap.add_argument("--ncu-items", default="", help="with --ncu: the items instead of NCU_ITEMS, as K,N,M,config;...")
    ap.add_argument("--dry", action="store_true", help="CPU: the op's PyTorch path on tiny shapes (no build, no timing "
                                                       "of any kernel)")
    args = ap.parse_args(argv)
    skip = [v for v in args.skip.split(",") if v]
    bad = set(skip) - {"triton", "dequant", "tinygemm", "cuda_default"}
    if bad:
        ap.error(f"--skip: {sorted(bad)} are not baselines this script can leave out")
    if args.update_table:
        update_table(*args.update_table)
        return 0
    from sdquant.kernels import int4_cuda, int4_triton, layout_dequant  # noqa: F401  (register the ops; nothing is built here)
    t_start = time.time()
    configs = [int(c) for c in args.configs.split(",")]
    modes = args.schedule.split(",")
    labels = [label(c, mode) for mode in modes for c in configs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("SDQUANT_COMMIT"),
              "src_digest": provenance.source_digest(), "configs": labels}
    if args.dry:
        dev = torch.device("cpu")
        rows = int4_tune.check_configs(dev, configs, DRY_CASES)
        passing = [str(c) for c in configs if all(r["pass"] for r in rows if r["config"] == c)]
        result["checks"] = rows
        shapes, ms = [(256, 512)], [3, 40, 300]
    else:
        dev = torch.device("cuda")
        result["device"] = torch.cuda.get_device_name(0)
        result["gpu_limits"] = gpu_clocks.limits()
        passing, rows, build, occ = run_checks(configs, args.check_timeout, modes)
        result.update(checks=rows, build=build, occupancy=occ)
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        ms = [int(v) for v in args.ms.split(",")]
    result["passing"] = passing
    splits = [int(v) for v in args.splits.split(",")]
    result["rounds"] = args.rounds
    result["rows"] = time_shapes(dev, shapes, ms, passing, args.dry, args.budget_s, t_start, splits, args.rounds, skip)
    (out / "int4_wgmma.json").write_text(json.dumps(result, indent=1))
    if args.ncu and not args.dry and passing:
        items = ([tuple(int(v) for v in it.split(",")) for it in args.ncu_items.split(";")] if args.ncu_items
                 else NCU_ITEMS)
        ncu(out, [it for it in items if str(it[3]) in passing])
    log(f"\nchecks: {len(passing)}/{len(labels)} configs pass; wall {time.time() - t_start:.0f} s")
    log(table(result["rows"], timed_names(passing, splits)))
    return 0 if len(passing) == (len(configs) if args.dry else len(labels)) else 1


if __name__ == "__main__":
    sys.exit(main())
