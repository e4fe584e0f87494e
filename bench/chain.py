"""What a batch-1 decode layer's four INT4 GEMMs cost as a chain, with and without the fused decode-block ends, on the
H200 (docs/benchmarks/decode.md, "Where a batch-1 layer's GEMM time goes").

    python bench/chain.py --out DIR          # one device call, about a minute
    python bench/chain.py --dry --out DIR    # CPU, tiny layers, no timing: the chains' plumbing (CI)

A Llama-3-8B-shaped stack of ``--layers`` random INT4 layers (g128, symmetric, bf16; qkv 4096x6144, o 4096x4096, gate/up
4096x28672, down 14336x4096, distinct weights a layer, so every step streams ~3.7 GB from DRAM), no attention. One
CUDA graph replays the whole stack; median of ``--reps`` replays, µs a layer:
- a chain per ``--modes`` entry, one letter a role (qkv, o, gate/up, down): P ``sdquant::w4a16_cuda`` (plain), F
  ``sdquant::w4a16_cuda_fused`` with the ends ``Block.forward_fused`` gives it (RMSNorm statistic in, SiLU * up out,
  both residual adds and the next norm's statistic), N the fused build with no end. Each GEMM reads the previous
  output (a slice where the widths differ), so the chain's dependencies are the decode step's; the attention is a
  slice of the qkv output. PPPP = the plain kernels, FFFF = the decode default, FFFP = the default less down's ends;
- each GEMM alone, back to back with itself in a graph (bench/gemm.py's ``time_rotating``, weights rotated past L2),
  the plain op and the fused build with no end.
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

DIMS = (4096, 14336, 6144)       # hidden, MLP, qkv width (Llama-3-8B)
DRY_DIMS = (256, 512, 384)


def shapes_of(hid: int, ffn: int, qkv: int) -> dict:
    """role -> (K, N) of a decode layer's four GEMMs (gate/up as one GEMM of 2 x ffn features)."""
    return {"qkv": (hid, qkv), "o": (hid, hid), "gate_up": (hid, 2 * ffn), "down": (ffn, hid)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ms", default="1")
    ap.add_argument("--sweep", default="",
                    help="tight variants (e.g. 38,39,40,41): the FFFF chain again with one role at a time on each")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny layers, every chain run once untimed")
    ap.add_argument("--modes", default="PPPP,FFFF,NNNN,FPPP,PFPP,PPFP,PPPF",
                    help="one letter a role (qkv, o, gate/up, down): P plain, F fused with its ends, N fused, no end")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    import gemm
    import provenance
    from sdquant.kernels import int4_cuda, int4_layout
    t0 = time.time()
    hid, ffn, qkv_n = DRY_DIMS if a.dry else DIMS
    shapes = shapes_of(hid, ffn, qkv_n)
    dev, dt = torch.device("cpu" if a.dry else "cuda"), torch.bfloat16
    layers = []
    for i in range(a.layers):
        lay = {}
        for j, (name, (k, n)) in enumerate(shapes.items()):
            qw = gemm.random_int4(n, k, 128, True, False, device=dev, seed=97 * i + j)
            lay[name] = int4_layout.repack_cuda(qw, dt)
        lay["ffn_norm"] = (1 + 0.1 * torch.randn(hid, device=dev)).to(dt)
        lay["next_norm"] = (1 + 0.1 * torch.randn(hid, device=dev)).to(dt)
        layers.append(lay)
    print(f"{a.layers} layers built in {time.time() - t0:.0f} s", flush=True)

    def plain(L, x):
        return torch.ops.sdquant.w4a16_cuda(x, L["qweight"], L["scales"], L["zeros"], None, L["locks"], None)

    def fused(L, x, cfg=-1, **kw):
        return torch.ops.sdquant.w4a16_cuda_fused(x, L["qweight"], L["scales"], L["zeros"], L["locks"],
                                                  kw.get("rms_ss"), 1e-5, kw.get("silu", False), kw.get("resid"),
                                                  kw.get("gamma"), cfg)

    ss_static = int4_cuda.block_sumsq(torch.randn(1, hid, device=dev, dtype=dt), hid)

    def make_chain(mode: str, cfgs=None):
        """mode: one letter a role (qkv, o, gate/up, down): P plain op, F fused op with its ends, N the fused build
        with no end. A fused consumer whose producer is not fused reads a fixed statistic of the right shape.
        cfgs: {role: config} for the fused ops (default: ``fused_config``'s)."""
        mq, mo, mg, md = mode
        cfgs = cfgs or {}

        def gemm_of(kind, layer, role, x, **kw):
            L = layer[role]
            if kind == "P":
                return plain(L, x), None, None
            if kind == "N":
                return fused(L, x, cfgs.get(role, -1))[0], None, None
            return fused(L, x, cfgs.get(role, -1), **kw)

        def run(x):
            ss_m = ss_static.expand(x.shape[0], -1).contiguous()
            xg, ss = x, ss_m
            for L in layers:
                q = gemm_of(mq, L, "qkv", xg, rms_ss=ss)[0]
                h, hg, hss = gemm_of(mo, L, "o", q[:, :hid], resid=x, gamma=L["ffn_norm"])
                if hg is None:
                    hg, hss = h, ss_m
                g = gemm_of(mg, L, "gate_up", hg, rms_ss=hss, silu=True)[0]
                if g.shape[-1] != ffn:
                    g = g[:, :ffn]
                x, xg2, ss2 = gemm_of(md, L, "down", g, resid=h, gamma=L["next_norm"])
                xg, ss = (x, ss_m) if xg2 is None else (xg2, ss2)
            return x
        return run

    def graph_time(fn, x):
        if a.dry:  # the chain once, untimed: its shapes and dependencies
            y = fn(x)
            assert y.shape == x.shape and torch.isfinite(y).all(), (y.shape, x.shape)
            return 0.0, y
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

    modes = a.modes.split(",")
    if any(len(md) != 4 or set(md) - set("PFN") for md in modes) or "PPPP" not in modes:
        ap.error("--modes: four letters of P / F / N each, PPPP among them")
    rows = []
    for m in [int(v) for v in a.ms.split(",")]:
        x = torch.randn(m, hid, device=dev, dtype=dt)
        r = {"M": m}
        for pdl in (False, True):
            old = int4_cuda.set_pdl(pdl, early_trigger=pdl)
            try:
                tag = "_pdl" if pdl else ""
                for mode in modes:
                    r[mode + tag], y = graph_time(make_chain(mode), x)
                r["PPPP" + tag + "_2"], _ = graph_time(make_chain("PPPP"), x)
                for v in [int(t) for t in a.sweep.split(",") if t]:
                    for role in shapes:
                        r[f"FFFF_{role}{v}{tag}"], _ = graph_time(make_chain("FFFF", {role: v}), x)
                for name, (k, n) in shapes.items():
                    lays = [layers[i][name] for i in range(a.layers)]
                    xi = torch.randn(m, k, device=dev, dtype=dt)
                    if a.dry:
                        r[f"{name}{tag}"] = r[f"{name}_n{tag}"] = 0.0
                        continue
                    r[f"{name}{tag}"] = round(gemm.time_rotating(lambda i: plain(lays[i], xi), len(lays)), 2)
                    r[f"{name}_n{tag}"] = round(gemm.time_rotating(lambda i: fused(lays[i], xi)[0], len(lays)), 2)
            finally:
                int4_cuda.set_pdl(bool(old), early_trigger=old == 2)
        for tag in ("", "_pdl"):
            r["sum" + tag] = round(sum(r[f"{name}{tag}"] for name in shapes), 2)
            r["sum_n" + tag] = round(sum(r[f"{name}_n{tag}"] for name in shapes), 2)
        rows.append(r)
        print(json.dumps(r), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("SDQUANT_COMMIT"),
            "src_digest": provenance.source_digest(), "device": "cpu (dry)" if a.dry else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "layers": a.layers, "reps": a.reps, "dims": [hid, ffn, qkv_n], "modes": modes}
    tmp = out / "chain.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    os.replace(tmp, out / "chain.json")
    print("\n| M | PDL | qkv | o | gate/up | down | sum alone | " + " | ".join(modes) + " | PPPP again |")
    print("|---|---|---|---|---|---|---|" + "---|" * (len(modes) + 1))
    for r in rows:
        for tag, lab in (("", "off"), ("_pdl", "on")):
            ch = " | ".join(str(r[md + tag]) for md in modes)
            print(f"| {r['M']} | {lab} | {r['qkv' + tag]} | {r['o' + tag]} | {r['gate_up' + tag]} | "
                  f"{r['down' + tag]} | "
                  f"{r['sum' + tag]} | {ch} | {r['PPPP' + tag + '_2']} |")
    print("\nEach GEMM alone, back to back with itself: plain / the fused build with no end (µs)")
    print("| M | PDL | " + " | ".join(shapes) + " | sum |")
    print("|---|---|" + "---|" * (len(shapes) + 1))
    for r in rows:
        for tag, lab in (("", "off"), ("_pdl", "on")):
            print(f"| {r['M']} | {lab} | " + " | ".join(f"{r[n + tag]} / {r[n + '_n' + tag]}" for n in shapes)
                  + f" | {r['sum' + tag]} / {r['sum_n' + tag]} |")
    if a.sweep:
        vs = [int(t) for t in a.sweep.split(",") if t]
        print("\nFFFF chain, one role's fused config forced (µs a layer; default configs: "
              + ", ".join(f"{role} {int4_cuda.fused_config(1, n, k)}" for role, (k, n) in shapes.items()) + ")")
        print("| M | PDL | role | " + " | ".join(f"v{v}" for v in vs) + " |")
        print("|---|---|---|" + "---|" * len(vs))
        for r in rows:
            for tag, lab in (("", "off"), ("_pdl", "on")):
                for role in shapes:
                    cells = " | ".join(str(r[f"FFFF_{role}{v}{tag}"]) for v in vs)
                    print(f"| {r['M']} | {lab} | {role} | {cells} |")
    print(f"wall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
