"""The public verbs: calibrate, export, load (and compile). The CLI is a thin layer over these.

    import sdquant
    result = sdquant.calibrate(config="templates/quickstart.yaml", progress=False)
    sdquant.export(result, "model.sd2")
    model = sdquant.load("model.sd2", device="cpu")

No global state, no printing (progress bars only when ``progress=True``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from sdquant.config import Config, from_dict, layer_spec, load_config, validate_against_model
from sdquant.errors import ConfigError, SdquantError

log = logging.getLogger("sdquant")


@dataclass
class CalibrationResult:
    """Everything calibration produced. ``model`` holds the folded scales and dequantized weights (a
    fake-quantized float model, handy for evaluation); ``weights`` the canonical quantized tensors."""
    model: nn.Module
    config: Config
    weights: dict                                  # name -> QuantizedWeight | Fp8Weight
    smooth: dict = field(default_factory=dict)     # name -> [K] explicit divisors
    rows: list = field(default_factory=list)       # per-layer table
    scales: dict = field(default_factory=dict)
    tokenizer: Any = None
    family: str = ""
    data_fingerprint: str = ""
    seconds: float = 0.0
    size_before: int = 0                           # bytes of the float linears that were quantized
    size_after: int = 0
    metrics: dict = field(default_factory=dict)
    peak_device_bytes: int = 0
    resumed_blocks: int = 0

    def quantized_model(self) -> nn.Module:
        """The model with QuantLinear/Fp8Linear modules in place of the quantized linears (in place)."""
        from sdquant.models.hf import replace_linears
        return replace_linears(self.model, self.weights, self.smooth)

    def report(self) -> dict:
        return {"method": self.config.quant.method, "config": self.config.to_dict(), "layers": self.rows,
                "data_fingerprint": self.data_fingerprint, "seconds": self.seconds,
                "size_before": self.size_before, "size_after": self.size_after, "metrics": self.metrics,
                "scales": self.scales}


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{name} requested but CUDA is not available on this machine")
    return torch.device(name)


def _as_config(config) -> Config:
    if config is None:
        raise ConfigError("config", "a Config, a dict or a YAML path is required")
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return from_dict(config)
    return load_config(config)


def calibrate(model: Optional[nn.Module] = None, config: Union[Config, dict, str, Path, None] = None,
              data=None, *, tokenizer=None, progress: Union[bool, Callable] = False,
              resume: bool = False, work_dir: Optional[Union[str, Path]] = None,
              stop_after: Optional[int] = None) -> CalibrationResult:
    """Quantize a model. ``model`` may be None (loaded from config.model); ``data`` may be None (loaded
    from config.data), a CalibrationData, a LongTensor [n, seq] of token ids or a list of batches."""
    from sdquant.calibrate.pipeline import fingerprint_of, run_pipeline
    from sdquant.models.adapters import get_adapter
    from sdquant.models.hf import convert_conv1d, linear_shapes, load_model, torch_dtype

    from sdquant.calibrate import distributed

    cfg = _as_config(config)
    t0 = time.perf_counter()
    dist = distributed.current()          # an initialised torch.distributed group means data parallel
    device = distributed.rank_device(_resolve_device(cfg.device), dist)
    dtype = torch_dtype(cfg.dtype, str(device))
    if model is None:
        model, tok = load_model(cfg.model, dtype)
        tokenizer = tokenizer or tok
    model.eval()
    convert_conv1d(model)
    adapter = get_adapter(model)
    shapes = linear_shapes(model, adapter.blocks)
    validate_against_model(cfg, shapes, lambda n: layer_spec(cfg.quant, n, adapter.keep))
    batches, data_fp = _batches(cfg, data, tokenizer, model)
    fp = fingerprint_of(model, data_fp, cfg.quant)
    batches = dist.shard(batches)
    if not batches:
        raise ConfigError("data.n_samples", f"{dist.world} ranks but too few calibration batches to give each "
                                            f"one (lower pipeline.batch_size)")
    if work_dir is None and cfg.pipeline.work_dir:
        work_dir = cfg.pipeline.work_dir
    if work_dir is None and resume:
        if not cfg.output:
            raise ConfigError("pipeline.work_dir", "--resume needs pipeline.work_dir or output to be set")
        work_dir = str(cfg.output) + ".work"
    cb = _progress_callback(progress)
    pres = run_pipeline(model, adapter, batches, cfg.quant, device=device,
                        work_dir=Path(work_dir) if work_dir else None, fingerprint=fp, resume=resume,
                        progress=cb if dist.is_main else None, stop_after=stop_after, dist=dist)
    if cb is not None and hasattr(cb, "close"):
        cb.close()
    size_before = sum(shapes[n][0] * shapes[n][1] for n in pres.weights) * torch.finfo(dtype).bits // 8
    size_after = sum(w.nbytes() for w in pres.weights.values())
    family = getattr(getattr(model, "config", None), "model_type", None) or adapter.family
    return CalibrationResult(model, cfg, pres.weights, pres.smooth, pres.rows, pres.scales, tokenizer, family,
                             data_fp, time.perf_counter() - t0, size_before, size_after,
                             peak_device_bytes=pres.peak_device_bytes, resumed_blocks=pres.resumed_blocks)


def _batches(cfg: Config, data, tokenizer, model):
    """Normalise calibration data into a list of batches (LongTensor [b, seq] or dicts of tensors)."""
    import hashlib
    bs = cfg.pipeline.batch_size
    if data is None and cfg.data.kind == "diffusion":
        # denoiser inputs: taken from the file, or captured along sampler trajectories when it holds only
        # conditioning embeddings (timesteps stratified across the schedule)
        from sdquant.models.seedance_sampler import diffusion_inputs
        data = diffusion_inputs(model, cfg.data.path, cfg.data.n_samples, cfg.data.seed)
    if isinstance(data, dict):
        n = next(iter(data.values())).shape[0]
        data = [{k: v[i:i + bs] for k, v in data.items()} for i in range(0, n, bs)]
    if data is None:
        from sdquant.data import load_calibration
        data = load_calibration(cfg.data, tokenizer=tokenizer, model=model)
    if isinstance(data, torch.Tensor):
        fp = hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()
        return list(data.split(bs)), fp
    if isinstance(data, (list, tuple)):
        h = hashlib.sha256()
        for b in data:
            for t in (b.values() if isinstance(b, dict) else [b]):
                if isinstance(t, torch.Tensor):
                    h.update(t.detach().float().cpu().numpy().tobytes())
        return list(data), h.hexdigest()
    # a CalibrationData from sdquant.data
    fp = getattr(data, "fingerprint", "")
    if callable(fp):
        fp = fp()
    return list(data.batches(bs)), fp


class _Bar:
    def __init__(self):
        self.bar = None

    def __call__(self, what, i, n):
        if self.bar is None:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=n, desc=f"calibrating {what}", unit="block")
        self.bar.update(i - self.bar.n)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _progress_callback(progress):
    if progress is True:
        return _Bar()
    if callable(progress):
        return progress
    return None


# ------------------------------------------------------------------------------------------- export
def export(result: CalibrationResult, path: Union[str, Path], format: str = "sd2", **kwargs) -> Path:
    """Write a calibration result: ``sd2`` (the deployable package), ``onnx`` (a folder), ``gptq`` or
    ``awq`` (Hugging Face checkpoint folders)."""
    path = Path(path)
    if format == "sd2":
        return _export_sd2(result, path)
    if format == "onnx" and result.family == "seedance":
        from sdquant.export.onnx_module import export_seedance_onnx
        return export_seedance_onnx(result.quantized_model(), path / "model.onnx", **kwargs)
    if format == "onnx":
        from sdquant.export import onnx as onnx_export
        return onnx_export.export_onnx(result.quantized_model(), path, tokenizer=result.tokenizer, **kwargs)
    if format in ("gptq", "awq"):
        from sdquant.export import hf as hf_export
        return hf_export.export_checkpoint(result, path, format=format, **kwargs)
    raise ConfigError("--format", f"{format!r} is not supported (sd2, onnx, gptq, awq)")


def _arch_config(model: nn.Module) -> dict:
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise SdquantError(f"{type(model).__name__} has no config to package")
    import json
    # through JSON so that every key is a string (HF configs hold int-keyed id2label maps)
    d = json.loads(cfg.to_json_string(use_diff=False)) if hasattr(cfg, "to_json_string") \
        else dataclasses.asdict(cfg)
    for k in ("quantization_config", "_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        d.pop(k, None)
    return d


def _export_sd2(result: CalibrationResult, path: Path) -> Path:
    from sdquant.export.sd2 import declared_ties, write_sd2
    from sdquant.models.hf import tokenizer_files

    model = result.model
    qnames = set(result.weights)

    def float_tensors():
        for name, t in model.state_dict(keep_vars=False).items():
            mod, _, leaf = name.rpartition(".")
            if mod in qnames and leaf in ("weight", "bias"):
                continue
            yield name, t

    def quant_layers():
        for name, w in result.weights.items():
            bias = getattr(model.get_submodule(name), "bias", None)
            yield name, w, (bias.detach() if isinstance(bias, torch.Tensor) else None), result.smooth.get(name)

    from sdquant.models.adapters import get_adapter
    adapter = get_adapter(model)
    high = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in qnames]
    return write_sd2(path, family=result.family, arch_config=_arch_config(model),
                     float_tensors=float_tensors(), quant_layers=quant_layers(),
                     extra_files=tokenizer_files(result.tokenizer), calibration=result.report(),
                     high_precision=high, tied=declared_ties(model))


# --------------------------------------------------------------------------------------------- load
def load(path: Union[str, Path], device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None,
         kernels: Optional[str] = None, verify: str = "full", compile: Optional[bool] = None) -> nn.Module:
    """Load a .sd2 package into a runnable model (HF causal LM with ``generate``, or a Seedance DiT).
    The tokenizer, when packaged, is attached as ``model.tokenizer``.

    ``kernels`` / ``compile``: None takes the package's own ``runtime.kernels`` / ``runtime.compile`` (the calibration
    config's, e.g. a template's kernel preference) when loading onto a GPU; on a CPU "auto" (the reference ops) and
    no compile. A malformed runtime section is refused on either."""
    from sdquant.export.sd2 import open_sd2, runtime_preference

    device = torch.device(device)
    with open_sd2(path, verify=verify) as pkg:
        pref_kernels, pref_compile = runtime_preference(pkg.calibration)
        if device.type != "cuda":
            pref_kernels, pref_compile = "auto", False
        kernels = pref_kernels if kernels is None else kernels
        compile = pref_compile if compile is None else compile
        family = pkg.family
        arch = dict(pkg.arch_config)
        qlayers = pkg.quant_layers()
        floats, aliases = pkg.float_tensors(), pkg.aliases  # an alias is its target's tensor object
        files = {n: pkg.file(n) for n in pkg.manifest.get("files", {}) if str(n).startswith("tokenizer/")} \
            if hasattr(pkg, "file") else {}
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = _build_model(family, arch, dtype)
        _materialize(model, floats, qlayers, dtype, aliases)
    # quantized layers first: each copies its canonical tensors to the device only while it repacks them, so the
    # device never holds the whole model's canonical tensors and its layouts at once; then everything else
    _prepare_kernels(model, device, dtype, kernels)
    model.to(device)
    model.eval()
    if files:
        from sdquant.models.hf import tokenizer_from_files
        model.tokenizer = tokenizer_from_files(files)
    if compile:
        from sdquant.export import compile as _c
        model = _c.compile(model)
    return model


def _build_model(family: str, arch: dict, dtype: torch.dtype) -> nn.Module:
    if family == "seedance":
        from sdquant.models import seedance
        return seedance.build_empty(arch, dtype=dtype)
    from sdquant.models.hf import build_from_config, convert_conv1d
    model = build_from_config(arch, dtype)
    return convert_conv1d(model)


def _materialize(model: nn.Module, floats: dict, qlayers: dict, dtype: torch.dtype,
                 aliases: Optional[dict] = None) -> None:
    """Swap in quantized modules, then load the float tensors in place of the meta parameters."""
    from sdquant.models.hf import replace_linears
    weights = {n: v[0] for n, v in qlayers.items()}
    smooth = {n: v[2] for n, v in qlayers.items() if v[2] is not None}
    replace_linears(model, weights, smooth, dtype)
    for name, (_, bias, _) in qlayers.items():
        if bias is not None:
            model.get_submodule(name).bias = bias.to(dtype)
    # each tensor takes the dtype of the parameter it fills: layers a model keeps in fp32 on purpose
    # (Seedance's Cross-Gate Fusion gate) must not be rounded through the load dtype
    want = {k: t.dtype for k, t in list(model.named_parameters()) + list(model.named_buffers())}
    aliases = aliases or {}
    floats = {k: (v.to(want.get(k, dtype)) if v.is_floating_point() else v) for k, v in floats.items()
              if k not in aliases}
    floats.update({a: floats[t] for a, t in aliases.items()})  # a tied pair is converted once
    missing, unexpected = model.load_state_dict(floats, strict=False, assign=True)
    if unexpected:
        raise SdquantError(f"package holds tensors the model does not have: {unexpected[:5]}")
    from sdquant.export.sd2 import tie_aliases
    tie_aliases(model, aliases)  # the alias parameter IS its target's Parameter, as when it was written
    tied = _tie_if_needed(model)
    still_meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
                  if p.device.type == "meta"]
    if still_meta:
        raise SdquantError(f"package lacks tensors for: {still_meta[:5]}{' …' if len(still_meta) > 5 else ''}")


def _tie_if_needed(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if out is not None and inp is not None and isinstance(out, nn.Linear):
            out.weight = inp.weight
            return True
    return False


def _prepare_kernels(model: nn.Module, device, dtype, kernels: str) -> None:
    from sdquant.kernels.linear import Fp8Linear, QuantLinear
    for m in model.modules():
        if isinstance(m, (QuantLinear, Fp8Linear)) and hasattr(m, "prepare"):
            m.prepare(device=device, dtype=dtype, kernels=kernels)


def compile(model: nn.Module, **kwargs):  # noqa: A001 - the public verb mirrors torch.compile
    """torch.compile a (quantized) model; see sdquant.export.compile."""
    from sdquant.export import compile as _c
    return _c.compile(model, **kwargs)
