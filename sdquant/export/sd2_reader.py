"""Validating, zero-copy .sd2 reader (spec: docs/FORMAT.md).

Order of trust: nothing in the file is used before it is checked. (1) the ZIP structure is parsed with caps
and bounds checks and compared byte for byte with the canonical form the writer produces (so overlaps,
gaps, duplicates, compression, encryption, trailing garbage and every single-byte change of a header are
refused); (2) the manifest is CRC-checked, parsed as strict JSON (no NaN, no duplicate keys, depth-limited)
and validated field by field; (3) every weights member's safetensors header is parsed with a size cap and
checked arithmetic and must agree with the manifest; (4) member sha256 hashes are checked at open
(verify="full"), on first use of a member (verify="lazy"), or not at all (verify="none").

Tensors are ``torch.frombuffer`` views of a private (copy-on-write) mmap of the whole file: loading costs
page faults, not copies, and writing to a loaded tensor never modifies the file.
"""
from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from sdquant.errors import PackageError, ShapeError
from sdquant.export import sd2_format as F
from sdquant.export.sd2_manifest import (TOP_KEYS, _dtype, _exact_keys, _is_int, _shape,  # noqa: F401
                                         check_manifest, expected_layer_tensors, strict_json)
from sdquant.quant.qtensor import Fp8Weight, QuantizedWeight

VERIFY_MODES = ("full", "lazy", "none")


@dataclass(frozen=True)
class Member:
    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int


# =========================================================================================== ZIP layer
def _u(fmt: struct.Struct, mm, off: int, what: str):
    if off < 0 or off + fmt.size > len(mm):
        raise PackageError(f"truncated file: {what} at offset {off} runs past the end")
    return fmt.unpack_from(mm, off)


def read_members(mm) -> dict[str, Member]:
    """Parse and canonically check the ZIP structure; returns members in file order."""
    size = len(mm)
    if size < F.EOCD.size:
        raise PackageError(f"truncated file: {size} bytes is too small to be an .sd2 package")
    sig, disk, disk_cd, n_disk, n_total, cd_size, cd_off, clen = _u(F.EOCD, mm, size - F.EOCD.size, "end record")
    if sig != F.SIG_EOCD:
        raise PackageError("no ZIP end record at the end of the file (truncated, not an .sd2, or trailing bytes)")
    if disk or disk_cd or n_disk != n_total or clen:
        raise PackageError("ZIP end record: multi-disk archives and archive comments are not allowed")
    cd_end = size - F.EOCD.size
    if n_total == F.U16 or cd_size == F.U32 or cd_off == F.U32:
        loc = size - F.EOCD.size - F.LOCATOR64.size
        lsig, ldisk, eocd64_off, ndisks = _u(F.LOCATOR64, mm, loc, "ZIP64 locator")
        if lsig != F.SIG_LOCATOR64 or ldisk or ndisks != 1 or eocd64_off != loc - F.EOCD64.size:
            raise PackageError("ZIP64 end locator is missing or malformed")
        r = _u(F.EOCD64, mm, eocd64_off, "ZIP64 end record")
        if r[0] != F.SIG_EOCD64 or r[1] != F.EOCD64.size - 12 or r[4] or r[5] or r[6] != r[7]:
            raise PackageError("ZIP64 end record is malformed")
        n_total, cd_size, cd_off, cd_end = r[7], r[8], r[9], eocd64_off
    if n_total > F.MAX_MEMBERS:
        raise PackageError(f"{n_total} members exceed the cap of {F.MAX_MEMBERS}")
    if cd_off + cd_size != cd_end or cd_size < n_total * F.CENTRAL.size:
        raise PackageError("central directory size/offset do not match the file (truncated or corrupt)")
    if bytes(mm[cd_end:size]) != F.end_records(n_total, cd_off, cd_size):
        raise PackageError("ZIP end records are not in canonical sd2 form")

    entries: list[tuple[str, bytes, int, int, int]] = []
    folded: set[str] = set()
    pos = cd_off
    for i in range(n_total):
        (sig, _vm, _vn, flags, method, _t, _d, crc, csize, usize, nlen, elen, clen, _ds, _ia, _ea,
         off) = _u(F.CENTRAL, mm, pos, f"central directory entry {i}")
        if sig != F.SIG_CENTRAL:
            raise PackageError(f"central directory entry {i}: bad signature (corrupt)")
        end = pos + F.CENTRAL.size + nlen + elen + clen
        if end > cd_end:
            raise PackageError(f"central directory entry {i}: runs past the directory (corrupt)")
        raw = bytes(mm[pos + F.CENTRAL.size: pos + F.CENTRAL.size + nlen])
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PackageError(f"central directory entry {i}: member name is not UTF-8") from None
        F.check_member_name(name)
        if method != 0:
            raise PackageError(f"member {name!r}: compressed (method {method}); .sd2 members must be STORED")
        if flags & 1:
            raise PackageError(f"member {name!r}: encrypted members are not allowed")
        if name.casefold() in folded:
            raise PackageError(f"member {name!r}: duplicate name")
        folded.add(name.casefold())
        vals = _zip64_values(mm, pos + F.CENTRAL.size + nlen, elen, name)
        try:
            usize = vals.pop(0) if usize == F.U32 else usize
            csize = vals.pop(0) if csize == F.U32 else csize
            off = vals.pop(0) if off == F.U32 else off
        except IndexError:
            raise PackageError(f"member {name!r}: ZIP64 extra field is missing values") from None
        if csize != usize:
            raise PackageError(f"member {name!r}: compressed size {csize} != size {usize}; must be STORED")
        if bytes(mm[pos:end]) != F.central_header(raw, usize, crc, off):
            raise PackageError(f"member {name!r}: central directory entry is not in canonical sd2 form")
        entries.append((name, raw, usize, crc, off))
        pos = end
    if pos != cd_end:
        raise PackageError("central directory has trailing bytes")

    # members must tile [0, cd_off) exactly, in directory order: no gaps, no overlaps, no hidden data
    members: dict[str, Member] = {}
    expect = 0
    for name, raw, usize, crc, off in entries:
        if off != expect:
            raise PackageError(f"member {name!r}: starts at {off}, expected {expect} (overlapping or hidden data)")
        head = F.local_header(raw, usize, crc, off)
        data = off + len(head)
        if data + usize > cd_off:
            raise PackageError(f"member {name!r}: data runs past the central directory (truncated or corrupt)")
        if bytes(mm[off:data]) != head:
            lsig, _v, _fl, lmethod = struct.unpack_from("<IHHH", mm, off)
            if lsig != F.SIG_LOCAL:
                raise PackageError(f"member {name!r}: bad local header signature (corrupt)")
            if lmethod != 0:
                raise PackageError(f"member {name!r}: compressed (method {lmethod}); must be STORED")
            raise PackageError(f"member {name!r}: local header disagrees with the central directory (corrupt)")
        members[name] = Member(name, off, data, usize, crc)
        expect = data + usize
    if expect != cd_off:
        raise PackageError(f"{cd_off - expect} unaccounted bytes before the central directory")
    return members


def _zip64_values(mm, start: int, length: int, name: str) -> list[int]:
    p, end = start, start + length
    while p + 4 <= end:
        hid, hsz = struct.unpack_from("<HH", mm, p)
        if p + 4 + hsz > end:
            break
        if hid == F.ZIP64_ID:
            if hsz % 8:
                raise PackageError(f"member {name!r}: malformed ZIP64 extra field")
            return list(struct.unpack_from(f"<{hsz // 8}Q", mm, p + 4))
        p += 4 + hsz
    return []


def parse_safetensors_header(mm, m: Member) -> tuple[int, dict[str, tuple[str, tuple, int, int]]]:
    """-> (absolute offset of the data section, {key: (dtype, shape, begin, end)}) with every offset checked."""
    if m.size < 8:
        raise PackageError(f"member {m.name!r}: too small for a safetensors header")
    n = int.from_bytes(mm[m.data_offset:m.data_offset + 8], "little")
    if n > F.MAX_ST_HEADER_BYTES or 8 + n > m.size:
        raise PackageError(f"member {m.name!r}: safetensors header length {n} exceeds the cap or the member")
    hdr = strict_json(bytes(mm[m.data_offset + 8:m.data_offset + 8 + n]), f"member {m.name!r} header")
    if not isinstance(hdr, dict):
        raise PackageError(f"member {m.name!r}: safetensors header is not an object")
    meta = hdr.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise PackageError(f"member {m.name!r}: __metadata__ must map strings to strings")
    if len(hdr) > F.MAX_TENSORS_PER_MEMBER:
        raise PackageError(f"member {m.name!r}: {len(hdr)} tensors exceed the cap of {F.MAX_TENSORS_PER_MEMBER}")
    base, data_len = m.data_offset + 8 + n, m.size - 8 - n
    out, spans = {}, []
    for key, info in hdr.items():
        w = f"member {m.name!r} tensor {key!r}"
        if not isinstance(info, dict):
            raise PackageError(f"{w}: entry is not an object")
        _exact_keys(info, {"dtype", "shape", "data_offsets"}, w)
        dt, shape = _dtype(info["dtype"], w), _shape(info["shape"], w)
        offs = info["data_offsets"]
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(x) for x in offs)
                and 0 <= offs[0] <= offs[1] <= data_len):
            raise PackageError(f"{w}: data_offsets {str(offs)[:60]} out of range [0, {data_len}]")
        if math.prod(shape) * F.itemsize(dt) != offs[1] - offs[0]:
            raise PackageError(f"{w}: {dt} {list(shape)} needs {math.prod(shape) * F.itemsize(dt)} bytes, "
                               f"data_offsets span {offs[1] - offs[0]}")
        if (base + offs[0]) % F.itemsize(dt):
            raise PackageError(f"{w}: data is not aligned to its element size")
        out[key] = (dt, shape, offs[0], offs[1])
        spans.append((offs[0], offs[1]))
    spans.sort()
    pos = 0
    for a, b in spans:  # safetensors: the data section is fully covered, no holes, no overlaps
        if a != pos:
            raise PackageError(f"member {m.name!r}: tensor data has holes or overlaps at byte {a}")
        pos = b
    if pos != data_len:
        raise PackageError(f"member {m.name!r}: {data_len - pos} trailing bytes after the last tensor")
    return base, out


# =========================================================================================== package
class Package:
    """An open .sd2 package. Use as a context manager or call ``close()``. Tensors returned stay valid
    after close (they keep the mapping alive)."""

    def __init__(self, path, verify: str = "full"):
        if verify not in VERIFY_MODES:
            raise PackageError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.path, self.verify_mode = Path(path), verify
        self._verified: set[str] = set()
        try:
            fh = open(self.path, "rb")
        except OSError as e:
            raise PackageError(f"{self.path}: cannot open ({e.strerror or e})") from None
        with fh:
            if os.fstat(fh.fileno()).st_size == 0:
                raise PackageError(f"{self.path}: empty file (truncated)")
            # private copy-on-write mapping: writable buffer for torch.frombuffer, never writes the file
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self):
        self.members = read_members(self._mm)
        mf = self.members.get(F.MANIFEST)
        if mf is None:
            raise PackageError(f"no {F.MANIFEST} member: not an .sd2 package")
        if mf.size > F.MAX_MANIFEST_BYTES:
            raise PackageError(f"{F.MANIFEST}: {mf.size} bytes exceed the cap of {F.MAX_MANIFEST_BYTES}")
        raw = bytes(self._mm[mf.data_offset:mf.data_offset + mf.size])
        if zlib.crc32(raw) != mf.crc:  # CRC-32 catches every burst error up to 32 bits
            raise PackageError(f"{F.MANIFEST}: CRC-32 mismatch (corrupt)")
        self.manifest = strict_json(raw, F.MANIFEST)
        promised = check_manifest(self.manifest, self.members)
        self._headers: dict[str, tuple[int, dict]] = {}
        for member, specs in promised.items():
            base, hdr = parse_safetensors_header(self._mm, self.members[member])
            if set(hdr) != set(specs):
                diff = sorted(set(hdr) ^ set(specs))[0]
                raise PackageError(f"member {member!r}: tensor {diff[:80]!r} is in only one of manifest and header")
            for key, (dt, shape) in specs.items():
                if hdr[key][:2] != (dt, shape):
                    raise PackageError(f"member {member!r} tensor {key!r}: manifest says {dt} {list(shape)}, "
                                       f"safetensors header says {hdr[key][0]} {list(hdr[key][1])}")
            self._headers[member] = (base, hdr)
        if self.verify_mode == "full":
            self._check_hashes([m for m in self.members.values() if m.name != F.MANIFEST])

    # ------------------------------------------------------------------ internals
    def _view(self, m: Member) -> memoryview:
        return memoryview(self._mm)[m.data_offset:m.data_offset + m.size]

    def _sha256(self, m: Member) -> str:
        view = self._view(m)
        try:
            return hashlib.sha256(view).hexdigest()
        finally:
            view.release()  # no buffer export may outlive the call, or the mapping could not be closed

    def _check_hashes(self, todo: list[Member]) -> None:
        """Hash members on a few threads (hashlib releases the GIL); report the first bad one in file order."""
        workers = min(len(todo), os.cpu_count() or 1, 8)
        if workers > 1 and sum(m.size for m in todo) > (64 << 20):
            with ThreadPoolExecutor(workers) as ex:
                digests = list(ex.map(self._sha256, todo))
        else:
            digests = [self._sha256(m) for m in todo]
        for m, h in zip(todo, digests):
            if h != self.manifest["members"][m.name]["sha256"]:
                raise PackageError(f"member {m.name!r}: sha256 mismatch (corrupt data)")
            self._verified.add(m.name)

    def _check_hash(self, m: Member) -> None:
        if m.name in self._verified:
            return
        if self._sha256(m) != self.manifest["members"][m.name]["sha256"]:
            raise PackageError(f"member {m.name!r}: sha256 mismatch (corrupt data)")
        self._verified.add(m.name)

    def _use(self, member: str) -> dict[str, torch.Tensor]:
        if self._mm is None:
            raise PackageError(f"{self.path}: package is closed")
        if self.verify_mode != "none":
            self._check_hash(self.members[member])
        base, hdr = self._headers[member]
        out = {}
        for key, (dt, shape, a, b) in hdr.items():
            dtype = F.ST_DTYPES[dt]
            if b == a:
                out[key] = torch.empty(shape, dtype=dtype)
            else:
                self._exported = True
                out[key] = torch.frombuffer(self._mm, dtype=dtype, count=(b - a) // dtype.itemsize,
                                            offset=base + a).view(shape)
        return out

    # ------------------------------------------------------------------ public
    @property
    def family(self) -> str:
        return self.manifest["family"]

    @property
    def arch_config(self) -> dict:
        return self.manifest["arch_config"]

    @property
    def calibration(self) -> dict:
        return self.manifest["calibration"]

    @property
    def high_precision(self) -> list:
        return self.manifest["high_precision"]

    @property
    def aliases(self) -> dict[str, str]:
        """{alias: stored float tensor} of tied tensors stored once (format_version 2; {} for version 1)."""
        return {a: e["target"] for a, e in self.manifest.get("aliases", {}).items()}

    def tensor(self, name: str, device=None) -> torch.Tensor:
        """One float tensor by name; an alias gives its target's tensor (a tied pair is one set of bytes)."""
        e = self.manifest["float_tensors"].get(name)
        if e is None and name in self.manifest.get("aliases", {}):
            name = self.manifest["aliases"][name]["target"]
            e = self.manifest["float_tensors"][name]
        if e is None:
            raise PackageError(f"no float tensor {name!r} in {self.path.name}")
        t = self._use(e["member"])[name]
        return t if device is None else t.to(device)

    def float_tensors(self, device=None) -> dict[str, torch.Tensor]:
        """Every float tensor by name, aliases included: an alias maps to the *same* tensor object as its
        target, so a loader that assigns these tensors gets tied parameters (also after a device move)."""
        out = {name: self.tensor(name, device) for name in self.manifest["float_tensors"]}
        out.update({a: out[t] for a, t in self.aliases.items()})
        return out

    def layer(self, name: str, device=None):
        """-> (QuantizedWeight | Fp8Weight, bias | None, smooth | None) of one quantized module."""
        e = self.manifest["layers"].get(name)
        if e is None:
            raise PackageError(f"no quantized layer {name!r} in {self.path.name}")
        t = self._use(e["member"])  # validated on the CPU views, then moved (no device sync for checks)
        s = e["scheme"]
        try:
            if s["type"] == "int":
                w = QuantizedWeight(t["qweight"], t["scales"], t.get("zeros"), s["bits"], s["group_size"],
                                    e["in_features"], t.get("g_idx"))
            else:
                w = Fp8Weight(t["weight"], t["weight_scale"], t.get("input_scale"))
        except ShapeError as err:
            raise PackageError(f"layer {name!r}: {err}") from None
        bias, smooth = t.get("bias"), t.get("smooth")
        if device is not None:
            w = w.to(device)
            bias, smooth = (None if v is None else v.to(device) for v in (bias, smooth))
        return w, bias, smooth

    def quant_layers(self, device=None) -> dict:
        return {name: self.layer(name, device) for name in self.manifest["layers"]}

    def files(self) -> list[str]:
        return list(self.manifest["files"])

    def file(self, name: str) -> bytes:
        if name not in self.manifest["files"]:
            raise PackageError(f"no file {name!r} in {self.path.name}")
        m = self.members[F.FILES_DIR + name]
        if self.verify_mode != "none":
            self._check_hash(m)
        view = self._view(m)
        try:
            return bytes(view)
        finally:
            view.release()

    def verify(self) -> list[str]:
        """Re-check every member's sha256 and CRC-32 and every layer's tensors; returns the problems found
        (empty = package is intact). Does not raise for corrupt data."""
        def check(m: Member) -> list[str]:
            view, out = self._view(m), []
            try:
                if zlib.crc32(view) != m.crc:
                    out.append(f"member {m.name!r}: CRC-32 mismatch (corrupt data)")
                if m.name != F.MANIFEST and hashlib.sha256(view).hexdigest() != \
                        self.manifest["members"][m.name]["sha256"]:
                    out.append(f"member {m.name!r}: sha256 mismatch (corrupt data)")
            finally:
                view.release()
            return out

        with ThreadPoolExecutor(min(len(self.members), os.cpu_count() or 1, 8)) as ex:
            problems = [p for ps in ex.map(check, self.members.values()) for p in ps]
        if problems:
            return problems
        for name in self.manifest["layers"]:
            try:
                w, _, _ = self.layer(name)
            except PackageError as e:
                problems.append(str(e))
                continue
            scale = w.scales if isinstance(w, QuantizedWeight) else w.weight_scale
            if not bool(torch.isfinite(scale.float()).all()):
                problems.append(f"layer {name!r}: non-finite scales")
        return problems

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None and not getattr(self, "_exported", False):
            try:
                mm.close()
            except BufferError:
                pass
        # once tensors view the mapping, mm.close() would unmap memory they still point at (torch.frombuffer
        # holds a reference to the mmap object but no buffer export, so close() succeeds and later reads
        # segfault). Dropping our reference instead unmaps it when the last tensor is freed.

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_sd2(path, verify: str = "full") -> Package:
    """Open and validate an .sd2 package. verify: "full" (hash every member now), "lazy" (hash each member
    on first use), "none" (structure, manifest and headers only)."""
    return Package(path, verify)
