"""FP8 W8A8 kernels and the per-shape dispatch table, on one GPU in one call.

    python bench/gemm_fp8.py [--quick] [--out DIR]

1. correctness on the GPU of every fp8 path (Triton, _scaled_mm rowwise, dequant+cuBLAS; dynamic and static
   activation scales; bias; unfolded smooth) and of the int dequant path, against fp64 references;
   pass bound ||y - ref|| / ||ref|| <= 1e-2 (bf16 outputs round at 2^-9; an fp8 code can flip where GPU and
   reference round a tie differently);
2. the crossover table (``sdquant.kernels.crossover.measure``): bf16 F.linear and every available fp8 / int4
   path per (K x N, M), Triton fp8 tile configs tuned per M <= 64 -> DIR/crossover_h200.json;
3. GEMM-only baselines in the same process: ``torch._scaled_mm`` tensorwise and rowwise on pre-quantized
   activations vs sdquant's Triton GEMM, plus the whole layers -> DIR/gemm_fp8.json, table printed last.
Timing: CUDA graphs over weight copies rotating past the 60 MB L2, medians (crossover.time_graph).
"""
import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sdquant.kernels import crossover, dispatch, fp8_triton  # noqa: E402
from sdquant.kernels.ops import quantize_fp8_per_token  # noqa: E402
from sdquant.quant.qtensor import quantize_fp8_weight  # noqa: E402

BOUND = 1e-2


def copy_bandwidth(dev) -> float:
    a = torch.empty(2 ** 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    t = crossover.time_graph([lambda: b.copy_(a)], trials=5, target_ms=5)
    return 2 * a.numel() / (t * 1e-6) / 1e12  # TB/s, read + write


def check_correctness(dev, log, small: bool = False) -> list:
    rows = []
    torch.manual_seed(1)
    for (k, n) in ((256, 96), (14336, 4096)) if small else ((256, 96), (4096, 4096), (14336, 4096)):
        for m in (1, 33) if small else (1, 3, 16, 33, 1024):
            for static in (False, True):
                for extras in (False, True):
                    w = torch.randn(n, k, device=dev) / math.sqrt(k)
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    smooth = (torch.rand(k, device=dev) + 0.5) if extras else None
                    xs_in = x.float() / smooth if extras else x.float()
                    isc = (xs_in.abs().amax() / 448.0).reshape(()) if static else None
                    fw = quantize_fp8_weight(w, isc if static else None)
                    bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if extras else None
                    layer = crossover.Fp8Linear(fw, bias, smooth).to(dev)
                    # fp64 reference of the W8A8 function on x / smooth
                    if static:
                        xq = (xs_in / isc).clamp(-448, 448).to(torch.float8_e4m3fn)
                        xsc = isc.double()
                    else:
                        xq, xsc = quantize_fp8_per_token(xs_in)
                        xsc = xsc.double()
                    ref = (xq.double() @ layer.weight.double().t()) * xsc * layer.weight_scale.double()
                    if bias is not None:
                        ref = ref + bias.double()
                    for name in ("triton", "scaled_mm", "dequant", "reference"):
                        try:
                            y = layer._run(name, x, ())
                            err = crossover.rel_err(y, ref)
                        except Exception as e:
                            err = float("nan")
                            log(f"correctness {name} {k}x{n} M={m}: {type(e).__name__}: {str(e)[:300]}")
                        rows.append({"kind": "fp8", "kernel": name, "K": k, "N": n, "M": m, "static": static,
                                     "bias_smooth": extras, "rel_err": err, "ok": bool(err <= BOUND)})
    for (k, n, gs, sym) in ((256, 96, 32, False), (4096, 4096, 128, True), (4096, 4096, 128, False),
                            (8192, 1024, -1, False)):
        layer = crossover.random_int4_layer(n, k, "cpu", gs, sym).to(dev)
        for m in (1, 33, 1024):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.double() @ layer.weight_q.to(dev).dequantize(torch.float64).t()  # prepare may host-keep them
            names = ["dequant", *[nm for nm in ("triton", "cuda") if nm in layer.available_kernels(dev, x.dtype)]]
            for name in names:
                try:
                    layer.prepare(dev, x.dtype, kernels={"dequant": "torch"}.get(name, name))
                    y = layer(x)
                    err = crossover.rel_err(y, ref)
                except Exception as e:
                    err = float("nan")
                    log(f"correctness int4 {name} {k}x{n} M={m}: {type(e).__name__}: {str(e)[:300]}")
                rows.append({"kind": "int4", "kernel": name, "K": k, "N": n, "M": m, "group": gs,
                             "symmetric": sym, "rel_err": err, "ok": bool(err <= BOUND)})
    bad = [r for r in rows if not r["ok"]]
    worst = {}
    for r in rows:
        key = (r["kind"], r["kernel"])
        worst[key] = max(worst.get(key, 0.0), r["rel_err"] if r["rel_err"] == r["rel_err"] else float("inf"))
    for key, v in sorted(worst.items()):
        log(f"correctness {key[0]:5s} {key[1]:10s} worst rel err {v:.2e} ({'ok' if v <= BOUND else 'FAIL'})")
    log(f"correctness: {len(rows) - len(bad)}/{len(rows)} within {BOUND}")
    return rows


def gemm_baselines(dev, table, shapes_ms, log) -> list:
    """GEMM-only (activations pre-quantized) and whole-layer timings for the FP8 targets."""
    out = []
    for (k, n), ms in shapes_ms:
        entry = dispatch.nearest_entry(table, "fp8", n, k) if table else None
        proto = crossover.random_fp8_layer(n, k, "cpu")
        nc = crossover.n_copies(n * k)
        ws = [proto.weight.to(dev) for _ in range(nc)]
        wsc = proto.weight_scale.to(dev)
        dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(crossover.n_copies(2 * n * k))]
        layers = [crossover.Fp8Linear(proto.weight_q).to(dev).prepare(dev, torch.bfloat16, "auto", table)
                  for _ in range(nc)]
        one = torch.ones((), device=dev)
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = fp8_triton.quantize_act(x)
            sa, sb = xs.reshape(-1, 1), wsc.reshape(1, -1)
            cfg = None
            if entry and m in table["buckets"] and entry["triton_config"][table["buckets"].index(m)]:
                cfg = fp8_triton.GemmConfig.from_list(entry["triton_config"][table["buckets"].index(m)])
            r = {"K": k, "N": n, "M": m, "triton_config": cfg.as_list() if cfg else None}
            cands = {
                "bf16": [lambda w=w: torch.nn.functional.linear(x, w) for w in dense],
                "scaled_mm_tensorwise": [lambda w=w: torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one,
                                                                      out_dtype=torch.bfloat16) for w in ws],
                "scaled_mm_rowwise": [lambda w=w: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb,
                                                                   out_dtype=torch.bfloat16) for w in ws],
                "scaled_mm_rowwise_fastacc": [lambda w=w: torch._scaled_mm(
                    xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True) for w in ws],
                "triton_gemm": [lambda w=w: fp8_triton.gemm_swapab(xq, xs, w, wsc, None, torch.bfloat16, cfg)
                                for w in ws],
                "quantize_act": [lambda: fp8_triton.quantize_act(x)],
                "layer_dispatched": [lambda c=c: c(x) for c in layers],
                "layer_triton": [lambda c=c: c._run("triton", x, cfg.as_list() if cfg else ()) for c in layers],
                "layer_scaled_mm": [lambda c=c: c._run("scaled_mm", x, ()) for c in layers],
            }
            for name, calls in cands.items():
                try:
                    r[name] = crossover.time_graph(calls, trials=9)
                except Exception as e:
                    r[name] = None
                    log(f"baseline {name} {k}x{n} M={m}: {type(e).__name__}: {str(e)[:200]}")
            r["dispatch"] = layers[0].plan.select(m)[0]
            out.append(r)
            log("gemm " + " ".join(f"{a}={v:.1f}" if isinstance(v, float) else f"{a}={v}" for a, v in r.items()))
        del ws, dense, layers
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and batch sizes")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--skip-table", action="store_true", help="use the shipped table instead of measuring")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop starting table shapes after this")
    ap.add_argument("--correctness", choices=("full", "small", "none"), default="full")
    ap.add_argument("--kinds", default="fp8,int4", help="kinds to (re)measure for the table")
    ap.add_argument("--merge-table", default=None,
                    help="existing table whose entries of the other kinds are kept (re-measure one kind only)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    logf = open(os.path.join(a.out, "gemm_fp8.log"), "w")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    dev = torch.device("cuda", 0)
    import triton
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "commit": os.environ.get("SDQ_COMMIT", "unknown"), "bound": BOUND}
    t0 = time.perf_counter()
    log(f"{res['device']} torch {res['torch']} triton {res['triton']}")
    res["copy_TBps"] = copy_bandwidth(dev)
    log(f"device-to-device copy: {res['copy_TBps']:.2f} TB/s")
    if a.correctness != "none":
        try:
            res["correctness"] = check_correctness(dev, log, a.correctness == "small")
        except Exception:
            log(traceback.format_exc())
    log(f"[{time.perf_counter() - t0:.0f} s]")
    if a.quick:
        shapes, ms = ((14336, 4096), (4096, 4096), (8192, 28672)), (1, 16, 64, 256, 4096)
    else:
        shapes, ms = crossover.LLAMA_SHAPES, crossover.TABLE_MS
    table = None
    kinds = tuple(a.kinds.split(","))
    keep = []
    if a.merge_table:
        keep = [e for e in dispatch.load_table(a.merge_table)["entries"] if e["kind"] not in kinds]

    def merged(t):
        t = dict(t, entries=keep + t["entries"])
        dispatch.write_table(t, os.path.join(a.out, "crossover_h200.json"))
        return t
    if not a.skip_table:
        try:
            table = merged(crossover.measure(shapes=shapes, ms=ms, kinds=kinds, log=log, deadline=t0 + a.budget_s,
                                             on_entry=merged))
        except Exception:
            log(traceback.format_exc())
    log(f"[{time.perf_counter() - t0:.0f} s]")
    targets = [((14336, 4096), (1, 16, 32, 64)), ((8192, 28672), (1, 16, 1024, 2048, 4096)),
               ((4096, 14336), (16, 1024, 4096))]
    if a.quick:
        targets = [((14336, 4096), (1, 16, 64)), ((8192, 28672), (16, 4096))]
    if table is None and a.merge_table:
        table = dispatch.load_table(a.merge_table)
    try:
        res["gemm"] = gemm_baselines(dev, table, targets, log)
    except Exception:
        log(traceback.format_exc())
        res["gemm"] = []
    res["seconds"] = time.perf_counter() - t0
    with open(os.path.join(a.out, "gemm_fp8.json"), "w") as f:
        json.dump(res, f, indent=1)
    log("\n| K×N | M | bf16 | sm tensorwise | sm rowwise | sm rowwise fastacc | triton gemm | quant | "
        "layer (dispatch) | kernel | ×bf16 | ×rowwise(gemm) | layer/tensorwise |")
    for r in res["gemm"]:
        f = lambda v: f"{v:.1f}" if isinstance(v, float) else "–"  # noqa: E731
        sp = r["bf16"] / r["layer_dispatched"] if r.get("layer_dispatched") and r.get("bf16") else float("nan")
        sr = (r["scaled_mm_rowwise"] / r["triton_gemm"]) if r.get("triton_gemm") and r.get("scaled_mm_rowwise") \
            else float("nan")
        lt = r["layer_dispatched"] / r["scaled_mm_tensorwise"] if r.get("layer_dispatched") and \
            r.get("scaled_mm_tensorwise") else float("nan")
        log(f"| {r['K']}×{r['N']} | {r['M']} | {f(r.get('bf16'))} | {f(r.get('scaled_mm_tensorwise'))} | "
            f"{f(r.get('scaled_mm_rowwise'))} | {f(r.get('scaled_mm_rowwise_fastacc'))} | {f(r.get('triton_gemm'))} | "
            f"{f(r.get('quantize_act'))} | {f(r.get('layer_dispatched'))} | {r.get('dispatch')} | {sp:.2f} | "
            f"{sr:.2f} | {lt:.3f} |")
    log(f"total {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
