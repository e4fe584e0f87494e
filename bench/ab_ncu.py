"""ncu beside an A/B: this tree's CUDA W4A16 extension built twice (as is, and with --new-defines), one call of each
profiled at one shape, so that two kernel variants' stall reasons can be read side by side (H200, one device call).

    python bench/ab_ncu.py --new-defines=-DSDQ_WS_SMALL=1 --config 63 --k 8192 --n 28672 --m 64 --out $OUT

The builds are ab_build.py's (cached under $SDQUANT_CACHE_DIR); the child that ncu runs loads them again from the cache,
calls each twice on the same random layout and activations (the first call warms up), and checks that their outputs
agree. ncu profiles the kernels matching --kernel-regex (clocks not locked); the report goes to $OUT/ab_ncu.txt and
its key lines to stdout.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

KEEP = ("w4a16", "Duration", "Registers Per", "Achieved Occupancy", "DRAM Throughput", "Compute (SM) Throughput",
        "Issue Slots Busy", "No Eligible", "Warp Cycles Per Issued", "Stall", "stall", "Tensor", "Executed Ipc",
        "Block Limit", "agree")


def builds(new_defines: str) -> dict:
    """ab_build.py's two builds of this tree's extension: as is ("new") and with the defines ("new+defs")."""
    import ab_build
    from sdquant.kernels import int4_cuda
    here = Path(int4_cuda.__file__).parent / "csrc"
    return {"new": ab_build.build("sdq_ab_new", here, []),
            "new+defs": ab_build.build("sdq_ab_newdefs", here, new_defines.split(","))}


def child(args) -> None:
    import torch

    import gemm
    from sdquant.kernels import int4_layout
    exts = builds(args.new_defines)
    dev = torch.device("cuda")
    qw = gemm.random_int4(args.n, args.k, device=dev, seed=args.k + args.n)
    lay = int4_layout.repack_cuda(qw, torch.bfloat16)
    x = torch.randn(args.m, args.k, device=dev, dtype=torch.bfloat16)
    outs = {}
    for name, ext in exts.items():
        for _ in range(2):
            outs[name] = ext.w4a16(x, lay["qweight"], lay["scales"], lay["zeros"], lay["locks"], 0, False,
                                   args.config % 64, args.config // 64, 0, 0)
        torch.cuda.synchronize()
    a, b = outs["new"].float(), outs["new+defs"].float()
    print(f"outputs agree: {torch.equal(a, b)} (max rel {((a - b).norm() / a.norm()).item():.1e})", flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-defines", required=True, help="comma-separated nvcc defines of the second build")
    ap.add_argument("--config", type=int, default=63)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--kernel-regex", default="w4a16_wgmma")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    return ap


def ncu_command(args, ncu: str, python: str) -> list:
    """ncu over this script's child with the same point and builds (clocks not locked; the sections read here)."""
    return [ncu, "--clock-control", "none", "--kernel-name", f"regex:{args.kernel_regex}",
            "--section", "SpeedOfLight", "--section", "Occupancy", "--section", "SchedulerStats",
            "--section", "WarpStateStats", "--section", "LaunchStats", python, str(Path(__file__).resolve()),
            "--child", f"--new-defines={args.new_defines}", "--config", str(args.config), "--k", str(args.k),
            "--n", str(args.n), "--m", str(args.m)]


def key_lines(txt: str, width: int = 200) -> list:
    """The report's lines worth printing: kernel headers, times, occupancy, issue and stall figures."""
    return [ln.rstrip()[:width] for ln in txt.splitlines() if any(k in ln for k in KEEP)]


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.child:
        child(args)
        return
    builds(args.new_defines)  # built here, outside ncu; the child loads them from the cache
    cmd = ncu_command(args, shutil.which("ncu") or "/usr/local/cuda/bin/ncu", sys.executable)
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    txt = r.stdout + "\n" + r.stderr
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab_ncu.txt").write_text(txt)
    print(f"ncu rc={r.returncode} in {time.time() - t:.0f} s; report in ab_ncu.txt", flush=True)
    print("\n".join(key_lines(txt)))


if __name__ == "__main__":
    main()
