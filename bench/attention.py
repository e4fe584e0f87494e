"""sdquant::decode_attention alone (H200, one device call): tile settings by batch size and position, against the
KV-read floor and PyTorch's attention on the same cache.

The e2e harness (bench/e2e.py) measures the attention only inside a whole decode step, one process per setting; this
script times the op by itself, so one call sweeps what e2e runs 35-37 swept one setting at a time.

    SDQUANT_COMMIT=<hash> python bench/attention.py --out $OUT
    python bench/attention.py --dry          # CPU: Triton's interpreter, tiny shapes, checks only

Llama-3-8B heads (8 KV heads x 4 query heads, head_dim 128, bf16), a static cache of --max-seq slots, RoPE applied to
q in the kernel, position p (slots 0..p live). Each setting (SDQUANT_ATTN_CHUNK / _BT / _WARPS, "rule" = the shipped
choice) is checked against ``decode_attention.reference`` in float32 (relative error <= 1e-2), then timed with
bench/gemm.py's time_rotating over cache copies rotating past 3x the L2 (CUDA graph, median of 5 replays). Baselines
in the same process: "masked" = the runtime's "matmul" attention (q.kT over every slot, masked fp32 softmax, p.v),
"sdpa" = F.scaled_dot_product_attention(enable_gqa=True) over the live slots (a slice, so a new graph per position).
"floor" = the live keys and values / the copy bandwidth measured in the run. Writes $OUT/attention.json.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
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

KNOBS = ("SDQUANT_ATTN_CHUNK", "SDQUANT_ATTN_BT", "SDQUANT_ATTN_WARPS")


def settings(chunks: str, bts: str, warps: str):
    """[(label, {env var: value})]: "rule" alone, then every (chunk, BT, warps) combination asked for."""
    out = [("rule", {})]
    for c, b, w in itertools.product(chunks.split(","), bts.split(","), warps.split(",")):
        if not c or c == "rule":
            continue
        if b and int(b) > int(c):
            continue
        env = {"SDQUANT_ATTN_CHUNK": c, **({"SDQUANT_ATTN_BT": b} if b else {}),
               **({"SDQUANT_ATTN_WARPS": w} if w else {})}
        out.append((f"c{c}" + (f"/bt{b}" if b else "") + (f"/w{w}" if w else ""), env))
    return out


@contextlib.contextmanager
def with_env(env: dict):
    """The knobs set to env (the rest unset) inside the block, restored afterwards."""
    old = {k: os.environ.pop(k, None) for k in KNOBS}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def masked_attention(q, k, v, pos, scale, cos, sin):
    """The runtime's "matmul" implementation: every slot, masked (what a static cache costs without the op)."""
    from sdquant.kernels.decode_attention import rope_q
    q = rope_q(q, cos, sin).to(q.dtype)
    live = torch.arange(k.shape[2], device=k.device) <= pos.reshape(())
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    p = torch.softmax(s.masked_fill(~live, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(p, v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--positions", default="512,1088,2047")
    ap.add_argument("--max-seq", type=int, default=2176)
    ap.add_argument("--chunks", default="64,128,256,512,1024")
    ap.add_argument("--bts", default="64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--dry", action="store_true", help="CPU: Triton's interpreter, tiny shapes, checks only")
    args = ap.parse_args(argv)
    if args.dry:
        os.environ["TRITON_INTERPRET"] = "1"
    from sdquant.kernels import decode_attention as da

    dev = torch.device("cpu" if args.dry else "cuda")
    dt = torch.float32 if args.dry else torch.bfloat16
    nkv, rep, hd = (2, 4, 32) if args.dry else (8, 4, 128)
    T = 200 if args.dry else args.max_seq
    batches = [2] if args.dry else [int(b) for b in args.batches.split(",")]
    positions = [0, 129, 199] if args.dry else [int(p) for p in args.positions.split(",")]
    sets = settings("128", "64", "") if args.dry else settings(args.chunks, args.bts, args.warps)
    scale = hd ** -0.5
    bw = None if args.dry else gemm.copy_bandwidth(dev)
    rows, t0 = [], time.time()
    for b in batches:
        g = torch.Generator(device=dev).manual_seed(b)
        cache_bytes = 2 * b * nkv * T * hd * 2
        n = 1 if args.dry else gemm.n_copies(cache_bytes)
        ks = [torch.randn(b, nkv, T, hd, generator=g, device=dev).to(dt) for _ in range(n)]
        vs = [torch.randn(b, nkv, T, hd, generator=g, device=dev).to(dt) for _ in range(n)]
        q = torch.randn(b, nkv, rep, hd, generator=g, device=dev).to(dt)
        ang = torch.rand(hd // 2, generator=g, device=dev)
        cos, sin = torch.cos(ang).repeat(2).to(dt), torch.sin(ang).repeat(2).to(dt)
        for pos in positions:
            p = torch.tensor([pos], device=dev)
            ref = da.reference(q.float(), ks[0].float(), vs[0].float(), p, 0, scale, cos.float(), sin.float())
            live_bytes = 2 * b * nkv * (pos + 1) * hd * 2
            row = {"B": b, "pos": pos, "live_MB": round(live_bytes / 1e6, 2),
                   "rule_chunk": da.chunk_for(b * nkv, T, 132 if args.dry else da._sms(dev))}
            for label, env in sets:
                with with_env(env):
                    y = torch.ops.sdquant.decode_attention(q, ks[0], vs[0], p, 0, scale, cos, sin)
                    err = float((y.float() - ref).norm() / ref.norm())
                    row[f"{label}_err"] = err
                    if err > 1e-2:
                        raise SystemExit(f"decode_attention {label} at B={b} pos={pos}: rel. error {err:.2e} > 1e-2")
                    if not args.dry:
                        row[label] = round(gemm.time_rotating(
                            lambda i: torch.ops.sdquant.decode_attention(q, ks[i], vs[i], p, 0, scale, cos, sin),
                            n), 2)
            if not args.dry:
                row["masked"] = round(gemm.time_rotating(
                    lambda i: masked_attention(q, ks[i], vs[i], p, scale, cos, sin), n), 2)
                qs = da.rope_q(q, cos, sin).to(dt)
                row["sdpa"] = round(gemm.time_rotating(
                    lambda i: torch.nn.functional.scaled_dot_product_attention(
                        qs, ks[i][:, :, :pos + 1], vs[i][:, :, :pos + 1], scale=scale, enable_gqa=True), n), 2)
                row["floor"] = round(live_bytes / (bw * 1e12) * 1e6, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ks, vs
        if not args.dry:
            torch.cuda.empty_cache()
    gemm.save_rows(args.out, "attention", rows, copy_TBps=bw, T=T, heads=[nkv, rep, hd], dry=args.dry)
    if not args.dry:
        labels = [label for label, _ in sets]
        print("\n| B | pos | live MB | floor | " + " | ".join(labels) + " | masked | sdpa | best |")
        print("|---|---|---|---|" + "---|" * (len(labels) + 3))
        for r in rows:
            best = min(labels, key=lambda lb: r[lb])
            print(f"| {r['B']} | {r['pos']} | {r['live_MB']} | {r['floor']} | " + " | ".join(f"{r[lb]:.1f}" for lb in labels)
                  + f" | {r['masked']:.1f} | {r['sdpa']:.1f} | {best} |")
    print(f"wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
