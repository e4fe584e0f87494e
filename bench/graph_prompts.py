"""Pending 30's reproduction: a block-compiled model whose decode step a CUDA graph replays, then new prompt lengths.

    python bench/graph_prompts.py --mode replay [--pdl off] [--out $OUT/graph_prompts.json]
    bash bench/graph_prompts.sh          # every mode below, each in a process of its own, in one device call

Found and fixed on 2026-12-06 (see bench/pending30_bisect.py). This script builds each model from an HF model of its
own, both before the capture, so it never met the cause (a second runtime from the same HF model re-preparing the
first's o / down layers); it passed in every mode on an H100. Kept as a check of CUDAGraphStep over many prompt
lengths.

Compile smoke run 29 (2026-12-04, H200) found, with ``scope="block"``: after ``CUDAGraphStep`` captured the greedy
decode step at batch 2 (before a 12-token prompt), prompts of 5, 9, 17 and 33 tokens at batch 2 gave other tokens than
the eager model, and the direct decode step after them NaN logits. The same sequence without the graph passed (run
28), and so does this script on the CPU (no graph there). Modes, one process each:
  none        no graph: prompts, then direct decode steps (the passing reference)
  capture     the graph captured before the first prompt, never replayed; direct decode steps
  replay      the graph captured and replayed for the decode steps (the failing case)
  sidestream  no graph, but the decode step's first call (its compile) on a side stream, as the capture's warm-up runs
Per prompt shape: whether the greedy tokens equal the eager model's, the first decode step's logits against eager's
(relative), whether either model's logits or KV cache (live slots) hold NaN, and whether the prompt moved the compiled
model's cache storage (a captured graph would keep writing the old one). A small random Llama (hidden 512, 4
layers, heads of 128), RTN W4 g128, bf16: bench/compile_smoke.py's smoke_model.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # compile_smoke's model

MODES = ("none", "capture", "replay", "sidestream")


def build(dev, dtype, compiled: bool, pdl):
    from compile_smoke import smoke_model
    from sdquant.runtime.model import Transformer
    rt = Transformer.from_hf(smoke_model(dict(bits=4, group_size=128)), max_seq_len=256, device=dev, dtype=dtype)
    if compiled:
        backend = "inductor" if dev.type == "cuda" else "aot_eager"
        rt.compile_decode(mode=None, scope="block", backend=backend, pdl=pdl)
    return rt


def nan_in_cache(rt, upto: int) -> bool:
    return any(bool(torch.isnan(blk.attn.kv_cache.kv[..., :upto, :]).any()) for blk in rt.layers)


def cache_ptrs(rt) -> list:
    return [blk.attn.kv_cache.kv.data_ptr() for blk in rt.layers]


def run_shape(rt, eager, prompt, n, graph) -> dict:
    """Prompt then n greedy tokens on both models (rt through the graph when given), and rt's first step's logits;
    whether the prompt moved rt's cache storage (a captured graph would write the old one)."""
    b, s = prompt.shape
    dev = prompt.device
    ptrs = cache_ptrs(rt)
    toks = {}
    first = {}
    with torch.no_grad():
        for name, m in (("eager", eager), ("compiled", rt)):
            tok = m(prompt, torch.arange(s, device=dev), last_only=True, greedy=True)[:, -1]
            if m is rt:
                moved = cache_ptrs(rt) != ptrs
            out = [tok.clone()]
            if name == "compiled" and graph is not None:
                graph.idx.copy_(tok[:, None])
                graph.pos.fill_(s)
                first[name] = None
                for _ in range(n - 1):
                    out.append(graph()[:, 0].clone())
            else:
                for i in range(n - 1):
                    logits = m.decode_step(out[-1][:, None], torch.tensor([s + i], device=dev))
                    if i == 0:
                        first[name] = logits.float()
                    out.append(logits.argmax(-1))
            toks[name] = torch.stack(out, 1)
        if first.get("compiled") is None:   # the graph's own logits are not kept: one direct step after its prompt
            rt(prompt, torch.arange(s, device=dev), last_only=True)
            first["compiled"] = rt.decode_step(toks["compiled"][:, :1], torch.tensor([s], device=dev)).float()
    d = first["compiled"] - first["eager"]
    return {"shape": f"{b}x{s}", "identical": bool(torch.equal(toks["compiled"], toks["eager"])),
            "step_rel_diff": float(d.norm() / first["eager"].norm()),
            "nan_logits": {k: bool(torch.isnan(v).any()) for k, v in first.items()},
            "nan_cache": {"compiled": nan_in_cache(rt, s + n), "eager": nan_in_cache(eager, s + n)},
            "prompt_moved_cache": moved}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, default="replay")
    ap.add_argument("--pdl", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--shapes", default="2x12,2x5,2x9,2x17,2x33")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=None,
                    help="tokens after the first prompt (default --tokens; compile smoke run 29 generated 24 there, "
                         "twice, before the new prompt lengths)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (aot_eager; modes none and sidestream only)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "graph_prompts.json"))
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.cpu else "cuda")
    if dev.type == "cpu" and args.mode in ("capture", "replay"):
        ap.error(f"--mode {args.mode} needs a CUDA device")
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    pdl = {"auto": None, "on": True, "off": False}[args.pdl]
    rt = build(dev, dtype, True, pdl if dev.type == "cuda" else None)
    eager = build(dev, dtype, False, None)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    b0 = shapes[0][0]
    for m in (rt, eager):
        m.setup_caches(b0, 256)
    graph = None
    with torch.no_grad():
        if args.mode in ("capture", "replay"):
            from sdquant.runtime.model import CUDAGraphStep
            graph = CUDAGraphStep(lambda idx, pos: rt.decode_step(idx, pos, greedy=True)[:, None], b0, dev,
                                  feedback=True)
        elif args.mode == "sidestream" and dev.type == "cuda":
            s = torch.cuda.Stream(dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):
                rt.decode_step(torch.zeros(b0, 1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long,
                                                                                               device=dev))
            torch.cuda.current_stream(dev).wait_stream(s)
    rows, ok = [], True
    g = torch.Generator().manual_seed(1)
    for j, (b, s) in enumerate(shapes):
        prompt = torch.randint(0, 1024, (b, s), generator=g).to(dev)
        for m in (rt, eager):
            if m.max_batch != b:
                m.setup_caches(b, 256)
        n = args.first_tokens if j == 0 and args.first_tokens else args.tokens
        row = run_shape(rt, eager, prompt, n, graph if args.mode == "replay" and b == b0 else None)
        row["passed"] = row["step_rel_diff"] < 0.1 and not any(row["nan_logits"].values())
        ok &= row["passed"]
        rows.append(row)
        print(f"{args.mode} pdl={args.pdl} {row['shape']}: identical={row['identical']} step rel "
              f"{row['step_rel_diff']:.3g} nan logits {row['nan_logits']} nan cache {row['nan_cache']} cache moved "
              f"{row['prompt_moved_cache']} -> "
              f"{'PASS' if row['passed'] else 'FAIL'}", flush=True)
    return finish(args.out, {"mode": args.mode, "pdl": args.pdl}, rows, ok, dev, "graph prompts")


def finish(out, head: dict, rows: list, ok: bool, dev, label: str) -> int:
    """Write the JSON (head, rows, ok, device, torch version), print the verdict; the exit status."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({**head, "rows": rows, "ok": ok, "device": str(dev), "torch": torch.__version__},
                                    indent=1))
    print(f"{label}:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
