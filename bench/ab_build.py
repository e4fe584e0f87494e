"""A/B two builds of the CUDA W4A16 extension in one process (H200): the kernel sources of another commit (--old,
a directory holding sdquant/kernels/csrc from e.g. ``git archive <rev> sdquant/kernels/csrc``), this tree, and
this tree with extra nvcc defines (--new-defines). Each build is its own module; the same layouts and activations
go through each, outputs are compared (bit-identical, else the relative difference to the old build), and each
config is timed interleaved (A, B, C, A, B, C) at M = 1-8 (--ms) on the Llama shapes (bench/gemm.py's method).
Used to tell a code change from a machine difference. "max_rel_vs_old" compares every build's output with the first
build's (old, or new with --old none), and "identical_each" says for each build whether its output is bit-identical
to that first build's; --new-defines may be given several times (one build each); --dtypes times bf16 and/or fp16
activations (each with its own layout). ab_build.json is rewritten after every point ("complete" false until the
end); a point that runs past --point-timeout (a hung kernel) ends the process with a traceback, keeping the rest.

    python bench/ab_build.py --old ab_old --new-defines -DSDQ_DIRECT_XS_BYTES=0 --out $OUT
    python bench/ab_build.py --old none --new-defines=-DSDQ_TIGHT_L2PF=0 --configs 38,39 --ms 1 \
        --dtypes bfloat16,float16 --out $OUT
    python bench/ab_build.py --old none --new-defines=-DSDQ_WG_EARLY_TRIGGER_MAX_M=0 --configs 62,63 --ms 12,16 --pdl 2
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm  # noqa: E402
import gpu_clocks  # noqa: E402
import provenance  # noqa: E402

from sdquant.kernels import int4_cuda, int4_layout  # noqa: E402


def build(name: str, csrc: Path, defines) -> object:
    from torch.utils.cpp_extension import load
    srcs = [csrc / "w4a16_binding.cpp", csrc / "w4a16_sm90.cu", *sorted(csrc.glob("w4a16_part_*.cu"))]
    d = Path(os.environ.get("SDQUANT_CACHE_DIR", "/tmp/sdq_ab")) / name
    d.mkdir(parents=True, exist_ok=True)
    t = time.time()
    ext = load(name=name, sources=[str(s) for s in srcs], extra_cflags=["-O3", "-std=c++17"],
               extra_cuda_cflags=[*int4_cuda.NVCC_FLAGS, *defines], extra_include_paths=[str(csrc)],
               build_directory=str(d), verbose=False)
    print(f"built {name} from {csrc} {defines} in {time.time() - t:.0f} s", flush=True)
    return ext


@contextlib.contextmanager
def watchdog(seconds: float):
    """Ends the process (exit code 1, every thread's traceback on stderr) if the block runs longer than `seconds`: a
    hung kernel blocks the CUDA call with the GIL held, so only faulthandler's C-level timer can still act. 0 = off."""
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        if seconds > 0:
            faulthandler.cancel_dump_traceback_later()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="a directory holding sdquant/kernels/csrc, or 'none' (no old build: "
                                                 "outputs and times are then compared with this tree's build)")
    ap.add_argument("--new-defines", action="append", default=[],
                    help="comma-separated extra nvcc defines for one more build of this tree; may be given several "
                         "times (one build each)")
    ap.add_argument("--configs", default="10")
    ap.add_argument("--ms", default="1,4,8")
    ap.add_argument("--dtypes", default="bfloat16", help="activation dtypes, comma-separated (bfloat16, float16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pdl", type=int, default=0, choices=[0, 1, 2, 3],
                    help="launch every build with programmatic dependent launch (int4_cuda.set_pdl's modes: 1 on, 2 "
                         "with the early trigger, the decode runtime's; 3 the tight kernel's trigger first), so the "
                         "timed back-to-back calls overlap as a decode step's do")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--point-timeout", type=float, default=180.0,
                    help="end the run if one (shape, M, config) point takes longer than this (a hung kernel); the "
                         "points done so far are in ab_build.json (0 = no limit)")
    args = ap.parse_args(argv)
    here = Path(int4_cuda.__file__).parent / "csrc"
    exts = {} if args.old == "none" else {"old": build("sdq_ab_old", Path(args.old) / "sdquant/kernels/csrc", [])}
    exts["new"] = build("sdq_ab_new", here, [])
    for i, defs in enumerate(d for d in args.new_defines if d):
        exts["new+defs" if i == 0 else f"new+defs{i + 1}"] = build(f"sdq_ab_newdefs{i or ''}", here, defs.split(","))
    base = next(iter(exts))  # outputs are compared with this build's
    dev = torch.device("cuda")
    rows = []
    limits = gpu_clocks.limits()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(complete: bool) -> None:  # after every point, so that a run ended by the watchdog keeps what it measured
        tmp = out / "ab_build.json.tmp"
        tmp.write_text(json.dumps(
            {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("SDQUANT_COMMIT"),
             "src_digest": provenance.source_digest(), "gpu_limits": limits, "old": args.old,
             "new_defines": args.new_defines, "pdl": args.pdl,
             "complete": complete, "rows": rows}, indent=1))
        os.replace(tmp, out / "ab_build.json")

    def point(x, lays, c) -> dict:  # every build on one (shape, M, config): outputs compared, times interleaved
        calls, outs = {}, {}
        for name, ext in exts.items():
            def call(i, ext=ext, extra=(0,)):
                L = lays[i]
                return ext.w4a16(x, L["qweight"], L["scales"], L["zeros"], L["locks"], 0, False, c % 64, c // 64,
                                 args.pdl, *extra)
            try:
                outs[name] = call(0)
            except TypeError:  # a build from before the binding's x-in-shared-memory argument
                call = functools.partial(call, extra=())
                outs[name] = call(0)
            calls[name] = call
        ref = outs[base].float()
        got = {"identical": all(torch.equal(outs[base], o) for o in outs.values()),
               "identical_each": {name: torch.equal(outs[base], o) for name, o in outs.items() if name != base},
               "max_rel_vs_old": max(((o.float() - ref).norm() / ref.norm()).item() for o in outs.values())}
        ts = {name: [] for name in exts}
        t0 = time.monotonic()
        for _ in range(args.rounds):
            for name, call in calls.items():
                ts[name].append(gemm.time_rotating(call, len(lays)))
        return {**got, **{name: round(statistics.median(v), 2) for name, v in ts.items()},
                "gpu": gemm.gpu_state(t0, time.monotonic())}

    for (k, n), dt in itertools.product(gemm.RUN_ORDER, [getattr(torch, d) for d in args.dtypes.split(",")]):
        qw = gemm.random_int4(n, k, device=dev, seed=k + n)
        lays = [int4_layout.repack_cuda(qw, dt) for _ in range(gemm.n_copies(n * k // 2))]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=dt)
            for c in [int(v) for v in args.configs.split(",")]:
                print(f"# {k}x{n} M={m} v{c}", flush=True)  # (the last such line names a point that hung)
                with watchdog(args.point_timeout):
                    row = {"K": k, "N": n, "M": m, "dtype": str(dt).removeprefix("torch."), "config": c,
                           **point(x, lays, c)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                save(False)
        del lays
        torch.cuda.empty_cache()
    save(True)
    names = list(exts)
    print("\n| K×N | dtype | M | config | " + " | ".join(names) + " | identical to " + base + " | SM MHz (min) |")
    print("|---|---|---|---|" + "---|" * len(names) + "---|---|")
    for r in rows:
        same = ", ".join(f"{nm}: {'yes' if v else 'no'}" for nm, v in r["identical_each"].items())
        print(f"| {r['K']}×{r['N']} | {r['dtype']} | {r['M']} | v{r['config']} | "
              + " | ".join(f"{r[nm]:.1f}" for nm in names) + f" | {same} (max rel {r['max_rel_vs_old']:.1e}) | "
              + gpu_clocks.mhz(r.get("gpu")) + " |")


if __name__ == "__main__":
    main()
