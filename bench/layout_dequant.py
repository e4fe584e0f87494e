#!/usr/bin/env python
"""Dequantize+cuBLAS from each int4 source on one GPU: the canonical tensors (the table's "dequant" column),
the CUDA kernel's layout and the Triton kernel's layout (``sdquant.kernels.layout_dequant``) — what a layer
prepared with one layout per layer (``QuantLinear.prepare(layouts="one")``) runs at large M.

Times ``QuantLinear._run("dequant")`` per source at the table's buckets for every int4 entry of the table
(same method as ``sdquant.kernels.crossover``: weight copies rotating past L2, one CUDA graph, medians), checks
each source against the canonical path on the GPU, and writes the table again with the measured
"dequant_cuda" / "dequant_triton" columns added (``dispatch.plan_layer`` times a layout's dequant by them).
Then prints the one-layout plans of the Llama-3-8B layer shapes with and without the new columns.

    python bench/layout_dequant.py --out $OUT/crossover_h200_layouts.json     # ~1 min on an H200
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sdquant.kernels import crossover, dispatch  # noqa: E402
from sdquant.kernels.linear import QuantLinear  # noqa: E402

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}  # (N, K)
SOURCES = (None, "cuda", "triton")  # None = the canonical tensors


def one_layout_plans(table: dict, available=("reference", "dequant", "triton", "cuda")) -> dict:
    """What QuantLinear.prepare(layouts="one") would plan for the 8B shapes (the kept kernel's dequant column
    where the table has it)."""
    out = {}
    for name, (n, k) in SHAPES_8B.items():
        plan = dispatch.plan_one_layout(lambda a, cols: dispatch.plan_layer("int4", n, k, a, table, columns=cols),
                                        available)
        out[name] = plan.describe()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", default=None, help="table to extend (default: the shipped H200 table)")
    ap.add_argument("--out", required=True, help="where to write the extended table (JSON, atomically)")
    ap.add_argument("--trials", type=int, default=7)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/layout_dequant.py needs a CUDA GPU")
    dev, act = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    table = json.loads(json.dumps(dispatch.load_table(args.table)))  # a private copy to extend
    ms, t0, checks = table["buckets"], time.perf_counter(), {}
    for e in table["entries"]:
        if e["kind"] != "int4":
            continue
        n, k = e["N"], e["K"]
        proto = crossover.random_int4_layer(n, k, "cpu", table.get("meta", {}).get("group_size", 128))
        copies = [QuantLinear(proto.weight_q).to(dev) for _ in range(crossover.n_copies(n * k // 2))]
        for c in copies:
            c.prepare(dev, act, kernels="reference")   # canonical tensors on the device
            ok = [c.attach_int4(name, dev, act) for name in ("cuda", "triton")]
        sources = [s for s, good in zip(SOURCES, (True, *ok)) if good]
        rows = {s: [None] * len(ms) for s in sources}
        for i, m in enumerate(ms):
            x = torch.randn(m, k, device=dev, dtype=act)
            ys = {}
            for s in sources:
                for c in copies:
                    c.use_layout_dequant(s)
                ys[s] = copies[0]._run("dequant", x, ())
                rows[s][i] = crossover.time_graph([lambda c=c: c._run("dequant", x, ()) for c in copies],
                                                  args.trials)
            for s in sources[1:]:
                checks[f"{n}x{k} M={m} {s}"] = crossover.rel_err(ys[s], ys[None])
            print(f"int4 N={n} K={k} M={m}: " + " ".join(
                f"{s or 'canonical'}={rows[s][i]:.1f}us" for s in sources) + " | table dequant="
                f"{e['us'].get('dequant', [None] * len(ms))[i]}", flush=True)
        for s in sources[1:]:
            e["us"][f"dequant_{s}"] = rows[s]
        del copies
        torch.cuda.empty_cache()
    worst = max(checks.values()) if checks else float("nan")
    print(f"rel. error of layout dequant vs canonical dequant (bf16 GEMM outputs): worst {worst:.2e}")
    table.setdefault("meta", {})["layout_dequant"] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev), "worst_rel_err": worst,
        "method": "QuantLinear._run('dequant') per source; crossover.time_graph"}
    dispatch.write_table(table, args.out)
    before = one_layout_plans({**table, "entries": [
        {**e, "us": {c: v for c, v in e["us"].items() if not c.startswith("dequant_")}} for e in table["entries"]]})
    after = one_layout_plans(table)
    for name in SHAPES_8B:
        print(f"one-layout plan {name}: {before[name]}  ->  with measured layout dequant: {after[name]}")
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
