"""FP8 W8A8 with per-tensor weight scales and static activation scales (``quant.fp8.weights: tensor``,
templates/fp8-w8a8-tensorwise-h100.yaml) against torch's tensorwise ``_scaled_mm`` at M >= 128: issue 4's "FP8 at
M >= 1024 within 5% of torch._scaled_mm tensorwise and >= 1.6x bf16".

    SDQUANT_COMMIT=<hash> python bench/fp8_tensorwise.py --out $OUT
    python bench/fp8_tensorwise.py --dry          # CPU: torch's CPU _scaled_mm, tiny shapes, checks only

Per (K x N, M), in one process (bench/gemm.py's method: weight copies rotating past 3x the L2, one CUDA graph per
point, median of 5 replays), bf16 activations, µs:
- ``bf16``: cuBLAS ``F.linear``;
- ``tensorwise`` / ``rowwise``: ``torch._scaled_mm`` on activations quantized beforehand (the GEMM alone; the target's
  baseline is tensorwise);
- ``channel_layer``: the default Fp8Linear (per-channel weights, dynamic per-token activations) as an eager call
  runs it: the Triton quantize kernel + rowwise ``_scaled_mm``;
- ``tensor_layer``: Fp8Linear with per-tensor weights and a static activation scale, eager: the quantize kernel +
  tensorwise ``_scaled_mm`` (bias-free);
- ``tensor_gemm``: that layer's GEMM op (``sdquant::fp8_gemm_scaled_mm``) on pre-quantized activations: what a
  compiled model runs, where the activation quantization is fused into the producing kernel.
Every sdquant path is checked first against an fp64 evaluation of its own W8A8 function (relative error <= 1e-2).
Writes $OUT/fp8_tensorwise.json and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SHAPES = [(8192, 28672), (28672, 8192), (4096, 14336), (14336, 4096), (4096, 4096), (8192, 10240), (4096, 6144)]
MS = [128, 256, 1024, 2048, 4096]


def w8a8_reference(x, fw):
    """fp64 y = (q(x) * s_x) @ (W_q * s_w)^T with q the static or per-token e4m3 quantization of x."""
    import torch
    xf = x.double()
    if fw.input_scale is None:
        sx = (xf.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
    else:
        sx = fw.input_scale.double()
    xq = (xf / sx).clamp(-448, 448).to(torch.float8_e4m3fn).double() * sx
    return xq @ (fw.weight.double() * fw.weight_scale.double()[:, None]).t()


def rel_err(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def layers(w, x, device):
    """(per-channel dynamic layer, per-tensor static layer) on device, both prepared for the _scaled_mm path."""
    import torch

    from sdquant.kernels.linear import Fp8Linear
    from sdquant.quant.qtensor import quantize_fp8_weight
    isc = (x.float().abs().amax() / 448.0).reshape(())
    ch = Fp8Linear(quantize_fp8_weight(w), None).prepare(device, torch.bfloat16, kernels="cuda")
    te = Fp8Linear(quantize_fp8_weight(w, isc, per_tensor=True), None).prepare(device, torch.bfloat16,
                                                                              kernels="cuda")
    if not (ch.kernel.endswith("scaled_mm") and te.kernel.endswith("scaled_mm") and "tensorwise" in repr(te)):
        raise SystemExit(f"error: the layers did not plan the _scaled_mm paths: {ch.kernel} / {te!r}")
    return ch, te


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU: tiny shapes, checks only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every path this many times, round robin, and keep the median (run-to-run noise)")
    a = ap.parse_args(argv)
    import torch

    from sdquant.kernels import ops
    from sdquant.quant.qtensor import Fp8Weight
    t0 = time.time()
    rows = []
    if a.dry:
        g = torch.Generator().manual_seed(0)
        for (k, n) in [(256, 128), (512, 64)]:
            w = torch.randn(n, k, generator=g) / math.sqrt(k)
            for m in (1, 17, 64):
                x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                ch, te = layers(w, x, "cpu")
                for name, layer in (("channel_layer", ch), ("tensor_layer", te)):
                    e = rel_err(layer(x), w8a8_reference(x, layer.weight_q))
                    rows.append({"K": k, "N": n, "M": m, "path": name, "rel_err": e})
                    print(json.dumps(rows[-1]), flush=True)
                    if not e <= 1e-2:
                        raise SystemExit(f"error: {name} K={k} N={n} M={m}: relative error {e:.2e} > 1e-2")
        return
    import gemm
    dev, dt = torch.device("cuda"), torch.bfloat16
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("SDQUANT_COMMIT"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": a.rounds}
    for (k, n) in SHAPES:
        w = torch.randn(n, k, device=dev) / math.sqrt(k)
        nrot = gemm.n_copies(n * k)
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ch, te = layers(w, x, dev)
            row = {"K": k, "N": n, "M": m}
            for name, layer in (("channel_layer", ch), ("tensor_layer", te)):
                row[name + "_err"] = rel_err(layer(x), w8a8_reference(x, layer.weight_q))
                if not row[name + "_err"] <= 1e-2:
                    raise SystemExit(f"error: {name} K={k} N={n} M={m}: relative error {row[name + '_err']:.2e}")
            chs = [ch.weight.clone() for _ in range(nrot)]
            wb = [(ch.weight.float() * ch.weight_scale[:, None]).to(dt) for _ in range(min(nrot, gemm.n_copies(2 * n * k)))]
            xq_t = (x.float() / te.input_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev)
            xq_r, xs_r = ops.quantize_fp8_per_token(x.float())
            sa, sb = xs_r.reshape(-1, 1).float(), ch.weight_scale.reshape(1, -1)
            ch_l = [ch] + [layer_copy(ch, c) for c in chs[1:]]
            te_l = [te] + [layer_copy(te, c) for c in chs[1:]]
            xq, xs = ops.quantize_act_torch(x, None, te.input_scale)
            ws1 = te._scaled_mm_scale()
            paths = {
                "bf16": (lambda i: torch.nn.functional.linear(x, wb[i % len(wb)]), len(wb)),
                "tensorwise": (lambda i: torch._scaled_mm(xq_t, chs[i].t(), scale_a=one, scale_b=one,
                                                          out_dtype=dt), nrot),
                "rowwise": (lambda i: torch._scaled_mm(xq_r, chs[i].t(), scale_a=sa, scale_b=sb, out_dtype=dt), nrot),
                "channel_layer": (lambda i: ch_l[i](x), nrot),
                "tensor_layer": (lambda i: te_l[i](x), nrot),
                "tensor_gemm": (lambda i: torch.ops.sdquant.fp8_gemm_scaled_mm(xq, xs, chs[i], ws1, None, dt, False),
                                nrot),
            }
            times = {name: [] for name in paths}
            for _ in range(max(1, a.rounds)):
                for name, (call, nr) in paths.items():
                    times[name].append(gemm.time_rotating(call, nr))
            for name, ts in times.items():
                row[name] = sorted(ts)[len(ts) // 2]
                if len(ts) > 1:
                    row[name + "_rounds"] = ts
            print(json.dumps(row), flush=True)
            rows.append(row)
            del chs, wb, ch_l, te_l
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "fp8_tensorwise.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    tmp.replace(out / "fp8_tensorwise.json")
    names = ["bf16", "tensorwise", "rowwise", "channel_layer", "tensor_layer", "tensor_gemm"]
    print("\n| K×N | M | " + " | ".join(names) + " | tensor_layer ÷ tensorwise | tensor_gemm ÷ tensorwise "
          "| bf16 ÷ tensor_layer | bf16 ÷ tensor_gemm |")
    print("|---|---|" + "---|" * len(names) + "---|---|---|---|")
    for r in rows:
        print(f"| {r['K']}×{r['N']} | {r['M']} | " + " | ".join(f"{r[c]:.1f}" for c in names)
              + f" | {r['tensor_layer'] / r['tensorwise']:.3f} | {r['tensor_gemm'] / r['tensorwise']:.3f}"
              + f" | {r['bf16'] / r['tensor_layer']:.2f} | {r['bf16'] / r['tensor_gemm']:.2f} |")
    print(f"wall {time.time() - t0:.0f} s")


def layer_copy(layer, weight):
    """A shallow copy of a prepared Fp8Linear reading another copy of its weight (for the rotation)."""
    import copy
    c = copy.copy(layer)
    c._buffers = dict(layer._buffers)
    c._buffers["weight"] = weight
    return c


if __name__ == "__main__":
    main()
