"""Direct decode kernel with its activations staged in shared memory (``int4_cuda.set_x_smem``) against the same
kernel reading them through L1 every K step (issue 4, M = 1-8 targets).

bench/read_order.py --factors (H200, 2026-12-01) measured the bare per-warp weight streams at 27.7-30.8 us on
8192x28672 and the same streams plus the M = 1 activation reads of a decode kernel at 38.3-52.3 us: the activation
reads, not the weight stream, are most of what the kernels lose to the copy bandwidth. This script times, in one
process, each direct-kernel config the op runs at M = 1-8 (and v10 on every shape) with the activations read
through L1 (the default) and from shared memory, beside cuBLAS bf16 and the op's default config. Both settings
must give bit-identical outputs (same values into the same MMAs); every call is also checked against a float64
reference. Weights copied past 3x the 60 MB L2 and rotated, back-to-back calls in one CUDA graph, median of 5
replays (bench/gemm.py).

    python bench/x_smem.py --out $OUT       # on the GPU machine; table last, JSON in $OUT
    python bench/x_smem.py --dry            # CPU: the op's PyTorch path on a tiny shape (CI)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm  # noqa: E402

from sdquant.kernels import int4_layout  # noqa: E402

MS = [1, 2, 4, 8]
DIRECT = tuple(range(8, 13))


def log(*a):
    print(*a, flush=True)


def run(dev, shapes, ms, dry: bool) -> list:
    from sdquant.kernels import int4_cuda
    dtype = torch.bfloat16
    timer = (lambda call, n: gemm.time_cpu(call, n)) if dry else (lambda call, n: gemm.time_rotating(call, n))
    op = torch.ops.sdquant.w4a16_cuda
    rows = []
    for (k, n) in shapes:
        qw = gemm.random_int4(n, k, device=dev, seed=k + n)
        w_ref = qw.dequantize(dtype)
        wbytes = n * k // 2 + n * (k // gemm.GS) * 4
        ncopy = 1 if dry else gemm.n_copies(wbytes)
        lays = [int4_layout.repack_cuda(qw, dtype) for _ in range(ncopy)]
        dense = [w_ref.clone() for _ in range(1 if dry else gemm.n_copies(n * k * 2))]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = (x.double() @ w_ref.double().t()).float()
            dflt = int4_cuda.auto_config(m, n, k, dtype, wgmma=False)
            row = {"K": k, "N": n, "M": m, "default": dflt,
                   "bf16": round(timer(lambda i: torch.nn.functional.linear(x, dense[i]), len(dense)), 2)}
            configs = list(dict.fromkeys([dflt, 10]))
            for c in configs:
                call = (lambda i, c=c: op(x, lays[i]["qweight"], lays[i]["scales"], lays[i]["zeros"], lays[i]["perm"],
                                          lays[i]["locks"], None, 0, False, c))
                outs = {}
                for xs in (0, 1):
                    old = int4_cuda.set_x_smem(bool(xs))
                    try:
                        y = call(0)
                        outs[xs] = y
                        row[f"v{c}_xs{xs}"] = round(timer(call, ncopy), 2)
                        row[f"v{c}_xs{xs}_err"] = gemm.rel_err(y, ref)
                    finally:
                        int4_cuda.set_x_smem(bool(old))
                row[f"v{c}_identical"] = bool(torch.equal(outs[0], outs[1]))
                row[f"v{c}_direct"] = c % 64 in DIRECT
            rows.append(row)
            log("  " + json.dumps(row))
        del lays, dense
        if not dry:
            torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    out = ["| K×N | M | bf16 | default (v) L1 | default smem | v10 L1 | v10 smem | smem ÷ L1 (default) | identical |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["default"]
        f = (lambda v: "–" if v is None else f"{v:.1f}")
        a, b = r.get(f"v{d}_xs0"), r.get(f"v{d}_xs1")
        ident = all(r[key] for key in r if key.endswith("_identical"))
        out.append(f"| {r['K']}×{r['N']} | {r['M']} | {f(r['bf16'])} | {f(a)} (v{d % 64}) | {f(b)} | "
                   f"{f(r.get('v10_xs0'))} | {f(r.get('v10_xs1'))} | "
                   f"{'–' if not a or not b else f'{b / a:.3f}'} | {ident} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args(argv)
    from sdquant.kernels import int4_cuda  # noqa: F401  (registers the op)
    t0 = time.time()
    if args.dry:
        dev, shapes, ms = torch.device("cpu"), [(256, 512)], [1, 3]
    else:
        dev, shapes, ms = torch.device("cuda"), gemm.RUN_ORDER, [int(v) for v in args.ms.split(",")]
        assert int4_cuda.available(), int4_cuda._STATE.get("reason")
    rows = run(dev, shapes, ms, args.dry)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("SDQUANT_COMMIT"),
           "device": None if args.dry else torch.cuda.get_device_name(0), "rows": rows}
    (out / "x_smem.json").write_text(json.dumps(res, indent=1))
    bad = [r for r in rows if not all(r[key] for key in r if key.endswith("_identical"))
           or any(r[key] != r[key] or r[key] > 1e-2 for key in r if key.endswith("_err"))]
    log(f"\n{len(rows)} points, {len(bad)} with a mismatch; wall {time.time() - t0:.0f} s")
    log(table(rows))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
