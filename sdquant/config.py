"""Typed, frozen configuration. Loaded from YAML, overridden with ``--set a.b=c``, written back to YAML.

Every invalid value raises ``ConfigError`` whose message starts with the dotted field path, e.g.
``quant.activation_scaling.ratio_range: [0.5, 1.2] lies outside the allowed [0.8, 1.2]``.
Checks that need the model (a group size that does not divide a layer's in_features) live in
``validate_against_model``, called once the model is loaded.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Optional, Tuple

import yaml

from sdquant.errors import ConfigError

RATIO_LIMITS = (0.8, 1.2)


@dataclass(frozen=True)
class ModelConfig:
    # hf: a Hugging Face folder (config.json + (sharded) safetensors); gguf: a .gguf file (transformers+gguf);
    # builtin: a named model that needs no download (see sdquant.models.builtin); seedance: a Seedance DiT folder
    kind: Literal["auto", "hf", "gguf", "builtin", "seedance"] = "auto"
    path: Optional[str] = None
    name: Optional[str] = None          # builtin name, e.g. "smollm2-135m" or "tiny-llama"
    tokenizer: Optional[str] = None     # defaults to the model folder / gguf file


@dataclass(frozen=True)
class DataConfig:
    kind: Literal["builtin", "text", "jsonl", "hf_disk", "parquet", "self", "tensors", "diffusion"] = "builtin"
    path: Optional[str] = None
    field: str = "text"
    n_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    split: Optional[str] = None                     # hf_disk: which split (default "train" or the only one)
    sampling: Literal["random", "packed"] = "random"  # random starts (the GPTQ/AWQ protocol) or disjoint windows
    temperature: float = 1.0                        # kind "self": sampling temperature
    top_k: int = 50                                 # kind "self": 0 = whole vocabulary


@dataclass(frozen=True)
class AwqConfig:
    grid: int = 20                 # number of alpha values tried in [0, 1)
    duo_scaling: bool = True       # s = x^a / w^(1-a) (True) or s = x^a (False)
    clip_search: bool = True
    clip_grid: int = 20
    clip_max_shrink: float = 0.5
    max_tokens: int = 8192         # tokens kept per scaling group for the search (memory bound)
    clip_for_gptq: bool = False    # also hand AWQ's clipping ratios to GPTQ (off: GPTQ fits its own range)


@dataclass(frozen=True)
class ActivationScalingConfig:
    per_channel: bool = True
    init_ratio: float = 1.0
    ratio_range: Tuple[float, float] = RATIO_LIMITS
    granularity: int = 1           # input channels that share one multiplier; must divide quant.group_size
    method: Literal["ste", "bucket"] = "ste"   # Adam through a straight-through quantizer, or bucketed search
    steps: int = 8                 # STE steps per scaling group


@dataclass(frozen=True)
class Fp8Config:
    activations: Literal["dynamic", "static"] = "dynamic"
    weights: Literal["channel", "tensor"] = "channel"   # weight scales per output channel, or one per tensor
    smoothing: bool = False        # SmoothQuant-style migration of activation range into the weights
    smooth_alpha: float = 0.5


@dataclass(frozen=True)
class OverrideConfig:
    pattern: str = ""
    method: Optional[Literal["rtn", "awq", "gptq", "awq+gptq", "fp8", "keep"]] = None
    bits: Optional[int] = None
    group_size: Optional[int] = None
    symmetric: Optional[bool] = None


@dataclass(frozen=True)
class QuantConfig:
    method: Literal["rtn", "awq", "gptq", "awq+gptq", "fp8"] = "awq+gptq"
    bits: int = 4
    group_size: int = 128          # -1 = one scale per output channel
    symmetric: bool = False
    act_order: Literal["none", "static", "group"] = "static"
    damp: float = 0.01
    damp_max: float = 1.0
    gptq_block_size: int = 128
    gptq_mse_grid: int = 10        # per-group MSE range search inside GPTQ (0 = plain min/max)
    true_sequential: bool = True
    awq: AwqConfig = AwqConfig()
    activation_scaling: ActivationScalingConfig = ActivationScalingConfig()
    fp8: Fp8Config = Fp8Config()
    ignore: Tuple[str, ...] = ()   # regexes of layers kept in high precision (on top of the adapter's defaults)
    overrides: Tuple[OverrideConfig, ...] = ()


@dataclass(frozen=True)
class PipelineConfig:
    batch_size: int = 8            # calibration samples per block forward
    offload: Literal["cpu", "none"] = "cpu"   # where blocks wait while not being calibrated
    memory_budget_gb: Optional[float] = None  # device memory the walker may use; batches shrink to fit
    work_dir: Optional[str] = None            # per-block results for --resume (default: <output>.work)
    progress: bool = True


@dataclass(frozen=True)
class RuntimeConfig:
    kernels: Literal["auto", "cuda", "triton", "torch", "reference"] = "auto"
    compile: bool = False


@dataclass(frozen=True)
class ReportConfig:
    prompt: Optional[str] = "The capital of France is"
    max_new_tokens: int = 24
    eval_text: Optional[str] = None
    eval_seq_len: int = 512
    eval_windows: int = 8


@dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    quant: QuantConfig = QuantConfig()
    pipeline: PipelineConfig = PipelineConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    report: ReportConfig = ReportConfig()
    device: str = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    output: Optional[str] = None

    def to_dict(self) -> dict:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **overrides) -> "Config":
        """Return a copy with dotted-path overrides applied, e.g. replace(**{"quant.bits": 3})."""
        d = self.to_dict()
        for k, v in overrides.items():
            _set_path(d, k, v)
        return from_dict(d)


# --------------------------------------------------------------------------------------------- parsing
def _to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(x) for x in obj]
    return obj


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (tuple, Tuple):
        return "a list"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp, path: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(path, f"{value!r} is not {_type_name(tp)}{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__} {value!r}")
        return _build(tp, value, path)
    if origin in (tuple, Tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(path, f"expected a list of {len(args)} values, got {len(value)}")
        return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    return value


def _build(cls, data: dict, path: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in data.items():
        p = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(p, f"unknown key{hint}")
        kwargs[key] = _convert(value, hints[key], p)
    return cls(**kwargs)


def from_dict(data: Optional[dict]) -> Config:
    cfg = _build(Config, data or {}, "")
    validate(cfg)
    return cfg


def _parse_scalar(text: str):
    # YAML rules for --set values: 3 -> int, 0.5 -> float, true -> bool, [0.8, 1.1] -> list, null -> None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_path(d: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    cur = d
    for i, part in enumerate(parts[:-1]):
        nxt = cur.get(part)
        if nxt is None:
            nxt = cur[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(".".join(parts[: i + 1]), f"is not a section, cannot set {dotted}")
        cur = nxt
    cur[parts[-1]] = value


def parse_overrides(items) -> dict:
    out = {}
    for item in items or ():
        if "=" not in item:
            raise ConfigError("--set", f"expected key.path=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = _parse_scalar(v)
    return out


def load_config(path: Optional[str | os.PathLike] = None, overrides=None) -> Config:
    """Load a YAML file (or the defaults when path is None) and apply overrides ({dotted: value} or
    ["a.b=c", ...]). Relative paths inside the file are resolved against the working directory."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("--config", f"file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError("--config", f"{p} is not valid YAML{where}") from None
        if not isinstance(data, dict):
            raise ConfigError("--config", f"{p} must hold a mapping at the top level")
    if isinstance(overrides, (list, tuple)):
        overrides = parse_overrides(overrides)
    for k, v in (overrides or {}).items():
        _set_path(data, k, v)
    return from_dict(data)


# ------------------------------------------------------------------------------------------ validation
def _check_pattern(path: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(path, f"invalid regular expression {pattern!r}: {e}") from None


def _check_bits_group(path: str, bits: Optional[int], group_size: Optional[int]) -> None:
    if bits is not None and bits not in (2, 3, 4, 8):
        raise ConfigError(f"{path}.bits", f"{bits} is not supported (choose 2, 3, 4 or 8)")
    if group_size is not None and group_size != -1 and (group_size < 8 or group_size % 8):
        raise ConfigError(f"{path}.group_size", f"{group_size} must be -1 (per channel) or a positive "
                                                f"multiple of 8")


def validate(cfg: Config) -> None:
    q = cfg.quant
    _check_bits_group("quant", q.bits, q.group_size)
    if not 0 < q.damp <= 1:
        raise ConfigError("quant.damp", f"{q.damp} must lie in (0, 1]")
    if not q.damp <= q.damp_max <= 10:
        raise ConfigError("quant.damp_max", f"{q.damp_max} must lie in [quant.damp={q.damp}, 10]")
    if q.gptq_block_size < 1:
        raise ConfigError("quant.gptq_block_size", f"{q.gptq_block_size} must be >= 1")
    if q.act_order == "group" and q.method in ("rtn", "awq", "fp8"):
        raise ConfigError("quant.act_order", f"'group' needs a GPTQ method, not {q.method!r}")
    a = q.awq
    for name in ("grid", "clip_grid", "max_tokens"):
        if getattr(a, name) < 1:
            raise ConfigError(f"quant.awq.{name}", f"{getattr(a, name)} must be >= 1")
    if not 0 < a.clip_max_shrink < 1:
        raise ConfigError("quant.awq.clip_max_shrink", f"{a.clip_max_shrink} must lie in (0, 1)")
    s = q.activation_scaling
    lo, hi = s.ratio_range
    if lo > hi:
        raise ConfigError("quant.activation_scaling.ratio_range", f"[{lo}, {hi}] is empty (low > high)")
    if lo < RATIO_LIMITS[0] or hi > RATIO_LIMITS[1]:
        raise ConfigError("quant.activation_scaling.ratio_range",
                          f"[{lo}, {hi}] lies outside the allowed [{RATIO_LIMITS[0]}, {RATIO_LIMITS[1]}]")
    if not lo <= s.init_ratio <= hi:
        raise ConfigError("quant.activation_scaling.init_ratio", f"{s.init_ratio} lies outside ratio_range "
                                                                 f"[{lo}, {hi}]")
    if s.steps < 1:
        raise ConfigError("quant.activation_scaling.steps", f"{s.steps} must be >= 1")
    if q.gptq_mse_grid < 0:
        raise ConfigError("quant.gptq_mse_grid", f"{q.gptq_mse_grid} must be >= 0")
    if s.granularity < 1:
        raise ConfigError("quant.activation_scaling.granularity", f"{s.granularity} must be >= 1")
    if s.granularity > 1 and q.group_size != -1 and q.group_size % s.granularity:
        raise ConfigError("quant.activation_scaling.granularity",
                          f"{s.granularity} channels per scale does not line up with quant.group_size "
                          f"{q.group_size} (it must divide it)")
    if not 0 <= q.fp8.smooth_alpha <= 1:
        raise ConfigError("quant.fp8.smooth_alpha", f"{q.fp8.smooth_alpha} must lie in [0, 1]")
    for i, pat in enumerate(q.ignore):
        _check_pattern(f"quant.ignore[{i}]", pat)
    for i, o in enumerate(q.overrides):
        if not o.pattern:
            raise ConfigError(f"quant.overrides[{i}].pattern", "is required")
        _check_pattern(f"quant.overrides[{i}].pattern", o.pattern)
        _check_bits_group(f"quant.overrides[{i}]", o.bits, o.group_size)
    d = cfg.data
    if d.n_samples < 1:
        raise ConfigError("data.n_samples", f"{d.n_samples} must be >= 1")
    if d.temperature <= 0:
        raise ConfigError("data.temperature", f"{d.temperature} must be > 0")
    if d.top_k < 0:
        raise ConfigError("data.top_k", f"{d.top_k} must be >= 0 (0 = whole vocabulary)")
    if d.seq_len < 2:
        raise ConfigError("data.seq_len", f"{d.seq_len} must be >= 2")
    if d.kind in ("text", "jsonl", "hf_disk", "parquet", "tensors") and not d.path:
        raise ConfigError("data.path", f"is required for data.kind {d.kind!r}")
    if d.path and d.kind != "builtin" and not Path(d.path).exists():
        raise ConfigError("data.path", f"file not found: {d.path}")
    m = cfg.model
    if m.kind == "builtin" and not m.name:
        raise ConfigError("model.name", "is required for model.kind 'builtin'")
    if m.kind in ("hf", "gguf", "seedance") and not m.path:
        raise ConfigError("model.path", f"is required for model.kind {m.kind!r}")
    if m.kind == "auto" and not (m.path or m.name):
        raise ConfigError("model", "set model.path (a folder or .gguf file) or model.name (a builtin model)")
    if m.path and not Path(m.path).exists() and m.kind != "builtin":
        raise ConfigError("model.path", f"not found: {m.path}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", cfg.device):
        raise ConfigError("device", f"{cfg.device!r} is not a device (auto, cpu, cuda, cuda:N)")
    if cfg.pipeline.batch_size < 1:
        raise ConfigError("pipeline.batch_size", f"{cfg.pipeline.batch_size} must be >= 1")
    if cfg.pipeline.memory_budget_gb is not None and cfg.pipeline.memory_budget_gb <= 0:
        raise ConfigError("pipeline.memory_budget_gb", f"{cfg.pipeline.memory_budget_gb} must be > 0")
    if cfg.report.max_new_tokens < 0:
        raise ConfigError("report.max_new_tokens", "must be >= 0")


def validate_against_model(cfg: Config, layer_shapes: dict[str, tuple[int, int]], spec_for) -> None:
    """Model-dependent checks: every layer that will be quantized must accept its (bits, group_size).
    ``layer_shapes``: name -> (out_features, in_features); ``spec_for(name)`` -> LayerSpec or None (kept)."""
    for name, (n, k) in layer_shapes.items():
        spec = spec_for(name)
        if spec is None or spec.method == "fp8":
            continue
        gs = spec.group_size
        field_path = spec.source or "quant.group_size"
        if gs != -1 and k % gs:
            raise ConfigError(field_path, f"{gs} does not divide in_features {k} of layer {name}")
        if (k * spec.bits) % 8:
            raise ConfigError(spec.source_bits or "quant.bits",
                              f"{spec.bits} bits x in_features {k} of layer {name} is not whole bytes")


@dataclass(frozen=True)
class LayerSpec:
    """How one linear is quantized, after ignore patterns and per-layer overrides."""
    method: str
    bits: int
    group_size: int
    symmetric: bool
    source: Optional[str] = None        # config field the group size came from (for error messages)
    source_bits: Optional[str] = None


def layer_spec(q: QuantConfig, name: str, keep: Tuple[str, ...] = ()) -> Optional[LayerSpec]:
    """The LayerSpec for a layer, or None when it stays in high precision. ``keep`` are the adapter's
    default keep-patterns; ``quant.ignore`` adds to them; overrides apply in order (later ones win), and an
    override with ``method: keep`` keeps the layer."""
    if any(re.search(p, name) for p in (*keep, *q.ignore)):
        return None
    method, bits, gs, sym = q.method, q.bits, q.group_size, q.symmetric
    src, src_bits = "quant.group_size", "quant.bits"
    for i, o in enumerate(q.overrides):
        if not re.search(o.pattern, name):
            continue
        if o.method is not None:
            method = o.method
        if o.bits is not None:
            bits, src_bits = o.bits, f"quant.overrides[{i}].bits"
        if o.group_size is not None:
            gs, src = o.group_size, f"quant.overrides[{i}].group_size"
        if o.symmetric is not None:
            sym = o.symmetric
    if method == "keep":
        return None
    return LayerSpec(method, bits, gs, sym, src, src_bits)
