"""`sdquant` command line: a thin layer over sdquant.api. Exit codes: 0 success, 2 bad input (one line,
no traceback), 1 internal failure."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from sdquant.errors import ConfigError, SdquantError

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdquant", description="Quantize transformers (joint AWQ+GPTQ, FP8), "
                                "export deployable .sd2 packages, ONNX and GPTQ/AWQ checkpoints.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    p.add_argument("--traceback", action="store_true", help="show Python tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("calibrate", help="calibrate a model from a YAML config and write a package",
                       description="Calibrate (quantize) the model named in the config and write a .sd2 package.")
    c.add_argument("--config", required=True, help="YAML config (see templates/)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set quant.bits=3 (repeatable)")
    c.add_argument("--output", help="package path (overrides the config's output)")
    c.add_argument("--resume", action="store_true", help="continue an interrupted run from its work folder")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.add_argument("--no-generate", action="store_true", help="skip the before/after generation sample")
    c.add_argument("--dump-config", action="store_true", help="print the resolved config as YAML and exit")

    e = sub.add_parser("export", help="convert a package (or a config, calibrating first) to another format",
                       description="SRC is a .sd2 package or a YAML config (calibrated first).")
    e.add_argument("src", help=".sd2 package or YAML config")
    e.add_argument("--format", required=True, choices=["sd2", "onnx", "gptq", "awq"])
    e.add_argument("--output", required=True, help="output file (sd2) or folder (onnx, gptq, awq)")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument("--accuracy-level", type=int, default=4, help="ONNX MatMulNBits accuracy_level (0-4)")

    i = sub.add_parser("inspect", help="show a package's layers, schemes, sizes and calibration metrics")
    i.add_argument("package")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")

    v = sub.add_parser("verify", help="check every hash and shape of a package (exit 0 only if all match)")
    v.add_argument("package")

    ev = sub.add_parser("eval", help="perplexity of a model or package on a text file (or DiT fidelity)")
    ev.add_argument("model", help=".sd2 package, HF folder, .gguf file or builtin name (e.g. smollm2-135m)")
    ev.add_argument("--text", required=True, help="plain-text file to evaluate on")
    ev.add_argument("--seq-len", type=int, default=2048)
    ev.add_argument("--windows", type=int, default=None, help="first K non-overlapping windows (default all)")

    t = sub.add_parser("tune-kernels", help="re-measure the kernel crossover table on this GPU")
    t.add_argument("--output", required=True, help="JSON file to write (rewritten after every shape)")
    t.add_argument("--budget-s", type=float, default=None,
                   help="skip the shapes not started within this many seconds (default: measure all)")
    t.add_argument("--resume", action="store_true",
                   help="keep the shapes already in --output (same GPU model and buckets) and measure the rest")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"calibrate": cmd_calibrate, "export": cmd_export, "inspect": cmd_inspect,
                "verify": cmd_verify, "eval": cmd_eval, "tune-kernels": cmd_tune}[args.command](args)
    except SdquantError as e:
        if args.traceback:
            raise
        print(f"sdquant: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `sdquant inspect X | head`: the reader left; not an error
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        print("sdquant: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # an internal failure: keep it short unless asked
        if args.traceback:
            raise
        print(f"sdquant: internal error: {type(e).__name__}: {e} (rerun with --traceback)", file=sys.stderr)
        return EXIT_INTERNAL


# ------------------------------------------------------------------------------------------ commands
def _load_cfg(args):
    from sdquant.config import load_config, parse_overrides
    over = parse_overrides(args.set)
    if getattr(args, "output", None) and args.command == "calibrate":
        over["output"] = args.output
    return load_config(args.config if hasattr(args, "config") else args.src, over)


def cmd_calibrate(args) -> int:
    import torch
    import sdquant
    from sdquant.api import _resolve_device
    from sdquant.models.hf import load_model, torch_dtype

    cfg = _load_cfg(args)
    if args.dump_config:
        print(cfg.to_yaml(), end="")
        return EXIT_OK
    out = Path(cfg.output or "model.sd2")
    if out.exists() and out.is_dir():
        raise SdquantError(f"output: {out} is a folder, expected a .sd2 file path")
    from sdquant.calibrate import distributed
    dist = distributed.init_from_env(cfg.device)  # under torchrun: data-parallel calibration
    if dist.active:
        return _calibrate_distributed(cfg, args, out, dist)
    device = _resolve_device(cfg.device)
    dtype = torch_dtype(cfg.dtype, str(device))
    t0 = time.perf_counter()
    model, tok = load_model(cfg.model, dtype)
    gen = cfg.report.prompt and cfg.report.max_new_tokens and tok is not None and not args.no_generate \
        and hasattr(model, "generate")
    before = _generate(model, tok, cfg) if gen else None
    ppl_fp = _ppl(model, tok, cfg) if cfg.report.eval_text and tok is not None else None
    res = sdquant.calibrate(model, cfg, tokenizer=tok, progress=not args.no_progress, resume=args.resume)
    ppl_q = _ppl(res.model, tok, cfg) if ppl_fp is not None else None
    path = sdquant.export(res, out, format="sd2")
    after = None
    if gen:  # the package as a user loads it: onto the calibration device, with its kernels where that is a GPU
        loaded = sdquant.load(path, device=device, dtype=dtype)
        after = _generate(loaded, tok, cfg)
    _print_summary(res, path, time.perf_counter() - t0, before, after, ppl_fp, ppl_q)
    return EXIT_OK


def _calibrate_distributed(cfg, args, out, dist) -> int:
    """Every rank calibrates its shard; statistics are reduced across ranks; rank 0 writes and reports."""
    import torch.distributed as tdist
    import sdquant
    t0 = time.perf_counter()
    try:
        res = sdquant.calibrate(None, cfg, progress=dist.is_main and not args.no_progress, resume=args.resume)
        if dist.is_main:
            path = sdquant.export(res, out, format="sd2")
            _print_summary(res, path, time.perf_counter() - t0, None, None, None, None)
            print(f"data parallel over {dist.world} ranks")
        dist.barrier()
    finally:
        tdist.destroy_process_group()
    return EXIT_OK


def _generate(model, tok, cfg) -> str:
    import torch
    ids = tok(cfg.report.prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=cfg.report.max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def _ppl(model, tok, cfg):
    from sdquant.eval import perplexity
    text = Path(cfg.report.eval_text).read_text(encoding="utf-8", errors="replace")
    return perplexity(model, tok, text, seq_len=cfg.report.eval_seq_len, windows=cfg.report.eval_windows)["ppl"]


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _print_layers(rows) -> None:
    """The per-layer table: layer, method, layer loss RTN -> final, damping (escalations), seconds, peak."""
    if not rows:
        return
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    w = max(len(str(r.get("layer", ""))) for r in rows)
    print(f"\n{'layer':<{w}}  {'method':<9} {'W/g':>7}  {'loss rtn -> final':>21}  {'damp':>7}  {'s':>6}  {'peak MiB':>9}")
    for r in rows:
        wg = f"{r.get('bits', '')}/{r.get('group_size', '')}" if r.get("method") != "fp8" else "8/fp8"
        loss = f"{f(r.get('rtn_loss'), '.3e')} -> {f(r.get('loss'), '.3e')}"
        damp = f(r.get("damp"), ".3g") + (f"(+{r['escalations']})" if r.get("escalations") else "")
        print(f"{str(r.get('layer', '')):<{w}}  {str(r.get('method', '')):<9} {wg:>7}  {loss:>21}  {damp:>7}  "
              f"{f(r.get('seconds'), '.2f'):>6}  {f(r.get('peak_mb'), '.0f'):>9}")


def _print_summary(res, path, seconds, before, after, ppl_fp, ppl_q) -> None:
    rows = res.rows
    _print_layers(rows)
    losses = [r.get("loss_after", r.get("loss")) for r in rows if r.get("loss_after", r.get("loss")) is not None]
    lines = [
        ("model family", res.family),
        ("method", f"{res.config.quant.method}  W{res.config.quant.bits} g{res.config.quant.group_size}"
                   f"{' sym' if res.config.quant.symmetric else ' asym'}"),
        ("layers quantized", str(len(res.weights))),
        ("linear weights before", _mb(res.size_before)),
        ("linear weights after", f"{_mb(res.size_after)}  ({res.size_before / max(res.size_after, 1):.2f}x smaller)"),
        ("mean layer loss", f"{sum(losses) / len(losses):.3e}" if losses else "-"),
        ("calibration time", f"{res.seconds:.1f} s"),
        ("total time", f"{seconds:.1f} s"),
        ("package", f"{path}  ({_mb(Path(path).stat().st_size)})"),
    ]
    if ppl_fp is not None:
        lines.append(("perplexity fp -> quant", f"{ppl_fp:.3f} -> {ppl_q:.3f}"))
    w = max(len(k) for k, _ in lines)
    print("\nsdquant calibrate — summary")
    print("-" * (w + 50))
    for k, v in lines:
        print(f"{k:<{w}}  {v}")
    if before is not None:
        print(f"{'generation (float)':<{w}}  {before!r}")
        print(f"{'generation (package)':<{w}}  {after!r}")


def cmd_export(args) -> int:
    import sdquant
    src = Path(args.src)
    if not src.exists():
        raise SdquantError(f"{src}: file not found")
    out = Path(args.output)
    if src.suffix in (".yaml", ".yml"):
        from sdquant.config import load_config, parse_overrides
        cfg = load_config(src, parse_overrides(args.set))
        res = sdquant.calibrate(None, cfg, progress=True)
        kw = {"accuracy_level": args.accuracy_level} if args.format == "onnx" else {}
        path = sdquant.export(res, out, format=args.format, **kw)
    else:
        path = _export_package(src, out, args)
    print(f"wrote {path}")
    return EXIT_OK


def _export_package(src: Path, out: Path, args) -> Path:
    import sdquant
    if args.format == "sd2":
        raise SdquantError(f"{src} is already a .sd2 package (use --format onnx, gptq or awq)")
    model = sdquant.load(src, device="cpu", kernels="reference")
    if args.format == "onnx" and getattr(getattr(model, "config", None), "model_type", "") == "seedance":
        from sdquant.export.onnx_module import export_seedance_onnx
        return export_seedance_onnx(model, out / "model.onnx", accuracy_level=args.accuracy_level)
    if args.format == "onnx":
        from sdquant.export.onnx import export_onnx
        return export_onnx(model, out, tokenizer=getattr(model, "tokenizer", None),
                           accuracy_level=args.accuracy_level)
    from sdquant.export import hf as hf_export
    return hf_export.export_model(model, out, format=args.format)


def cmd_inspect(args) -> int:
    from sdquant.export.sd2 import format_inspect, inspect_sd2
    info = inspect_sd2(args.package)
    print(json.dumps(info, indent=2, default=str) if args.json else format_inspect(info))
    return EXIT_OK


def cmd_verify(args) -> int:
    from sdquant.export.sd2 import package_aliases, verify_sd2
    problems = verify_sd2(args.package)
    if problems:
        for p in problems:
            print(f"FAIL {p}")
        return EXIT_BAD_INPUT
    print(f"OK {args.package}: every member hash, tensor shape and dtype checks out")
    for alias, target in package_aliases(args.package).items():
        print(f"  tied: {alias} -> {target} (stored once)")
    return EXIT_OK


def cmd_eval(args) -> int:
    from sdquant.eval import perplexity
    text_path = Path(args.text)
    if not text_path.is_file():
        raise SdquantError(f"--text: file not found: {text_path}")
    model, tok = _load_any(args.model)
    if tok is None:
        raise SdquantError(f"{args.model}: no tokenizer found to evaluate text with")
    t0 = time.perf_counter()
    r = perplexity(model, tok, text_path.read_text(encoding="utf-8", errors="replace"), seq_len=args.seq_len,
                   windows=args.windows)
    print(f"perplexity {r['ppl']:.4f}  ({r.get('windows')} windows x {args.seq_len} tokens, "
          f"{time.perf_counter() - t0:.1f} s)")
    return EXIT_OK


def _load_any(spec: str):
    import sdquant
    from sdquant.config import ModelConfig
    from sdquant.models.hf import load_model
    p = Path(spec)
    if p.suffix == ".sd2":
        if not p.is_file():
            raise SdquantError(f"{p}: file not found")
        m = sdquant.load(p, device="cpu")
        return m, getattr(m, "tokenizer", None)
    if p.exists():
        return load_model(ModelConfig(kind="auto", path=str(p)))
    return load_model(ModelConfig(kind="builtin", name=spec))


def cmd_tune(args) -> int:
    from sdquant.kernels import dispatch
    if not hasattr(dispatch, "measure_crossovers"):
        raise SdquantError("tune-kernels: this build has no crossover measurement")
    if args.budget_s is not None and args.budget_s <= 0:
        raise ConfigError("--budget-s", f"must be positive, got {args.budget_s}")
    dispatch.measure_crossovers(args.output, budget_s=args.budget_s, resume=args.resume)
    print(f"wrote {args.output}; SDQUANT_KERNEL_TABLE={args.output} makes quantized layers plan from it")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
