"""The fused decode-block op (``sdquant::w4a16_cuda_fused``) on the GPU: correctness against its PyTorch reference for
every tight variant, both split paths and every mode, then its time beside the plain op of the same config.

    python bench/fused_ops.py --out DIR          # one H200 call; prints a table last, writes DIR/fused_ops.json

Modes (Llama-3-8B decode layers; "rope": the consumer with the RoPE / KV-cache epilogue, checks only): "rms" = the consumer (qkv, lm_head: the RMSNorm scale of its input row), "rms_silu" =
gate/up (also SiLU * up over the interleaved halves), "resid" = the producer (o, down: the residual add and the next
norm's weight, two outputs). Times: weights rotated past L2 (bench/gemm.py's time_rotating: CUDA graphs of back-to-back
calls, median of trials).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gemm  # noqa: E402
import provenance  # noqa: E402
from sdquant.kernels import int4_layout  # noqa: E402

CHECK_SHAPES = [  # (K, N, mode): both split paths for each mode (the wide N run one split, the narrow ones several)
    (4096, 6144, "rms"), (4096, 4096, "resid"), (4096, 28672, "rms_silu"), (4096, 4096, "rms_silu"),
    (14336, 4096, "resid"), (8192, 28672, "resid"), (4096, 128256, "rms"),
]
TIME_SHAPES = [(4096, 6144, "rms"), (4096, 4096, "resid"), (4096, 28672, "rms_silu"), (14336, 4096, "resid"),
               (4096, 128256, "rms")]
TIGHT = (38, 39, 40, 41, 43, 44)


def log(*a):
    print(*a, flush=True)


def operands(k, n, mode, m, dev, dtype, g, t_block=64):
    """(x, rms_ss, silu, resid, gamma) for one call of the mode (rms_ss: the sums of squares of the norm's input in
    column blocks of t_block, as a producer writes them with 64)."""
    from sdquant.kernels.int4_cuda import block_sumsq
    h = torch.randn(m, k, device=dev, generator=g).to(dtype) * 3
    gam_in = (1 + 0.3 * torch.randn(k, device=dev, generator=g)).to(dtype)
    n_out = n // 2 if mode == "rms_silu" else n
    if mode in ("rms", "rms_silu"):
        return (h * gam_in).to(dtype), block_sumsq(h, t_block), mode == "rms_silu", None, None
    resid = torch.randn(m, n_out, device=dev, generator=g).to(dtype)
    gamma = (1 + 0.3 * torch.randn(n_out, device=dev, generator=g)).to(dtype)
    return torch.randn(m, k, device=dev, generator=g).to(dtype) * 0.1, None, False, resid, gamma


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time every tight variant's fused build (the choice of "
                    "int4_cuda.FUSED_SHAPE_CONFIGS)")
    args = ap.parse_args(argv)
    faulthandler.enable()
    dev = torch.device("cuda")
    from sdquant.kernels import int4_cuda as ic
    t0 = time.time()
    assert ic.available(), ic._STATE.get("reason")
    log(f"extension built in {time.time() - t0:.0f} s")
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "commit": os.environ.get("SDQUANT_COMMIT", "?"), "src_digest": provenance.source_digest(), "checks": [],
           "times": []}
    g = torch.Generator(device=dev).manual_seed(0)
    bound = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
    worst, fails = 0.0, 0
    for dtype in (torch.bfloat16, torch.float16):
        for (k, n, mode) in CHECK_SHAPES:
            if dtype == torch.float16 and n > 28672:
                continue
            qw = gemm.random_int4(n, k, device=dev, seed=k + n, symmetric=(dtype == torch.bfloat16))
            lay = int4_layout.repack_cuda(qw, dtype)
            for m in (1, 3, 8):
                x, rx, silu, resid, gamma = operands(k, n, mode, m, dev, dtype, g, t_block=k if m == 3 else 64)
                ref, ref2, rss = ic.fused_reference(x, lay["qweight"], lay["scales"], lay["zeros"], rx, 1e-5, silu,
                                                    resid, gamma)
                for v in TIGHT if dtype == torch.bfloat16 else (38, 39):
                    for target in (0, 2):
                        cfg = v + 64 * target
                        splits = ic.auto_splits(m, n, k, gemm.GS, cfg, dtype)
                        y, y2, ss = torch.ops.sdquant.w4a16_cuda_fused(x, lay["qweight"], lay["scales"],
                                                                       lay["zeros"], lay["locks"], rx, 1e-5, silu,
                                                                       resid, gamma, cfg)
                        e = rel(y, ref)
                        e2 = max(rel(y2, ref2), rel(ss, rss)) if gamma is not None else 0.0
                        ok = e < bound[dtype] and e2 < bound[dtype] and int(lay["locks"].abs().sum()) == 0
                        worst = max(worst, e, e2)
                        fails += not ok
                        res["checks"].append({"dtype": str(dtype)[6:], "K": k, "N": n, "mode": mode, "M": m,
                                              "config": cfg, "splits": splits, "err": e, "err2": e2, "ok": ok})
                        if not ok:
                            log(f"FAIL {dtype} {k}x{n} {mode} M={m} cfg={cfg} splits={splits}: {e:.3g} {e2:.3g}")
            del lay, qw
    # the RoPE / KV-cache epilogue (sdquant::w4a16_cuda_fused_rope) on Llama-3-8B's qkv: 32 query and 8 KV heads of 128
    for dtype in (torch.bfloat16, torch.float16):
        k, n, q_cols, nkv, T = 4096, 6144, 4096, 8, 64
        qw = gemm.random_int4(n, k, device=dev, seed=7, symmetric=(dtype == torch.bfloat16))
        lay = int4_layout.repack_cuda(qw, dtype)
        ang = torch.rand(64, device=dev, generator=g) * 6.3
        cos, sin = torch.cat([ang.cos(), ang.cos()]).to(dtype), torch.cat([ang.sin(), ang.sin()]).to(dtype)
        for m in (1, 3, 8):
            x, rx, *_ = operands(k, n, "rms", m, dev, dtype, g)
            kv0 = torch.randn(2, 8, nkv, T, 128, device=dev, generator=g).to(dtype)
            for pos in (0, T - 1):
                p = torch.tensor([pos], device=dev)
                want = kv0.clone()
                ref = ic.fused_rope_reference(x, lay["qweight"], lay["scales"], lay["zeros"], rx, 1e-5, want, p, cos,
                                              sin, q_cols)
                for v in TIGHT if dtype == torch.bfloat16 else (38, 39):
                    for target in (0, 2):
                        cfg = v + 64 * target
                        got = kv0.clone()
                        y = torch.ops.sdquant.w4a16_cuda_fused_rope(x, lay["qweight"], lay["scales"], lay["zeros"],
                                                                    lay["locks"], rx, 1e-5, got, p, cos, sin, q_cols,
                                                                    cfg)
                        slot = (slice(None), slice(0, m), slice(None), pos)
                        e, e2 = rel(y, ref), rel(got[slot], want[slot])
                        got[slot], ws = 0, want[slot].clone()
                        want[slot] = 0
                        rest = bool(torch.equal(got, want))
                        want[slot] = ws
                        ok = e < bound[dtype] and e2 < bound[dtype] and rest and int(lay["locks"].abs().sum()) == 0
                        worst = max(worst, e, e2)
                        fails += not ok
                        res["checks"].append({"dtype": str(dtype)[6:], "K": k, "N": n, "mode": "rope", "M": m,
                                              "pos": pos, "config": cfg, "err": e, "err2": e2, "rest_unchanged": rest,
                                              "ok": ok})
                        if not ok:
                            log(f"FAIL rope {dtype} M={m} pos={pos} cfg={cfg}: {e:.3g} {e2:.3g} rest {rest}")
        del lay, qw
    log(f"checks: {len(res['checks'])} points, {fails} failed, worst rel. error {worst:.3g}")
    if not args.no_time:
        dtype = torch.bfloat16
        for (k, n, mode) in TIME_SHAPES:
            qw = gemm.random_int4(n, k, device=dev, seed=k + n)
            base = int4_layout.repack_cuda(qw, dtype)
            nrot = gemm.n_copies(n * k // 2 + n * (k // gemm.GS) * 4)
            lays = [base] + [{kk: (None if t is None else t.clone()) for kk, t in base.items()} for _ in range(nrot - 1)]
            for m in (1, 8):
                x, rx, silu, resid, gamma = operands(k, n, mode, m, dev, dtype, g)
                cfg = ic.fused_config(m, n, k, dtype)

                def plain(i):
                    la = lays[i % nrot]
                    return torch.ops.sdquant.w4a16_cuda(x, la["qweight"], la["scales"], la["zeros"], None, la["locks"],
                                                        None, 0, False, cfg)

                def fused(i):
                    la = lays[i % nrot]
                    return torch.ops.sdquant.w4a16_cuda_fused(x, la["qweight"], la["scales"], la["zeros"], la["locks"],
                                                              rx, 1e-5, silu, resid, gamma, cfg)
                def fused_off(i):  # the fused kernel's build with every end off: its main loop's own cost
                    la = lays[i % nrot]
                    return torch.ops.sdquant.w4a16_cuda_fused(x, la["qweight"], la["scales"], la["zeros"], la["locks"],
                                                              None, 1e-5, False, None, None, cfg)
                tp = gemm.time_rotating(plain, nrot, trials=5, target_ms=2.0, max_calls=60)
                tf = gemm.time_rotating(fused, nrot, trials=5, target_ms=2.0, max_calls=60)
                to = gemm.time_rotating(fused_off, nrot, trials=5, target_ms=2.0, max_calls=60)
                row = {"K": k, "N": n, "mode": mode, "M": m, "config": cfg, "plain_us": tp, "fused_us": tf,
                       "fused_off_us": to}
                if args.sweep:
                    row["sweep_us"] = {}
                    for v in (38, 39, 40, 41, 43, 44):
                        def fv(i, v=v):
                            la = lays[i % nrot]
                            return torch.ops.sdquant.w4a16_cuda_fused(x, la["qweight"], la["scales"], la["zeros"],
                                                                      la["locks"], rx, 1e-5, silu, resid, gamma, v)
                        row["sweep_us"][v] = gemm.time_rotating(fv, nrot, trials=5, target_ms=2.0, max_calls=60)
                    log(f"    sweep: {', '.join(f'{v}: {t:.2f}' for v, t in row['sweep_us'].items())}")
                res["times"].append(row)
                log(f"  {k}x{n} {mode} M={m} cfg {cfg}: plain {tp:.2f} us, fused {tf:.2f} us ({tf / tp:.3f}x), "
                    f"fused build with the ends off {to:.2f} us")
            del lays, base, qw
            torch.cuda.empty_cache()
    # bad input: refused with an error, no launch
    bad = {}
    qw = gemm.random_int4(4096, 4096, device=dev, seed=1)
    lay = int4_layout.repack_cuda(qw, torch.bfloat16)
    for name, m, cfg in (("M=9", 9, -1), ("config 10 (not a tight variant)", 1, 10)):
        x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        log(f"bad input {name} ...")
        try:
            torch.ops.sdquant.w4a16_cuda_fused(x, lay["qweight"], lay["scales"], lay["zeros"], lay["locks"], None,
                                               1e-5, False, None, None, cfg)
            bad[name] = "accepted (wrong)"
        except Exception as e:  # noqa: BLE001
            bad[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    res["bad_input"] = bad
    log(f"bad input: {bad}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_ops.json").write_text(json.dumps(res, indent=1))
    log("\n| K×N | mode | M | config | plain µs | fused µs | fused, ends off µs | fused ÷ plain |\n"
        "|---|---|---|---|---|---|---|---|")
    for r in res["times"]:
        log(f"| {r['K']}×{r['N']} | {r['mode']} | {r['M']} | {r['config']} | {r['plain_us']:.2f} | "
            f"{r['fused_us']:.2f} | {r['fused_off_us']:.2f} | {r['fused_us'] / r['plain_us']:.3f} |")
    log(f"checks: {len(res['checks'])} points, {fails} failed, worst {worst:.3g}; wall {time.time() - t0:.0f} s")
    if fails:
        raise SystemExit(f"fused_ops: {fails} GPU checks failed")


if __name__ == "__main__":
    main()
