"""What a batch-1 decode layer's four INT4 GEMMs cost as a chain, with and without the fused decode-block ends, on the
H200 (docs/BENCHMARKS.md, "The decode layer's GEMMs as a chain").

    python bench/chain.py --out DIR          # one device call, about a minute

A Llama-3-8B-shaped stack of ``--layers`` random INT4 layers (g128, symmetric, bf16; qkv 4096x6144, o 4096x4096, gate/up
4096x28672, down 14336x4096, distinct weights a layer, so every step streams ~3.7 GB from DRAM), no attention. One
CUDA graph replays the whole stack; median of ``--reps`` replays, µs a layer:
- ``plain``: ``sdquant::w4a16_cuda`` four times a layer, each reading the previous output (a slice where the widths
  differ), so the chain's dependencies are the decode step's;
- ``fused``: ``sdquant::w4a16_cuda_fused`` as ``Block.forward_fused`` calls it (RMSNorm statistic in, SiLU * up out,
  both residual adds and the next norm's statistic), the attention replaced by a slice of the qkv output;
- each GEMM alone, back to back with itself in a graph (bench/gemm.py's ``time_rotating``, weights rotated past L2).
Each with and without programmatic dependent launch (the pipeline's default, early trigger).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

HID, FFN, QKV = 4096, 14336, 6144
SHAPES = {"qkv": (HID, QKV), "o": (HID, HID), "gate_up": (HID, 2 * FFN), "down": (FFN, HID)}   # name: (K, N)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ms", default="1")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    import gemm
    import provenance
    from sdquant.kernels import int4_cuda, int4_layout
    t0 = time.time()
    dev, dt = torch.device("cuda"), torch.bfloat16
    layers = []
    for i in range(a.layers):
        lay = {}
        for j, (name, (k, n)) in enumerate(SHAPES.items()):
            lay[name] = int4_layout.repack_cuda(gemm.random_int4(n, k, 128, True, False, device=dev, seed=97 * i + j), dt)
        lay["ffn_norm"] = (1 + 0.1 * torch.randn(HID, device=dev)).to(dt)
        lay["next_norm"] = (1 + 0.1 * torch.randn(HID, device=dev)).to(dt)
        layers.append(lay)
    print(f"{a.layers} layers built in {time.time() - t0:.0f} s", flush=True)

    def plain(L, x):
        return torch.ops.sdquant.w4a16_cuda(x, L["qweight"], L["scales"], L["zeros"], None, L["locks"], None)

    def fused(L, x, **kw):
        return torch.ops.sdquant.w4a16_cuda_fused(x, L["qweight"], L["scales"], L["zeros"], L["locks"],
                                                  kw.get("rms_ss"), 1e-5, kw.get("silu", False), kw.get("resid"),
                                                  kw.get("gamma"))

    def run_plain(x):
        for L in layers:
            q = plain(L["qkv"], x)
            o = plain(L["o"], q[:, :HID])
            g = plain(L["gate_up"], o)
            x = plain(L["down"], g[:, :FFN])
        return x

    def run_fused(x):
        xg, ss = x * layers[0]["ffn_norm"], int4_cuda.block_sumsq(x, HID)
        for L in layers:
            q = fused(L["qkv"], xg, rms_ss=ss)[0]
            h, hg, hss = fused(L["o"], q[:, :HID], resid=x, gamma=L["ffn_norm"])
            g = fused(L["gate_up"], hg, rms_ss=hss, silu=True)[0]
            x, xg, ss = fused(L["down"], g, resid=h, gamma=L["next_norm"])
        return x

    def graph_time(fn, x):
        fn(x)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = fn(x)
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(a.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) * 1000 / a.layers)
        del g
        return round(statistics.median(times), 2), y

    rows = []
    for m in [int(v) for v in a.ms.split(",")]:
        x = torch.randn(m, HID, device=dev, dtype=dt)
        r = {"M": m}
        for pdl in (False, True):
            old = int4_cuda.set_pdl(pdl, early_trigger=pdl)
            try:
                tag = "_pdl" if pdl else ""
                r["plain" + tag], yp = graph_time(run_plain, x)
                r["fused" + tag], yf = graph_time(run_fused, x)
                r["plain" + tag + "_2"], _ = graph_time(run_plain, x)
                r["finite" + tag] = bool(torch.isfinite(yp).all() and torch.isfinite(yf).all())
                L = layers[0]
                for name, (k, n) in SHAPES.items():
                    lays = [layers[i][name] for i in range(a.layers)]
                    xi = torch.randn(m, k, device=dev, dtype=dt)
                    r[f"{name}{tag}"] = round(gemm.time_rotating(lambda i: plain(lays[i], xi), len(lays)), 2)
            finally:
                int4_cuda.set_pdl(bool(old), early_trigger=old == 2)
        for tag in ("", "_pdl"):
            r["sum" + tag] = round(sum(r[f"{name}{tag}"] for name in SHAPES), 2)
        rows.append(r)
        print(json.dumps(r), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("SDQUANT_COMMIT"),
            "src_digest": provenance.source_digest(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "layers": a.layers, "reps": a.reps}
    tmp = out / "chain.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    os.replace(tmp, out / "chain.json")
    print("\n| M | PDL | qkv | o | gate/up | down | sum alone | plain chain (2nd) | fused chain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for tag, lab in (("", "off"), ("_pdl", "on")):
            print(f"| {r['M']} | {lab} | {r['qkv' + tag]} | {r['o' + tag]} | {r['gate_up' + tag]} | {r['down' + tag]} | "
                  f"{r['sum' + tag]} | {r['plain' + tag]} ({r['plain' + tag + '_2']}) | {r['fused' + tag]} |")
    print(f"wall {time.time() - t0:.0f} s")
    return 0 if all(r["finite"] and r["finite_pdl"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
