"""Shared definitions of the .sd2 container (docs/FORMAT.md): version, caps, member-name rules, dtype table,
and the byte layout of the few ZIP records sd2 uses. Writer and reader both import this file so that the
"canonical form" the reader checks is, by construction, exactly what the writer produces.

An .sd2 file is a ZIP archive in one canonical shape (no compression, no comments, fixed timestamps, every
member's data aligned to 64 bytes, members tiled back to back from offset 0, central directory in file
order). A reader that checks every field against that shape detects any single-byte change anywhere in the
file: a byte is either a checked constant, a CRC/sha256-protected payload, or a value cross-checked between
the local header and the central directory.
"""
from __future__ import annotations

import struct

import torch

from sdquant.errors import PackageError

FORMAT = "sd2"
FORMAT_VERSION = 2            # the newest version this sdquant writes (version 2 added `aliases`: tied tensors)
SUPPORTED_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
WEIGHTS_DIR = "weights/"
FILES_DIR = "files/"
ALIGN = 64  # member data and tensor data start on 64-byte boundaries (cache line, AVX-512, TMA-friendly)

# ---------------------------------------------------------------------------------------------- caps
MAX_MEMBERS = 100_000
MAX_ALIASES = 100_000
MAX_NAME_BYTES = 1024
MAX_MANIFEST_BYTES = 64 << 20
MAX_ST_HEADER_BYTES = 16 << 20         # safetensors itself allows 100 MB; an sd2 member holds one layer
MAX_TENSORS_PER_MEMBER = 4096
MAX_RANK = 8
MAX_JSON_DEPTH = 64

# ---------------------------------------------------------------------------------------------- dtypes
# safetensors dtype strings <-> torch dtypes (only those sd2 may carry; no object/pickle types exist here)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
FLOAT_ST = ("F64", "F32", "F16", "BF16")


def st_dtype(t: torch.Tensor, where: str) -> str:
    try:
        return TORCH_TO_ST[t.dtype]
    except KeyError:
        raise PackageError(f"{where}: dtype {t.dtype} cannot be stored in an .sd2 package") from None


def itemsize(st: str) -> int:
    return ST_DTYPES[st].itemsize


# ---------------------------------------------------------------------------------------------- names
def check_member_name(name: str) -> None:
    """Member names are relative POSIX paths: no absolute paths, drive letters, backslashes, '.'/'..' or
    empty components, no control characters, at most MAX_NAME_BYTES of UTF-8."""
    raw = name.encode("utf-8", "surrogatepass")
    if not name or len(raw) > MAX_NAME_BYTES:
        raise PackageError(f"member name {name[:80]!r}: length must be 1..{MAX_NAME_BYTES} bytes")
    if name.startswith("/") or "\\" in name or (len(name) > 1 and name[1] == ":"):
        raise PackageError(f"member name {name!r}: absolute paths and drive letters are not allowed")
    if any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in name):
        raise PackageError(f"member name {name!r}: control characters are not allowed")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise PackageError(f"member name {name!r}: empty, '.' or '..' path components are not allowed")


# ---------------------------------------------------------------------------------------------- ZIP records
U16, U32 = 0xFFFF, 0xFFFFFFFF
VERSION = 45                  # "ZIP64 capable"; used for version-made-by and version-needed of every record
FLAGS = 0x0800                # bit 11: names are UTF-8; no encryption (bit 0), no data descriptor (bit 3)
DOS_TIME, DOS_DATE = 0, 0x21  # 1980-01-01 00:00: fixed so equal inputs give byte-identical packages
PAD_ID = 0x5344               # "SD": extra field of zero bytes that aligns the member data
ZIP64_ID = 0x0001

LOCAL = struct.Struct("<IHHHHHIIIHH")          # 30 bytes
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
EOCD = struct.Struct("<IHHHHIIH")              # 22 bytes
EOCD64 = struct.Struct("<IQHHIIQQQQ")          # 56 bytes
LOCATOR64 = struct.Struct("<IIQI")             # 20 bytes
SIG_LOCAL, SIG_CENTRAL, SIG_EOCD = 0x04034B50, 0x02014B50, 0x06054B50
SIG_EOCD64, SIG_LOCATOR64 = 0x06064B50, 0x07064B50


def local_extra(size: int, header_offset: int, name_len: int) -> bytes:
    """The canonical local extra field: a ZIP64 block when the size needs it, then the padding block whose
    length puts the member data on an ALIGN boundary."""
    z = struct.pack("<HHQQ", ZIP64_ID, 16, size, size) if size >= U32 else b""
    before = header_offset + LOCAL.size + name_len + len(z) + 4
    pad = (-before) % ALIGN
    return z + struct.pack("<HH", PAD_ID, pad) + bytes(pad)


def local_header(name: bytes, size: int, crc: int, header_offset: int) -> bytes:
    extra = local_extra(size, header_offset, len(name))
    small = U32 if size >= U32 else size
    return LOCAL.pack(SIG_LOCAL, VERSION, FLAGS, 0, DOS_TIME, DOS_DATE, crc, small, small, len(name),
                      len(extra)) + name + extra


def central_extra(size: int, offset: int) -> bytes:
    vals = ([size, size] if size >= U32 else []) + ([offset] if offset >= U32 else [])
    return struct.pack(f"<HH{len(vals)}Q", ZIP64_ID, 8 * len(vals), *vals) if vals else b""


def central_header(name: bytes, size: int, crc: int, offset: int) -> bytes:
    extra = central_extra(size, offset)
    small = U32 if size >= U32 else size
    return CENTRAL.pack(SIG_CENTRAL, VERSION, VERSION, FLAGS, 0, DOS_TIME, DOS_DATE, crc, small, small,
                        len(name), len(extra), 0, 0, 0, 0, min(offset, U32)) + name + extra


def end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    """ZIP64 end record + locator (only when a value overflows the classic fields), then the classic end
    record with an empty comment."""
    out = b""
    if count >= U16 or cd_offset >= U32 or cd_size >= U32:
        eocd64_offset = cd_offset + cd_size
        out += EOCD64.pack(SIG_EOCD64, EOCD64.size - 12, VERSION, VERSION, 0, 0, count, count, cd_size,
                           cd_offset)
        out += LOCATOR64.pack(SIG_LOCATOR64, 0, eocd64_offset, 1)
    out += EOCD.pack(SIG_EOCD, 0, 0, min(count, U16), min(count, U16), min(cd_size, U32),
                     min(cd_offset, U32), 0)
    return out
