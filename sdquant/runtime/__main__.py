"""Generate with the sdquant runtime from a .sd2 package (or a HF folder / GGUF file) and report tokens/s.

    python -m sdquant.runtime model.sd2 "The capital of France is" --max-new-tokens 64 --compile reduce-overhead
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from sdquant.errors import SdquantError


def _load(src: str, device: str, dtype):
    import sdquant
    if src.endswith(".sd2"):
        return sdquant.load(src, device="cpu", dtype=dtype, kernels="reference")
    from sdquant.config import ModelConfig
    from sdquant.models.hf import load_model
    model, tok = load_model(ModelConfig(path=src), dtype)
    model.tokenizer = tok
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sdquant.runtime", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help=".sd2 package, HF folder or .gguf file")
    ap.add_argument("prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", default=None, help="torch.compile mode, e.g. reduce-overhead (default: eager)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-pdl", dest="pdl", action="store_false", default=None,
                    help="with --compile: no programmatic dependent launch (default: on where it can run)")
    args = ap.parse_args(argv)
    from sdquant.runtime.model import Transformer, generate
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    try:
        hf = _load(args.model, args.device, dtype if args.device == "cpu" else torch.float32)
        tok = getattr(hf, "tokenizer", None)
        if tok is None:
            raise SdquantError(f"{args.model}: no tokenizer packaged with the model")
        max_seq = min(args.max_seq_len, getattr(hf.config, "max_position_embeddings", None) or args.max_seq_len)
        rt = Transformer.from_hf(hf, max_seq_len=max_seq, device=args.device, dtype=dtype,
                                 compile=args.compile, pdl=args.pdl)
        ids = tok(args.prompt, return_tensors="pt").input_ids
        eos = getattr(tok, "eos_token_id", None)
        generate(rt, ids, 2, eos_token_id=None)                       # warm-up (and compile)
        t = time.perf_counter()
        out = generate(rt, ids, args.max_new_tokens, temperature=args.temperature, eos_token_id=eos)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    except SdquantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = out.shape[1] - ids.shape[1]
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s on {args.device}, prefill included]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
