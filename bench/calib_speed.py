"""Calibration speed and memory: joint AWQ+GPTQ on one decoder block of real shape, random weights.

    python bench/calib_speed.py --shapes 8b 70b --seqs 128 --seq-len 2048 --json runs/calib_speed.json
    python bench/calib_speed.py --shapes tiny --device cpu --seqs 4 --seq-len 64      # smoke test

Runs the product path: sdquant.calibrate.recipes.quantize_block through the walker's BlockContext (the same
object the pipeline builds), followed by the walker's pass that produces the next block's inputs. Reports
wall time (CUDA-synchronised) split into forward passes (statistics capture, true-sequential re-captures and
the next-inputs pass), AWQ search (grid + per-channel ratio + clipping) and GPTQ solve, and the peak device
memory of the whole block step including the calibration activations.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # hidden, intermediate, heads, kv heads
    "tiny": (256, 512, 4, 2),
    "8b": (4096, 14336, 32, 8),
    "70b": (8192, 28672, 64, 8),
}


def build_block(shape: str, device, dtype, seed=0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    hidden, inter, heads, kv = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hidden // heads, num_hidden_layers=1, vocab_size=256,
                      max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        block = LlamaDecoderLayer(cfg, 0).to(dtype).eval()
        rope = LlamaRotaryEmbedding(cfg)
    with torch.no_grad():
        for n, p in block.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.rand_like(p))
            else:
                p.normal_(0, 0.02)
    return block, rope


def make_inputs(rope, hidden, n_seqs, seq_len, batch, device, dtype, seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    outlier = torch.ones(hidden, device=device)
    outlier[torch.randperm(hidden, device=device, generator=g)[: hidden // 100]] = 20.0
    pos = torch.arange(seq_len, device=device)[None]
    inputs = []
    for b0 in range(0, n_seqs, batch):
        b = min(batch, n_seqs - b0)
        h = (torch.randn(b, seq_len, hidden, device=device, generator=g) * outlier).to(dtype)
        cos, sin = rope(h, pos.expand(b, seq_len))
        inputs.append(((h,), {"position_embeddings": (cos, sin), "attention_mask": None,
                              "position_ids": pos.expand(b, seq_len)}))
    return inputs


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_block(shape, device, dtype, n_seqs, seq_len, batch, quant: dict):
    from sdquant.calibrate import recipes
    from sdquant.calibrate.pipeline import BlockContext, block_targets
    from sdquant.config import QuantConfig
    from sdquant.models.adapters import ADAPTERS, resolve_groups

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    block, rope = build_block(shape, device, dtype)
    inputs = make_inputs(rope, SHAPES[shape][0], n_seqs, seq_len, batch, device, dtype)
    q = QuantConfig(**quant)
    prefix = "model.layers.0."
    targets = block_targets(block, prefix, q, ())
    groups = resolve_groups(block, prefix, ADAPTERS["llama"], targets)
    ctx = BlockContext(block, 0, prefix, inputs, groups, targets, q, (), device, dtype,
                       logging.getLogger("sdquant.bench"))
    fwd = {"s": 0.0, "n": 0}
    plain_run = ctx.run

    def timed_run(hooks=None):
        sync(device)
        t = time.perf_counter()
        out = plain_run(hooks)
        sync(device)
        fwd["s"] += time.perf_counter() - t
        fwd["n"] += 1
        return out
    ctx.run = timed_run
    plain_stream = recipes._stream

    def timed_stream(c, hooks):
        sync(device)
        t = time.perf_counter()
        plain_stream(c, hooks)
        sync(device)
        fwd["s"] += time.perf_counter() - t
        fwd["n"] += 1
    recipes._stream = timed_stream
    # peak device memory per phase: each tracked call starts a fresh peak window
    from sdquant.calibrate import awq as awq_mod
    from sdquant.calibrate import gptq as gptq_mod
    peaks: dict = {}
    top = [0]
    patched = []

    def track(mod, name, label):
        f = getattr(mod, name)

        def wrapped(*a, **k):
            if device.type != "cuda":
                return f(*a, **k)
            top[0] = max(top[0], torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
            try:
                return f(*a, **k)
            finally:
                pk = torch.cuda.max_memory_allocated(device)
                peaks[label] = max(peaks.get(label, 0), pk)
                top[0] = max(top[0], pk)
        setattr(mod, name, wrapped)
        patched.append((mod, name, f))
    track(recipes, "_stream", "forward passes")
    track(gptq_mod, "gptq_quantize", "GPTQ solve")
    track(awq_mod, "candidate_loss", "AWQ grid")
    track(awq_mod, "refine_channel_ratio", "AWQ ratio")
    track(awq_mod, "clip_search", "AWQ clip")
    sync(device)
    t0 = time.perf_counter()
    res = recipes.quantize_block(ctx)
    sync(device)
    t_recipe = time.perf_counter() - t0
    nxt = timed_run()                                  # the walker's pass: next block's inputs
    del nxt
    total = time.perf_counter() - t0
    awq_s = sum(r.get("awq_seconds", 0.0) for r in res.rows)
    gptq_s = sum(r.get("gptq_seconds", 0.0) for r in res.rows)
    peak = max(top[0], torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0
    for mod, name, f in patched:
        setattr(mod, name, f)
    out = {"shape": shape, "tokens": n_seqs * seq_len, "seconds_total": round(total, 3),
           "seconds_recipe": round(t_recipe, 3), "seconds_forward": round(fwd["s"], 3), "forward_passes": fwd["n"],
           "seconds_awq_search": round(awq_s, 3), "seconds_gptq_solve": round(gptq_s, 3),
           "seconds_other": round(total - fwd["s"] - awq_s - gptq_s, 3),
           "peak_gib": round(peak / 2 ** 30, 2),
           "peak_gib_by_phase": {k: round(v / 2 ** 30, 2) for k, v in peaks.items()}, "escalations": sum(r.get("escalations", 0) for r in res.rows),
           "layers": len(res.weights)}
    recipes._stream = plain_stream
    del block, inputs, ctx, res
    return out


def _site(frames) -> str:
    """Up to three sdquant frames (innermost first) of an allocation's Python stack."""
    own = [f for f in frames if "sdquant/" in f.get("filename", "") or "bench/" in f.get("filename", "")]
    pick = own[:3] or frames[:1]
    return " < ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in pick)


def peak_breakdown(snapshot: dict, device_index: int, top: int = 14) -> dict:
    """Replay the allocator trace: the moment the live bytes peaked (relative to when recording began) and the
    allocations alive then, summed by allocation site."""
    events = snapshot["device_traces"][device_index]
    cur = peak = 0
    peak_i = -1
    live: dict = {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
            if cur > peak:
                peak, peak_i = cur, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])
    live_at: dict = {}
    for e in events[:peak_i + 1]:
        if e["action"] == "alloc":
            live_at[e["addr"]] = e
        elif e["action"] == "free_completed":
            live_at.pop(e["addr"], None)
    by_site: dict = {}
    for e in live_at.values():
        k = _site(e.get("frames") or [])
        n, b = by_site.get(k, (0, 0))
        by_site[k] = (n + 1, b + e["size"])
    rows = sorted(by_site.items(), key=lambda kv: -kv[1][1])[:top]
    out = {"events": len(events), "peak_gib_traced": round(peak / 2 ** 30, 2),
           "at": _site(events[peak_i].get("frames") or []) if peak_i >= 0 else "",
           "live": [{"site": k, "tensors": n, "gib": round(b / 2 ** 30, 3)} for k, (n, b) in rows]}
    print(f"peak {out['peak_gib_traced']} GiB (traced) at {out['at']}; live by site:", flush=True)
    for r in out["live"]:
        print(f"  {r['gib']:8.3f} GiB  {r['tensors']:5d}  {r['site']}", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8b", "70b"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="sequences per block forward (pipeline.batch_size)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--mem-trace", action="store_true",
                    help="record the CUDA allocator's history and print the live tensors at each shape's peak, "
                         "grouped by the sdquant line that allocated them")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    quant = dict(method="awq+gptq", bits=4, group_size=a.group_size, symmetric=False, act_order="static")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "dtype": a.dtype, "quant": quant, "batch": a.batch}
    try:
        if os.environ.get("SDQUANT_COMMIT"):          # the device copy's .git can be stale: the sender knows
            raise RuntimeError
        meta["commit"] = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                 text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001 - the device copy may have no .git
        meta["commit"] = os.environ.get("SDQUANT_COMMIT", "unknown")
    if not a.no_warmup:   # CUDA context, cuBLAS/cuSOLVER handles, kernel caches: not part of the block time
        run_block("tiny", device, dtype, 2, 256, 2, quant)
    results = []
    for shape in a.shapes:
        trace = a.mem_trace and device.type == "cuda"
        if trace:
            torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
        r = {**meta, **run_block(shape, device, dtype, a.seqs, a.seq_len, a.batch, quant)}
        if trace:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            r["peak_breakdown"] = peak_breakdown(snap, torch.cuda.current_device())
            del snap
        results.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
