"""Per-layer, per-batch-size kernel choice from a measured crossover table.

A quantized layer has several ways to compute y = x W^T on a GPU: a weight-only or fp8 kernel that wins while
the GEMM is memory-bound (small M), and dequantize+cuBLAS (or cuBLASLt fp8) that wins once it is
compute-bound. Where the crossover lies depends on the shape and the GPU, so it is measured
(``measure_crossovers``, wired to ``sdquant tune-kernels``) and shipped as JSON (``crossover_h200.json``).

``plan_layer`` turns (kind, N, K, dtype, the kernels that can run here, the table) into a ``Plan``: a few M
ranges with one kernel each. QuantLinear.prepare calls it once; forward only compares M with the range
bounds (Python ints, so torch.compile sees a static branch per bucket).

Table format (version 1)::

    {"version": 1, "device": "NVIDIA H200", "meta": {...},
     "buckets": [1, 2, 4, ..., 4096],                 # M upper bounds; M above the last uses the last
     "entries": [{"kind": "fp8" | "int4", "N": 4096, "K": 14336, "dtype": "bfloat16",
                  "us": {"<kernel>": [median µs per bucket or null], "bf16": [...]},
                  "triton_config": [[block_n, block_m, block_k, split_k, warps, stages] or null, ...]}]}

A layer whose exact (N, K) is not in the table uses the entry of its kind nearest in log-shape. Optional
int4 columns "dequant_cuda" / "dequant_triton" time dequantize+cuBLAS reading that kernel's layout (what a
layer prepared with one layout runs at large M); where absent, the "dequant" column stands in.
"""
import functools
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from sdquant.errors import ConfigError

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
FP8_KERNELS = ("triton", "scaled_mm", "dequant", "dense", "reference")
INT_KERNELS = ("cuda", "triton", "dequant", "dense", "reference")
MODES = ("auto", "reference", "triton", "cuda", "torch")
SHIPPED_DIR = Path(__file__).parent  # the shipped tables: crossover_<gpu>.json, each naming its GPU model in "device"
SHIPPED_TABLE = SHIPPED_DIR / "crossover_h200.json"  # the default, for GPU models no shipped table was measured on


@dataclass(frozen=True)
class Plan:
    """Kernel per M range: ``kernels[i]`` serves bounds[i-1] < M <= bounds[i]; the last range is open."""
    bounds: Tuple[int, ...]
    kernels: Tuple[str, ...]
    configs: Tuple[Tuple[int, ...], ...]  # Triton tile config per range, () = heuristic
    source: str = "default"              # "table:<N>x<K>" or "default" or the forced mode
    cuda_tail: int = 0                   # at 128 < M <= 256 on the CUDA kernel: a last 128-token tile of at most
                                         # this many rows runs as a small-M launch of its own (cuda_tail_rows)
    bucket_us: Optional[Tuple[float, ...]] = field(default=None, compare=False)  # the table's µs of the chosen
                                         # kernel per table bucket; None: some bucket untimed (or no table)

    def index(self, m: int) -> int:
        for i, b in enumerate(self.bounds[:-1]):
            if m <= b:
                return i
        return len(self.bounds) - 1

    def select(self, m: int) -> Tuple[str, Tuple[int, ...]]:
        i = self.index(m)
        return self.kernels[i], self.configs[i]

    def describe(self) -> str:
        """e.g. "M1-64:triton M65+:scaled_mm" (ranges that differ only in tile config shown merged)."""
        lo, parts = 1, []
        for i, (b, k) in enumerate(zip(self.bounds, self.kernels)):
            if i + 1 < len(self.kernels) and self.kernels[i + 1] == k:
                continue
            parts.append(f"M{lo}+:{k}" if b == self.bounds[-1] else f"M{lo}-{b}:{k}")
            lo = b + 1
        if self.cuda_tail:
            parts.append(f"(cuda M129-256: a last tile of <= {self.cuda_tail} rows split off)")
        return " ".join(parts)


def uniform(kernel: str, source: str) -> Plan:
    return Plan((DEFAULT_BUCKETS[-1],), (kernel,), ((),), source)


# The row counts a CUDA plan may split off a part-filled last 128-token tile, each timed by its own table bucket, and
# the share of the one-launch time the two launches must stay under (a second launch's fixed cost, table noise)
TAIL_ROWS = (16, 32, 64)
TAIL_MARGIN = 0.9


def cuda_tail_rows(buckets: Sequence[int], cuda_us: Sequence[Optional[float]]) -> int:
    """The largest r in TAIL_ROWS for which the table's CUDA times say that 128 rows plus an r-row launch beat one
    launch of 256 rows by a margin (cuda[128] + cuda[r] < TAIL_MARGIN * cuda[256]), else 0. At M = 129-256 the wgmma
    kernel computes a whole second 128-token tile however few of its rows are real, so M = 144 costs what M = 256
    does, while the small-M kernels stream the weights once more at near their M = 1 cost. H100, int4_wgmma run 45:
    8192x28672 M = 136 / 144 / 160 176.2 / 174.8 / 173.4 -> 137.6 / 144.0 / 151.6 us with the last rows apart; the
    layers whose 256-row launch costs far less than two 128-row ones (N = 4096 / 6144, 8192x10240) lose 3-41%."""
    if any(b not in buckets for b in (128, 256, *TAIL_ROWS)):
        return 0
    t = {b: cuda_us[buckets.index(b)] for b in (128, 256, *TAIL_ROWS)}
    if t[128] is None or t[256] is None:
        return 0
    return max([r for r in TAIL_ROWS if t[r] is not None and t[128] + t[r] < TAIL_MARGIN * t[256]], default=0)


# Two one-layout plans whose times at the smallest M differ by less than this share count as tied there (the
# table's run-to-run noise); the geometric mean over all buckets then decides (QuantLinear.prepare, layouts="one")
DECODE_TIE = 0.05


def pick_one_layout(plans: Sequence[Plan]) -> int:
    """Index of the plan to keep when a layer may hold one int4 layout: ``plans[i]`` runs layout i's kernel and
    dequantize+cuBLAS from it, ``plans[0]`` being the table's decode (smallest-M) kernel. The plans within
    DECODE_TIE of the fastest at the smallest bucket compete on the geometric mean of their bucket times; on a
    tie, or where some bucket is untimed, the earlier plan wins. E.g. H100 4096x4096: Triton 8.1 against CUDA
    8.2 us at M = 1 is a tie, and CUDA's 17 / 23 / 48 us against 21 / 30 / 58 at M = 128 / 256 / 1024 decide."""
    if len(plans) < 2 or any(p.bucket_us is None for p in plans):
        return 0
    first = min(p.bucket_us[0] for p in plans)
    near = [i for i, p in enumerate(plans) if p.bucket_us[0] <= first * (1 + DECODE_TIE)]
    return min(near, key=lambda i: (sum(math.log(max(t, 1e-9)) for t in plans[i].bucket_us), i))


def plan_one_layout(plan_fn: Callable[[tuple, Optional[Dict[str, str]]], Plan], available: Sequence[str],
                    int4_kernels: Iterable[str] = ("cuda", "triton")) -> Plan:
    """The plan of a layer that may hold one int4 layout (``QuantLinear.prepare(layouts="one")``). ``plan_fn(available,
    columns)`` plans among ``available`` (``columns`` as for ``plan_layer``). For each int4 kernel the full plan calls,
    every bucket is re-planned among that kernel and dequantize+cuBLAS, timed by the table's column for
    dequantize+cuBLAS from that kernel's layout ("dequant_<kernel>") where measured; ``pick_one_layout`` keeps one."""
    available = tuple(available)
    plan = plan_fn(available, None)
    kinds = set(int4_kernels)
    used = [k for k in dict.fromkeys(plan.kernels) if k in kinds]
    if not used:
        return plan
    plans = [plan_fn(tuple(k for k in available if k == keep or k not in used), {"dequant": f"dequant_{keep}"})
             for keep in used]
    return plans[pick_one_layout(plans)]


def _compress(buckets: Sequence[int], kernels: Sequence[str], configs: Sequence[Tuple[int, ...]],
              source: str, cuda_tail: int = 0, bucket_us: Optional[Tuple[float, ...]] = None) -> Plan:
    """Merge neighbouring buckets that run the same kernel with the same config."""
    b_out: List[int] = []
    k_out: List[str] = []
    c_out: List[Tuple[int, ...]] = []
    for b, k, c in zip(buckets, kernels, configs):
        if k_out and k_out[-1] == k and c_out[-1] == c:
            b_out[-1] = b
        else:
            b_out.append(b)
            k_out.append(k)
            c_out.append(c)
    return Plan(tuple(b_out), tuple(k_out), tuple(c_out), source, cuda_tail, bucket_us)


# --------------------------------------------------------------------------------------------- the table
_LOADED: Dict[Tuple[str, int, int], dict] = {}  # (path, mtime_ns, size) -> parsed table: one parse per model


def load_table(path: Optional[os.PathLike] = None) -> dict:
    """Read and validate a crossover table (the shipped H200 one by default). Parsed once per file version
    (every layer of a model plans from the same table); callers must not mutate the result."""
    p = Path(path) if path is not None else SHIPPED_TABLE
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
        if key in _LOADED:
            return _LOADED[key]
        table = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError("kernels.table", f"crossover table {p} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError("kernels.table", f"{p} is not valid JSON ({e.msg} at line {e.lineno})") from None
    validate_table(table, str(p))
    _LOADED.clear()
    _LOADED[key] = table
    return table


@functools.lru_cache(maxsize=None)
def _shipped_by_device(directory: Path) -> Dict[str, Path]:
    """GPU model -> the shipped table measured on it, from the "device" field of each crossover_*.json in
    ``directory`` (read once a process: the package's files do not change under it). A file that cannot be read
    is never chosen by name; load_table reports it where it is named."""
    out: Dict[str, Path] = {}
    for p in sorted(directory.glob("crossover_*.json")):
        try:
            dev = json.loads(p.read_text()).get("device")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(dev, str):
            out.setdefault(dev, p)
    return out


def shipped_table(device_name: Optional[str] = None) -> Path:
    """The shipped crossover table measured on the GPU model ``device_name`` (``torch.cuda.get_device_name``), else
    the default one (SHIPPED_TABLE's name, the H200's). The chosen table is validated when loaded."""
    return _shipped_by_device(SHIPPED_DIR).get(device_name or "", SHIPPED_DIR / SHIPPED_TABLE.name)


def validate_table(table: dict, where: str = "table") -> None:
    if not isinstance(table, dict) or table.get("version") != 1:
        raise ConfigError("kernels.table", f"{where}: expected a dict with version 1")
    buckets = table.get("buckets")
    if (not isinstance(buckets, list) or not buckets or not all(isinstance(b, int) and b > 0 for b in buckets)
            or sorted(set(buckets)) != buckets):
        raise ConfigError("kernels.table.buckets", f"{where}: buckets must be increasing positive integers")
    entries = table.get("entries")
    if not isinstance(entries, list):
        raise ConfigError("kernels.table.entries", f"{where}: entries must be a list")
    for i, e in enumerate(entries):
        f = f"kernels.table.entries[{i}]"
        if not isinstance(e, dict) or e.get("kind") not in ("fp8", "int4") or not isinstance(e.get("us"), dict):
            raise ConfigError(f, f"{where}: needs kind 'fp8'|'int4' and a 'us' dict")
        for key in ("N", "K"):
            if not isinstance(e.get(key), int) or e[key] <= 0:
                raise ConfigError(f"{f}.{key}", f"{where}: must be a positive integer")
        for name, row in e["us"].items():
            if not isinstance(row, list) or len(row) != len(buckets) or not all(
                    v is None or (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)) for v in row):
                raise ConfigError(f"{f}.us.{name}", f"{where}: needs {len(buckets)} positive numbers or nulls")
        cfgs = e.get("triton_config")
        if cfgs is not None and (not isinstance(cfgs, list) or len(cfgs) != len(buckets) or not all(
                c is None or (isinstance(c, list) and len(c) == 6 and all(isinstance(v, int) and v > 0 for v in c))
                for c in cfgs)):
            raise ConfigError(f"{f}.triton_config", f"{where}: needs {len(buckets)} lists of 6 positive ints or nulls")


def nearest_entry(table: dict, kind: str, n: int, k: int, dtype: str = "bfloat16") -> Optional[dict]:
    """The entry of this kind nearest to (N, K) in log-shape (exact match wins); same dtype preferred."""
    cands = [e for e in table.get("entries", []) if e["kind"] == kind]
    if not cands:
        return None
    return min(cands, key=lambda e: (abs(math.log(e["N"] / n)) + abs(math.log(e["K"] / k)),
                                     e.get("dtype", "bfloat16") != dtype))


# ------------------------------------------------------------------------------------------------ plans
def default_choice(kind: str, m: int, available: Iterable[str]) -> str:
    """What to run when the table has nothing for this kind: kernels while memory-bound, cuBLAS after."""
    av = set(available)
    order = (("triton", "scaled_mm") if m <= 64 else ("scaled_mm", "triton")) if kind == "fp8" else \
        (("cuda", "triton") if m <= 16 else ("triton", "cuda")) if m <= 64 else ()
    for k in (*order, "scaled_mm" if kind == "fp8" else "dequant", "dequant", "reference"):
        if k in av:
            return k
    raise ConfigError("kernels", f"no {kind} kernel can run here (available: {sorted(av)})")


def _col(kernel: str) -> str:
    return "bf16" if kernel == "dense" else kernel


def plan_layer(kind: str, n: int, k: int, available: Iterable[str], table: Optional[dict] = None,
               dtype: str = "bfloat16", mode: str = "auto", columns: Optional[Dict[str, str]] = None) -> Plan:
    """Choose the kernel per M bucket for one layer.

    ``available``: kernel names that can run for this layer on this device (see linear.py). ``mode`` other
    than "auto" forces one family: "reference" (the CPU reference op), "triton", "cuda" (the CUDA C++ int4
    kernel, or cuBLASLt ``_scaled_mm`` for fp8), "torch" (dequantize + cuBLAS at every M).
    ``columns``: kernel name -> the table column to time it by when the entry has that column (else its own):
    e.g. {"dequant": "dequant_cuda"} for dequantize+cuBLAS reading the CUDA layout instead of the canonical
    tensors (QuantLinear.prepare with one layout per layer).
    """
    if mode not in MODES:
        raise ConfigError("kernels", f"unknown kernel mode {mode!r} (choose from {', '.join(MODES)})")
    av = tuple(available)
    if mode != "auto":
        want = {"reference": "reference", "triton": "triton", "torch": "dequant",
                "cuda": "scaled_mm" if kind == "fp8" else "cuda"}[mode]
        if want not in av:
            raise ConfigError("kernels", f"kernels={mode!r} asks for the {want} {kind} kernel, which cannot run "
                                         f"for this [{n}x{k}] layer here (available: {', '.join(av)})")
        return uniform(want, mode)
    entry = nearest_entry(table, kind, n, k, dtype) if table else None
    if entry is None:
        buckets = list(DEFAULT_BUCKETS)
        return _compress(buckets, [default_choice(kind, b, av) for b in buckets], [()] * len(buckets), "default")
    buckets = table["buckets"]
    us: Dict[str, list] = entry["us"]
    cfgs = entry.get("triton_config") or [None] * len(buckets)
    col = {name: (columns or {}).get(name) if (columns or {}).get(name) in us else _col(name) for name in av}
    kernels, configs, times = [], [], []
    for i, b in enumerate(buckets):
        # "dense" (a cached x.dtype copy of W, opt-in) runs exactly the bf16 baseline's F.linear
        timed = [(us[col[name]][i], name) for name in av if col[name] in us and us[col[name]][i] is not None]
        name = min(timed)[1] if timed else default_choice(kind, b, av)
        times.append(min(timed)[0] if timed else None)
        kernels.append(name)
        configs.append(tuple(cfgs[i]) if name == "triton" and cfgs[i] else ())
    tail = 0
    if kind == "int4" and "cuda" in av and col["cuda"] in us and 256 in buckets and \
            kernels[buckets.index(256)] == "cuda":
        tail = cuda_tail_rows(buckets, us[col["cuda"]])
    return _compress(buckets, kernels, configs, f"table:{entry['N']}x{entry['K']}", tail,
                     None if None in times else tuple(times))


# ---------------------------------------------------------------------------------------------- writing
def write_table(table: dict, path: os.PathLike) -> Path:
    """Validate, then write atomically (temp file in the target folder + os.replace)."""
    validate_table(table, str(path))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def resumable_entries(path: os.PathLike, device_name: str, buckets: Sequence[int], dtype: str = "bfloat16",
                      group_size: int = 128) -> List[dict]:
    """The entries of an earlier ``measure_crossovers`` run at ``path`` that a resumed run keeps: none where the file
    does not exist; a ConfigError naming --resume where it was measured on another GPU model, with other buckets, or
    for another activation dtype or group size (its numbers would not belong in this table)."""
    p = Path(path)
    if not p.exists():
        return []
    table = load_table(p)
    meta = table.get("meta") or {}
    theirs = {"GPU": table.get("device"), "buckets": table["buckets"], "dtype": meta.get("dtype", dtype),
              "group size": meta.get("group_size", group_size)}
    ours = {"GPU": device_name, "buckets": list(buckets), "dtype": dtype, "group size": group_size}
    for what in theirs:
        if theirs[what] != ours[what]:
            raise ConfigError("--resume", f"{p} was measured with {what} {theirs[what]}, this run's is {ours[what]}: "
                                          f"write to another file, or delete it to start over")
    return [dict(e) for e in table["entries"]]


def measure_crossovers(path: os.PathLike, shapes: Optional[Sequence[Tuple[int, int]]] = None,
                       ms: Sequence[int] = DEFAULT_BUCKETS, kinds: Sequence[str] = ("fp8", "int4"),
                       dtype: str = "bfloat16", group_size: int = 128, tune: bool = True,
                       log=print, budget_s: Optional[float] = None, resume: bool = False) -> dict:
    """Re-measure the crossover table on the current GPU and write it to ``path`` (JSON, atomically).

    ``shapes`` are (K, N) pairs (in_features, out_features); by default the Llama-family set of
    ``bench/gemm_fp8.py``. Every available kernel of each kind and the bf16 F.linear baseline are timed per
    M (CUDA graphs, weights rotated past L2, medians); with ``tune`` the Triton fp8 tile config is chosen per
    M from a small sweep. The table is rewritten after every shape, so an interrupted run leaves the shapes it
    finished; with ``budget_s``, shapes not started within that many seconds are skipped (and logged); with
    ``resume``, the entries already in ``path`` (``resumable_entries``) are kept and not measured again, so a table
    can be completed over several runs. Needs a CUDA GPU. Returns the table.
    """
    import time

    import torch

    from sdquant.kernels import crossover  # the timing code (needs a GPU; imported only here)
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    prior = (resumable_entries(path, torch.cuda.get_device_name(), ms, dtype, group_size)
             if resume and torch.cuda.is_available() else [])
    table = crossover.measure(shapes=shapes, ms=ms, kinds=kinds, dtype=dtype, group_size=group_size,
                              tune=tune, log=log, deadline=deadline, on_entry=lambda t: write_table(t, path),
                              prior=prior)
    write_table(table, path)
    return table
