"""GEMM benchmark: sdquant INT4 (Triton, CUDA) and FP8 kernels against what torch already has, on one GPU.

    python bench/gemm.py [--shapes 4096x4096,8192x28672] [--ms 1,16,64] [--out DIR] [--dtype bfloat16]

For every K x N (in x out features) and M: cuBLAS bf16 ``F.linear``; torch's int4 tinygemm
(``torch._weight_int4pack_mm``, group 128); ``torch._scaled_mm`` FP8 tensorwise and rowwise (activations
pre-quantized: the GEMM alone); sdquant W4A16 Triton and CUDA (group 128, symmetric), and at M <= 16 the CUDA op
again as the decode runtime launches it (sdq_cuda_pdl: programmatic dependent launch with the early trigger; not in
the default list, sdq_cuda_pdl_late: the same without the early trigger); sdquant FP8 Triton
(``sdquant.kernels.fp8_triton.fp8_linear``, includes its activation quantization) when that module exists; and the
layers as a user runs them, ``QuantLinear`` (sdq_int4_layer) and ``Fp8Linear`` (sdq_fp8_layer: per-channel weights,
dynamic per-token activations, the default; sdq_fp8_tensor_layer: the per-tensor recipe, one weight scale and a static
activation scale) prepared with kernels="auto": each M takes the kernel its crossover table plans
($SDQUANT_KERNEL_TABLE, else the table shipped for this GPU model), and each row records that choice ("plan").

Method: each kernel's weights are replicated until the copies exceed 3x the 60 MB L2 and calls rotate
through them; CALLS back-to-back calls are captured in one CUDA graph (launch gaps stay out), replayed TRIALS
times, timed with CUDA events; the median per call is reported. Effective TB/s counts the bytes a call must
move (weights incl. scales, activations, output); "%copy" is that over the device-to-device copy bandwidth
measured in the same run. torch's tinygemm is not timed at M > 256 (1.0 ms at M = 64 on 8192x28672 already, and
growing with M); the sdquant CUDA op is timed at every M. GPU correctness: every timed call is
compared with x @ W.T in float64 (``rel_err``; the FP8 rows' include the W8A8 quantization error). Results: a table on
stdout (last) and JSON in --out (or $OUT), saved after every shape.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdquant.kernels import int4_layout  # noqa: E402
from sdquant.quant.qtensor import QuantizedWeight  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_clocks  # noqa: E402
import provenance  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 28672), (28672, 8192)]
# timing order: the shapes with INT4 targets first, so a run cut short still holds them
RUN_ORDER = [(8192, 28672), (4096, 28672), (14336, 4096), (4096, 4096), (8192, 10240), (28672, 8192), (4096, 6144)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
L2_BYTES = 60 * 2**20
GS = 128


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------ timing
def copy_bandwidth(dev) -> float:
    """Device-to-device copy, bytes read + written per second (TB/s), median of 10."""
    a = torch.empty(2**30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * 2**30 / statistics.median(ts) / 1e12


# monotonic seconds at the start and end of the last time_rotating call (gpu_state's default window)
LAST_SPAN = [0.0, 0.0]


def gpu_state(t0=None, t1=None):
    """The GPU's clocks, power and temperature over [t0, t1] (monotonic seconds; default: the last time_rotating
    call), from the process's nvidia-smi sampler (bench/gpu_clocks.py); None without one."""
    clocks = gpu_clocks.shared(start=False)
    if clocks is None:
        return None
    return clocks.window(LAST_SPAN[0] if t0 is None else t0, LAST_SPAN[1] if t1 is None else t1)


def time_rotating(call, n_rot: int, trials: int = 5, target_ms: float = 5.0, max_calls: int = 100) -> float:
    """Median microseconds per call; call(i) runs the kernel on copy i % n_rot. Graph replay when possible. The
    first call in a process starts the nvidia-smi sampler that gpu_state reads."""
    gpu_clocks.shared()
    LAST_SPAN[0] = time.monotonic()
    for i in range(max(n_rot, 3)):
        call(i % n_rot)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for i in range(n_rot):
        call(i)
    e.record()
    torch.cuda.synchronize()
    est_ms = s.elapsed_time(e) / n_rot
    calls = int(min(max_calls, max(3, target_ms / max(est_ms, 1e-4))))
    graph = None
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                for i in range(calls):
                    call(i % n_rot)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as ex:  # some library paths refuse capture: time eagerly instead
        log(f"  (graph capture failed: {type(ex).__name__}: {str(ex)[:120]}; timing eagerly)")
        graph = None
    ts = []
    for _ in range(trials):
        s.record()
        if graph is not None:
            graph.replay()
        else:
            for i in range(calls):
                call(i % n_rot)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / calls)
    LAST_SPAN[1] = time.monotonic()
    return statistics.median(ts)


def save_rows(out_dir, name: str, rows, **meta) -> Path:
    """{"meta": {date, commit, device, **meta}, "rows": rows} as out_dir/name.json, written to a temporary file and
    renamed (the probes' shared record format)."""
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": os.environ.get("SDQUANT_COMMIT"),
            "src_digest": provenance.source_digest(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", **meta}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    os.replace(tmp, out / f"{name}.json")
    return out / f"{name}.json"


def time_cpu(call, n_rot: int, trials: int = 3) -> float:
    """The --dry modes' timer: host clock, no graph (the CPU op path), median microseconds per call of
    call(0..n_rot-1)."""
    ts = []
    for _ in range(trials):
        t = time.perf_counter()
        for i in range(n_rot):
            call(i)
        ts.append((time.perf_counter() - t) * 1e6 / n_rot)
    return statistics.median(ts)


def n_copies(nbytes: int) -> int:
    return max(1, math.ceil(3 * L2_BYTES / max(nbytes, 1)))


# ----------------------------------------------------------------------------------------------- weights
def random_int4(n: int, k: int, gs: int = GS, symmetric: bool = True, act_order: bool = False,
                device="cpu", seed: int = 0) -> QuantizedWeight:
    """Random codes/scales/zeros generated on ``device`` (a 28672x8192 weight takes seconds on a CPU)."""
    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8, device=device)
    groups = 1 if gs == -1 else k // gs
    scales = (torch.rand(n, groups, generator=g, device=device) * 0.02 + 0.002).to(torch.float16)
    zeros = None if symmetric else torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8, device=device)
    g_idx = (torch.randperm(k, generator=g, device=device) // gs).to(torch.int32) if act_order else None
    return QuantizedWeight.from_codes(codes, scales, zeros, 4, gs, g_idx)


def tinygemm_pack(qw: QuantizedWeight, dtype=torch.bfloat16):
    """(packed int4, scales_and_zeros) for torch._weight_int4pack_mm computing the same weights.
    tinygemm dequantizes w = (q - 8) * s + z, so z = (8 - zero) * s."""
    codes = qw.codes().to(torch.int32)
    packed_u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    w = torch.ops.aten._convert_weight_to_int4pack(packed_u8.contiguous(), 8)
    s = qw.scales.float()
    z = torch.full_like(s, 8.0) if qw.zeros is None else qw.zeros.float()
    sz = torch.stack([s, (8.0 - z) * s], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [G, N, 2]
    return w, sz


# --------------------------------------------------------------------------------------------- providers
def build_providers(n: int, k: int, dev, dtype, which: set, log_fn=log, gs: int = GS):
    """name -> (make(copy_index) -> ctx, run(ctx, x) -> y, weight bytes). Failures become None entries. gs: the
    INT4 group size of the random weights (-1: per channel)."""
    qw = random_int4(n, k, gs, device=dev)
    w_ref = qw.dequantize(dtype)                          # [N, K] the dense weight every int4 path represents
    provs = {}
    int4_bytes = n * k // 2 + n * (k // (k if gs == -1 else gs)) * 2 * 2

    def add(name, factory):
        if name not in which:
            return
        try:
            provs[name] = factory()
        except Exception as ex:
            log_fn(f"  {name}: not available ({type(ex).__name__}: {str(ex)[:200]})")
            provs[name] = None

    add("bf16", lambda: (lambda i: w_ref.clone(), lambda w, x: torch.nn.functional.linear(x, w), n * k * 2))

    def tinygemm():
        if gs == -1:
            raise ValueError("torch's int4 kernel takes groups of 32-256, not per channel")
        w, sz = tinygemm_pack(qw, dtype)
        return (lambda i: (w.clone(), sz.clone()), lambda c, x: torch._weight_int4pack_mm(x, c[0], gs, c[1]),
                int4_bytes)
    add("tinygemm", tinygemm)

    def fp8(rowwise: bool):
        wf = w_ref.float()
        if rowwise:
            ws = (wf.abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)     # [N, 1]
        else:
            ws = (wf.abs().amax() / 448.0).clamp(min=1e-12).reshape(())
        wq = (wf / ws).to(torch.float8_e4m3fn)
        scale_b = ws.reshape(1, n) if rowwise else ws.float()

        def run(c, x):
            xq, xs = c[2](x)
            return torch._scaled_mm(xq, c[0].t(), scale_a=xs, scale_b=c[1], out_dtype=dtype)
        return (lambda i: (wq.clone(), scale_b.float().contiguous(), _xquant_cache(rowwise)), run, n * k + n * 4)
    add("fp8_tensorwise", lambda: fp8(False))
    add("fp8_rowwise", lambda: fp8(True))

    def triton_int4(counters: bool):
        from sdquant.kernels import int4_triton  # noqa: F401
        lay = int4_layout.repack_triton(qw, dtype)
        op = torch.ops.sdquant.w4a16_triton
        return (lambda i: {kk: (None if v is None else v.clone()) for kk, v in lay.items()},
                lambda c, x: op(x, c["qweight"], c["scales"], c["zs"], c["perm"], None,
                                c["locks"] if counters else None), int4_bytes)
    add("sdq_triton", lambda: triton_int4(True))          # as QuantLinear calls it: split-K summed in the kernel
    add("sdq_triton_2k", lambda: triton_int4(False))      # no counters: the split-K second pass (A/B)

    def cuda_int4():
        from sdquant.kernels import int4_cuda
        if not int4_cuda.available():
            raise RuntimeError(f"int4_cuda unavailable: {int4_cuda._STATE.get('reason')}")
        lay = int4_layout.repack_cuda(qw, dtype)
        op = torch.ops.sdquant.w4a16_cuda
        return (lambda i: {kk: (None if v is None else v.clone()) for kk, v in lay.items()},
                lambda c, x: op(x, c["qweight"], c["scales"], c["zeros"], c["perm"], c["locks"], None), int4_bytes)
    add("sdq_cuda", cuda_int4)

    def cuda_int4_pdl():
        """The CUDA op as the decode runtime launches it: programmatic dependent launch with the early trigger
        (``cuda_exp.pdl_on``, what ``Transformer.compile_decode`` turns on), so in the graph's back-to-back calls each
        kernel requests its first weights while the previous one finishes."""
        import cuda_exp
        make, run, nbytes = cuda_int4()

        def run_pdl(c, x):
            with cuda_exp.pdl_on():
                return run(c, x)
        return make, run_pdl, nbytes
    add("sdq_cuda_pdl", cuda_int4_pdl)

    def cuda_int4_pdl_late():
        """The CUDA op with programmatic dependent launch but without the early trigger (``set_pdl(True)``): each
        kernel lets the next one launch only after its main loop. Beside sdq_cuda_pdl it shows what the early trigger
        is worth: at M <= 8 the tight kernel's, at M = 9-16 the wgmma kernels' and variant 63's split-K sum's
        (SDQ_WG_EARLY_TRIGGER_MAX_M); above that the two columns time the same code (Pending 51-52)."""
        import cuda_exp
        make, run, nbytes = cuda_int4()

        def run_late(c, x):
            with cuda_exp.pdl_on(early_trigger=False):
                return run(c, x)
        return make, run_late, nbytes
    add("sdq_cuda_pdl_late", cuda_int4_pdl_late)

    def fp8_triton():
        from sdquant.kernels import fp8_triton as f8
        from sdquant.quant.qtensor import quantize_fp8_weight
        fw = quantize_fp8_weight(w_ref)
        return (lambda i: (fw.weight.clone(), fw.weight_scale.clone()),
                lambda c, x: f8.fp8_linear(x, c[0], c[1], None, None), n * k + n * 4)
    add("sdq_fp8_triton", fp8_triton)

    # The layers as a user runs them: QuantLinear / Fp8Linear prepared with kernels="auto", so each M takes the kernel
    # the crossover table plans for its bucket ($SDQUANT_KERNEL_TABLE, else the table shipped for this GPU model).
    # Issue 4's "the dispatched layer >= 1.0x bf16 at every M" and its FP8 layer targets are read from these columns.
    def int4_layer():
        from sdquant.kernels.linear import QuantLinear

        def make(i):  # a copy of the canonical tensors each too, for the plans that read them (dequant, reference)
            c = [None if t is None else t.clone() for t in (qw.qweight, qw.scales, qw.zeros, qw.g_idx)]
            wq = QuantizedWeight(c[0], c[1], c[2], qw.bits, qw.group_size, qw.in_features, c[3])
            return QuantLinear(wq).prepare(dev, dtype)
        return make, lambda layer, x: layer(x), int4_bytes
    add("sdq_int4_layer", int4_layer)

    def fp8_layer(per_tensor: bool):
        """Fp8Linear as prepared from its package: the default (per-channel weight scales, dynamic per-token
        activations), or the per-tensor recipe (quant.fp8.weights: tensor, activations: static), which issue 4's FP8
        targets at M >= 1024 were met with ("FP8 kernels and dispatch"): its large-M GEMM is the tensorwise call. The
        recipe's static scale covers the benchmark's N(0, 1) activations to STATIC_X_AMAX, as calibration would."""
        from sdquant.kernels.linear import Fp8Linear
        from sdquant.quant.qtensor import FP8_MAX, Fp8Weight, quantize_fp8_weight
        x_scale = torch.tensor(STATIC_X_AMAX / FP8_MAX) if per_tensor else None
        fw = quantize_fp8_weight(w_ref, input_scale=x_scale, per_tensor=per_tensor)

        def make(i):  # the fp8 paths read the weight as it is: a copy each
            c = [None if t is None else t.clone() for t in (fw.weight, fw.weight_scale, fw.input_scale)]
            return Fp8Linear(Fp8Weight(*c)).prepare(dev, dtype)
        return make, lambda layer, x: layer(x), n * k + n * 4
    add("sdq_fp8_layer", lambda: fp8_layer(False))
    add("sdq_fp8_tensor_layer", lambda: fp8_layer(True))
    return provs, w_ref


PDL_KERNELS = ("sdq_cuda_pdl", "sdq_cuda_pdl_late")
PDL_MAX_M = 16  # the PDL columns' largest M (--pdl-max-m): decode batches, where a launch's fixed cost is a large part
STATIC_X_AMAX = 6.0  # the per-tensor FP8 layer's calibrated activation range: the inputs are N(0, 1)
LAYERS = ("sdq_int4_layer", "sdq_fp8_layer", "sdq_fp8_tensor_layer")


def layer_plan(ctx, m: int):
    """The kernel a prepared layer's plan picks at M rows (None for the non-layer providers)."""
    plan = getattr(ctx, "plan", None)
    if plan is None:
        return None
    name, _cfg = plan.select(m)
    tail = plan.cuda_tail
    return f"{name} (tail {tail})" if name == "cuda" and tail and 128 < m <= 256 else name


_XQ: dict = {}


def _xquant_cache(rowwise: bool):
    """Pre-quantized activations for the _scaled_mm baselines (GEMM time only), one per x tensor."""
    def q(x):
        key = (x.data_ptr(), tuple(x.shape), rowwise)
        if key not in _XQ:
            xf = x.float()
            if rowwise:
                xs = (xf.abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
            else:
                xs = (xf.abs().amax() / 448.0).clamp(min=1e-12).reshape(())
            _XQ[key] = ((xf / xs).to(torch.float8_e4m3fn), xs.float())
        return _XQ[key]
    return q


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float()
    if not torch.isfinite(y).all():
        return float("nan")
    return float((y - ref).norm() / ref.norm().clamp(min=1e-30))


def run_sweep(shapes, ms, dev, dtype, which, copy_bw, check=True, log_fn=log, on_shape=None, gs: int = GS,
              rounds: int = 1, pdl_max_m: int = PDL_MAX_M):
    """Time every kernel in ``which`` at every (K, N) x M; ``on_shape(rows)`` after each shape (partial saves).
    ``rounds`` > 1: at each (K, N, M) the kernels are timed round robin that many times, each round starting one
    kernel later, and each keeps the median of its rounds (``us_rounds`` lists them, ``gpu`` is the GPU's state over
    the median round), so a clock that drifts under a power cap weighs on every kernel of a point alike instead of
    on whichever ran last or after the most power-hungry one."""
    rows = []
    for (k, n) in shapes:
        t0 = time.time()
        provs, w_ref = build_providers(n, k, dev, dtype, which, log_fn, gs)
        ctx_cache: dict = {}
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = None
            if check:
                ref = x.double() @ w_ref.double().t()
                ref = ref.float()
            live, out = [], {}  # live: (name, run, ctxs, wbytes, err); out: name -> its row (in provider order)

            def untimed(name, note):
                return {"K": k, "N": n, "M": m, "kernel": name, "us": None, "note": note}
            for name, p in provs.items():
                if p is None:
                    out[name] = untimed(name, "not available")
                    continue
                make, run, wbytes = p
                if name == "tinygemm" and m > 256:  # a decode kernel: milliseconds a call, no information
                    out[name] = untimed(name, "skipped (M>256)")
                    continue
                if name in PDL_KERNELS and m > pdl_max_m:  # the decode launch mode: timed where decode runs
                    out[name] = untimed(name, f"skipped (M>{pdl_max_m})")
                    continue
                try:
                    if name not in ctx_cache:  # weight copies built once per shape and kernel
                        ctx_cache[name] = [make(i) for i in range(n_copies(wbytes))]
                    _XQ.clear()
                    err = rel_err(run(ctx_cache[name][0], x), ref) if check else None
                except Exception as ex:
                    log_fn(f"  {name} {k}x{n} M={m}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
                    out[name] = untimed(name, f"failed: {ex}"[:200])
                    continue
                live.append((name, run, ctx_cache[name], wbytes, err))
                out[name] = None
            timed = {name: [] for name, *_ in live}
            for rnd in range(max(1, rounds)):
                # each round starts one kernel later: a kernel timed right after a power-hungry one meets the
                # power cap's lowered clock, so no kernel should always hold the same place
                first = rnd % len(live) if live else 0
                for name, run, ctxs, _w, _e in live[first:] + live[:first]:
                    if timed[name] is None:
                        continue
                    try:
                        _XQ.clear()
                        us = time_rotating(lambda i: run(ctxs[i], x), len(ctxs))
                    except Exception as ex:
                        log_fn(f"  {name} {k}x{n} M={m}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
                        out[name] = untimed(name, f"failed: {ex}"[:200])
                        timed[name] = None
                        continue
                    timed[name].append((us, gpu_state()))
            done = {name: sorted(ts, key=lambda t: t[0]) for name, ts in timed.items() if ts}
            bf16_us = statistics.median(t for t, _ in done["bf16"]) if "bf16" in done else None
            for name, run, ctxs, wbytes, err in live:
                if name not in done:
                    continue
                ts = done[name]
                us = statistics.median(t for t, _ in ts)
                nbytes = wbytes + m * k * 2 + m * n * 2
                tbs = nbytes / (us * 1e-6) / 1e12
                row = {"K": k, "N": n, "M": m, "kernel": name, "us": round(us, 2), "rel_err": err,
                       "TBps": round(tbs, 3), "pct_copy": round(100 * tbs / copy_bw, 1),
                       "speedup_vs_bf16": None if bf16_us is None else round(bf16_us / us, 3),
                       "gpu": ts[(len(ts) - 1) // 2][1]}
                if len(ts) > 1:
                    row["us_rounds"] = [round(t, 2) for t, _ in ts]
                if name in LAYERS:
                    row["plan"] = layer_plan(ctxs[0], m)
                out[name] = row
            rows.extend(r for r in out.values() if r is not None)
            torch.cuda.empty_cache()
        log_fn(f"shape {k}x{n} done in {time.time() - t0:.1f} s")
        del provs, ctx_cache
        if on_shape is not None:
            on_shape(rows)
        torch.cuda.empty_cache()
    return rows


def table(rows, kernels) -> str:
    cells = {}
    for r in rows:
        cells[(r["K"], r["N"], r["M"], r["kernel"])] = r
    keys = sorted({(r["K"], r["N"], r["M"]) for r in rows}, key=lambda t: (SHAPES.index((t[0], t[1]))
                                                                           if (t[0], t[1]) in SHAPES else 99, t[2]))
    extra = [c for c, kn in (("int4 layer ×bf16", "sdq_int4_layer"), ("fp8 layer ×bf16", "sdq_fp8_layer"),
                             ("fp8 layer ÷ tensorwise", "sdq_fp8_layer"),
                             ("fp8 tensor layer ÷ tensorwise", "sdq_fp8_tensor_layer")) if kn in kernels]
    out = ["| " + " | ".join(["K×N", "M", *kernels, "best sdq int4 kernel ×bf16", *extra]) + " |",
           "|---|---|" + "---|" * (len(kernels) + 1 + len(extra))]

    def ratio(a, b) -> str:
        return f"{a / b:.2f}" if a and b else "–"
    for (k, n, m) in keys:
        vals = []
        for kn in kernels:
            r = cells.get((k, n, m, kn))
            vals.append("–" if r is None or r.get("us") is None else f"{r['us']:.1f}")
        bf = cells.get((k, n, m, "bf16"), {}).get("us")
        best = [cells.get((k, n, m, kk), {}).get("us") for kk in ("sdq_triton", "sdq_cuda")]
        sp = ratio(bf, min((b for b in best if b), default=None))
        us = {kk: cells.get((k, n, m, kk), {}).get("us") for kk in ("sdq_int4_layer", "sdq_fp8_layer",
                                                                     "sdq_fp8_tensor_layer", "fp8_tensorwise")}
        ex = {"int4 layer ×bf16": ratio(bf, us["sdq_int4_layer"]), "fp8 layer ×bf16": ratio(bf, us["sdq_fp8_layer"]),
              "fp8 layer ÷ tensorwise": ratio(us["sdq_fp8_layer"], us["fp8_tensorwise"]),
              "fp8 tensor layer ÷ tensorwise": ratio(us["sdq_fp8_tensor_layer"], us["fp8_tensorwise"])}
        out.append("| " + " | ".join([f"{k}×{n}", str(m), *vals, sp, *(ex[c] for c in extra)]) + " |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in RUN_ORDER))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--kernels", default="bf16,tinygemm,fp8_tensorwise,fp8_rowwise,sdq_triton,sdq_cuda,sdq_cuda_pdl,"
                    "sdq_fp8_triton,"
                    "sdq_int4_layer,sdq_fp8_layer,sdq_fp8_tensor_layer")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="time each point's kernels round robin this many times and "
                                                          "keep each one's median (a power-capped clock drifts)")
    ap.add_argument("--pdl-max-m", type=int, default=PDL_MAX_M, help="largest M the PDL columns are timed at")
    ap.add_argument("--group-size", type=int, default=GS, help="INT4 group size of the random weights (-1: per channel)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    dtype = getattr(torch, a.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.ms.split(",")]
    kernels = a.kernels.split(",")
    bw = copy_bandwidth(dev)
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} copy bandwidth {bw:.2f} TB/s")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_TBps": bw, "rounds": a.rounds,
            "dtype": a.dtype, "group_size": a.group_size, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": os.environ.get("SDQUANT_COMMIT"), "src_digest": provenance.source_digest(),
            "gpu_limits": gpu_clocks.limits()}
    Path(a.out).mkdir(parents=True, exist_ok=True)

    def save(rows):
        tmp = Path(a.out) / "gemm.json.tmp"
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        os.replace(tmp, Path(a.out) / "gemm.json")
    rows = run_sweep(shapes, ms, dev, dtype, set(kernels), bw, check=not a.no_check, on_shape=save, gs=a.group_size,
                     rounds=a.rounds, pdl_max_m=a.pdl_max_m)
    save(rows)
    log(table(rows, kernels))


if __name__ == "__main__":
    main()
