"""The .sd2 deployable package: public API (spec: docs/FORMAT.md).

    write_sd2(path, *, family, arch_config, float_tensors, quant_layers, extra_files=None, calibration=None,
              high_precision=(), tied=None) -> Path
        float_tensors: Iterable[(name, Tensor)]; quant_layers: Iterable[(module name, QuantizedWeight |
        Fp8Weight, bias | None, smooth | None)]; extra_files: {name: bytes | path}; tied: {name: name} declared
        ties (``declared_ties(model)``). Streams: iterators are consumed one item at a time and written straight
        to a temporary file that is renamed at the end. Tied tensors (shared memory, or declared and equal)
        are stored once and recorded as aliases.
    open_sd2(path, verify="full" | "lazy" | "none") -> Package
        .manifest .family .arch_config .calibration .high_precision .aliases ({alias: stored name})
        .float_tensors(device=None) -> {name: Tensor}          zero-copy mmap views on the CPU; an alias
                                                                 is the same tensor object as its target
        .quant_layers(device=None) -> {name: (weight, bias, smooth)}
        .tensor(name) / .layer(name)                            one item (lazy verification per member)
        .files() / .file(name) -> bytes
        .verify() -> [problem, ...]   .close()   context manager
    inspect_sd2(path) -> dict          format_inspect(info) -> str (the table `sdquant inspect` prints)
    verify_sd2(path) -> [problem, ...] (empty list = every hash, header and shape checks out)
    package_aliases(path) -> {alias: target}    tie_aliases(model, aliases): re-tie a loaded model

Every malformed, corrupt, hostile or unsupported file raises ``sdquant.errors.PackageError`` with one line
naming the member, layer or tensor.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from sdquant.errors import PackageError
from sdquant.export.sd2_format import FORMAT_VERSION
from sdquant.export.sd2_reader import Package, open_sd2
from sdquant.export.sd2_writer import declared_ties, write_sd2

__all__ = ["write_sd2", "open_sd2", "Package", "inspect_sd2", "verify_sd2", "format_inspect", "FORMAT_VERSION",
           "declared_ties", "package_aliases", "tie_aliases"]


def _scheme_str(s: dict) -> str:
    if s["type"] == "int":
        g = "per-channel" if s["group_size"] == -1 else f"g{s['group_size']}"
        return (f"int{s['bits']} {g} {'sym' if s['symmetric'] else 'asym'}"
                + (" act-order" if s["act_order"] else ""))
    return f"fp8 e4m3 {'static' if s['activation'] == 'static' else 'dynamic'}"


def _per_layer_losses(cal: dict) -> dict[str, float]:
    """Per-layer losses from the calibration report (docs/FORMAT.md §5.6): ``per_layer: {layer: {"loss": x}}``
    or ``{layer: x}``, or the row list ``layers: [{"layer": name, "loss": x}, ...]``."""
    pairs = []
    src = cal.get("per_layer")
    if isinstance(src, dict):
        pairs += list(src.items())
    rows = cal.get("layers")
    if isinstance(rows, list):
        pairs += [(r.get("layer", r.get("name")), r) for r in rows if isinstance(r, dict)]
    out = {}
    for k, v in pairs:
        if isinstance(v, dict):
            v = v.get("loss")
        if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
    return out


def inspect_sd2(path) -> dict:
    """Summary of a package (structure, manifest and headers are validated; hashes are not computed)."""
    with open_sd2(path, verify="none") as pkg:
        man = pkg.manifest
        losses = _per_layer_losses(man["calibration"])
        layers, schemes = [], {}
        qbytes, orig = 0, 0
        for name, e in man["layers"].items():
            member = pkg.members[e["member"]]
            s = _scheme_str(e["scheme"])
            schemes[s] = schemes.get(s, 0) + 1
            nk = e["in_features"] * e["out_features"]
            extra = sum(math.prod(t["shape"]) * 2 for k, t in e["tensors"].items() if k in ("bias", "smooth"))
            orig += nk * 2 + extra
            qbytes += member.size
            layers.append({"name": name, "scheme": s, "shape": [e["out_features"], e["in_features"]],
                           "bytes": member.size, "bf16_bytes": nk * 2 + extra, "loss": losses.get(name)})
        fbytes = sum(pkg.members[e["member"]].size for e in man["float_tensors"].values())
        fnum = sum(math.prod(e["shape"]) for e in man["float_tensors"].values())
        orig += 2 * fnum
        size = pkg.path.stat().st_size
        cal = man["calibration"]
        return {
            "path": str(pkg.path), "file_bytes": size, "format_version": man["format_version"],
            "sdquant_version": man["sdquant_version"], "family": man["family"],
            "n_layers": len(layers), "schemes": schemes, "layers": layers,
            "n_float_tensors": len(man["float_tensors"]), "float_bytes": fbytes, "quant_bytes": qbytes,
            "high_precision": man["high_precision"], "files": man["files"], "aliases": pkg.aliases,
            "bf16_bytes": orig, "compression_ratio": orig / size if size else float("nan"),
            "calibration": {"method": cal.get("method"), "metrics": cal.get("metrics", {})},
        }


def verify_sd2(path) -> list[str]:
    """Every problem found in a package; [] when every hash, header and shape checks out and the runtime section
    the loader reads (``runtime_preference``) is well formed."""
    try:
        with open_sd2(path, verify="none") as pkg:
            problems = pkg.verify()
            try:
                runtime_preference(pkg.calibration)
            except PackageError as e:
                problems.append(str(e))
            return problems
    except PackageError as e:
        return [str(e)]


def runtime_preference(calibration: dict) -> tuple:
    """(kernels, compile) a package asks for: its calibration config's ``runtime`` section (``sdquant.load`` applies
    it on a GPU). Packages written before the section existed, or by other tools, ask for ("auto", False). A malformed
    section is a PackageError."""
    from typing import get_args, get_type_hints

    from sdquant.config import RuntimeConfig
    where = "manifest.json calibration.config.runtime"
    cfg = calibration.get("config") if isinstance(calibration, dict) else None
    rt = cfg.get("runtime", {}) if isinstance(cfg, dict) else {}
    if not isinstance(rt, dict):
        raise PackageError(f"{where}: expected an object, got {type(rt).__name__}")
    kernels, comp = rt.get("kernels", "auto"), rt.get("compile", False)
    modes = get_args(get_type_hints(RuntimeConfig)["kernels"])
    if kernels not in modes:
        raise PackageError(f"{where}.kernels: {str(kernels)[:40]!r} is not one of {', '.join(modes)}")
    if not isinstance(comp, bool):
        raise PackageError(f"{where}.compile: expected true or false, got {str(comp)[:40]!r}")
    return kernels, comp


def _mb(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n} B"


def format_inspect(info: dict, max_layers: int = 40) -> str:
    """Plain-text table for ``sdquant inspect`` (at most ``max_layers`` layer rows; 0 = all)."""
    lines = [f"{info['path']}  (sd2 v{info['format_version']}, sdquant {info['sdquant_version']}, "
             f"family {info['family']})",
             f"size {_mb(info['file_bytes'])}  vs bf16 {_mb(info['bf16_bytes'])}  -> "
             f"compression {info['compression_ratio']:.2f}x",
             f"{info['n_layers']} quantized layers ({_mb(info['quant_bytes'])}), {info['n_float_tensors']} "
             f"high-precision tensors ({_mb(info['float_bytes'])})"]
    for s, c in sorted(info["schemes"].items()):
        lines.append(f"  {c:5d} x {s}")
    rows = info["layers"] if not max_layers else info["layers"][:max_layers]
    if rows:
        w = max(len("layer"), *(len(r["name"]) for r in rows))
        lines.append("")
        lines.append(f"{'layer':<{w}}  {'scheme':<24} {'shape':>14} {'size':>11} {'ratio':>6} {'loss':>10}")
        for r in rows:
            shape = "x".join(map(str, r["shape"]))
            loss = "" if r["loss"] is None else f"{r['loss']:.4g}"
            lines.append(f"{r['name']:<{w}}  {r['scheme']:<24} {shape:>14} {_mb(r['bytes']):>11} "
                         f"{r['bf16_bytes'] / max(r['bytes'], 1):>5.2f}x {loss:>10}")
        if len(rows) < len(info["layers"]):
            lines.append(f"... {len(info['layers']) - len(rows)} more layers")
    cal = info["calibration"]
    if cal.get("method") or cal.get("metrics"):
        lines.append("")
        lines.append(f"calibration: {cal.get('method') or '?'}")
        metrics = cal.get("metrics") if isinstance(cal.get("metrics"), dict) else {}
        for k, v in metrics.items():
            lines.append(f"  {k}: {v:.6g}" if isinstance(v, float) else f"  {k}: {v}")
    if info.get("aliases"):
        lines.append("")
        n = len(info["aliases"])
        lines.append(f"tied tensors stored once ({n} alias{'es' if n != 1 else ''}):")
        for a, t in info["aliases"].items():
            lines.append(f"  {a} -> {t}")
    if info["files"]:
        lines.append("files: " + ", ".join(info["files"]))
    return "\n".join(lines)


def package_aliases(path) -> dict[str, str]:
    """{alias: stored float tensor} of a package (validated; hashes are not computed)."""
    with open_sd2(path, verify="none") as pkg:
        return pkg.aliases


def tie_aliases(model: torch.nn.Module, aliases: dict[str, str]) -> None:
    """Make each alias parameter (or buffer) of a loaded model the very object of its target, as when the
    package was written: a tied lm_head becomes the embedding's Parameter again, not an equal copy, so it
    stays tied through ``.to()`` and training."""
    for alias, target in aliases.items():
        mod_name, _, leaf = alias.rpartition(".")
        tmod_name, _, tleaf = target.rpartition(".")
        try:
            mod, src = model.get_submodule(mod_name), getattr(model.get_submodule(tmod_name), tleaf)
        except AttributeError:
            raise PackageError(f"alias {alias!r}: the model has no {alias!r} or {target!r} to tie") from None
        if leaf in mod._parameters and isinstance(src, torch.nn.Parameter):
            setattr(mod, leaf, src)
        elif leaf in mod._buffers and isinstance(src, torch.Tensor) and not isinstance(src, torch.nn.Parameter):
            mod._buffers[leaf] = src
        else:
            raise PackageError(f"alias {alias!r}: not a parameter or buffer of the same kind as {target!r}")
