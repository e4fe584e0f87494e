"""Streaming .sd2 writer (spec: docs/FORMAT.md).

Memory: one layer at a time. Each float tensor and each quantized layer becomes its own safetensors member,
written straight from the tensor's memory into a temporary file in the target folder while its sha256 and
CRC-32 are computed; the caller's iterators are consumed lazily, so a model streamed from disk or from a
calibration loop is never held twice. The manifest (which needs every member's hash) is written last, then
the central directory, then the temporary file is renamed over the target (atomic on POSIX and Windows).

Tied tensors (an lm_head sharing the embedding matrix) are stored once: a float tensor that is a view of the
same memory as one already written (same storage and data pointer, shape, stride, dtype), or that the caller
declares tied (``tied=``, e.g. from a Hugging Face model's ``tie_word_embeddings``) and whose bytes equal its
partner's, becomes an entry of the manifest's ``aliases`` table instead of a second member.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import zlib
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional, Union

import torch

from sdquant.errors import PackageError
from sdquant.export import sd2_format as F
from sdquant.export.sd2_manifest import check_aliases
from sdquant.quant.qtensor import Fp8Weight, QuantizedWeight

Tensor = torch.Tensor
QuantItem = tuple  # (name, QuantizedWeight | Fp8Weight, bias | None, smooth | None)
_CHUNK = 16 << 20


def _sdquant_version() -> str:
    from sdquant import __version__
    return __version__


# ------------------------------------------------------------------------------------------- helpers
def _umask() -> int:
    """The process umask, read without changing it (os.umask would, briefly, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _as_bytes(t: Tensor) -> memoryview:
    """Zero-copy byte view of a CPU tensor (copies only when it lives on a device or is non-contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def _jsonable(obj, where: str, depth: int = 0):
    """Plain-JSON copy of a report: tensors/numpy scalars become numbers or lists, non-finite floats become
    null (the manifest is strict JSON), keys must be strings."""
    if depth > F.MAX_JSON_DEPTH:
        raise PackageError(f"{where}: nested deeper than {F.MAX_JSON_DEPTH} levels")
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, torch.Tensor):
        return _jsonable(obj.detach().cpu().tolist(), where, depth + 1)
    if hasattr(obj, "item") and hasattr(obj, "dtype"):  # numpy scalar
        return _jsonable(obj.item(), where, depth + 1)
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise PackageError(f"{where}: keys must be strings, got {type(k).__name__} {k!r}")
            out[k] = _jsonable(v, f"{where}.{k}", depth + 1)
        return out
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, where, depth + 1) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise PackageError(f"{where}: {type(obj).__name__} is not JSON-serialisable")


def safetensors_blob(tensors: list[tuple[str, Tensor]], where: str) -> tuple[bytes, list[memoryview]]:
    """(header bytes, tensor byte views) of one safetensors member. Tensors are ordered by decreasing
    element size, so with a 64-aligned data start every tensor is aligned to its own element size (safetensors
    forbids holes, so this ordering is the only way to align without padding tensors)."""
    if len(tensors) > F.MAX_TENSORS_PER_MEMBER:
        raise PackageError(f"{where}: {len(tensors)} tensors exceed the cap of {F.MAX_TENSORS_PER_MEMBER}")
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i][1].element_size())
    header, views, off = {}, [], 0
    for i in order:
        key, t = tensors[i]
        dt = F.st_dtype(t, f"{where}:{key}")
        if t.dim() > F.MAX_RANK:
            raise PackageError(f"{where}:{key}: rank {t.dim()} exceeds {F.MAX_RANK}")
        mv = _as_bytes(t)
        header[key] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [off, off + mv.nbytes]}
        views.append(mv)
        off += mv.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-(8 + len(raw))) % F.ALIGN)  # tensor data starts 64-aligned within the member
    if len(raw) > F.MAX_ST_HEADER_BYTES:
        raise PackageError(f"{where}: safetensors header of {len(raw)} bytes exceeds the cap")
    return len(raw).to_bytes(8, "little") + raw, views


# ------------------------------------------------------------------------------------------- zip stream
class _ZipStream:
    """Appends STORED members to an open binary file in the canonical sd2 layout."""

    def __init__(self, f):
        self.f = f
        self.entries: list[tuple[bytes, int, int, int]] = []  # (name, size, crc, header offset)
        self.members: dict[str, dict] = {}
        self._folded: set[str] = set()

    def add(self, name: str, size: int, chunks: Iterable) -> None:
        F.check_member_name(name)
        if name.casefold() in self._folded:
            raise PackageError(f"member {name!r}: duplicate name")
        if len(self.entries) >= F.MAX_MEMBERS:
            raise PackageError(f"member {name!r}: more than {F.MAX_MEMBERS} members")
        self._folded.add(name.casefold())
        raw = name.encode()
        offset = self.f.tell()
        self.f.write(F.local_header(raw, size, 0, offset))
        sha, crc, n = hashlib.sha256(), 0, 0
        for c in chunks:
            sha.update(c)
            crc = zlib.crc32(c, crc)
            n += len(c) if isinstance(c, bytes) else c.nbytes
            self.f.write(c)
        if n != size:
            raise PackageError(f"member {name!r}: wrote {n} bytes, expected {size} (source changed?)")
        end = self.f.tell()
        self.f.seek(offset + 14)
        self.f.write(crc.to_bytes(4, "little"))  # CRC-32 field of the local header, known only now
        self.f.seek(end)
        self.entries.append((raw, size, crc, offset))
        self.members[name] = {"size": size, "sha256": sha.hexdigest()}

    def add_tensors(self, name: str, tensors: list[tuple[str, Tensor]]) -> None:
        head, views = safetensors_blob(tensors, name)
        self.add(name, len(head) + sum(v.nbytes for v in views), [head, *views])

    def finish(self) -> None:
        cd_offset = self.f.tell()
        for raw, size, crc, offset in self.entries:
            self.f.write(F.central_header(raw, size, crc, offset))
        cd_size = self.f.tell() - cd_offset
        self.f.write(F.end_records(len(self.entries), cd_offset, cd_size))


def _file_chunks(src: Union[bytes, bytearray, memoryview, os.PathLike, str]) -> tuple[int, Iterator]:
    if isinstance(src, (bytes, bytearray, memoryview)):
        mv = memoryview(src).cast("B")
        return mv.nbytes, iter([mv])
    p = Path(src)
    size = p.stat().st_size

    def gen():
        with open(p, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                yield chunk
    return size, gen()


# ------------------------------------------------------------------------------------------- layers
def int_scheme(qw: QuantizedWeight) -> dict:
    gs = -1 if qw.group_size in (-1, 0) else qw.group_size  # 0 is qtensor's alias of per-channel
    return {"type": "int", "bits": qw.bits, "group_size": gs, "symmetric": qw.zeros is None,
            "act_order": qw.g_idx is not None}


def fp8_scheme(fw: Fp8Weight) -> dict:
    return {"type": "fp8", "format": "e4m3", "weight": "per_channel",
            "activation": "static" if fw.input_scale is not None else "dynamic_per_token"}


def _layer_tensors(name: str, w, bias: Optional[Tensor], smooth: Optional[Tensor]):
    if isinstance(w, QuantizedWeight):
        ts = [("qweight", w.qweight), ("scales", w.scales), ("zeros", w.zeros), ("g_idx", w.g_idx)]
        scheme = int_scheme(w)
    elif isinstance(w, Fp8Weight):
        ts = [("weight", w.weight), ("weight_scale", w.weight_scale),
              ("input_scale", None if w.input_scale is None else w.input_scale.reshape(()))]
        scheme = fp8_scheme(w)
    else:
        raise PackageError(f"layer {name!r}: expected QuantizedWeight or Fp8Weight, got {type(w).__name__}")
    n, k = w.out_features, w.in_features
    if bias is not None and tuple(bias.shape) != (n,):
        raise PackageError(f"layer {name!r}: bias must be [{n}], got {list(bias.shape)}")
    if smooth is not None and tuple(smooth.shape) != (k,):
        raise PackageError(f"layer {name!r}: smooth must be [{k}], got {list(smooth.shape)}")
    ts += [("bias", bias), ("smooth", smooth)]
    return scheme, [(key, t) for key, t in ts if t is not None]


# ------------------------------------------------------------------------------------------- ties
class _TieTracker:
    """Finds the float tensors to store as aliases of one already written.

    Shared memory: each written tensor is remembered by (device, data pointer, shape, stride, dtype) with a
    *weak* reference to its storage, so the writer keeps nothing alive. A later tensor with the same key is
    the same view of the same bytes only while that storage lives (once it is freed, the allocator may hand
    the address to an unrelated tensor), which the weak reference tells.
    Declared ties (``tied``: alias -> target, in either arrival order): the first of a pair to arrive is
    stored and its bytes hashed; the second becomes an alias if dtype, shape and bytes are equal, and is
    refused otherwise (the loader ties them, so storing both would not round-trip)."""

    def __init__(self, tied: Optional[Mapping[str, str]]):
        self.partner: dict[str, str] = {}
        for a, b in (tied or {}).items():
            if not isinstance(a, str) or not isinstance(b, str) or not a or not b or a == b:
                raise PackageError(f"tied {a!r} -> {b!r}: names must be two different non-empty strings")
            for x, y in ((a, b), (b, a)):
                if self.partner.get(x, y) != y:
                    raise PackageError(f"tied {x!r}: declared tied to both {self.partner[x]!r} and {y!r}")
                self.partner[x] = y
        self._seen: dict[tuple, tuple] = {}      # memory key -> (StorageWeakRef, stored name)
        self._digest: dict[str, tuple] = {}     # stored name of a declared pair -> (dtype, shape, sha256)

    @staticmethod
    def _key(t: Tensor):
        if t.numel() == 0 or t.is_sparse or t.device.type == "meta":
            return None
        return (str(t.device), t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)

    @staticmethod
    def _sha(t: Tensor) -> str:
        return hashlib.sha256(_as_bytes(t)).hexdigest()

    def target_of(self, name: str, t: Tensor) -> Optional[str]:
        """The stored tensor ``name`` is tied to, or None (then it must be stored and ``stored`` called)."""
        key = self._key(t)
        hit = self._seen.get(key) if key is not None else None
        if hit is not None and not hit[0].expired():
            return hit[1]
        other = self.partner.get(name)
        if other is not None and other in self._digest:
            if self._digest[other] != (t.dtype, tuple(t.shape), self._sha(t)):
                raise PackageError(f"float tensor {name!r}: declared tied to {other!r}, but dtype, shape or "
                                   "values differ (re-tie the model or drop the tie from its config)")
            return other
        return None

    def stored(self, name: str, t: Tensor) -> None:
        key = self._key(t)
        if key is not None:
            from torch.multiprocessing.reductions import StorageWeakRef  # weak: keeps no tensor alive
            try:
                self._seen[key] = (StorageWeakRef(t.untyped_storage()), name)
            except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a storage
                pass
        if name in self.partner:
            self._digest[name] = (t.dtype, tuple(t.shape), self._sha(t))


def declared_ties(model) -> dict[str, str]:
    """alias -> target of the parameters a Hugging Face model declares tied (``tie_word_embeddings``):
    transformers 5's ``all_tied_weights_keys``, else the output and input embeddings' weights."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if isinstance(keys, Mapping):
        return {str(k): str(v) for k, v in keys.items() if isinstance(v, str)}
    cfg = getattr(model, "config", None)
    if not getattr(cfg, "tie_word_embeddings", False) or not hasattr(model, "get_output_embeddings"):
        return {}
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    if out is None or inp is None or id(out) not in names or id(inp) not in names:
        return {}
    return {f"{names[id(out)]}.weight": f"{names[id(inp)]}.weight"}


# ------------------------------------------------------------------------------------------- public
def write_sd2(path, *, family: str, arch_config: dict, float_tensors: Iterable[tuple[str, Tensor]],
              quant_layers: Iterable[QuantItem], extra_files: Optional[Mapping[str, object]] = None,
              calibration: Optional[dict] = None, high_precision: Iterable[str] = (),
              tied: Optional[Mapping[str, str]] = None) -> Path:
    """Write an .sd2 package; returns its path. See the module docstring for the memory behaviour.

    float_tensors: (name, tensor) pairs kept in high precision (embeddings, norms, lm_head, biases of
    unquantized modules ...). quant_layers: (module name, QuantizedWeight | Fp8Weight, bias | None,
    smooth | None). extra_files: name -> bytes or a path to stream from (tokenizer files, model.onnx);
    stored under ``files/<name>``. calibration: JSON-able report. high_precision: module names left unquantized.
    tied: float tensor name -> name it is declared tied to (``declared_ties(model)``); tensors sharing memory
    are found without it. Tied tensors are stored once and recorded in ``aliases`` (format_version 2; a
    package without aliases is written as version 1, which older readers also read).
    """
    path = Path(path)
    if path.is_dir():
        raise PackageError(f"{path}: is a folder; give the path of the .sd2 file to write")
    if not isinstance(family, str) or not family:
        raise PackageError("family: must be a non-empty string")
    manifest = {
        "format": F.FORMAT, "format_version": 1, "sdquant_version": _sdquant_version(),
        "family": family, "arch_config": _jsonable(arch_config or {}, "arch_config"),
        "high_precision": [str(x) for x in high_precision],
        "calibration": _jsonable(calibration or {}, "calibration"),
        "float_tensors": {}, "layers": {}, "files": [], "members": {},
    }
    aliases: dict[str, dict] = {}
    ties = _TieTracker(tied)
    if not isinstance(manifest["arch_config"], dict) or not isinstance(manifest["calibration"], dict):
        raise PackageError("arch_config and calibration must be dicts")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            z = _ZipStream(f)
            for name, t in float_tensors:
                if not isinstance(name, str) or not name or name in manifest["float_tensors"] or name in aliases:
                    raise PackageError(f"float tensor {name!r}: empty or duplicate name")
                if not isinstance(t, torch.Tensor):
                    raise PackageError(f"float tensor {name!r}: expected a Tensor, got {type(t).__name__}")
                entry = {"dtype": F.st_dtype(t, name), "shape": list(t.shape)}
                target = ties.target_of(name, t)
                if target is not None:
                    aliases[name] = {"target": target, **entry}
                    del t
                    continue
                member = f"{F.WEIGHTS_DIR}f{len(manifest['float_tensors']):06d}.safetensors"
                z.add_tensors(member, [(name, t)])
                manifest["float_tensors"][name] = {"member": member, **entry}
                ties.stored(name, t)
                del t  # drop our reference before the next tensor is produced
            for i, item in enumerate(quant_layers):
                if not isinstance(item, tuple) or len(item) != 4:
                    raise PackageError("quant_layers items must be (name, weight, bias, smooth) tuples")
                name, w, bias, smooth = item
                if not isinstance(name, str) or not name or name in manifest["layers"]:
                    raise PackageError(f"layer {name!r}: empty or duplicate name")
                scheme, ts = _layer_tensors(name, w, bias, smooth)
                member = f"{F.WEIGHTS_DIR}q{i:06d}.safetensors"
                z.add_tensors(member, ts)
                manifest["layers"][name] = {
                    "member": member, "scheme": scheme, "in_features": w.in_features,
                    "out_features": w.out_features,
                    "tensors": {k: {"dtype": F.st_dtype(t, k), "shape": list(t.shape)} for k, t in ts}}
                del item, w, bias, smooth, ts
            for name, src in (extra_files or {}).items():
                if not isinstance(name, str):
                    raise PackageError(f"extra file {name!r}: name must be a string")
                F.check_member_name(name)
                size, chunks = _file_chunks(src)
                z.add(F.FILES_DIR + name, size, chunks)
                manifest["files"].append(name)
            manifest["members"] = z.members
            if aliases:  # version 2 only when needed: a package without ties stays readable by v1 readers
                check_aliases(aliases, manifest["float_tensors"], manifest["layers"])
                manifest["format_version"] = 2
                manifest["aliases"] = aliases
            raw = json.dumps(manifest, indent=1, allow_nan=False).encode()
            if len(raw) > F.MAX_MANIFEST_BYTES:
                raise PackageError(f"{F.MANIFEST}: {len(raw)} bytes exceed the cap of {F.MAX_MANIFEST_BYTES}")
            z.add(F.MANIFEST, len(raw), [raw])
            z.finish()
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
