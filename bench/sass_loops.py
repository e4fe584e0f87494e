"""Offline instruction counts of the CUDA W4A16 kernels' main loops (no GPU): compile one translation unit of the
extension for sm_90a with nvcc (optionally with extra defines, or from another commit's csrc as bench/ab_build.py's
--old takes it), disassemble it with cuobjdump (from PATH, or the copy Triton ships), and print for every kernel its
registers and spill bytes (ptxas -v) and each loop that holds a tensor-core or copy instruction: its length in SASS
instructions and how many HGMMA / HMMA / LDGSTS / LDG / LDS it holds. Each loop is the span of a backward branch; the
counts are static (instructions in the loop body, each taken path counted once).

Used to judge a code change by what it does to the instruction stream before spending device time on it
(docs/benchmarks/int4-wgmma.md "The 16-64-token tiles": the stage copies cost 4-11% of the loops).

    python bench/sass_loops.py --tu wgmma_bf16                       # this tree
    python bench/sass_loops.py --tu wgmma_bf16 --old ab_old          # against <ab_old>/sdquant/kernels/csrc
    python bench/sass_loops.py --tu wgmma_bf16 --defines -DSDQ_WG_RAW=0 --match raw
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# what a loop is counted by: tensor-core, asynchronous-copy, global and shared loads
COUNTED = ("HGMMA", "HMMA", "LDGSTS", "LDG", "LDS")
_FUNC = re.compile(r"Function : (\S+)")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRA = re.compile(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)")
_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_sass(text: str) -> dict:
    """cuobjdump -sass text -> {kernel: [(address, instruction text)]} in address order."""
    out, cur = {}, None
    for ln in text.splitlines():
        m = _FUNC.search(ln)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        m = _INSN.search(ln)
        if m and cur is not None:
            out[cur].append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(insn: str) -> str:
    """The opcode of an instruction's text, without its predicate and modifiers ("@!P0 LDGSTS.E.128 ..." -> LDGSTS)."""
    parts = insn.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


def loops(insns: list) -> list:
    """Each backward branch's span [target, branch] as {"start", "end", "length", <COUNTED opcode>: count}, for the
    spans that hold at least one COUNTED instruction; innermost (shortest) first."""
    res = []
    for addr, text in insns:
        m = _BRA.search(text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        lo = int(m.group(1), 16)
        body = [opcode(t) for a, t in insns if lo <= a <= addr]
        counts = {op: body.count(op) for op in COUNTED}
        if any(counts.values()):
            res.append({"start": lo, "end": addr, "length": len(body), **counts})
    return sorted(res, key=lambda r: r["length"])


def parse_ptxas(stderr: str) -> dict:
    """ptxas -v text -> {kernel: {"registers", "spill_stores", "spill_loads"}}."""
    out, cur = {}, None
    for ln in stderr.splitlines():
        m = _ENTRY.search(ln)
        if m:
            cur = m.group(1)
            out[cur] = {}
            continue
        if cur is None:
            continue
        m = _SPILL.search(ln)
        if m:
            out[cur]["spill_stores"], out[cur]["spill_loads"] = int(m.group(1)), int(m.group(2))
        m = _USED.search(ln)
        if m:
            out[cur]["registers"] = int(m.group(1))
    return out


def short_name(mangled: str) -> str:
    """A kernel's mangled name without its namespace prefix: the kernel and its template arguments as mangled
    ("w4a16_wgmma_raw_kernel<__nv_bfloat16,16,4,0,...>" stays recognisable, e.g. "w4a16_wgmma_raw_kernel I...")."""
    m = re.search(r"\d+(w4a16_\w+?kernel|wg_\w+?kernel)(I.*?)E?Ev", mangled)
    if not m:
        return mangled
    args = re.sub(r"13__nv_bfloat16|6__half", "", m.group(2))
    return f"{m.group(1)} {args}"


def compile_tu(csrc: Path, tu: str, defines: list, keep: Path | None = None) -> dict:
    """{kernel: {"registers", "spill_*", "loops"}} of csrc's w4a16_part_<tu>.cu compiled for sm_90a with `defines`."""
    from sdquant.kernels import int4_cuda
    nvcc, dump = int4_cuda.nvcc_path(), int4_cuda.cuobjdump_path()
    if nvcc is None or dump is None:
        raise SystemExit(f"sass_loops: {'nvcc' if nvcc is None else 'cuobjdump'} not found")
    src = csrc / f"w4a16_part_{tu}.cu"
    if not src.exists():
        raise SystemExit(f"sass_loops: {src} does not exist")
    with tempfile.TemporaryDirectory() as d:
        obj = Path(d) / "part.cubin"
        r = subprocess.run([nvcc, "-cubin", *int4_cuda.NVCC_FLAGS, *int4_cuda.TORCH_NVCC_DEFINES, *defines,
                            f"-I{csrc}", "-Xptxas", "-v", str(src), "-o", str(obj)],
                           capture_output=True, text=True, timeout=1800)
        if r.returncode:
            raise SystemExit(f"sass_loops: nvcc failed on {src}:\n{r.stderr[-3000:]}")
        sass = subprocess.run([dump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
        if keep is not None:
            keep.write_text(sass)
    res = parse_ptxas(r.stderr)
    for name, insns in parse_sass(sass).items():
        res.setdefault(name, {})["loops"] = loops(insns)
    return res


def main_loop(loops_: list) -> dict | None:
    """The main loop of loops(): the most tensor-core instructions, then the shortest (an outer loop holds the inner
    one's); None where there is no loop."""
    return max(loops_, key=lambda r: (r["HGMMA"] + r["HMMA"], -r["length"])) if loops_ else None


def describe(k: dict) -> str:
    main = main_loop(k.get("loops") or [])
    spill = k.get("spill_stores", 0) + k.get("spill_loads", 0)
    loop = (f"{main['length']} insns ({', '.join(f'{v} {op}' for op, v in main.items() if op in COUNTED and v)})"
            if main else "-")
    return f"{k.get('registers', '?')} regs{f', {spill} B spilled' if spill else ''}; main loop {loop}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tu", default="wgmma_bf16", help="the part to compile: w4a16_part_<TU>.cu (e.g. wgmma_bf16, bf16_nt1)")
    ap.add_argument("--defines", action="append", default=[], help="an extra nvcc flag (repeatable)")
    ap.add_argument("--old", default="", help="a directory holding sdquant/kernels/csrc to compare against")
    ap.add_argument("--match", default="", help="only kernels whose name contains this")
    ap.add_argument("--keep-sass", default="", help="write this tree's SASS to this file")
    args = ap.parse_args(argv)
    from sdquant.kernels import int4_cuda
    new = compile_tu(int4_cuda.CSRC, args.tu, args.defines, Path(args.keep_sass) if args.keep_sass else None)
    old = compile_tu(Path(args.old) / "sdquant" / "kernels" / "csrc", args.tu, args.defines) if args.old else {}
    # (an anonymous namespace's mangled name carries a hash of the file's path: match builds by the short name)
    old = {short_name(n): k for n, k in old.items()}
    for name in sorted(new, key=short_name):
        if args.match not in name or "kernel" not in name:
            continue
        line = f"{short_name(name)}: {describe(new[name])}"
        if short_name(name) in old:
            line += f"   | old: {describe(old[short_name(name)])}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
