"""GPU timing for the crossover table (``dispatch.measure_crossovers``) and for ``bench/gemm_fp8.py``.

Method (docs of the device: METHOD.md): every timed callable is captured ``reps`` times into one CUDA graph,
each call on a different copy of the layer (copies rotate past the 60 MB L2, so weights come from HBM as in
a real model), the graph is replayed after a warm-up, CUDA events time each replay, and the median over
``trials`` replays divided by ``reps`` is reported in µs. Inputs are random normal, never zeros.
"""
import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sdquant.errors import ConfigError
from sdquant.kernels import dispatch
from sdquant.kernels.linear import Fp8Linear, QuantLinear
from sdquant.quant.qtensor import QuantizedWeight, compute_qparams, quantize_codes, quantize_fp8_weight

LLAMA_SHAPES = ((14336, 4096), (8192, 28672), (4096, 4096), (4096, 28672), (8192, 10240), (28672, 8192),
                (4096, 6144))  # (K, N) = (in_features, out_features)
TABLE_MS = (1, 4, 16, 32, 64, 128, 256, 1024, 4096)  # the buckets a device run can afford to measure
L2_BYTES = 60 * 2 ** 20


def n_copies(bytes_per_copy: int, budget: int = 2 * 2 ** 30) -> int:
    """Enough copies that one rotation spans > 3x L2, within a memory budget."""
    need = math.ceil(3 * L2_BYTES / max(bytes_per_copy, 1))
    return max(2, min(need, max(2, budget // max(bytes_per_copy, 1)), 64))


def time_graph(calls: Sequence[Callable[[], object]], trials: int = 7, target_ms: float = 3.0) -> float:
    """Median µs per call of ``calls`` (one per weight copy), replayed as a CUDA graph."""
    for c in calls:  # warm up: compiles Triton kernels, creates cuBLAS handles, fills the allocator
        c()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c in calls:
        c()
    torch.cuda.synchronize()
    per = max((time.perf_counter() - t0) / len(calls), 1e-6)
    rounds = max(1, min(50, int(target_ms * 1e-3 / (per * len(calls)))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for c in calls:  # a warm-up on the capture stream, as torch recommends
            c()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(rounds):
                for c in calls:
                    c()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (rounds * len(calls)))
    del graph
    return statistics.median(times)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


# -------------------------------------------------------------------------------------------- layers
def random_fp8_layer(n: int, k: int, device, bias: bool = False, seed: int = 0) -> Fp8Linear:
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return Fp8Linear(quantize_fp8_weight(w), b).to(device)


def random_int4_layer(n: int, k: int, device, group_size: int = 128, symmetric: bool = True,
                      seed: int = 0) -> QuantLinear:
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(device)
    s, z = compute_qparams(w, 4, group_size, symmetric)
    qw = QuantizedWeight.from_codes(quantize_codes(w, s, z, 4, group_size), s, z, 4, group_size)
    return QuantLinear(qw)


def fp8_reference(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """fp64 evaluation of the W8A8 function (per-token e4m3 activations, per-channel e4m3 weights)."""
    from sdquant.kernels.ops import quantize_fp8_per_token
    xq, xs = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]).float())
    y = (xq.double() @ layer.weight.double().t()) * xs.double() * layer.weight_scale.double()
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y


# -------------------------------------------------------------------------------------------- measure
LAYOUT_COLUMNS = ("cuda", "triton")  # int4 layouts whose dequantize+cuBLAS gets a column "dequant_<layout>"


def run_column(layer, name: str, x: torch.Tensor, cfg=()) -> torch.Tensor:
    """One call of the path a table column times: a kernel by name, "dequant" (dequantize+cuBLAS from the canonical
    tensors) or "dequant_<layout>" (from an attached int4 layout: what a layer prepared with layouts="one" runs in
    its dequantize buckets, planned by this column where the table has it)."""
    if name.startswith("dequant_"):
        layer.use_layout_dequant(name[len("dequant_"):])
        try:
            return layer._run("dequant", x, cfg)
        finally:
            layer.use_layout_dequant(None)
    return layer._run(name, x, cfg)


def _fp8_tune_candidates(m: int, n: int, k: int) -> List[List[int]]:
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bk = 256 if k % 256 == 0 else 128
    out = []
    for bn in (64, 128):
        for split in (1, 2, 4, 8):
            if k // (bk * split) < 2:
                continue
            out.append([bn, bm, bk, split, 4, 4 if (bn + bm) * bk * 4 <= 160 * 1024 else 3])
    return out


def todo(shapes: Sequence[Tuple[int, int]], kinds: Sequence[str], prior: Sequence[dict],
         dtype: str) -> List[Tuple[int, int, str]]:
    """The (K, N, kind) a run still has to measure, in run order: every shape and kind not among the ``prior``
    entries (a resumed table's) of this activation dtype."""
    done = {(e["kind"], e["K"], e["N"]) for e in prior if e.get("dtype", dtype) == dtype}
    return [(k, n, kind) for (k, n) in shapes for kind in kinds if (kind, k, n) not in done]


def measure(shapes: Optional[Sequence[Tuple[int, int]]] = None, ms: Sequence[int] = dispatch.DEFAULT_BUCKETS,
            kinds: Sequence[str] = ("fp8", "int4"), dtype: str = "bfloat16", group_size: int = 128,
            tune: bool = True, log=print, trials: int = 7, deadline: Optional[float] = None,
            on_entry: Optional[Callable[[dict], None]] = None, prior: Sequence[dict] = ()) -> dict:
    """Time every available kernel (and bf16 F.linear) per (shape, M); returns a version-1 table.
    ``deadline`` (time.perf_counter() value): shapes not started by then are skipped (and logged);
    ``on_entry(table)`` is called with the partial table after each shape (to save progress); ``prior``: entries of
    an earlier run on this GPU with these buckets (``dispatch.resumable_entries``), kept, and not measured again."""
    if not torch.cuda.is_available():
        raise ConfigError("kernels.tune", "measuring kernel crossovers needs a CUDA GPU, and none is visible")
    dev = torch.device("cuda", torch.cuda.current_device())
    act = getattr(torch, dtype)
    shapes = tuple(shapes or LLAMA_SHAPES)
    ms = list(ms)
    entries = list(prior)
    if prior:
        log(f"resuming: {len(prior)} entries kept")

    def table() -> dict:
        return {"version": 1, "device": torch.cuda.get_device_name(dev), "buckets": ms, "entries": list(entries),
                "meta": {"torch": torch.__version__, "cuda": torch.version.cuda, "dtype": dtype,
                         "group_size": group_size, "date": time.strftime("%Y-%m-%d"),
                         "method": "CUDA graph of calls over weight copies rotating past L2; median of replays"}}
    for (k, n, kind) in todo(shapes, kinds, prior, dtype):
        t_shape = time.perf_counter()
        if deadline is not None and t_shape > deadline:
            log(f"skipped {kind} K={k} N={n}: out of time")
            continue
        entry = {"kind": kind, "N": n, "K": k, "dtype": dtype, "us": {}, "triton_config": [None] * len(ms)}
        if kind == "fp8":
            proto = random_fp8_layer(n, k, "cpu")
            copies = [Fp8Linear(proto.weight_q, None).to(dev) for _ in range(n_copies(n * k))]
        else:
            proto = random_int4_layer(n, k, "cpu", group_size)
            copies = [QuantLinear(proto.weight_q).to(dev) for _ in range(n_copies(n * k // 2))]
        for c in copies:
            c.prepare(dev, act, kernels="reference")
        names = [x for x in copies[0].available_kernels(dev, act) if x != "reference"]
        if kind == "int4":  # build the int4 kernels' layouts once per copy
            names = [x for x in names if x == "dequant" or all(c.attach_int4(x, dev, act) for c in copies)]
            names += [f"dequant_{x}" for x in names if x in LAYOUT_COLUMNS]
        dense = [torch.randn(n, k, device=dev, dtype=act) / math.sqrt(k) for _ in range(n_copies(n * k * 2, 2 ** 30))]
        rows: Dict[str, List[Optional[float]]] = {nm: [None] * len(ms) for nm in ["bf16", *names]}
        for i, m in enumerate(ms):
            x = torch.randn(m, k, device=dev, dtype=act)
            rows["bf16"][i] = time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in dense], trials)
            for nm in names:
                cfg = ()
                try:
                    if nm == "triton" and kind == "fp8" and tune and m <= 64:
                        best = None
                        for cand in _fp8_tune_candidates(m, n, k):
                            t = time_graph([lambda c=c, cand=cand: c._run("triton", x, cand) for c in copies], 3)
                            if best is None or t < best[0]:
                                best = (t, cand)
                        cfg = tuple(best[1])
                        entry["triton_config"][i] = list(cfg)
                    rows[nm][i] = time_graph([lambda c=c: run_column(c, nm, x, cfg) for c in copies], trials)
                except Exception as e:  # a kernel that fails here is simply not chosen for this bucket
                    log(f"  {kind} {k}x{n} M={m} {nm}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    rows[nm][i] = None
            log(f"{kind} K={k} N={n} M={m}: " + " ".join(
                f"{nm}={v[i]:.1f}" if v[i] else f"{nm}=-" for nm, v in rows.items()))
        entry["us"] = rows
        entries.append(entry)
        del copies, dense
        torch.cuda.empty_cache()
        log(f"  ({time.perf_counter() - t_shape:.1f} s)")
        if on_entry is not None:
            on_entry(table())
    return table()
