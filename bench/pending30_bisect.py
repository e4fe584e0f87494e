"""Pending 30, second reproduction: compile smoke's INT4 scope="block" sequence with ``generate`` replaying one captured
decode graph a batch size (what 4def202's ``decode_graph`` did), with the runtime's state checked after every stage.

    python bench/pending30_bisect.py [--graph off] [--pdl off] [--out $OUT/pending30.json]

On an H100 (2026-12-06) compile smoke with 4def202's ``decode_graph`` applied failed as on the H200 (2x5 and 2x33: NaN
in the direct step after ``generate``; 2x9, 2x17: other tokens), while bench/graph_prompts.py, the same prompts through
a user-level ``CUDAGraphStep``, passed. This script runs the failing sequence itself, without patching the runtime: its
``generate_graph`` is ``generate`` as 4def202 had it (the graph captured before the prompt, kept per batch size and
cache, greedy steps feeding themselves). After each stage it records whether every split-K counter (the INT4 layouts'
``locks`` buffers, zero between calls by contract) is zero, whether the live cache slots hold NaN, and the stage's
tokens and first-step logits against the eager model's. As compile smoke does, the scope="model" case runs first in the
same process (``--before none``: not). ``--graph off`` runs the same stages with plain ``generate`` (the control, which
passed in compile smoke run 28); ``--cpu`` runs that control on the CPU (aot_eager; the script's own test).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def generate_graph(model, prompt, n: int, graphs: dict) -> torch.Tensor:
    """Greedy ``generate`` replaying one CUDAGraphStep a (batch, cache storage), captured before the prompt as 4def202
    did (its warm-up writes cache slot 0, which the prompt then overwrites)."""
    from sdquant.runtime.model import CUDAGraphStep, cache_len_for
    b, s = prompt.shape
    total = s + n
    if b != model.max_batch or total > model.max_seq:
        model.setup_caches(b, max(cache_len_for(total, model.rope_cos.shape[0]), model.max_seq))
    key = (model.max_batch, model.layers[0].attn.kv_cache.kv.data_ptr())
    if key not in graphs:
        graphs.clear()   # decode_graph cleared its captures when the caches were replaced
        graphs[key] = CUDAGraphStep(lambda idx, pos: model.decode_step(idx, pos, greedy=True)[:, None],
                                    model.max_batch, model.norm.device, feedback=True)
    graph = graphs[key]
    res = model(prompt, torch.arange(s, device=prompt.device), last_only=True, greedy=True)[:, -1]
    out = [prompt, res.clone()[:, None]]
    graph.idx.copy_(out[-1])   # from here on the graph feeds itself
    graph.pos.fill_(s)
    for _ in range(n - 1):
        out.append(graph()[:, 0].clone()[:, None])
    return torch.cat(out, dim=1)


def state(models: dict, upto: int) -> dict:
    """Per model: split-K counters left non-zero (name: count) and NaN in the live cache slots. The kernels' launch
    settings (PDL) are process-wide, so the eager reference runs under the compiled model's too: both are checked."""
    from graph_prompts import nan_in_cache
    res = {}
    for tag, rt in models.items():
        locks = {name: int(torch.count_nonzero(buf)) for name, buf in rt.named_buffers() if name.endswith("locks")}
        res[tag] = {"locks_nonzero": {k: v for k, v in locks.items() if v}, "locks_checked": len(locks),
                    "nan_cache": rt.max_batch > 0 and nan_in_cache(rt, upto)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", choices=("on", "off"), default="on")
    ap.add_argument("--pdl", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--shapes", default="2x5,2x9,2x17,2x33,1x7,2x5")
    ap.add_argument("--before", choices=("model", "none"), default="model",
                    help="model: first the scope=\"model\" case in the same process, as compile smoke runs it "
                         "(inductor's CUDA graphs, every --shapes prompt, then torch._dynamo.reset()); none: the block "
                         "case alone")
    ap.add_argument("--cpu", action="store_true", help="the control (--graph off) on the CPU, aot_eager, fp32")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pending30.json"))
    args = ap.parse_args(argv)
    if args.cpu and args.graph == "on":
        ap.error("--graph on needs a CUDA device (run --cpu with --graph off)")
    import sdquant
    from compile_smoke import REL_MAX, first_step, smoke_model
    from graph_prompts import finish
    from sdquant.runtime.model import Transformer, generate
    dev = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model = smoke_model(dict(bits=4, group_size=128))
    rt = Transformer.from_hf(model, max_seq_len=256, device=dev, dtype=dtype)
    graphs: dict = {}
    gen = (lambda m, p, n: generate_graph(m, p, n, graphs)) if args.graph == "on" else generate
    prompt = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(1)).to(dev)
    rows, ok = [], True
    models = {"compiled": rt}

    def record(stage, out=None, ref=None, step=None, upto=None):
        nonlocal ok
        st = state(models, upto or rt.max_seq)
        row = {"stage": stage, "state": st}
        if out is not None:
            row["identical"] = bool(torch.equal(out, ref))
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
        if args.before == "model":   # compile smoke's first case, in the same process
            rm = Transformer.from_hf(model, max_seq_len=256, device=dev, dtype=dtype)
            generate(rm, prompt, 24)
            sdquant.compile(rm, scope="model", **compile_kw)
            generate(rm, prompt, 24)
            generate(rm, prompt, 24)
            for shape in args.shapes.split(","):
                b, s = (int(v) for v in shape.split("x"))
                generate(rm, torch.randint(0, 1024, (b, s), generator=torch.Generator().manual_seed(b * 100 + s)
                                           ).to(dev), 4)
            del rm
            torch._dynamo.reset()
        ref = generate(rt, prompt, 24)
        record("eager 2x12", upto=36)
        sdquant.compile(rt, scope="block", **compile_kw)
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
    return finish(args.out, {"graph": args.graph, "pdl": args.pdl, "before": args.before}, rows, ok, dev,
                  "pending 30 bisect")


if __name__ == "__main__":
    sys.exit(main())
