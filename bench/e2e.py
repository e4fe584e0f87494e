#!/usr/bin/env python
"""End-to-end decode and prefill of a Llama-3-8B-shaped model (random weights) on the sdquant runtime.

Variants (same harness, same process): bf16 eager; bf16 eager ops replayed as one CUDA graph per token;
bf16 / INT4 / FP8 compiled (torch.compile fullgraph, one compiled block shared by the 32 layers, the whole
decode step captured as one CUDA graph); INT4 with embedding and lm_head in INT4 too ("int4all").
Per variant: decode tokens/s at each batch size (greedy argmax inside the step, the sampled token fed back),
prefill latency of one prompt, GPU memory of the weights (canonical tensors; what the model holds on the device
by its layers' own accounting, ``QuantLinear.device_bytes``; and torch.cuda.memory_allocated after the build)
and the peak.

    python bench/e2e.py --out results.json                      # the H200 run (see docs/benchmarks/decode.md)
    python bench/e2e.py --tiny                                  # seconds on a CPU: checks the harness

Decode attends over the full static cache (``--max-seq`` slots, masked) as gpt-fast does, so the KV read per
token is the same at every position. Random weights: the values do not change the speed of any kernel here.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import provenance  # noqa: E402
from sdquant.runtime.model import CUDAGraphStep  # noqa: E402
from sdquant.runtime.testing import LLAMA3_8B, TINY, random_decoder, weight_bytes  # noqa: E402

VARIANTS = {
    "bf16-eager": dict(linears="bf16", compiled=False, graph=False),
    "bf16-eager-graph": dict(linears="bf16", compiled=False, graph=True),
    "bf16-compiled": dict(linears="bf16", compiled=True, graph=True),
    "int4-compiled": dict(linears="int4", compiled=True, graph=True),
    "int4all-compiled": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True),
    "fp8-compiled": dict(linears="fp8", compiled=True, graph=True),
    # per-tensor weights + static activation scales (templates/fp8-w8a8-tensorwise-h100.yaml): tensorwise _scaled_mm
    "fp8static-compiled": dict(linears="fp8-static", compiled=True, graph=True),
    # the same-run baseline of Fp8Linear.fuse_act_quant: the quantize kernel inside the op, as before
    "fp8-compiled-unfused": dict(linears="fp8", compiled=True, graph=True, fp8_fuse=False),
    # programmatic dependent launch (PDL). "all": what Transformer.compile_decode(pdl=None) does on Hopper (inductor's
    # triton.enable_pdl as compile options; sdquant's INT4 GEMM and decode attention kernels launched with PDL and
    # letting the next kernel launch right after their wait). The others are ablations: "inductor" = inductor's
    # kernels only, "kernels" = sdquant's kernels only, "all-late" = both, sdquant's kernels triggering the next
    # launch only after their main loop. Every other compiled variant is compiled with pdl=False.
    "int4all-compiled-pdl": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                 pdl="inductor"),
    "int4all-compiled-kpdl": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                  pdl="kernels"),
    "int4all-compiled-pdl-all": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                     pdl="all-late"),
    "int4all-compiled-pdl-early": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                       pdl="all"),
    "bf16-compiled-pdl": dict(linears="bf16", compiled=True, graph=True, pdl="all"),
    # inductor's multi-kernel (a one-pass RMSNorm candidate, timed on first call) is in compile_decode's CUDA defaults
    # since run 16; these are the same-run baselines without it
    "int4all-compiled-pdl-nomk": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                      pdl="all", inductor={"triton.multi_kernel": 0}),
    "bf16-compiled-nomk": dict(linears="bf16", compiled=True, graph=True, inductor={"triton.multi_kernel": 0}),
    "fp8-compiled-pdl": dict(linears="fp8", compiled=True, graph=True, pdl="all"),
    # every kernel layout the plan calls kept on the GPU (QuantLinear.prepare(layouts="all")): the Triton mid-M
    # kernel serves M = 17-256 instead of dequantize+cuBLAS from the CUDA layout, for ~3x the INT4 memory
    "int4all-compiled-all-layouts": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                         layouts="all"),
    # int4all-compiled with the CUDA kernel configs proposed by a bench/int4_tune.py run (--int4-tuned JSON)
    "int4all-compiled-tuned": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                   tuned=True),
    # the INT4 default (int4all-compiled-pdl-early) with the --int4-tuned JSON's configs: e.g. the previous
    # defaults (bench/results/int4_defaults_before_tight.json), for a same-process A/B of a table change
    # the INT4 default without the fused decode blocks (Transformer.fused_decode: RMSNorm, SiLU * up and the residual
    # adds inside the tight INT4 kernel at M <= 8): the same-run baseline of that fusion
    "int4all-compiled-pdl-early-unfused": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                               pdl="all", fused=False),
    # ablations, not models: the decode attention (RoPE, cache write, attention kernels) replaced by q's slice of the
    # qkv output (a copy kernel a layer), so the step without it bounds what the attention costs in wall time from below
    # (outputs meaningless)
    "int4all-compiled-pdl-early-noattn": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                              pdl="all", no_attention=True),
    "bf16-compiled-noattn": dict(linears="bf16", compiled=True, graph=True, no_attention=True),
    # the default's decode attention path without the qkv GEMM's RoPE / cache epilogue (Transformer.set_kv_write:
    # inductor's RoPE + index_copy_ kernels), and with it but without the attention's preload (docs/benchmarks/decode.md,
    # e2e runs 60-62)
    "int4all-compiled-pdl-early-kvindex": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                               pdl="all", kv_write="index_copy"),
    "int4all-compiled-pdl-early-nopreload": dict(linears="int4", lm_head="int4", embed="int4", compiled=True,
                                                 graph=True, pdl="all", attn_preload=False),
    "int4all-compiled-pdl-early-tuned": dict(linears="int4", lm_head="int4", embed="int4", compiled=True, graph=True,
                                             pdl="all", tuned=True),
}
# cheap eager variants first (the CUDA int4 extension builds meanwhile), the baseline, then the quantized
# ones; int4all right after int4 reuses its compiled block (same block, only embedding/lm_head differ)
DEFAULT_ORDER = ["bf16-eager", "bf16-eager-graph", "bf16-compiled", "int4-compiled", "int4all-compiled",
                 "fp8-compiled"]


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, n):
    """Total seconds of n calls (CUDA events on a GPU)."""
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t


def greedy_step(rt, args):
    """The timed step, idx [B, 1] -> the next token [B, 1]: the runtime's greedy decode step (the argmax inside the
    compiled step, as ``generate`` runs it), or with --argmax eager the logits' argmax as an eager op after the step
    (the harness before 2026-12-04)."""
    if args.argmax == "eager":
        return lambda idx, pos: rt.decode_step(idx, pos).argmax(-1, keepdim=True)
    return lambda idx, pos: rt.decode_step(idx, pos, greedy=True)[:, None]


def bench_decode(rt, batch, args, dev, graph):
    rt.setup_caches(batch, args.max_seq)
    step = greedy_step(rt, args)
    feedback = graph and args.feed == "graph"
    runner = CUDAGraphStep(step, batch, dev, feedback=feedback) if graph else step
    state = {"tok": torch.randint(0, rt.d.vocab_size, (batch, 1), device=dev), "i": 0}
    start = args.max_seq // 2
    pos = torch.arange(start, start + args.steps + args.warmup + 8, device=dev)

    def one():
        i = state["i"] % (args.steps + args.warmup + 8)
        state["tok"] = runner(state["tok"], pos[i:i + 1])
        state["i"] += 1

    def restart():   # --feed graph: the graph advances its own position; each trial starts where the others do
        if feedback:
            runner.idx.copy_(state["tok"])
            runner.pos.fill_(start)

    same = None
    with torch.no_grad():
        if feedback:   # the graph's own feedback against the step called with each token and position
            tok0 = state["tok"].clone()
            restart()
            fed = [runner().clone() for _ in range(4)]
            t, ref = tok0, []
            for i in range(4):
                t = step(t, pos[i:i + 1]).clone()
                ref.append(t)
            same = sum(bool(torch.equal(a, b)) for a, b in zip(fed, ref))
            state["tok"] = tok0
        restart()
        for _ in range(args.warmup):
            runner() if feedback else one()
        trials = []
        for _ in range(args.trials):
            restart()
            trials.append(timed(runner if feedback else one, dev, args.steps) / args.steps)
    ms = statistics.median(trials) * 1e3
    del runner
    out = {"ms_per_step": ms, "tokens_per_s": batch * 1e3 / ms, "trials_ms": [t * 1e3 for t in trials]}
    if same is not None:
        out["feedback_same_tokens"] = f"{same}/4"
    return out


def bench_generate(rt, args, dev) -> dict:
    """The user-facing loop, ``generate(rt, prompt, n)`` at batch 1 from a 32-token prompt, timed end to end on its
    second call (the first compiles and captures ``decode_graph`` on a block-compiled CUDA model), prefill and Python
    included: tokens/s = n / seconds. Also whether both calls gave the same tokens."""
    from sdquant.runtime.model import generate
    prompt = torch.randint(0, rt.d.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).to(dev)
    n = args.generate
    with torch.no_grad():
        first = generate(rt, prompt, n)
        sync(dev)
        t = time.perf_counter()
        second = generate(rt, prompt, n)
        sync(dev)
        dt = time.perf_counter() - t
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "decode_graph": bool(rt._graph_steps),
            "same_tokens": bool(torch.equal(first, second))}


def check_compiled(rt, args, dev, batch=1) -> float:
    """Worst relative error, over the decode step's blocks, of the compiled block's outputs against the eager
    block (``_block_call``) on the same inputs and cache state: checks what compilation changed (fused FP8
    activation quantization, RoPE in the attention kernel, ...) one block at a time, so a random-weight model's
    growth of rounding differences through 32 layers does not hide it. Batch 1: a batch size the run compiles."""
    from sdquant.runtime.model import _block_call
    rt.setup_caches(batch, args.max_seq)
    d = rt.d
    with torch.no_grad():
        for blk in rt.layers:   # a cache that holds something: random keys and values
            blk.attn.kv_cache.kv.normal_()
        pos = torch.tensor([args.max_seq // 2], device=dev)
        cos, sin = rt.rope_cos[pos], rt.rope_sin[pos]
        x = torch.randn(batch, 1, d.hidden_size, device=dev, dtype=rt.norm.dtype)
        pending = torch.randn_like(x)
        worst = 0.0
        for blk in rt.layers:
            mask = rt.masks[blk.window][pos]
            hc, mc = rt._block_fn(blk, x, cos, sin, mask, pos, pending)
            he, me = _block_call(blk, x, cos, sin, mask, pos, pending)
            for c, e in ((hc, he), (mc, me)):
                worst = max(worst, float((c.float() - e.float()).norm() / e.float().norm()))
            x, pending = he, me
    return worst


def check_fused(rt, args, dev, batches=(1, 8)) -> dict:
    """Relative error of the fused decode blocks (Block.forward_fused, eager and as compiled) against the unfused
    eager block on the same inputs and cache state, one block at a time (as check_compiled), at each batch size, with
    random RMSNorm weights (the random model's are ones, which would not test their place in the fused kernels): the
    block's output x' and the next block's input x' * next_norm."""
    from sdquant.kernels.int4_cuda import block_sumsq
    from sdquant.runtime.model import _block_call, _fused_block_call
    out = {}
    d = rt.d
    g = torch.Generator(device=dev).manual_seed(1)
    saved = [(blk.attn_norm, blk.ffn_norm) for blk in rt.layers]
    try:
        for blk in rt.layers:
            blk.attn_norm = (1 + 0.3 * torch.randn(d.hidden_size, device=dev, generator=g)).to(blk.attn_norm.dtype)
            blk.ffn_norm = (1 + 0.3 * torch.randn(d.hidden_size, device=dev, generator=g)).to(blk.ffn_norm.dtype)
        for b in batches:
            why = rt.fused_why_not(b)
            if why is not None:
                out[f"B{b}"] = f"not fused: {why}"
                continue
            rt.setup_caches(b, args.max_seq)
            worst_e, worst_c = 0.0, 0.0
            with torch.no_grad():
                for blk in rt.layers:
                    blk.attn.kv_cache.kv.normal_()
                pos = torch.tensor([args.max_seq // 2], device=dev)
                cos, sin = rt.rope_cos[pos], rt.rope_sin[pos]
                x = torch.randn(b, 1, d.hidden_size, device=dev, dtype=rt.norm.dtype)
                for i, blk in enumerate(rt.layers):
                    nxt = rt.layers[i + 1].attn_norm if i + 1 < len(rt.layers) else rt.norm
                    mask = rt.masks[blk.window][pos]
                    xg, ss = x * blk.attn_norm, block_sumsq(x)
                    fe, fge, _ = _fused_block_call(blk, x, xg, ss, cos, sin, mask, pos, nxt)
                    fc, fgc, _ = rt._fused_block_fn(blk, x, xg, ss, cos, sin, mask, pos, nxt)
                    h, mlp = _block_call(blk, x, cos, sin, mask, pos, None)
                    ref = h + mlp
                    for a, r in ((fe, ref), (fge, ref * nxt)):
                        worst_e = max(worst_e, float((a.float() - r.float()).norm() / r.float().norm()))
                    for a, r in ((fc, fe), (fgc, fge)):
                        worst_c = max(worst_c, float((a.float() - r.float()).norm() / r.float().norm()))
                    x = ref
            out[f"B{b}"] = {"fused_vs_unfused": worst_e, "compiled_vs_eager": worst_c}
            if rt.layers[0].attn.rope_why_not(x, b) is None:
                out[f"B{b}"]["rope_epilogue"] = check_rope(rt, b, dev, g)
    finally:
        for blk, (a, f) in zip(rt.layers, saved):
            blk.attn_norm, blk.ffn_norm = a, f
    return out


def check_rope(rt, b, dev, g) -> dict:
    """The qkv GEMM's RoPE / cache epilogue (sdquant::w4a16_cuda_fused_rope) of layer 0 against its reference at batch b,
    positions 0 and T - 1 of a randomly filled cache: the relative errors of y and of the written slot, and whether
    every other cache entry is unchanged."""
    from sdquant.kernels import int4_cuda
    blk, out = rt.layers[0], {}
    lin, kv0 = blk.attn.wqkv, blk.attn.kv_cache.kv
    lay = {a[len("cuda") + 2:]: getattr(lin, a) for a in lin._layout_keys["cuda"]}
    dtype = kv0.dtype
    x = torch.randn(b, 1, lin.in_features, device=dev, generator=g).to(dtype)
    ss = int4_cuda.block_sumsq(torch.randn(b, 1, lin.in_features, device=dev, generator=g).to(dtype) * 3)
    for pos in (0, kv0.shape[3] - 1):
        p = torch.tensor([pos], device=dev)
        cos, sin = rt.rope_cos[p], rt.rope_sin[p]
        got = torch.randn(kv0.shape, device=dev, generator=g).to(dtype)
        want = got.clone()
        y = lin.forward_fused_rope(x, ss, rt.d.rms_eps, got, p, cos, sin, rt.d.q_size)
        ref = int4_cuda.fused_rope_reference(x.reshape(b, -1), lay["qweight"], lay["scales"], lay["zeros"],
                                             ss.reshape(b, -1), rt.d.rms_eps, want, p, cos, sin, rt.d.q_size)
        slot = (slice(None), slice(0, b), slice(None), pos)
        gs, ws = got[slot].float(), want[slot].float()
        got[slot], want[slot] = 0, 0
        out[f"pos{pos}"] = {"y": float((y.reshape(b, -1).float() - ref.float()).norm() / ref.float().norm()),
                            "slot": float((gs - ws).norm() / ws.norm()), "rest_unchanged": bool(torch.equal(got, want))}
    return out


def bench_prefill(rt, args, dev):
    rt.setup_caches(1, args.max_seq)
    ids = torch.randint(0, rt.d.vocab_size, (1, args.prefill), device=dev)
    pos = torch.arange(args.prefill, device=dev)
    fn = lambda: rt(ids, pos, last_only=True)  # noqa: E731
    with torch.no_grad():
        for _ in range(2):
            fn()
        sync(dev)
        trials = [timed(fn, dev, 1) for _ in range(args.prefill_trials)]
    return {"ms": statistics.median(trials) * 1e3, "trials_ms": [t * 1e3 for t in trials]}


def profile_step(rt, args, dev, batch=1, n=3):
    """CUDA kernel time per decode step (B=1), grouped by kernel name: where the step's time goes."""
    from torch.profiler import ProfilerActivity, profile
    rt.setup_caches(batch, args.max_seq)
    idx = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    pos = torch.tensor([args.max_seq // 2], device=dev)
    with torch.no_grad():
        for _ in range(2):
            rt.decode_step(idx, pos)
        sync(dev)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(n):
                rt.decode_step(idx, pos)
            sync(dev)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if t and e.key and not e.key.startswith(("cuda", "aten::", "Torch-Compiled", "CompiledFunction")):
            rows.append((t / n, e.count // n, e.key[:90]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"  profile: {total / 1e3:.2f} ms of kernels per step (B={batch}, no CUDA graph)", flush=True)
    for t, c, k in rows[:25]:
        print(f"    {t:8.1f} us  x{c:<4d} {k}", flush=True)
    return {"kernel_us_per_step": total, "top": [{"us": t, "count": c, "kernel": k} for t, c, k in rows[:40]]}


def timeline_of(events: list) -> dict:
    """timeline_step's arithmetic on a Chrome trace's events: kernels split into replays at gaps > 5 ms; per replay the
    span and each kernel's advance of the running end; the last replay's advances and busy times summed by name."""
    ks = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    replays, cur, end = [], [], None
    for e in ks:
        if cur and e["ts"] - end > 5000:
            replays.append(cur)
            cur = []
        end = e["ts"] + e["dur"] if not cur else max(end, e["ts"] + e["dur"])
        cur.append(e)
    if cur:
        replays.append(cur)
    out = {"kernels": len(ks), "replays": [], "by_name": []}
    for r in replays:
        t0 = r[0]["ts"]
        end, rows = t0, []
        for e in r:
            e_end = e["ts"] + e["dur"]
            rows.append({"name": e["name"][:160], "start_us": e["ts"] - t0, "dur_us": e["dur"],
                         "advance_us": max(0.0, e_end - end)})
            end = max(end, e_end)
        out["replays"].append({"span_us": end - t0, "kernels": rows})
    if out["replays"]:
        by = {}
        for k in out["replays"][-1]["kernels"]:
            a = by.setdefault(k["name"][:90], {"name": k["name"][:90], "count": 0, "advance_us": 0.0, "busy_us": 0.0})
            a["count"] += 1
            a["advance_us"] += k["advance_us"]
            a["busy_us"] += k["dur_us"]
        out["by_name"] = sorted(by.values(), key=lambda a: -a["advance_us"])
    return out


def timeline_step(rt, args, dev, batch=1, n=3):
    """Each kernel of the decode step as its CUDA graph replays (what ``bench_decode`` times, PDL overlap included):
    CUPTI's start and end of every kernel of n replays (torch.profiler), 50 ms apart. Per replay: the span from the
    first kernel's start to the last one's end, and per kernel the advance of the running end, max(end) - the previous
    max(end), which partitions the span (a kernel overlapped by the one before advances it by less than it lasts),
    summed by kernel name (``timeline_of``). GPU only; the profiler's own tracing can slow the replay a little."""
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    rt.setup_caches(batch, args.max_seq)
    feedback = args.feed == "graph"   # as bench_decode runs it: the graph's own token and position, or copied in
    runner = CUDAGraphStep(greedy_step(rt, args), batch, dev, feedback=feedback)
    tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    pos = torch.tensor([args.max_seq // 2], device=dev)

    def replay():
        if feedback:   # every replay at the same position, as with the copies
            runner.pos.copy_(pos)
            runner()
        else:
            runner(tok, pos)
    with torch.no_grad():
        for _ in range(3):
            replay()
        sync(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                replay()
                sync(dev)
                time.sleep(0.05)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    del runner
    out = {"batch": batch, **timeline_of(events)}
    print(f"  timeline B={batch}: {out['kernels']} kernels in {len(out['replays'])} replays, spans "
          f"{[round(r['span_us'], 1) for r in out['replays']]} us", flush=True)
    for row in out["by_name"][:16]:
        print(f"    advance {row['advance_us']:8.1f} us  busy {row['busy_us']:8.1f} us  x{row['count']:<4d} {row['name']}",
              flush=True)
    return out


def kernel_labels(rt):
    """Which kernel each quantized layer kind runs, from the layers' dispatch plans."""
    out = {}
    blk = rt.layers[0]
    for name, m in (("qkv", blk.attn.wqkv), ("o", blk.attn.wo), ("gate_up", blk.w13), ("down", blk.w2),
                    ("lm_head", rt.lm_head)):
        out[name] = getattr(m, "kernel", f"nn.Linear ({str(rt.norm.dtype).replace('torch.', '')})")
    return out


def check_attention(d, max_seq, dev, dtype) -> dict:
    """sdquant::decode_attention on the GPU against masked fp64 attention over the whole cache, at the
    model's head shapes, batch 2 and 32 (one- and many-tile programs under the slots-per-program rule), positions
    0 / middle / last: relative error per batch and position."""
    from sdquant.kernels import decode_attention  # noqa: F401  (registers the op)
    g = torch.Generator(device=dev).manual_seed(0)
    rep = d["n_heads"] // d["n_kv_heads"]
    out = {}
    for b in (2, 32):
        q = torch.randn(b, d["n_kv_heads"], rep, d["head_dim"], device=dev, generator=g).to(dtype)
        k = torch.randn(b, d["n_kv_heads"], max_seq, d["head_dim"], device=dev, generator=g).to(dtype)
        v = torch.randn(b, d["n_kv_heads"], max_seq, d["head_dim"], device=dev, generator=g).to(dtype)
        for pos in (0, max_seq // 2, max_seq - 1):
            s = (q.double() @ k.double().transpose(-1, -2)) * d["head_dim"] ** -0.5
            s[..., pos + 1:] = float("-inf")
            ref = torch.softmax(s, -1) @ v.double()
            # batch 2 has one-tile programs: also the preload forms (the runtime's path after the qkv epilogue: dead
            # programs write no partial, slot pos in the tile or as one row, SDQUANT_ATTN_NEWROW)
            forms = (("", False, None), ("/preload", True, "tile"), ("/preload-row", True, "row")) if b == 2 else \
                (("", False, None),)
            for tag, pre, row in forms:
                with mock.patch.dict(os.environ, {"SDQUANT_ATTN_NEWROW": row} if row else {}):
                    y = torch.ops.sdquant.decode_attention(q, k, v, torch.tensor([pos], device=dev), 0,
                                                           d["head_dim"] ** -0.5, None, None, pre)
                out[f"B{b}/pos{pos}{tag}"] = float((y.double() - ref).norm() / ref.norm())
        del q, k, v
    return out


def check_layers(rt, dev, dtype):
    """Relative error of the prepared quantized layers against their own dequantized weights (fp32 matmul),
    at M = 1, 8, 32 and 2048: the kernels the plans picked must compute the same function."""
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    from sdquant.kernels.ops import fp8_linear
    out = {}
    blk = rt.layers[0]
    for name, m in (("qkv", blk.attn.wqkv), ("down", blk.w2), ("lm_head", rt.lm_head)):
        if not isinstance(m, (QuantLinear, Fp8Linear)):
            continue
        for mm in (1, 8, 32, 2048):
            x = torch.randn(mm, m.in_features, device=dev, dtype=dtype)
            with torch.no_grad():
                y = m(x).float()
                if isinstance(m, QuantLinear):
                    ref = x.float() @ m.weight_q.to(dev).dequantize(torch.float32).t()  # canonical may be host-kept
                else:
                    ref = fp8_linear(x.float(), m.weight, m.weight_scale, m.input_scale, None)
            out[f"{name}/M{mm}"] = float((y - ref).norm() / ref.norm())
    return out


def held_bytes(rt, dev):
    """(quantized layers, whole model) bytes held on ``dev``: each QuantLinear/Fp8Linear reports its own
    (``device_bytes``: kernel layouts, canonical tensors only where a bucket reads them); every other module
    its own parameters and buffers on the device. Storages counted once."""
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    layers, rest, seen = 0, 0, set()
    for m in rt.modules():
        if isinstance(m, (QuantLinear, Fp8Linear)):
            layers += m.device_bytes()
            continue
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            st = t.untyped_storage()
            if t.device.type == dev.type and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                rest += st.nbytes()
    return layers, layers + rest


_LAST_BLOCK = {"linears": None}


def run_variant(name, args, dev, dtype, dims):
    spec = VARIANTS[name]
    if spec.get("tuned"):
        from sdquant.kernels import int4_cuda
        if not args.int4_tuned:
            return {"variant": name, "skipped": "no --int4-tuned JSON", "decode": {}, "weights_gb": float("nan")}
        old = int4_cuda.use_configs(*int4_cuda.tuned_configs(args.int4_tuned))
        try:
            res = _run_variant(name, spec, args, dev, dtype, dims)
            res["int4_tuned"] = {"DEFAULT_CONFIGS": int4_cuda.DEFAULT_CONFIGS,
                                 "SHAPE_CONFIGS": {f"{k}x{n}:M{b}": c for (k, n, b), c in int4_cuda.SHAPE_CONFIGS.items()}}
            return res
        finally:
            int4_cuda.use_configs(*old)
    return _run_variant(name, spec, args, dev, dtype, dims)


def _run_variant(name, spec, args, dev, dtype, dims):
    # every variant compiles the same block function: when the block's linears change, start from an empty
    # dynamo cache so the previous variant's entries do not count against this one's recompile limit
    from sdquant.kernels.linear import Fp8Linear
    Fp8Linear.fuse_act_quant = spec.get("fp8_fuse", True)
    import torch._inductor.config as inductor_config
    tcfg = inductor_config.triton
    pdl = spec.get("pdl")
    if pdl and not hasattr(tcfg, "enable_pdl"):
        return {"variant": name, "skipped": f"torch {torch.__version__}: inductor has no triton.enable_pdl",
                "decode": {}, "weights_gb": float("nan")}
    # the ablations set the switches by hand (a global inductor setting, for this benchmark process only);
    # pdl="all" goes through compile_decode(pdl=True) below, as a user's model would
    if hasattr(tcfg, "enable_pdl"):
        tcfg.enable_pdl = pdl in ("inductor", "all-late")
    from sdquant.kernels import decode_attention, int4_cuda
    int4_cuda.set_pdl(pdl in ("kernels", "all-late"))
    decode_attention.set_pdl(pdl in ("kernels", "all-late"))
    key = (spec["linears"], Fp8Linear.fuse_act_quant, pdl in ("inductor", "all-late", "all"), spec.get("layouts", "one"),
           str(spec.get("inductor")), spec.get("fused"), spec.get("no_attention", False), spec.get("kv_write"),
           spec.get("attn_preload", True))
    if spec["compiled"] and _LAST_BLOCK["linears"] != key:
        torch._dynamo.reset()
        _LAST_BLOCK["linears"] = key
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    t0 = time.perf_counter()
    rt = random_decoder(dims, spec["linears"], device=dev, dtype=dtype, lm_head=spec.get("lm_head", "bf16"),
                        embed=spec.get("embed", "bf16"), max_seq_len=args.max_seq, kernels=args.kernels,
                        group_size=args.group_size, fused=spec.get("fused"))
    if spec.get("kv_write"):
        rt.set_kv_write(spec["kv_write"])
    for blk in rt.layers:
        blk.attn.attn_preload = spec.get("attn_preload", True)
    if spec.get("no_attention"):
        rt.set_kv_write("index_copy")  # the fused blocks then call Attention.attend, replaced below
        for blk in rt.layers:   # an instance attribute shadows Attention.attend (prefill keeps working: same shapes)
            blk.attn.attend = (lambda q_size: lambda qkv, cos, sin, mask, input_pos: qkv[..., :q_size].contiguous())(rt.d.q_size)
    if spec.get("layouts", "one") != "one":
        from sdquant.kernels.linear import QuantLinear
        for m in rt.modules():
            if isinstance(m, QuantLinear):
                m.prepare(dev, dtype, kernels=args.kernels, layouts=spec["layouts"])
    sync(dev)
    res = {"variant": name, "build_s": time.perf_counter() - t0, "weights_gb": weight_bytes(rt) / 1e9,
           "kernels": kernel_labels(rt)}
    layers_b, held_b = held_bytes(rt, dev)
    res["quant_layers_device_gb"], res["weights_held_gb"] = layers_b / 1e9, held_b / 1e9
    if dev.type == "cuda":
        res["weights_allocated_gb"] = (torch.cuda.memory_allocated(dev) - base) / 1e9
    print(f"  {name} weights: canonical {res['weights_gb']:.2f} GB, held on device {res['weights_held_gb']:.2f} GB "
          f"(quantized layers {res['quant_layers_device_gb']:.2f}), allocated "
          f"{res.get('weights_allocated_gb', float('nan')):.2f} GB", flush=True)
    try:
        res["kernel_check_rel_err"] = check_layers(rt, dev, dtype)
    except Exception as e:
        res["kernel_check_rel_err"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(f"  {name} kernels {res['kernels']} check {res['kernel_check_rel_err']}", flush=True)
    if "triton" in args.attention or ("auto" in args.attention and dev.type == "cuda"):  # "auto": the op on CUDA
        try:
            res["attention_check_rel_err"] = check_attention(dims, args.max_seq, dev, dtype)
        except Exception as e:
            res["attention_check_rel_err"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  {name} decode_attention check {res['attention_check_rel_err']}", flush=True)
    if spec["compiled"]:
        rt.compile_decode(mode=args.mode, fullgraph=True, backend=args.backend, scope="block", pdl=pdl == "all",
                          options=spec.get("inductor"))
        if args.glue == "eager":
            rt._embed_fn = rt._head_fn = None
        try:
            res["compiled_vs_eager_rel_err"] = check_compiled(rt, args, dev)
        except Exception as e:
            res["compiled_vs_eager_rel_err"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  {name} compiled vs eager block, worst over the layers: rel. error {res['compiled_vs_eager_rel_err']}",
              flush=True)
        res["fused_decode"] = bool(rt.fused_decode)
        if rt.fused_decode:
            try:
                res["fused_check_rel_err"] = check_fused(rt, args, dev)
            except Exception as e:
                res["fused_check_rel_err"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {name} fused decode blocks, worst over the layers: {res['fused_check_rel_err']}", flush=True)
    graph = spec["graph"] and dev.type == "cuda"
    from torch._dynamo.utils import counters
    graphs0 = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    res["attention"] = args.attention[0]
    res["decode_other_attention"] = {}
    for j, impl in enumerate(args.attention):
        rt.set_attention(impl)
        if j == 0:
            out = res["decode"] = {}
        else:
            out = res["decode_other_attention"][impl] = {}
        # other implementations: first batch only, unless --attention-all-batches
        for b in args.batches if j == 0 or args.attention_all_batches else args.batches[:1]:
            try:
                out[str(b)] = bench_decode(rt, b, args, dev, graph)
            except Exception as e:  # keep the other measurements; say what broke
                out[str(b)] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {name} [{impl}] decode B={b}: {out[str(b)]}", flush=True)
    rt.set_attention(args.attention[0])
    if name == args.profile_variant:
        res["profile"] = profile_step(rt, args, dev, batch=args.profile_batch)
    if name in args.timeline and graph:
        try:
            res["timeline"] = [timeline_step(rt, args, dev, batch=b) for b in args.timeline_batches]
        except Exception as e:
            res["timeline"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    if args.generate and spec["compiled"]:
        try:
            res["generate"] = bench_generate(rt, args, dev)
        except Exception as e:
            res["generate"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  {name} generate: {res['generate']}", flush=True)
    if args.prefill:
        try:
            res["prefill"] = bench_prefill(rt, args, dev)
        except Exception as e:
            res["prefill"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    res["measure_s"] = time.perf_counter() - t0   # includes the block compiles (one per shape)
    res["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs0
    if dev.type == "cuda":
        res["peak_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
    for blk in rt.layers:
        blk.attn.kv_cache = None
    del rt
    return res


def ratios_to_baseline(results, batches, base="bf16-compiled") -> dict:
    """Decode tokens/s of every quantized variant over the baseline's, a batch size at a time. A variant named more than
    once in --variants (e.g. the baseline before and after the others: bf16-compiled,int4...,bf16-compiled) counts
    with the median of its runs, so a drift within the process shows in the JSON and moves the ratio less."""
    runs = {}
    for r in results:
        for b in batches:
            v = r.get("decode", {}).get(str(b), {}).get("tokens_per_s")
            if v:
                runs.setdefault((r["variant"], b), []).append(v)
    out = {}
    for (name, b), vals in sorted(runs.items()):
        if name.startswith("bf16") or (base, b) not in runs:
            continue
        out[f"{name}/{base} B={b}"] = statistics.median(vals) / statistics.median(runs[(base, b)])
    out["runs"] = {f"{n} B={b}": v for (n, b), v in sorted(runs.items()) if len(v) > 1}
    return out


def table(results, batches):
    head = "| variant | " + " | ".join(f"decode B={b} tok/s" for b in batches) + \
        " | prefill ms | weights GB (canonical / held / allocated) | peak GB |"
    lines = [head, "|" + "---|" * (len(batches) + 4)]
    for r in results:
        cells = [f"{r['decode'][str(b)]['tokens_per_s']:.1f}" if "tokens_per_s" in r["decode"].get(str(b), {})
                 else "err" for b in batches]
        p = r.get("prefill", {})
        cells.append(f"{p['ms']:.1f}" if "ms" in p else "err" if p else "–")
        cells.append(f"{r['weights_gb']:.2f} / {r.get('weights_held_gb', float('nan')):.2f} / "
                     f"{r.get('weights_allocated_gb', float('nan')):.2f}")
        cells.append(f"{r.get('peak_gb', float('nan')):.1f}")
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy on CPU (or GPU): checks the harness")
    ap.add_argument("--variants", default=",".join(DEFAULT_ORDER))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--max-seq", type=int, default=2048 + 128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prefill-trials", type=int, default=5)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--kernels", default="auto", help="QuantLinear.prepare kernels= (auto, cuda, triton, torch)")
    ap.add_argument("--mode", default="default", help="torch.compile mode for the block (CUDA graph is ours)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (default inductor; aot_eager on CPU)")
    ap.add_argument("--attention", default="auto",
                    help="decode attention implementations, comma-separated; the first gets every batch size, "
                         "the others the first batch size only (matmul, sdpa, sdpa_gqa, triton)")
    ap.add_argument("--attention-all-batches", action="store_true",
                    help="time every attention implementation at every batch size (same-run baselines)")
    ap.add_argument("--profile-variant", default=None, help="profile one decode step of this variant")
    ap.add_argument("--profile-batch", type=int, default=1, help="the batch size of that profile")
    ap.add_argument("--timeline", default="", help="variants (comma-separated) whose CUDA-graph decode step is traced "
                    "kernel by kernel (timeline_step)")
    ap.add_argument("--argmax", choices=("step", "eager"), default="step",
                    help="the greedy argmax inside the decode step (default) or an eager op after it (the harness "
                         "before 2026-12-04)")
    ap.add_argument("--glue", choices=("compiled", "eager"), default="compiled",
                    help="a decode step's glue before the first block and after the last as compile_decode compiles "
                         "it (default) or eager (the runtime before 2026-12-04; with --argmax eager: that harness)")
    ap.add_argument("--timeline-batches", default="1", help="the batch sizes of those traces")
    ap.add_argument("--feed", choices=("host", "graph"), default="graph",
                    help="how a CUDA-graph decode step gets its next token and position: copied in before each replay "
                         "(host, one copy each) or inside the graph from its own output (graph: CUDAGraphStep "
                         "feedback=True, no launch between replays)")
    ap.add_argument("--generate", type=int, default=0,
                    help="also time generate() for this many tokens at batch 1 (compiled variants; 0: off)")
    ap.add_argument("--no-prefill", dest="prefill_on", action="store_false")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new variant after this many seconds")
    ap.add_argument("--int4-tuned", default=None, help="a bench/int4_tune.py JSON: its proposed CUDA kernel configs "
                                                      "for the int4all-compiled-tuned variant")
    ap.add_argument("--commit", default=os.environ.get("SDQUANT_COMMIT", "unknown"))
    ap.add_argument("--out", default=None, help="write results JSON here")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.attention = [a for a in args.attention.split(",") if a]
    args.timeline = [v for v in args.timeline.split(",") if v]
    args.timeline_batches = [int(b) for b in args.timeline_batches.split(",") if b]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = TINY if args.tiny else LLAMA3_8B
    if args.tiny:
        args.prefill, args.max_seq, args.steps, args.warmup, args.trials, args.prefill_trials = 64, 128, 4, 1, 1, 1
        args.batches = [b for b in args.batches if b <= 8] or [1]
    if not args.prefill_on:
        args.prefill = 0
    if args.backend is None:
        args.backend = "inductor" if dev.type == "cuda" else "aot_eager"
    if args.backend != "inductor":
        args.mode = None
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if dev.type == "cuda" and any(VARIANTS[v]["linears"] == "int4" for v in names):
        # build the CUDA W4A16 extension (nvcc, about a minute) while the bf16 variants run
        def _build():
            try:
                from sdquant.kernels import int4_cuda
                int4_cuda.extension()
            except Exception as e:  # reported by the layers' plans later
                print(f"int4_cuda build: {e}", flush=True)
        threading.Thread(target=_build, daemon=True).start()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": args.commit,
            "src_digest": provenance.source_digest(),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "dims": dims, "args": {k: v for k, v in vars(args).items()}}
    results, t_start = [], time.perf_counter()
    for name in names:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"skip {name}: over the time budget", flush=True)
            results.append({"variant": name, "skipped": "time budget", "decode": {}, "weights_gb": float("nan")})
            continue
        print(f"== {name}", flush=True)
        try:
            results.append(run_variant(name, args, dev, dtype, dims))
        except Exception as e:
            results.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:500]}", "decode": {},
                            "weights_gb": float("nan")})
            print(f"  {name} failed: {results[-1]['error']}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    meta["ratios"] = ratios = ratios_to_baseline(results, args.batches)
    meta["total_s"] = time.perf_counter() - t_start
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    ok = [r for r in results if "decode" in r and "error" not in r and "skipped" not in r]
    print(table(ok, args.batches))
    for r in ok:
        for impl, d in r.get("decode_other_attention", {}).items():
            for b, v in d.items():
                if "tokens_per_s" in v:
                    main_v = r["decode"].get(b, {}).get("tokens_per_s", float("nan"))
                    print(f"{r['variant']} B={b}: attention {impl} {v['tokens_per_s']:.1f} tok/s vs "
                          f"{r['attention']} {main_v:.1f}")
    for k, v in ratios.items():
        if k != "runs":
            print(f"{k}: {v:.3f}x")
    for k, v in ratios["runs"].items():
        print(f"{k}: {len(v)} runs, tok/s {[round(x, 1) for x in v]}")
    print(f"total {meta['total_s']:.0f} s on {meta['device']}")


if __name__ == "__main__":
    main()
