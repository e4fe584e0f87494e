"""Helpers of the bench-only CUDA experiments (bench/mlp_fused.py, bench/narrow_tile.py). Each builds its own small
torch extension from bench/<name>/ against the sdquant kernels' headers and flags, and times it beside the shipped
op."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path


def compile_only(src: Path, out_dir: Path) -> int:
    """nvcc ``src`` for sm_90a with the sdquant extension's flags and ``ptxas -v`` (CI: no GPU needed); prints the
    compiler's output (register and spill lines) and returns its exit code. The object goes to out_dir/<stem>.o."""
    from sdquant.kernels import int4_cuda
    nvcc = int4_cuda.nvcc_path()
    if nvcc is None:
        print("nvcc not found")
        return 2
    cmd = [nvcc, "-c", *int4_cuda.NVCC_FLAGS, *int4_cuda.TORCH_NVCC_DEFINES, "-Xptxas", "-v",
           f"-I{int4_cuda.CSRC}", str(src), "-o", str(out_dir / (src.stem + ".o"))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(r.stdout[-6000:] + r.stderr[-8000:])
    return r.returncode


def run_compile_only(script: str, out_dir: Path) -> subprocess.CompletedProcess:
    """``python bench/<script> --compile-only --out out_dir`` as a CI test runs it (output captured): the experiment's
    own command line, so its --compile-only path is what is tested."""
    import sys
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, str(root / "bench" / script), "--compile-only", "--out", str(out_dir)],
                          capture_output=True, text=True, timeout=900, cwd=str(root))


def ptxas_spills(text: str, kernel: str, dtype: str = "bfloat16") -> list:
    """[(mangled name, spill-store bytes)] of every instantiation of ``kernel`` for ``dtype`` in ``ptxas -v`` output
    (compile_only's), in the order ptxas reports them."""
    props = re.findall(r"Function properties for (\S+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores", text)
    return [(name, int(spill)) for name, _, spill in props if kernel in name and dtype in name]


def build(name: str, sources, subdir: str):
    """(the loaded extension, torch): torch.utils.cpp_extension.load of ``sources`` into $SDQUANT_CACHE_DIR/<subdir>."""
    import torch
    from torch.utils.cpp_extension import load

    from sdquant.kernels import int4_cuda
    d = Path(os.environ.get("SDQUANT_CACHE_DIR", "/tmp/sdq_ext")) / subdir
    d.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(s) for s in sources], extra_cflags=["-O3", "-std=c++17"],
                extra_cuda_cflags=int4_cuda.NVCC_FLAGS, extra_include_paths=[str(int4_cuda.CSRC)],
                build_directory=str(d), verbose=False), torch


@contextlib.contextmanager
def pdl_on(early_trigger: bool = True):
    """The shipped CUDA ops launched with programmatic dependent launch inside: with the early trigger (the e2e
    default's), or without it (each kernel lets the next launch only after its main loop)."""
    from sdquant.kernels import int4_cuda
    old = int4_cuda.set_pdl(True, early_trigger=early_trigger)
    try:
        yield
    finally:
        int4_cuda.set_pdl(bool(old), early_trigger=old == 2)
