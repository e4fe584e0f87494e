"""Does staging a decode GEMM's INT4 weights in L2 ahead of time pay? (H200, one device call)

At batch 1 a decode step alternates DRAM-bound GEMMs with latency-bound kernels (attention, RMSNorm, RoPE) that
leave the memory system mostly idle for ~10 us a layer. This probe asks whether weights requested into L2 during
such a phase (``cp.async.bulk.prefetch.L2``, fire and forget, optionally with an evict_last cache policy) make the
next GEMM faster, and whether evict_last lines survive another GEMM's 60 MB weight stream in between.

    SDQUANT_COMMIT=<hash> python bench/l2_prefetch.py --out $OUT

Each scenario is a sequence timed by bench/gemm.py's time_rotating (one CUDA graph of back-to-back sequences over
weight copies rotating past 3x the L2, median of 5 replays, CUDA events); "spin" is an ALU-only kernel standing in for the
latency-bound phase (no DRAM traffic); the GEMM is sdquant's CUDA op at M = 1 (bf16, symmetric, group 128).
  A  [spin, GEMM(w_i)]  vs  [prefetch(w_i), spin, GEMM(w_i)]  vs  [prefetch(w_i), spin]  vs  [spin]
  B  [spin, GEMM_gate_up(u_j), GEMM_down(w_i)]  vs  the same with prefetch(w_i) first (normal / evict_last policy)
Outputs are checked bit-identical with and without the prefetch. Writes $OUT/l2_prefetch.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gemm  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sdquant.kernels import int4_cuda, int4_layout  # noqa: E402


@triton.jit
def _prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr):
    # program p requests bytes [p CHUNK, (p + 1) CHUNK) of the buffer into L2, 1 KB a thread, and exits
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK // 1024) * 1024
    ptrs = base + offs
    ok = offs < nbytes
    ptrs = tl.where(ok, ptrs, base)  # (past the end: the first bytes again, already requested)
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{\n .reg .b64 pol;\n createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n"
            " cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], 1024, pol;\n mov.u32 $0, 0;\n}",
            "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 1024;\n mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _touch_kernel(base, nbytes, out, CHUNK: tl.constexpr):
    # the control: plain loads of the same bytes (they allocate in L2), xor-reduced to one word a program
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(base + offs, mask=offs < nbytes, other=0).to(tl.int32)
    tl.store(out + tl.program_id(0), tl.reduce_or(v, 0))


@triton.jit
def _spin_kernel(out, iters, SEED: tl.constexpr):
    # ALU only: a dependent FMA chain per lane, one store at the end (no DRAM traffic worth the name)
    v = tl.arange(0, 128).to(tl.float32) * 1e-3 + SEED
    for _ in range(iters):
        v = v * 0.999 + 1e-4
    tl.store(out + tl.program_id(0) * 128 + tl.arange(0, 128), v)


def prefetch(t: torch.Tensor, evict_last: bool, chunk: int = 65536):
    nbytes = t.numel() * t.element_size()
    flat = t.view(torch.uint8).reshape(-1)
    _prefetch_kernel[(triton.cdiv(nbytes, chunk),)](flat, nbytes, CHUNK=chunk, EVICT_LAST=evict_last,
                                                     num_warps=2)


def touch(t: torch.Tensor, scratch: torch.Tensor, chunk: int = 16384):
    nbytes = t.numel() * t.element_size()
    flat = t.view(torch.uint8).reshape(-1)
    _touch_kernel[(triton.cdiv(nbytes, chunk),)](flat, nbytes, scratch, CHUNK=chunk, num_warps=8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--spin-us", type=float, default=8.0, help="length of the stand-in latency-bound phase")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available() and int4_cuda.available(), "needs a GPU and the CUDA extension"
    dev, dt = torch.device("cuda"), torch.bfloat16
    op = torch.ops.sdquant.w4a16_cuda
    t0 = time.time()
    spin_out = torch.empty(132 * 128, device=dev)

    # calibrate the spin kernel to ~spin_us
    iters = 1000
    for _ in range(6):
        us = gemm.time_rotating(lambda i: _spin_kernel[(132,)](spin_out, iters, SEED=0, num_warps=4), 1)
        iters = max(100, int(iters * args.spin_us / us))
    spin = lambda: _spin_kernel[(132,)](spin_out, iters, SEED=0, num_warps=4)  # noqa: E731
    spin_us = gemm.time_rotating(lambda i: spin(), 1)
    print(f"spin kernel: {iters} iterations, {spin_us:.2f} us", flush=True)

    def layouts(k, n, seed):
        qw = gemm.random_int4(n, k, device=dev, seed=seed)
        one = int4_layout.repack_cuda(qw, dt)
        nb = one["qweight"].numel() * one["qweight"].element_size()
        return [{kk: (None if v is None else v.clone()) for kk, v in one.items()} for _ in range(gemm.n_copies(nb))]

    def gemm_call(L, x):
        return op(x, L["qweight"], L["scales"], L["zeros"], L["perm"], L["locks"], None)

    def pf(L, ev):
        prefetch(L["qweight"], ev)
        prefetch(L["scales"], ev)

    scratch = torch.empty(1 << 16, dtype=torch.int32, device=dev)

    def tc(L):
        touch(L["qweight"], scratch)
        touch(L["scales"], scratch)

    rows = []
    # A: the GEMM right after a latency-bound phase, weights requested into L2 before it (or not)
    for (k, n) in [(4096, 4096), (4096, 6144), (14336, 4096), (4096, 28672)]:
        lays = layouts(k, n, k + n)
        x = torch.randn(1, k, device=dev, dtype=dt)
        y0 = gemm_call(lays[0], x).clone()
        pf(lays[0], True)
        same = torch.equal(y0, gemm_call(lays[0], x))
        r = {"scenario": "A", "K": k, "N": n, "M": 1, "identical": same, "spin_us": spin_us,
             "gemm_alone": gemm.time_rotating(lambda i: gemm_call(lays[i], x), len(lays)),
             "spin+gemm": gemm.time_rotating(lambda i: (spin(), gemm_call(lays[i], x)), len(lays)),
             "pf+spin": gemm.time_rotating(lambda i: (pf(lays[i], False), spin()), len(lays)),
             "pf+spin+gemm": gemm.time_rotating(lambda i: (pf(lays[i], False), spin(), gemm_call(lays[i], x)), len(lays)),
             "pfLast+spin+gemm": gemm.time_rotating(lambda i: (pf(lays[i], True), spin(), gemm_call(lays[i], x)), len(lays))}
        # controls: the same copy twice in a row (the second reads what the first left in L2), and plain loads of
        # the weights (a touch kernel) instead of the prefetch
        r["gemm+gemm_same"] = gemm.time_rotating(lambda i: (gemm_call(lays[i], x), gemm_call(lays[i], x)), len(lays))
        r["touch+spin"] = gemm.time_rotating(lambda i: (tc(lays[i]), spin()), len(lays))
        r["touch+spin+gemm"] = gemm.time_rotating(lambda i: (tc(lays[i]), spin(), gemm_call(lays[i], x)), len(lays))
        r["gemm_hot"] = round(r["gemm+gemm_same"] - r["gemm_alone"], 2)
        r["gemm_after_touch"] = round(r["touch+spin+gemm"] - r["touch+spin"], 2)
        r["gemm_after_spin"] = round(r["spin+gemm"] - spin_us, 2)
        r["gemm_after_pf"] = round(r["pf+spin+gemm"] - r["pf+spin"], 2)
        rows.append(r)
        print(json.dumps(r), flush=True)
        del lays
        torch.cuda.empty_cache()

    # B: prefetch the down projection's weights, then the gate/up GEMM streams 60 MB, then the down GEMM
    downs = layouts(14336, 4096, 7)
    ups = layouts(4096, 28672, 8)
    xd = torch.randn(1, 14336, device=dev, dtype=dt)
    xu = torch.randn(1, 4096, device=dev, dtype=dt)
    nr = max(len(downs), len(ups))
    base = lambda i: (spin(), gemm_call(ups[i % len(ups)], xu), gemm_call(downs[i % len(downs)], xd))  # noqa: E731
    r = {"scenario": "B", "spin_us": spin_us,
         "spin+up+down": gemm.time_rotating(base, nr),
         "pf+spin+up+down": gemm.time_rotating(lambda i: (pf(downs[i % len(downs)], False), base(i)), nr),
         "pfLast+spin+up+down": gemm.time_rotating(lambda i: (pf(downs[i % len(downs)], True), base(i)), nr),
         "spin+up": gemm.time_rotating(lambda i: (spin(), gemm_call(ups[i % len(ups)], xu)), nr),
         "pfLast+spin+up": gemm.time_rotating(lambda i: (pf(downs[i % len(downs)], True), spin(),
                                               gemm_call(ups[i % len(ups)], xu)), nr)}
    rows.append(r)
    print(json.dumps(r), flush=True)

    gemm.save_rows(args.out, "l2_prefetch", rows)
    print("\n| K×N | GEMM alone | after spin | after prefetch + spin | prefetch + spin | spin | evict_last | hot (same copy twice) | after touch + spin | touch + spin |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["scenario"] == "A":
            print(f"| {r['K']}×{r['N']} | {r['gemm_alone']:.2f} | {r['gemm_after_spin']:.2f} | {r['gemm_after_pf']:.2f} "
                  f"| {r['pf+spin']:.2f} | {r['spin_us']:.2f} | {r['pfLast+spin+gemm'] - r['pf+spin']:.2f} | {r['gemm_hot']:.2f} "
                  f"| {r['gemm_after_touch']:.2f} | {r['touch+spin']:.2f} |")
    print(f"B: {json.dumps(rows[-1])}")
    print(f"wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
