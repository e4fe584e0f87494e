"""The CUDA C++ W4A16 decode kernel for Hopper (sm_90a), built on first use, as the op ``sdquant::w4a16_cuda``.

    torch.ops.sdquant.w4a16_cuda(x, qweight, scales, zeros, perm, locks, bias, splits=0, evict_first=False) -> y
        x        fp16/bf16 [..., K]            (dtype must match zeros)
        qweight  int32 [N/64, K/16, 32, 4]     scales fp16 / zeros x.dtype [G, N/64, 8, 8]  (int4_layout.repack_cuda)
        perm     int32 [K] or None             act-order: x[:, perm] is gathered before the kernel
        locks    int32 [N/64]                  split-K counters; zero before and after every call (so one layout
                                               must not run on two streams at once)
        bias     dtype [N] or None
        splits   split-K factor, 0 = automatic (fill every SM once)
        evict_first  copy weights with an L2 evict-first policy (use only if ``evict_first_works()``)

Best at M <= 16 (the tokens are the n8 side of the MMA, the weights the 16-row side); M <= 32 runs in one
launch, larger M in 32-row launches that each re-read the weights (the dispatcher should prefer the Triton GEMM
or cuBLAS there). On CPU tensors the op evaluates the layout with PyTorch
(``int4_layout.dequantize_cuda``), which is what opcheck and the CPU tests exercise.

Building: ``torch.utils.cpp_extension.load`` compiles csrc/w4a16_sm90.cu and csrc/w4a16_binding.cpp with
``-gencode=arch=compute_90a,code=sm_90a`` into ``$SDQUANT_CACHE_DIR`` (default ~/.cache/sdquant/extensions);
later processes reuse the build. ``available()`` says whether the kernel can run here; when it cannot (no
CUDA, not sm_90, no nvcc, build error) it warns once and callers fall back to the Triton kernels.
``nvcc_compile(out_dir)`` compiles the kernel file alone (no torch headers) — used by the CI compile test.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Optional

import torch

from sdquant.errors import ShapeError
from sdquant.kernels import int4_layout

CSRC = Path(__file__).parent / "csrc"
KERNEL_SRC = CSRC / "w4a16_sm90.cu"
BINDING_SRC = CSRC / "w4a16_binding.cpp"
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", *ARCH_FLAGS]

_STATE: dict = {}


def nvcc_path() -> Optional[str]:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def nvcc_compile(out_dir: str, extra_flags: tuple = ()) -> subprocess.CompletedProcess:
    """Compile the kernel translation unit alone for sm_90a (object file + ptxas resource report)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out = Path(out_dir) / "w4a16_sm90.o"
    cmd = [nvcc, "-c", *NVCC_FLAGS, "-Xptxas", "-v", *extra_flags, str(KERNEL_SRC), "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def _cache_dir() -> Path:
    root = os.environ.get("SDQUANT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sdquant")
    tag = f"torch{torch.__version__.split('+')[0]}_cuda{torch.version.cuda}".replace(".", "")
    d = Path(root) / "extensions" / tag
    d.mkdir(parents=True, exist_ok=True)
    return d


def _why_unavailable() -> Optional[str]:
    if not torch.cuda.is_available():
        return "no CUDA device"
    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        return f"compute capability {cc[0]}.{cc[1]} (the kernel is built for sm_90a)"
    if nvcc_path() is None:
        return "nvcc not found"
    return None


def extension():
    """The compiled module (built once per process, cached on disk across processes), or None."""
    if "ext" in _STATE:
        return _STATE["ext"]
    reason = _why_unavailable()
    ext = None
    if reason is None:
        try:
            from torch.utils.cpp_extension import load
            ext = load(name="sdquant_w4a16_sm90", sources=[str(BINDING_SRC), str(KERNEL_SRC)],
                       extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=NVCC_FLAGS,
                       extra_include_paths=[str(CSRC)], build_directory=str(_cache_dir()), verbose=False)
        except Exception as e:  # a compiler/toolkit problem must not take the model down: fall back
            reason = f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
    if ext is None:
        warnings.warn(f"sdquant: CUDA W4A16 kernel unavailable ({reason}); using the Triton kernels instead",
                      RuntimeWarning, stacklevel=2)
    _STATE["ext"] = ext
    _STATE["reason"] = reason
    return ext


def available() -> bool:
    """True when the sm_90a kernel is built (or could be built now) and runs on the current device."""
    return extension() is not None


def evict_first_works() -> bool:
    """Run the tiny cp.async + L2::evict_first probe once. A failure can poison the CUDA context, so call this
    in a throw-away process (bench/gpu_check.py does) before passing evict_first=True anywhere."""
    ext = extension()
    return ext is not None and int(ext.probe_evict_first()) == 0


def auto_splits(m: int, n: int, k: int, group_size: int) -> int:
    ext = extension()
    return 1 if ext is None else int(ext.auto_splits(m, n, k, group_size // 16))


def _check(x, qweight, scales, zeros, perm):
    if qweight.dim() != 4 or qweight.shape[2:] != (32, 4):
        raise ShapeError(f"qweight: expected int32 [N/64, K/16, 32, 4], got {list(qweight.shape)}")
    k, n = qweight.shape[1] * 16, qweight.shape[0] * 64
    if x.shape[-1] != k:
        raise ShapeError(f"x: last dim {x.shape[-1]} does not match the weight's in_features {k}")
    if x.dtype not in (torch.float16, torch.bfloat16) or zeros.dtype != x.dtype or scales.dtype != torch.float16:
        raise ShapeError(f"x: dtype {x.dtype} must be float16/bfloat16 and equal the layout's {zeros.dtype}")
    g = scales.shape[0]
    if g == 0 or k % g or (k // g) % 32 or k % 64 or zeros.shape != scales.shape:
        raise ShapeError(f"w4a16_cuda: K={k} with {g} groups: K must be a multiple of 64 and the group size "
                         f"a multiple of 32")
    if perm is not None and perm.shape != (k,):
        raise ShapeError(f"perm: expected [{k}], got {list(perm.shape)}")
    return k, n


@torch.library.custom_op("sdquant::w4a16_cuda", mutates_args=())
def w4a16_cuda(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               perm: Optional[torch.Tensor], locks: torch.Tensor, bias: Optional[torch.Tensor],
               splits: int = 0, evict_first: bool = False) -> torch.Tensor:
    """y = x @ W.T + bias over the CUDA fragment layout (see module docstring)."""
    k, n = _check(x, qweight, scales, zeros, perm)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if perm is not None:
        x2 = x2.index_select(1, perm.long() if x2.device.type == "cpu" else perm)
    ext = extension() if x.is_cuda else None
    if ext is None:
        layout = {"qweight": qweight, "scales": scales, "zeros": zeros, "perm": None}
        y = torch.nn.functional.linear(x2, int4_layout.dequantize_cuda(layout).to(x.dtype), bias)
        return y.reshape(*lead, n)
    x2 = x2.contiguous()
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    y = ext.w4a16(x2, qweight, scales, zeros, locks, int(splits), bool(evict_first))
    if bias is not None:
        y += bias
    return y.reshape(*lead, n)


@w4a16_cuda.register_fake
def _(x, qweight, scales, zeros, perm, locks, bias, splits=0, evict_first=False):
    return x.new_empty((*x.shape[:-1], qweight.shape[0] * 64))
