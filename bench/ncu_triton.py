"""ncu of the Triton W4A16 small-M kernels as the op routes them (H200, one device call): where the GEMV (M = 1-2)
and the swap-AB mid-M kernel (M = 4-16) spend their time on the Llama shapes.

    SDQUANT_COMMIT=<hash> python bench/ncu_triton.py --out $OUT
    python bench/ncu_triton.py --child "8192x28672:1,8192x28672:8"   # what ncu runs (needs a GPU)
    python bench/ncu_triton.py --dry       # CPU: the child on tiny shapes under Triton's interpreter, no ncu

Each point: random symmetric g128 codes in the Triton layout, bf16 activations, the op's own plan (the kernel and
tile config ``int4_triton`` picks for that M), called twice (the first call compiles; both launches are profiled,
the report keeps both); the output is checked against x @ W.T in float32 (relative error <= 1e-2). ncu runs with unlocked clocks (``--clock-control none``) and the sections below; the
split-K reduction kernel is left out by the kernel-name filter. Writes $OUT/ncu_triton.txt (the full report) and
prints the lines that say where the time goes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POINTS = "8192x28672:1,14336x4096:1,8192x28672:8,28672x8192:8"
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats",
            "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis")
KEEP = ("ITEM", "_kernel", "Duration", "DRAM Throughput", "Compute (SM) Throughput", "Registers Per Thread",
        "Achieved Occupancy", "Theoretical Occupancy", "Issue Slots Busy", "No Eligible", "Warp Cycles Per Issued",
        "Block Limit", "Grid Size", "Block Size", "Executed Ipc Active", "L1/TEX Hit", "Mem Busy", "Max Bandwidth")


DRY_POINTS = "256x128:1,256x128:2,512x128:4"


def child(points: str, dev_name: str = "cuda") -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import gemm
    from sdquant.kernels import int4_layout, int4_triton
    dev = torch.device(dev_name)
    for item in points.split(","):
        kn, m = item.split(":")
        k, n = (int(v) for v in kn.split("x"))
        m = int(m)
        qw = gemm.random_int4(n, k, device=dev, seed=k + n)
        lay = int4_layout.repack_triton(qw, torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        plan = int4_triton.mid_m_plan(m, n, k) or int4_triton.small_m_plan(m, n, k)
        print(f"ITEM {k}x{n} M={m} plan={plan}", flush=True)
        ys = [int4_triton.w4a16_triton_impl(x, lay["qweight"], lay["scales"], lay["zs"], lay.get("perm"), None)
              for _ in range(2)]
        ref = x.float() @ qw.dequantize().float().t()
        err = max(((y.float() - ref).norm() / ref.norm()).item() for y in ys)
        print(f"  rel err {err:.2e}", flush=True)
        if not err <= 1e-2:
            raise SystemExit(f"error: {k}x{n} M={m}: relative error {err:.2e} > 1e-2")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--points", default=POINTS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--dry", action="store_true", help="CPU: the child on tiny shapes under Triton's interpreter")
    a = ap.parse_args(argv)
    if a.child:
        child(a.child)
        return
    if a.dry:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported
        child(DRY_POINTS, "cpu")
        return
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--clock-control", "none", "--kernel-name", "regex:_gemv_kernel|_midm_kernel|_tc_kernel",
           *[x for s in SECTIONS for x in ("--section", s)], sys.executable, str(Path(__file__).resolve()),
           "--child", a.points]
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), timeout=a.timeout)
    txt = r.stdout + "\n" + r.stderr
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "ncu_triton.txt.tmp"
    tmp.write_text(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} commit "
                   f"{os.environ.get('SDQUANT_COMMIT', 'unknown')} rc {r.returncode} {time.time() - t:.0f} s\n" + txt)
    tmp.replace(out / "ncu_triton.txt")
    for ln in txt.splitlines():
        if any(kw in ln for kw in KEEP):
            print(ln.rstrip()[:200])
    print(f"ncu rc={r.returncode} in {time.time() - t:.0f} s")


if __name__ == "__main__":
    main()
