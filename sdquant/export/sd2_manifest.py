"""Validation of the .sd2 manifest (docs/FORMAT.md §5): strict JSON parsing and a field-by-field schema
check. Nothing from the manifest is used before it passes ``check_manifest``; every failure is a
PackageError naming the field, member, layer or tensor."""
from __future__ import annotations

import json
import math

from sdquant.errors import PackageError
from sdquant.export import sd2_format as F
from sdquant.quant.qtensor import SUPPORTED_BITS

_MAX_INT = 1 << 62


def _no_dupes(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _bad_constant(c):
    raise ValueError(f"{c} is not allowed")


def _finite_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"{s[:20]} overflows a float")
    return v


def strict_json(raw: bytes, where: str):
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_dupes, parse_constant=_bad_constant,
                          parse_float=_finite_float)
    except RecursionError:
        raise PackageError(f"{where}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise PackageError(f"{where}: invalid JSON ({str(e).splitlines()[0][:120]})") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_MAX_INT < v < _MAX_INT


def _need(d, key, typ, where):
    if not isinstance(d, dict) or key not in d:
        raise PackageError(f"{where}: missing field {key!r}")
    v = d[key]
    ok = _is_int(v) if typ is int else isinstance(v, typ) and not (typ is not bool and isinstance(v, bool))
    if not ok:
        raise PackageError(f"{where}.{key}: expected {typ.__name__}, got {type(v).__name__}")
    return v


def _exact_keys(d: dict, keys: set, where: str, optional: set = frozenset()):
    extra, missing = set(d) - keys - optional, keys - set(d)
    if missing:
        raise PackageError(f"{where}: missing field {sorted(missing)[0]!r}")
    if extra:
        raise PackageError(f"{where}: unknown field {sorted(extra)[0]!r}")


def _shape(v, where) -> tuple:
    if not isinstance(v, list) or len(v) > F.MAX_RANK or not all(_is_int(x) and x >= 0 for x in v):
        raise PackageError(f"{where}: shape must be a list of at most {F.MAX_RANK} non-negative integers")
    return tuple(v)


def _dtype(v, where) -> str:
    if v not in F.ST_DTYPES:
        raise PackageError(f"{where}: unknown dtype {str(v)[:40]!r}")
    return v


TOP_KEYS = {"format", "format_version", "sdquant_version", "family", "arch_config", "high_precision",
            "calibration", "float_tensors", "layers", "files", "members"}
V2_KEYS = TOP_KEYS | {"aliases"}  # format_version 2 adds the alias table (tied tensors stored once)


def check_aliases(aliases, float_tensors: dict, layers: dict) -> dict[str, str]:
    """Validate the ``aliases`` table (docs/FORMAT.md §5.3.1): every alias names a stored float tensor of the
    same dtype and shape, never itself, another alias (so no chains or cycles) or a name that a stored tensor
    or quantized layer already owns. Returns {alias: target}. ``float_tensors``/``layers`` are the (already
    validated) manifest tables; the writer runs the same check on what it is about to write."""
    if not isinstance(aliases, dict):
        raise PackageError(f"{F.MANIFEST}.aliases: expected dict, got {type(aliases).__name__}")
    if len(aliases) > F.MAX_ALIASES:
        raise PackageError(f"{F.MANIFEST}.aliases: {len(aliases)} aliases exceed the cap of {F.MAX_ALIASES}")
    out = {}
    for name, e in aliases.items():
        w = f"alias {name[:80]!r}"
        if not name:
            raise PackageError(f"{w}: name must be non-empty")
        if not isinstance(e, dict):
            raise PackageError(f"{w}: entry is not an object")
        _exact_keys(e, {"target", "dtype", "shape"}, w)
        target = _need(e, "target", str, w)
        dt, sh = _dtype(e["dtype"], w), _shape(e["shape"], w)
        if target == name:
            raise PackageError(f"{w}: points to itself")
        if name in float_tensors:
            raise PackageError(f"{w}: shadows the stored float tensor of the same name")
        module = name.rpartition(".")[0]
        if module in layers:
            raise PackageError(f"{w}: shadows quantized layer {module[:80]!r}, whose tensors the layer entry owns")
        if target in aliases:
            chain, seen, cur = [name], {name}, target
            while cur in aliases and cur not in seen:  # ends: every step adds a new alias to `seen`
                chain.append(cur)
                seen.add(cur)
                t = aliases[cur]
                cur = t.get("target") if isinstance(t, dict) and isinstance(t.get("target"), str) else None
            if cur in seen:
                cyc = " -> ".join(c[:40] for c in chain[chain.index(cur):] + [cur])
                raise PackageError(f"{w}: aliases form a cycle ({cyc[:200]})")
            raise PackageError(f"{w}: points to alias {target[:80]!r}; an alias must name a stored float tensor")
        if target not in float_tensors:
            raise PackageError(f"{w}: points to missing float tensor {target[:80]!r}")
        te = float_tensors[target]
        if (te["dtype"], list(te["shape"])) != (dt, list(sh)):
            raise PackageError(f"{w}: {dt} {list(sh)} does not match its target {target[:80]!r} "
                               f"({te['dtype']} {list(te['shape'])})")
        out[name] = target
    return out


def expected_layer_tensors(name: str, e: dict) -> dict[str, tuple]:
    """The tensors a layer entry's scheme implies: key -> (allowed dtypes, shape). Validates the scheme."""
    w = f"layer {name!r}"
    _exact_keys(e, {"member", "scheme", "in_features", "out_features", "tensors"}, w)
    k, n = _need(e, "in_features", int, w), _need(e, "out_features", int, w)
    s = _need(e, "scheme", dict, w)
    if k <= 0 or n <= 0:
        raise PackageError(f"{w}: in_features/out_features must be positive")
    t = _need(s, "type", str, w + ".scheme")
    opt = {}
    if t == "int":
        _exact_keys(s, {"type", "bits", "group_size", "symmetric", "act_order"}, w + ".scheme")
        bits, gs = _need(s, "bits", int, w + ".scheme"), _need(s, "group_size", int, w + ".scheme")
        sym, act = _need(s, "symmetric", bool, w + ".scheme"), _need(s, "act_order", bool, w + ".scheme")
        if bits not in SUPPORTED_BITS:
            raise PackageError(f"{w}: bits={bits} is not supported {SUPPORTED_BITS}")
        if not (gs == -1 or (gs > 0 and k % gs == 0)) or (k * bits) % 8:
            raise PackageError(f"{w}: group_size {gs} / bits {bits} do not fit in_features {k}")
        g = 1 if gs == -1 else k // gs
        req = {"qweight": (("U8",), (n, k * bits // 8)), "scales": (("F16",), (n, g))}
        opt = {"zeros": (("U8",), (n, g)), "g_idx": (("I32",), (k,))}
        if not sym:
            req["zeros"] = opt.pop("zeros")
        if act:
            req["g_idx"] = opt.pop("g_idx")
        opt = {}
    elif t == "fp8":
        _exact_keys(s, {"type", "format", "weight", "activation"}, w + ".scheme")
        if s["format"] != "e4m3" or s["weight"] != "per_channel" or s["activation"] not in ("static",
                                                                                            "dynamic_per_token"):
            raise PackageError(f"{w}: unsupported fp8 scheme {json.dumps(s)[:120]}")
        req = {"weight": (("F8_E4M3",), (n, k)), "weight_scale": (("F32",), (n,))}
        if s["activation"] == "static":
            req["input_scale"] = (("F32",), ())
    else:
        raise PackageError(f"{w}: unknown scheme type {t[:40]!r}")
    opt.update({"bias": (F.FLOAT_ST, (n,)), "smooth": (F.FLOAT_ST, (k,))})
    got = _need(e, "tensors", dict, w)
    for key in req:
        if key not in got:
            raise PackageError(f"{w}: manifest lacks tensor {key!r} required by its scheme")
    out = {}
    for key, spec in got.items():
        if key not in req and key not in opt:
            raise PackageError(f"{w}: unexpected tensor {key[:40]!r} for scheme {t}")
        dts, shape = req.get(key) or opt[key]
        wk = f"{w} tensor {key!r}"
        if not isinstance(spec, dict):
            raise PackageError(f"{wk}: entry is not an object")
        _exact_keys(spec, {"dtype", "shape"}, wk)
        dt, sh = _dtype(spec["dtype"], wk), _shape(spec["shape"], wk)
        if dt not in dts or sh != shape:
            raise PackageError(f"{wk}: manifest says {dt} {list(sh)}, the scheme requires "
                               f"{'/'.join(dts)} {list(shape)}")
        out[key] = (dt, sh)
    return out


def check_manifest(man, members: dict) -> dict[str, dict[str, tuple]]:
    """Validate the manifest; returns {weights member: {tensor key: (dtype, shape)}} it promises."""
    if not isinstance(man, dict):
        raise PackageError(f"{F.MANIFEST}: top level is not an object")
    if man.get("format") != F.FORMAT:
        raise PackageError(f"{F.MANIFEST}: format is {str(man.get('format'))[:40]!r}, expected 'sd2'")
    ver = man.get("format_version")
    if not _is_int(ver) or ver not in F.SUPPORTED_VERSIONS:
        raise PackageError(f"{F.MANIFEST}: unsupported format_version {str(ver)[:20]} "
                           f"(this sdquant reads {', '.join(map(str, F.SUPPORTED_VERSIONS))}); upgrade sdquant")
    _exact_keys(man, TOP_KEYS if ver == 1 else V2_KEYS, F.MANIFEST)
    for key, typ in (("sdquant_version", str), ("family", str), ("arch_config", dict), ("calibration", dict),
                     ("high_precision", list), ("files", list), ("members", dict), ("float_tensors", dict),
                     ("layers", dict)):
        _need(man, key, typ, F.MANIFEST)
    if not man["family"] or not all(isinstance(x, str) for x in man["high_precision"]):
        raise PackageError(f"{F.MANIFEST}: family must be non-empty and high_precision a list of strings")

    listed = man["members"]
    for name, info in listed.items():
        w = f"{F.MANIFEST} member {name[:80]!r}"
        if not isinstance(info, dict):
            raise PackageError(f"{w}: entry is not an object")
        _exact_keys(info, {"size", "sha256"}, w)
        h = _need(info, "sha256", str, w)
        if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
            raise PackageError(f"{w}: sha256 must be 64 lowercase hex digits")
        if name not in members:
            raise PackageError(f"member {name[:80]!r} is listed in the manifest but missing from the archive")
        if _need(info, "size", int, w) != members[name].size:
            raise PackageError(f"member {name!r}: size {members[name].size} != manifest size {info['size']}")
    for name in members:
        if name != F.MANIFEST and name not in listed:
            raise PackageError(f"member {name!r} is in the archive but not in the manifest")

    used: dict[str, str] = {}

    def claim(member, owner):
        if not isinstance(member, str) or member not in listed or not member.startswith(F.WEIGHTS_DIR):
            raise PackageError(f"{owner}: member {str(member)[:80]!r} is not a weights member of the archive")
        if member in used:
            raise PackageError(f"{owner}: member {member!r} is already used by {used[member]}")
        used[member] = owner

    promised: dict[str, dict[str, tuple]] = {}
    for name, e in man["float_tensors"].items():
        w = f"float tensor {name[:80]!r}"
        if not isinstance(e, dict):
            raise PackageError(f"{w}: entry is not an object")
        _exact_keys(e, {"member", "dtype", "shape"}, w)
        claim(e["member"], w)
        promised[e["member"]] = {name: (_dtype(e["dtype"], w), _shape(e["shape"], w))}
    for name, e in man["layers"].items():
        if not isinstance(e, dict):
            raise PackageError(f"layer {name[:80]!r}: entry is not an object")
        specs = expected_layer_tensors(name, e)
        claim(e["member"], f"layer {name!r}")
        promised[e["member"]] = specs
    for fname in man["files"]:
        if not isinstance(fname, str):
            raise PackageError(f"{F.MANIFEST}: files must be strings")
        F.check_member_name(fname)
        if F.FILES_DIR + fname not in listed or F.FILES_DIR + fname in used:
            raise PackageError(f"file {fname[:80]!r}: missing from the archive or listed twice")
        used[F.FILES_DIR + fname] = f"file {fname!r}"
    for name in listed:
        if name not in used:
            raise PackageError(f"member {name!r} is not referenced by any tensor, layer or file")
    if ver >= 2:
        check_aliases(man["aliases"], man["float_tensors"], man["layers"])
    return promised
