"""Pending 30, second reproduction: compile smoke's INT4 scope="block" sequence with ``generate`` replaying one captured
decode graph a batch size (``Transformer.decode_graph``), with the runtime's state checked after every stage.

    python bench/pending30_bisect.py [--graph off] [--pdl off] [--poison] [--out $OUT/pending30.json]

**Found and fixed (2026-12-06, H100, bench/results/pending30_h100_run1/).** The eager reference model, built from the
same HF model after the graph was captured, shared the compiled model's unfused linears (o and down were the HF
model's own modules): its prepare re-attached their kernel layouts, and the captured graph kept reading the freed
ones. Memory that nothing reused still held the old layouts, so it passed in a fresh process; ``--poison`` (freed
memory filled with NaN bytes before the run) made it fail every time. ``Transformer.from_spec`` now builds its own
linears (``own_linear``); with it every variant below passes. (Runs s1-s7 used this script's own copy of 4def202's
``generate``; decode_graph, re-landed since, is the same capture and replay.)

After each stage the script records whether every split-K counter (the INT4 layouts' ``locks`` buffers, zero between
calls by contract) is zero, whether the live cache slots hold NaN (and which layers and slots), and the stage's tokens
and first-step logits against the eager model's. As compile smoke does, the scope="model" case runs first in the same
process (``--before none``: not; ``model-nocg``, ``model-noreset``, ``eager``: that case without inductor's CUDA
graphs, without the reset, or uncompiled). ``--graph off`` runs the same stages without the graph;
``--recapture`` captures a graph for every prompt; ``--attention``, ``--fused off`` and ``--kv-write`` change the block
model's kernels; ``--cpu`` runs the control on the CPU (aot_eager; the script's own test).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


BEFORE = ("model", "none", "model-nocg", "model-noreset", "eager")


def nan_slots(rt, upto: int) -> dict:
    """Where the live cache slots hold NaN: {layer: {"k"|"v": [slots]}} for the first layers that do (at most 3)."""
    res = {}
    for i, blk in enumerate(rt.layers):
        kv = blk.attn.kv_cache.kv[..., :upto, :]          # [2, B, nkv, T, hd]
        bad = {("k", "v")[j]: torch.isnan(kv[j]).flatten(0, 1).any(0).any(-1).nonzero().flatten().tolist()
               for j in range(2)}
        if any(bad.values()):
            res[i] = bad
        if len(res) == 3:
            break
    return res


def state(models: dict, upto: int) -> dict:
    """Per model: split-K counters left non-zero (name: count) and NaN in the live cache slots (and where). The
    kernels' launch settings (PDL) are process-wide, so the eager reference runs under the compiled model's too: both
    are checked."""
    res = {}
    for tag, rt in models.items():
        locks = {name: int(torch.count_nonzero(buf)) for name, buf in rt.named_buffers() if name.endswith("locks")}
        slots = nan_slots(rt, upto) if rt.max_batch > 0 else {}
        res[tag] = {"locks_nonzero": {k: v for k, v in locks.items() if v}, "locks_checked": len(locks),
                    "nan_cache": bool(slots)}
        if slots:
            res[tag]["nan_slots"] = slots
    return res


def poison(dev, nbytes: int = 6 << 30) -> int:
    """Fill ``nbytes`` of device memory (at most half the free memory) with NaN bytes (0xFF) and give it back to the
    caching allocator and (empty_cache) to the driver, then a few hundred MB more that the allocator keeps: a later read
    of memory that nothing wrote then sees NaN, not whatever a fresh process happens to hold (zeros). Returns the bytes
    poisoned."""
    free, _ = torch.cuda.mem_get_info(dev)
    chunk = 256 << 20
    held = [torch.full((chunk,), 255, dtype=torch.uint8, device=dev) for _ in range(min(nbytes, free // 2) // chunk)]
    n = len(held) * chunk
    del held
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    # and blocks the caching allocator keeps (not returned to the driver) in its usual small sizes
    held = [torch.full((size,), 255, dtype=torch.uint8, device=dev) for size in (1 << 20, 2 << 20, 8 << 20, 64 << 20)
            for _ in range(16)]
    n += sum(t.numel() for t in held)
    del held
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", choices=("on", "off"), default="on")
    ap.add_argument("--pdl", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--shapes", default="2x5,2x9,2x17,2x33,1x7,2x5")
    ap.add_argument("--before", choices=BEFORE, default="model",
                    help="model: first the scope=\"model\" case in the same process, as compile smoke runs it "
                         "(inductor's CUDA graphs, every --shapes prompt, then torch._dynamo.reset()); none: the block "
                         "case alone; model-nocg: that case compiled with mode=None (no inductor CUDA graphs); "
                         "model-noreset: without torch._dynamo.reset(); eager: that model's calls uncompiled (only "
                         "its allocations)")
    ap.add_argument("--poison", action="store_true", help="fill 6 GB of device memory with NaN bytes and free it "
                                                            "before the block case (uninitialized reads see NaN)")
    ap.add_argument("--recapture", action="store_true", help="capture a new graph for every prompt (not one a batch "
                                                               "size and cache)")
    ap.add_argument("--attention", default="auto", help="the block model's decode attention (set_attention)")
    ap.add_argument("--fused", choices=("auto", "off"), default="auto", help="off: the block model without the fused "
                                                                           "decode GEMMs")
    ap.add_argument("--kv-write", choices=("gemm", "index_copy"), default="gemm", help="the block model's cache "
                                                                                     "write (set_kv_write)")
    ap.add_argument("--cpu", action="store_true", help="the control (--graph off) on the CPU, aot_eager, fp32")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pending30.json"))
    args = ap.parse_args(argv)
    if args.cpu and (args.graph == "on" or args.poison):
        ap.error("--graph on and --poison need a CUDA device (run --cpu with --graph off)")
    import sdquant
    from compile_smoke import REL_MAX, first_step, smoke_model
    from graph_prompts import finish
    from sdquant.runtime.model import Transformer, generate
    dev = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model = smoke_model(dict(bits=4, group_size=128))
    rt = Transformer.from_hf(model, max_seq_len=256, device=dev, dtype=dtype,
                             fused=False if args.fused == "off" else None)
    rt.set_attention(args.attention).set_kv_write(args.kv_write)

    def gen(m, p, n):   # generate: on the block-compiled CUDA model it replays Transformer.decode_graph (--graph on)
        if args.recapture:
            m.drop_decode_graphs()
        return generate(m, p, n)
    prompt = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(1)).to(dev)
    rows, ok = [], True
    models = {"compiled": rt}

    def record(stage, out=None, ref=None, step=None, upto=None):
        nonlocal ok
        st = state(models, upto or rt.max_seq)
        row = {"stage": stage, "state": st}
        if out is not None:
            row["identical"] = bool(torch.equal(out, ref))
            row["tokens_out_of_range"] = int(((out < 0) | (out >= rt.d.vocab_size)).sum())
        if step is not None:
            d = step["compiled"] - step["eager"]
            row["step_rel_diff"] = float(d.norm() / step["eager"].norm())
            row["nan_logits"] = {k: bool(torch.isnan(v).any()) for k, v in step.items()}
        row["passed"] = (not any(v["locks_nonzero"] or v["nan_cache"] for v in st.values()) and
                         (step is None or row["step_rel_diff"] < REL_MAX))   # (NaN fails the comparison)
        ok &= row["passed"]
        rows.append(row)
        print(f"{stage}: {'' if out is None else 'identical=%s ' % row['identical']}"
              f"{'' if step is None else 'step rel %.3g nan logits %s ' % (row['step_rel_diff'], row['nan_logits'])}"
              + " ".join(f"[{k}: locks non-zero {v['locks_nonzero'] or 'none'} of {v['locks_checked']}, nan cache "
                         f"{v['nan_cache']}]" for k, v in st.items()) + f" -> {'PASS' if row['passed'] else 'FAIL'}",
              flush=True)

    compile_kw = dict(backend="aot_eager", mode=None) if args.cpu else {}
    if args.pdl != "auto":
        compile_kw["pdl"] = args.pdl == "on"
    with torch.no_grad():
        if args.before != "none":   # compile smoke's first case, in the same process
            rm = Transformer.from_hf(model, max_seq_len=256, device=dev, dtype=dtype)
            generate(rm, prompt, 24)
            if args.before != "eager":
                sdquant.compile(rm, scope="model", **{**compile_kw, **({"mode": None} if args.before == "model-nocg"
                                                                       else {})})
            generate(rm, prompt, 24)
            generate(rm, prompt, 24)
            for shape in args.shapes.split(","):
                b, s = (int(v) for v in shape.split("x"))
                generate(rm, torch.randint(0, 1024, (b, s), generator=torch.Generator().manual_seed(b * 100 + s)
                                           ).to(dev), 4)
            del rm
            if args.before != "model-noreset":
                torch._dynamo.reset()
        poisoned = poison(dev) if args.poison else 0
        ref = generate(rt, prompt, 24)
        record("eager 2x12", upto=36)
        sdquant.compile(rt, scope="block", **compile_kw)
        rt.graph_decode = args.graph == "on"   # (the runtime's switch; generate captures where it is on and on CUDA)
        out = gen(rt, prompt, 24)
        record("compiled 2x12 x24", out, ref, upto=36)
        out2 = gen(rt, prompt, 24)
        record("again 2x12 x24", out2, ref, upto=36)
        eager = Transformer.from_hf(model, max_seq_len=256, device=dev, dtype=dtype)
        models["eager"] = eager
        record("direct step 2x12", step=first_step(models, prompt, ref), upto=13)
        for shape in args.shapes.split(","):
            b, s = (int(v) for v in shape.split("x"))
            p = torch.randint(0, 1024, (b, s), generator=torch.Generator().manual_seed(b * 100 + s)).to(dev)
            ref_s = generate(eager, p, 4)
            record(f"generate {shape}", gen(rt, p, 4), ref_s, upto=s + 4)
            record(f"direct step {shape}", step=first_step(models, p, ref_s), upto=s + 1)
    conf = {k: getattr(args, k) for k in ("graph", "pdl", "before", "recapture", "attention", "fused", "kv_write")}
    return finish(args.out, conf | {"poisoned_bytes": poisoned}, rows, ok, dev, "pending 30 bisect")


if __name__ == "__main__":
    sys.exit(main())
