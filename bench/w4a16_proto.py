"""The harness of the Triton W4A16 layout prototypes (bench/triton_bytes.py, bench/triton_frag.py): the --dry checks
under Triton's interpreter and the H200 sweep beside cuBLAS bf16, the shipped Triton op and the sdquant CUDA op.

A prototype module provides ``CONFIGS`` (name -> config dict), ``repack(qw, dtype) -> layout`` and
``run(x, layout, gs, cfg, sms) -> y``, and calls ``main(argv, doc, name, configs, repack, run, ...)``.

Timing: bench/gemm.py's method (weight copies rotating past 3x L2, one CUDA graph per point, median of 5 replays),
bf16, random symmetric g128 codes. Every timed config is checked first against x @ W.T in fp32 (bound 1e-2; 2e-3 for
fp16 under --dry). Writes $OUT/<name>.json and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Callable


def rel_err(y, ref) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def reduce_splits(part, out, m: int, n: int, split: int) -> None:
    """Sum the fp32 split-K partials [split, M, N] into out in a fixed order (int4_triton_gemv's reduction)."""
    import triton

    from sdquant.kernels import int4_triton_gemv as G
    block = 512
    G._kernels()["reduce"][(triton.cdiv(m * n, block),)](part, out, m * n, SPLIT_K=split, BLOCK=block,
                                                         EVEN=(m * n) % block == 0, num_warps=4)


def main(argv, doc: str, name: str, configs: dict, repack: Callable, run: Callable, ms: list,
         dry_shapes: list, dry_ms: tuple, dry_applies: Callable = lambda cfg, k, n, m: True):
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU: Triton's interpreter, tiny shapes, checks only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ms", default=",".join(map(str, ms)))
    ap.add_argument("--configs", default=",".join(configs))
    ap.add_argument("--no-cuda", action="store_true", help="skip the sdquant CUDA op (it builds on first use)")
    a = ap.parse_args(argv)
    if a.dry:
        os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported
    import torch

    import gemm
    from sdquant.kernels import int4_triton  # noqa: F401  (registers the op)
    chosen = {c: configs[c] for c in a.configs.split(",")}
    t0 = time.time()
    rows = []
    if a.dry:
        dt, sms = torch.float16, 4
        for (k, n, gs, sym) in dry_shapes:
            qw = gemm.random_int4(n, k, gs=gs, symmetric=sym, seed=k + n)
            lay = repack(qw, dt)
            for m in dry_ms:
                x = torch.randn(m, k).to(dt)
                ref = x.float() @ qw.dequantize().float().t()
                for cname, cfg in chosen.items():
                    if not dry_applies(cfg, k, n, m):
                        continue
                    e = rel_err(run(x, lay, k if gs == -1 else gs, cfg, sms), ref)
                    rows.append({"K": k, "N": n, "gs": gs, "sym": sym, "M": m, "config": cname, "rel_err": e})
                    print(json.dumps(rows[-1]), flush=True)
                    if not e <= 2e-3:
                        raise SystemExit(f"error: {cname} K={k} N={n} M={m}: relative error {e:.2e} > 2e-3")
        return rows
    import triton

    from sdquant.kernels import int4_layout
    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("SDQUANT_COMMIT"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "configs": chosen}
    use_cuda = False
    if not a.no_cuda:
        from sdquant.kernels import int4_cuda
        use_cuda = int4_cuda.available()
        if not use_cuda:
            print(f"int4_cuda unavailable: {int4_cuda._STATE.get('reason')}", flush=True)
    meta["cuda_op"] = use_cuda
    for (k, n) in gemm.RUN_ORDER:
        qw = gemm.random_int4(n, k, device=dev, seed=k + n)
        nrot = gemm.n_copies(n * k // 2)
        lays = [repack(qw, dt) for _ in range(nrot)]
        tl_lays = [int4_layout.repack_triton(qw, dt) for _ in range(nrot)]
        cu_lays = [int4_layout.repack_cuda(qw, dt) for _ in range(nrot)] if use_cuda else []
        wf = qw.dequantize().float()
        w_bf16 = [wf.to(dt) for _ in range(min(nrot, max(2, gemm.n_copies(n * k * 2))))]
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = x.float() @ wf.t()
            row = {"K": k, "N": n, "M": m}
            row["bf16"] = gemm.time_rotating(lambda i: torch.nn.functional.linear(x, w_bf16[i % len(w_bf16)]),
                                             len(w_bf16))

            def shipped(i):
                c = tl_lays[i]
                return torch.ops.sdquant.w4a16_triton(x, c["qweight"], c["scales"], c["zs"], None, None)
            row["shipped_err"] = rel_err(shipped(0), ref)
            row["shipped"] = gemm.time_rotating(shipped, nrot)
            if use_cuda:
                def cuda_op(i):
                    c = cu_lays[i]
                    return torch.ops.sdquant.w4a16_cuda(x, c["qweight"], c["scales"], c["zeros"], c["perm"],
                                                        c["locks"], None)
                row["cuda_err"] = rel_err(cuda_op(0), ref)
                row["cuda"] = gemm.time_rotating(cuda_op, nrot)
            for cname, cfg in chosen.items():
                if not dry_applies(cfg, k, n, m):
                    continue
                try:
                    e = rel_err(run(x, lays[0], 128, cfg, sms), ref)
                except Exception as ex:  # a config that does not compile is a result, not a crash
                    row[cname + "_fail"] = f"{type(ex).__name__}: {str(ex)[:200]}"
                    continue
                row[cname + "_err"] = e
                if e <= 1e-2:
                    row[cname] = gemm.time_rotating(lambda i, cfg=cfg: run(x, lays[i], 128, cfg, sms), nrot)
            print(json.dumps(row), flush=True)
            rows.append(row)
        del lays, tl_lays, cu_lays, w_bf16, wf
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    tmp.replace(out / f"{name}.json")
    names = ["bf16", "cuda", "shipped", *chosen]
    nan = float("nan")
    print("\n| K×N | M | " + " | ".join(names) + " | best prototype ÷ shipped | CUDA ÷ shipped | CUDA ÷ best prototype |")
    print("|---|---|" + "---|" * len(names) + "---|---|---|")
    for r in rows:
        best = min((r[c] for c in chosen if c in r), default=nan)
        print(f"| {r['K']}×{r['N']} | {r['M']} | " + " | ".join(f"{r[c]:.1f}" if c in r else "–" for c in names)
              + f" | {best / r['shipped']:.2f} | {r.get('cuda', nan) / r['shipped']:.2f}"
              + f" | {r.get('cuda', nan) / best:.2f} |")
    print(f"wall {time.time() - t0:.0f} s")
    return rows
