"""Hugging Face GPTQ / AWQ checkpoints in and out: the layouts the GPTQ/AWQ ecosystem (transformers, vLLM,
AutoGPTQ, GPTQModel, AutoAWQ) reads, converted losslessly to and from sdquant's canonical QuantizedWeight.

Layouts, for a linear with K input and N output features, G groups (N, K, G as in ``qtensor``):

GPTQ (AutoGPTQ "v1" = checkpoint_format "gptq"; GPTQModel "v2" = "gptq_v2")
    qweight int32 [K*bits/32, N]  codes packed along K: column n is the little-endian bit stream of
                                  code[n, 0..K) cut into 32-bit words (bits 2/4/8: word i holds k = i*32/bits
                                  + j at bit j*bits; bits 3: 32 codes span 3 words, codes 10 and 21 straddle)
    qzeros  int32 [G, N*bits/32]  zero points packed the same way along N; v1 stores zero - 1, v2 stores zero
    scales  fp16  [G, N]
    g_idx   int32 [K]             group of each input channel (k // group_size unless act-order)
    Because canonical qweight is also a little-endian bit stream along K, GPTQ's qweight is just its bytes
    read as int32 and transposed. v1 cannot hold a zero point of 0 (zero - 1 = -1 overflows the field; v1
    kernels add 1 back without masking), so exporting such a layer to v1 raises and suggests "gptq_v2".

AWQ (AutoAWQ GEMM, version "gemm", 4 bits only)
    qweight int32 [K, N/8]        codes packed along N: word c of row k holds output channels 8c + ORDER[i]
                                  in nibble i (bits 4i..4i+3), ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    qzeros  int32 [G, N/8]        zero points, same packing (always present: the GEMM kernel reads them)
    scales  fp16  [G, N]
    No g_idx: act-order weights cannot be expressed and raise. Symmetric weights are written with zero = 8
    and come back as symmetric (zeros=None) when every zero of a layer is 8 (numerically identical).

Testing (tests/export/test_hf.py): autoawq 0.2.9 installs here (``pip install --no-deps autoawq``) and its own
``WQLinear_GEMM.from_linear`` / ``dequantize_gemm`` are the AWQ reference. auto-gptq 0.7.1 installs but does
not import with transformers 5; its packer module (``nn_modules/qlinear/qlinear_cuda.py``, numpy/torch only) is
loaded by file path and is the GPTQ reference when available (``AUTOGPTQ_PATH=<pip --target dir>``, bits
2/3/4/8, act-order). Independently of both, the GPTQ layout is tested against fixtures written by hand from
the definition above (literal words, a big-integer bit-stream model, v1/v2 zero handling).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

from sdquant.errors import PackageError, ShapeError
from sdquant.quant.qtensor import Fp8Weight, QuantizedWeight, num_groups, pack_codes, unpack_codes

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # nibble i of a word holds output channel 8c + AWQ_ORDER[i]
AWQ_INVERSE = (0, 4, 1, 5, 2, 6, 3, 7)        # channel j sits in nibble AWQ_INVERSE[j]
GPTQ_FORMATS = ("gptq", "gptq_v2")


def _as_int32(packed_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] (C % 4 == 0) -> int32 [R, C/4], little-endian words (the layout every GPTQ/AWQ kernel
    assumes; torch views use the host order, which is little-endian on every platform torch supports)."""
    r, c = packed_u8.shape  # (flatten first: a size-1 dim may carry a stride that blocks .view)
    return packed_u8.contiguous().reshape(-1).view(torch.int32).reshape(r, c // 4)


def _as_u8(words: torch.Tensor) -> torch.Tensor:
    r, c = words.shape
    return words.contiguous().reshape(-1).view(torch.uint8).reshape(r, c * 4)


def _trivial_g_idx(k: int, group_size: int) -> torch.Tensor:
    gs = k if group_size in (-1, 0) else group_size
    return (torch.arange(k, dtype=torch.int32) // gs).to(torch.int32)


# ============================================================================================== GPTQ
def to_gptq(qw: QuantizedWeight, checkpoint_format: str = "gptq", name: str = "layer") -> dict[str, torch.Tensor]:
    """Canonical -> GPTQ tensors {qweight, qzeros, scales, g_idx}."""
    if checkpoint_format not in GPTQ_FORMATS:
        raise ShapeError(f"{name}: checkpoint_format must be one of {GPTQ_FORMATS}, got {checkpoint_format!r}")
    n, k, bits = qw.out_features, qw.in_features, qw.bits
    if (k * bits) % 32 or (n * bits) % 32:
        raise ShapeError(f"{name}: GPTQ packs 32-bit words: in_features {k} and out_features {n} times "
                         f"{bits} bits must be multiples of 32")
    qw = qw.to("cpu")
    zeros = qw.zeros.to(torch.int64) if qw.zeros is not None else torch.full(qw.scales.shape, 1 << (bits - 1))
    if checkpoint_format == "gptq":
        if bool((zeros == 0).any()):
            raise ShapeError(f"{name}: a zero point of 0 cannot be stored in the GPTQ v1 layout (it stores "
                             f"zero - 1); export with checkpoint_format='gptq_v2' or symmetric quantization")
        zeros = zeros - 1
    qzeros = _as_int32(pack_codes(zeros.t().contiguous(), bits))          # [G, N*bits/32]
    return {"qweight": _as_int32(qw.qweight).t().contiguous(),            # [K*bits/32, N]
            "qzeros": qzeros, "scales": qw.scales.t().contiguous().to(torch.float16),
            "g_idx": (qw.g_idx if qw.g_idx is not None else _trivial_g_idx(k, qw.group_size)).to(torch.int32)}


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: Optional[torch.Tensor],
              bits: int, group_size: int, sym: bool, checkpoint_format: str = "gptq",
              name: str = "layer") -> QuantizedWeight:
    """GPTQ tensors -> canonical QuantizedWeight (lossless)."""
    if bits not in (2, 3, 4, 8) or checkpoint_format not in GPTQ_FORMATS:
        raise PackageError(f"{name}: unsupported GPTQ bits={bits} / checkpoint_format={checkpoint_format!r}")
    for t, nm, dt in ((qweight, "qweight", torch.int32), (qzeros, "qzeros", torch.int32),
                      (scales, "scales", None)):
        if t.dim() != 2 or (dt is not None and t.dtype != dt):
            raise PackageError(f"{name}.{nm}: expected a 2-D {dt or 'float'} tensor, got {t.dtype} {list(t.shape)}")
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    g = scales.shape[0]
    gs = -1 if group_size in (-1, 0) else group_size
    if (qweight.shape[0] * 32) % bits or tuple(scales.shape) != (g, n) or g != num_groups(k, gs) \
            or (gs != -1 and k % gs) or tuple(qzeros.shape) != (g, n * bits // 32):
        raise PackageError(f"{name}: GPTQ shapes disagree (qweight {list(qweight.shape)}, qzeros "
                           f"{list(qzeros.shape)}, scales {list(scales.shape)}, bits {bits}, group_size {group_size})")
    zeros = unpack_codes(_as_u8(qzeros), bits, n).t().to(torch.int64)      # [N, G]
    if checkpoint_format == "gptq":
        zeros = zeros + 1  # what v1 kernels compute (no masking): a stored all-ones field means 2**bits
        if bits == 8 and bool((zeros > 255).any()):
            raise PackageError(f"{name}: v1 qzeros hold zero-1 = 255, i.e. zero 256, which 8-bit codes cannot use")
    if g_idx is not None:
        if tuple(g_idx.shape) != (k,):
            raise PackageError(f"{name}.g_idx: expected [{k}], got {list(g_idx.shape)}")
        g_idx = g_idx.to(torch.int32)
        if torch.equal(g_idx, _trivial_g_idx(k, gs)):
            g_idx = None
    zeros_u8 = zeros.to(torch.uint8)
    if sym and bool((zeros == (1 << (bits - 1))).all()):
        zeros_u8 = None
    try:
        return QuantizedWeight(_as_u8(qweight.t()), scales.t().contiguous().to(torch.float16), zeros_u8, bits, gs,
                               k, g_idx)
    except ShapeError as e:
        raise PackageError(f"{name}: {e}") from None


# ============================================================================================== AWQ
def _awq_pack(v: torch.Tensor) -> torch.Tensor:
    """[R, N] codes -> int32 [R, N/8] in AWQ's interleaved nibble order."""
    r, n = v.shape
    inter = v.reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, n)
    return _as_int32(pack_codes(inter, 4))


def _awq_unpack(w: torch.Tensor) -> torch.Tensor:
    r, c = w.shape
    inter = unpack_codes(_as_u8(w), 4, c * 8)                   # [R, N] in nibble order
    return inter.reshape(r, c, 8)[:, :, list(AWQ_INVERSE)].reshape(r, c * 8)


def to_awq(qw: QuantizedWeight, name: str = "layer") -> dict[str, torch.Tensor]:
    """Canonical -> AutoAWQ GEMM tensors {qweight, qzeros, scales}."""
    n, k = qw.out_features, qw.in_features
    if qw.bits != 4 or qw.g_idx is not None or qw.group_size in (-1, 0) or n % 8:
        raise ShapeError(f"{name}: AutoAWQ GEMM holds only 4-bit, grouped, non-act-order weights with "
                         f"out_features % 8 == 0 (got bits={qw.bits}, group_size={qw.group_size}, "
                         f"act_order={qw.g_idx is not None}, N={n}); export as GPTQ instead")
    qw = qw.to("cpu")
    zeros = qw.zeros if qw.zeros is not None else torch.full(qw.scales.shape, 8, dtype=torch.uint8)
    return {"qweight": _awq_pack(qw.codes().t().contiguous()), "qzeros": _awq_pack(zeros.t().contiguous()),
            "scales": qw.scales.t().contiguous().to(torch.float16)}


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             name: str = "layer") -> QuantizedWeight:
    for t, nm in ((qweight, "qweight"), (qzeros, "qzeros")):
        if t.dim() != 2 or t.dtype != torch.int32:
            raise PackageError(f"{name}.{nm}: expected 2-D int32, got {t.dtype} {list(t.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if scales.dim() != 2 or scales.shape[1] != n or group_size <= 0 or k % group_size \
            or scales.shape[0] != k // group_size or tuple(qzeros.shape) != (scales.shape[0], n // 8):
        raise PackageError(f"{name}: AWQ shapes disagree (qweight {list(qweight.shape)}, qzeros "
                           f"{list(qzeros.shape)}, scales {list(scales.shape)}, group_size {group_size})")
    codes = _awq_unpack(qweight).t().contiguous()              # [N, K]
    zeros = _awq_unpack(qzeros).t().contiguous()               # [N, G]
    return QuantizedWeight.from_codes(codes, scales.t().contiguous(), None if bool((zeros == 8).all()) else zeros,
                                      4, group_size)


# ============================================================================================== folders
def _quant_config(fmt: str, layers: list[tuple[int, int, bool, bool]], checkpoint_format: str,
                  high_precision: list[str]) -> dict:
    """layers: (bits, group_size, symmetric, act_order) of every quantized layer."""
    bits = {b for b, _, _, _ in layers}
    gss = {(-1 if g in (-1, 0) else g) for _, g, _, _ in layers}
    if len(bits) > 1 or len(gss) > 1:
        raise ShapeError(f"{fmt} checkpoints need one bits/group_size for all layers, got bits {sorted(bits)} "
                         f"group sizes {sorted(gss)}")
    b, gs = bits.pop(), gss.pop()
    if fmt == "awq":
        return {"quant_method": "awq", "bits": b, "group_size": gs, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": high_precision or None}
    cfg = {"quant_method": "gptq", "bits": b, "group_size": gs,
           "desc_act": any(act for _, _, _, act in layers),
           "sym": all(sym for _, _, sym, _ in layers), "checkpoint_format": checkpoint_format,
           "true_sequential": True, "static_groups": False, "damp_percent": 0.01,
           "meta": {"quantizer": ["sdquant"]}}
    if high_precision:  # GPTQModel/vLLM "dynamic": a "-:" rule leaves the matching module unquantized
        cfg["dynamic"] = {f"-:^{m.replace('.', '[.]')}$": {} for m in high_precision}
    return cfg


def export_hf_checkpoint(folder, *, fmt: str, config: dict, float_tensors: Iterable[tuple[str, torch.Tensor]],
                         quant_layers: Iterable[tuple], checkpoint_format: str = "gptq",
                         high_precision: Iterable[str] = (), extra_files: Optional[dict] = None,
                         max_shard_bytes: int = 4 << 30) -> Path:
    """Write a GPTQ (``fmt="gptq"``) or AutoAWQ GEMM (``fmt="awq"``) checkpoint folder: sharded safetensors
    (+ model.safetensors.index.json when sharded), config.json with ``quantization_config``, and extra files
    (tokenizer ...). Streams tensors into shards of at most ``max_shard_bytes``; the folder appears atomically
    (written as a temporary sibling, then renamed). ``folder`` must not exist or be empty."""
    from safetensors.torch import save_file

    if fmt not in ("gptq", "awq"):
        raise ShapeError(f"fmt must be 'gptq' or 'awq', got {fmt!r}")
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise PackageError(f"{folder}: output folder exists and is not empty")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        shards, cur, cur_bytes, weight_map, total = [], {}, 0, {}, 0
        layers_seen: list[tuple[int, int, bool, bool]] = []

        def flush():
            nonlocal cur, cur_bytes
            if cur:
                fname = f"shard-{len(shards):05d}.tmp"
                save_file(cur, str(tmp / fname), metadata={"format": "pt"})
                shards.append((fname, list(cur)))
                cur, cur_bytes = {}, 0

        def put(key, t):
            nonlocal cur_bytes, total
            if key in weight_map or key in cur:
                raise PackageError(f"tensor {key!r}: duplicate name")
            nb = t.numel() * t.element_size()
            if cur and cur_bytes + nb > max_shard_bytes:
                flush()
            t = t.detach().cpu().contiguous()
            if t.numel() and any(u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                                 for u in cur.values()):
                t = t.clone()  # tied (lm_head = embedding): both keys are written, safetensors refuses shared memory
            cur[key] = t
            cur_bytes += nb
            total += nb
            weight_map[key] = None

        for key, t in float_tensors:
            put(key, t)
        for item in quant_layers:
            name, w, bias, smooth = item
            if isinstance(w, Fp8Weight) or not isinstance(w, QuantizedWeight):
                raise ShapeError(f"{name}: only integer QuantizedWeight layers can go into a {fmt} checkpoint")
            if smooth is not None:
                raise ShapeError(f"{name}: an unfolded smooth scale cannot be expressed in a {fmt} checkpoint")
            tensors = to_gptq(w, checkpoint_format, name) if fmt == "gptq" else to_awq(w, name)
            for k, t in tensors.items():
                put(f"{name}.{k}", t)
            if bias is not None:
                put(f"{name}.bias", bias)
            layers_seen.append((w.bits, w.group_size, w.zeros is None, w.g_idx is not None))
            del item, w, bias, tensors
        flush()
        if not layers_seen:
            raise ShapeError(f"no quantized layers to write into the {fmt} checkpoint")
        n = len(shards)
        for i, (tmpname, keys) in enumerate(shards):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp / tmpname, tmp / final)
            for k in keys:
                weight_map[k] = final
        if n > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        cfg = dict(config)
        cfg["quantization_config"] = _quant_config(fmt, layers_seen, checkpoint_format, list(high_precision))
        cfg.setdefault("torch_dtype", "float16")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for fname, data in (extra_files or {}).items():
            if "/" in fname or "\\" in fname or fname in ("", ".", ".."):
                raise PackageError(f"extra file {fname!r}: must be a plain file name")
            (tmp / fname).write_bytes(data)
        if folder.exists():
            folder.rmdir()  # empty, checked above
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


@dataclass
class HFCheckpoint:
    config: dict
    quant_config: dict
    float_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    quant_layers: dict[str, tuple] = field(default_factory=dict)  # name -> (QuantizedWeight, bias, None)


def _read_json(p: Path) -> dict:
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise PackageError(f"{p}: cannot read JSON ({e})") from None
    if not isinstance(d, dict):
        raise PackageError(f"{p}: top level is not an object")
    return d


def import_hf_checkpoint(folder) -> HFCheckpoint:
    """Read a GPTQ (v1 or v2) or AutoAWQ GEMM checkpoint folder into canonical weights."""
    from safetensors import safe_open

    folder = Path(folder)
    cfg = _read_json(folder / "config.json")
    qc = cfg.get("quantization_config")
    if qc is None:  # checkpoints from before the transformers integration keep it in a side file
        for side, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
            if (folder / side).exists():
                qc = {"quant_method": method, **_read_json(folder / side)}
                break
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() not in ("gptq", "awq"):
        raise PackageError(f"{folder}/config.json: quantization_config.quant_method must be 'gptq' or 'awq'")
    method = str(qc["quant_method"]).lower()
    bits, gs = qc.get("bits", qc.get("w_bit", 4)), qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(bits, int) or not isinstance(gs, int):
        raise PackageError(f"{folder}/config.json: quantization_config bits/group_size must be integers")
    if method == "awq" and (bits != 4 or str(qc.get("version", "gemm")).lower() != "gemm"):
        raise PackageError(f"{folder}: only 4-bit AutoAWQ 'gemm' checkpoints are supported "
                           f"(bits={bits}, version={qc.get('version')!r})")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"  # GPTQModel also writes "format"
    index = folder / "model.safetensors.index.json"
    if index.exists():
        wm = _read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise PackageError(f"{index}: weight_map missing")
        files = sorted(set(wm.values()))
        if any(not isinstance(f, str) or "/" in f or "\\" in f or f.startswith(".") for f in files):
            raise PackageError(f"{index}: shard names must be plain file names")
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise PackageError(f"{folder}: no safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(folder / f), framework="pt") as fh:
                for key in fh.keys():
                    tensors[key] = fh.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for malformed files
            raise PackageError(f"{folder / f}: unreadable safetensors file ({str(e).splitlines()[0][:120]})") from None
    out = HFCheckpoint(cfg, qc)
    prefixes = [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]
    for p in prefixes:
        need = ("qweight", "qzeros", "scales")
        missing = [s for s in need if f"{p}.{s}" not in tensors]
        if missing:
            raise PackageError(f"{p}: missing {missing[0]} next to qweight")
        qweight, qzeros, scales = (tensors.pop(f"{p}.{s}") for s in need)
        if method == "gptq":
            w = from_gptq(qweight, qzeros, scales, tensors.pop(f"{p}.g_idx", None), bits, gs,
                          bool(qc.get("sym", True)), fmt, p)
        else:
            w = from_awq(qweight, qzeros, scales, gs, p)
        out.quant_layers[p] = (w, tensors.pop(f"{p}.bias", None), None)
    out.float_tensors = tensors
    return out


# ============================================================================================== from models
def _hf_config(model) -> dict:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_json_string"):
        raise ShapeError(f"{type(model).__name__} has no Hugging Face config to write into config.json")
    d = json.loads(cfg.to_json_string(use_diff=False))  # through JSON: every key becomes a string
    for k in ("quantization_config", "_name_or_path"):
        d.pop(k, None)
    return d


def _tokenizer_files(tok) -> dict[str, bytes]:
    if tok is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        return {p.name: p.read_bytes() for p in Path(d).iterdir() if p.is_file()}


def export_checkpoint(result, path, format: str = "gptq", checkpoint_format: str = "gptq",
                      max_shard_bytes: int = 4 << 30) -> Path:
    """``sdquant.export(result, path, format="gptq"|"awq")``: a CalibrationResult (``model`` with folded
    scales, ``weights`` {name: QuantizedWeight}, ``smooth``, ``tokenizer``) as a checkpoint folder."""
    model, weights = result.model, result.weights
    smooth = getattr(result, "smooth", {}) or {}

    def floats():
        for name, t in model.state_dict().items():
            mod, _, leaf = name.rpartition(".")
            if not (mod in weights and leaf in ("weight", "bias")):
                yield name, t

    def quant():
        for name, w in weights.items():
            bias = getattr(model.get_submodule(name), "bias", None)
            yield name, w, bias.detach() if isinstance(bias, torch.Tensor) else None, smooth.get(name)

    high = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in weights
            and n != "lm_head"]
    return export_hf_checkpoint(path, fmt=format, config=_hf_config(model), float_tensors=floats(),
                                quant_layers=quant(), checkpoint_format=checkpoint_format, high_precision=high,
                                extra_files=_tokenizer_files(getattr(result, "tokenizer", None)),
                                max_shard_bytes=max_shard_bytes)


def export_model(model, path, format: str = "gptq", checkpoint_format: str = "gptq",
                 max_shard_bytes: int = 4 << 30) -> Path:
    """A loaded sdquant model (``sdquant.load``: QuantLinear modules in place of linears) as a checkpoint
    folder; ``model.tokenizer`` is written too when present."""
    from sdquant.kernels.linear import Fp8Linear, QuantLinear

    fp8 = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    if fp8:
        raise ShapeError(f"{fp8[0]}: FP8 layers cannot go into a {format} checkpoint")
    qmods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not qmods:
        raise ShapeError(f"{type(model).__name__} has no QuantLinear layers to export")

    def floats():
        for name, t in model.state_dict().items():
            mod, _, _ = name.rpartition(".")
            if mod not in qmods:
                yield name, t

    def quant():
        for name, m in qmods.items():
            yield name, m.weight_q, m.bias, m.smooth

    high = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    return export_hf_checkpoint(path, fmt=format, config=_hf_config(model), float_tensors=floats(),
                                quant_layers=quant(), checkpoint_format=checkpoint_format, high_precision=high,
                                extra_files=_tokenizer_files(getattr(model, "tokenizer", None)),
                                max_shard_bytes=max_shard_bytes)
