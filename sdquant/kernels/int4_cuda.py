"""The CUDA C++ W4A16 decode kernel for Hopper (sm_90a), built on first use, as the op ``sdquant::w4a16_cuda``.

    torch.ops.sdquant.w4a16_cuda(x, qweight, scales, zeros, perm, locks, bias, splits=0, evict_first=False,
                                 config=-1) -> y
        x        fp16/bf16 [..., K]            (dtype must match zeros)
        qweight  int32 [N/64, K/16, 32, 4]     scales fp16 / zeros x.dtype [G, N/64, 8, 8]  (int4_layout.repack_cuda)
        perm     int32 [K] or None             act-order: x[:, perm] is gathered before the kernel
        locks    int32 [max(N/64, 1024)]       split-K / stream-K counters; zero before and after every call (so one
                                               layout must not run on two streams at once)
        bias     dtype [N] or None
        splits   split-K factor, 0 = automatic (fill every SM once)
        evict_first  copy weights with an L2 evict-first policy (use only if ``evict_first_works()``; variant 0 only)
        config   kernel variant + 64 * target, -1 = ``auto_config`` (the measured defaults). variant: an id of
                 the list in csrc/w4a16_kernel.cuh (0 = the run-3 kernel; 1-7 differ in warps per CTA, intra-CTA
                 split-K, pipeline depth and stage-wide shared-memory reads; 8-12 are the direct kernel of
                 csrc/w4a16_direct.cuh, global -> register loads with no shared-memory pipeline; 13-27 the
                 stream-K kernel of csrc/w4a16_streamk.cuh, a persistent grid of the resident slots walking a
                 flattened tile x K space (13-18 with a register ring like 8-12, 19-22 with a per-warp
                 shared-memory cp.async ring, 23-25 = 14/13/16 plus an L2 bulk prefetch 8 stages ahead, 26-27
                 one block a CTA with its warps interleaving 4 KB chunks; 28-37 the lean direct kernel of
                 csrc/w4a16_lean.cuh, 64-96 registers for 20-32 warps per SM, a ring of single K steps, the
                 group scale on the weights in bf16 (28-37, 42) or raw magic-number codes into the MMA with
                 zero and scale applied per group in fp32 (46-48), the splits of a tile reducing through
                 distributed shared memory as one thread-block cluster (28-36) or fp32 partials (37, 42);
                 38-41 and 43-44 the tight kernel of csrc/w4a16_tight.cuh, the direct kernel's stream and arithmetic
                 in a loop of static indices (chunks of 64 K, groups a multiple of 64, else they run 10; 43-44 with
                 the raw codes); 45 the
                 stream-K kernel with the raw codes; 46-49 the lean kernel on a flat grid of the resident slots,
                 every warp an equal share of the flattened block x K-step space; 50-57 the bulk-copy kernel of
                 csrc/w4a16_bulk.cuh, the direct kernel's grid and arithmetic fed through a per-warp
                 shared-memory ring that lane 0 fills with one cp.async.bulk (TMA) copy a chunk; 58-59 the same on the
                 flat grid of 46-49, every warp one contiguous byte range of the fragments; 60-61 the feed kernel of
                 csrc/w4a16_feed.cuh (M <= 8, else the M <= 8 default runs): one CTA a SM streams one contiguous
                 range of the fragments through a 192 KB shared-memory ring of large bulk copies, 16 warps doing
                 the direct kernel's arithmetic from it (60: 32 KB stages, K % 1024 == 0; 61: 16 KB stages,
                 K % 512 == 0; groups a multiple of 64 / 32); 62-63 the wgmma kernel
                 of csrc/w4a16_wgmma.cuh, the fragments as the register A operand of warpgroup MMAs, 256 features x
                 16-128 tokens a CTA, M <= 256 a launch (all M in one where ``launch_rows`` says), N % 256 == 0, split-K summed in the last CTA (62) or a
                 second kernel (63; at the 128-token tile, where csrc/w4a16.h ``sdq_wg_ws_auto`` picks it, a
                 warp-specialized form whose producer warpgroup issues TMA copies; ``set_wgmma_schedule``); 1-61:
                 M <= 16 only, larger M uses 0 -- or 2 / 5 / 37 / 42, NT4_VARIANTS, instantiated up to M = 32);
                 target: automatic split-K (stream-K: the grid) aims at target / 2 CTAs per SM (0 = the variant's
                 default). Run 4 encoded configs as variant + 16 * target; every config it set had target 0, so
                 those values mean the same here.

Variants 0-61 are best at M <= 16 (the tokens are the n8 side of the MMA, the weights the 16-row side); M <= 32
runs in one launch, larger M in 32-row launches that each re-read the weights. The wgmma kernel (62-63) takes 256
rows a launch, or every row of a larger M where its warp-specialized form runs that M (``launch_rows``,
``set_wgmma_rows``); ``auto_config`` runs it above M = 32 and at the M = 9-32 points where it was measured faster. ``set_pdl`` launches variants 0-12, 38-41, 43-44 and 50-61 with programmatic dependent launch (``Transformer.compile_decode``
does on Hopper). On CPU tensors the op evaluates the layout with PyTorch
(``int4_layout.dequantize_cuda``), which is what opcheck and the CPU tests exercise.

``sdquant::w4a16_cuda_fused`` (below, ``QuantLinear.forward_fused``, the runtime's ``Block.forward_fused``) runs the tight
kernel (M <= 8) in a build with the decode block's RMSNorm scale, SiLU * up and residual add in its prologue and epilogue.

Building: ``torch.utils.cpp_extension.load`` compiles csrc/w4a16_binding.cpp, csrc/w4a16_sm90.cu (the C
interface) and csrc/w4a16_part_*.cu (the kernel instantiations of w4a16_kernel.cuh / w4a16_direct.cuh) with
``-gencode=arch=compute_90a,code=sm_90a`` (one translation unit per dtype and token-tile count, so ninja builds
them in parallel) into ``$SDQUANT_CACHE_DIR`` (default ~/.cache/sdquant/extensions);
later processes reuse the build. ``available()`` says whether the kernel can run here; when it cannot (no
CUDA, not sm_90, no nvcc, build error) it warns once and callers fall back to the Triton kernels.
``nvcc_compile(out_dir)`` compiles the kernel files alone (no torch headers) — used by the CI compile test.
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
KERNEL_SRC = CSRC / "w4a16_sm90.cu"          # the C interface (w4a16.h)
PART_SRCS = sorted(CSRC.glob("w4a16_part_*.cu"))  # kernel instantiations, one per (dtype, token tiles)
KERNEL_SRCS = [KERNEL_SRC, *PART_SRCS]
BINDING_SRC = CSRC / "w4a16_binding.cpp"
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", *ARCH_FLAGS]
# torch.utils.cpp_extension adds these to every nvcc call of the extension build (no implicit half/bf16 conversions
# or operators); nvcc_compile passes them too, so the CI compile fails where the extension build would
TORCH_NVCC_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]

_STATE: dict = {}


def nvcc_path() -> Optional[str]:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cuobjdump_path() -> Optional[str]:
    """cuobjdump from PATH, or the copy Triton ships (None: neither); offline SASS for tests and bench/sass_loops.py."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(p) if p.exists() else None


def nvcc_compile(out_dir: str, extra_flags: tuple = ()) -> subprocess.CompletedProcess:
    """Compile the kernel translation units alone for sm_90a (object files + ptxas resource report), in parallel.
    Returns one CompletedProcess: returncode = the first non-zero one, stdout/stderr concatenated."""
    from concurrent.futures import ThreadPoolExecutor
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")

    def one(src: Path) -> subprocess.CompletedProcess:
        out = Path(out_dir) / (src.stem + ".o")
        cmd = [nvcc, "-c", *NVCC_FLAGS, *TORCH_NVCC_DEFINES, "-Xptxas", "-v", *extra_flags, str(src), "-o", str(out)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    with ThreadPoolExecutor(max_workers=max(1, min(len(KERNEL_SRCS), os.cpu_count() or 1))) as pool:
        results = list(pool.map(one, KERNEL_SRCS))
    rc = next((r.returncode for r in results if r.returncode), 0)
    return subprocess.CompletedProcess([str(s) for s in KERNEL_SRCS], rc, "".join(r.stdout for r in results),
                                       "".join(r.stderr for r in results))


def _cache_dir() -> Path:
    root = os.environ.get("SDQUANT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sdquant")
    tag = f"torch{torch.__version__.split('+')[0]}_cuda{torch.version.cuda}".replace(".", "")
    d = Path(root) / "extensions" / tag
    d.mkdir(parents=True, exist_ok=True)
    return d


def build_options() -> tuple:
    """(module name, nvcc flags, build directory) of ``extension()``. SDQUANT_NVCC_FLAGS (environment, a measurement
    switch: unset in normal use) appends nvcc flags such as ``-DSDQ_TIGHT_L2PF=1``, so that one device call can time a
    compile-time switch of the kernels against the default in two processes; such a build gets a module name and a
    directory of its own (a hash of the flags), so it never reuses or overwrites the default build."""
    extra = os.environ.get("SDQUANT_NVCC_FLAGS", "").split()
    if not extra:
        return "sdquant_w4a16_sm90", list(NVCC_FLAGS), _cache_dir()
    import hashlib
    h = hashlib.sha1(" ".join(extra).encode()).hexdigest()[:10]
    d = _cache_dir() / f"flags_{h}"
    d.mkdir(parents=True, exist_ok=True)
    return f"sdquant_w4a16_sm90_{h}", [*NVCC_FLAGS, *extra], d


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
            name, flags, build_dir = build_options()
            ext = load(name=name, sources=[str(BINDING_SRC), *map(str, KERNEL_SRCS)],
                       extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=flags,
                       extra_include_paths=[str(CSRC)], build_directory=str(build_dir), verbose=False)
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


N_VARIANTS = 64
STREAMK_VARIANTS = (*range(13, 28), 45)
LEAN_VARIANTS = (*range(28, 38), 42, *range(46, 50))  # WSCALE applies to bf16 only (fp16 keeps fp32 group sums in-kernel)
NT4_VARIANTS = (2, 5, 37, 42)  # instantiated for M = 17-32 too (four token tiles); the others stop at M = 16
TIGHT_VARIANTS = (38, 39, 40, 41, 43, 44)  # csrc/w4a16_tight.cuh (43-44 raw codes; these ids were raw-code lean configs)
BULK_VARIANTS = tuple(range(50, 60))  # csrc/w4a16_bulk.cuh: fp32 group sums, both dtypes (58-59: flat grid)
FEED_VARIANTS = (60, 61)  # csrc/w4a16_feed.cuh: M <= 8 (else the M <= 8 default); these ids were flat bulk-copy configs
# csrc/w4a16_wgmma.cuh: warpgroup MMA, the dequantized weights the register A operand, 256 features x 16/32/64 tokens a
# CTA, M <= 256 a launch, N % 256 == 0; the weight scaled in the activation dtype (both dtypes), except at the 16-token
# tile with groups a multiple of 128, where the raw codes go into the wgmma and each group is scaled in fp32. Split-K:
# 62 sums the splits in the last CTA of a tile, 63 in a second kernel over the whole GPU
WGMMA_VARIANTS = (62, 63)

# Measured defaults (bench/int4_tune.py, H200 runs 4 and 5, bf16, group 128; docs/benchmarks/int4-cuda.md "INT4 CUDA kernel
# tuning (run 4)" / "(run 5)"): config per M bucket = best geometric mean over the 7 Llama shapes, and per (K, N,
# M bucket) the shapes whose own winner beat that default by > 3% in the same run. A config is variant + 64 * target
# (see the module docstring); 0 = the run-3 kernel. M <= 8: variant 10 (direct loads, 2 blocks x 4 K-warps) was
# fastest or within 3-7% everywhere and never slower than variant 0; M = 9-16: variant 2 (4 blocks x 2 K-warps)
# had the best mean, but was slower than variant 0 on 8192x28672 and 8192x10240 (overridden below).
# Run 5 (stream-K variants 13-27) changed three points, each faster than run 4's config in both of its passes:
# 8192x28672 M=1 -> 17 (stream-K, 8 blocks a CTA, per-weight scale: 48.5 / 49.6 us vs v5 49.7 / 50.4),
# 4096x6144 M=1 -> 11 (10.1 / 10.2 vs v1 10.2 / 10.6), 8192x10240 M=9-16 -> 0 (34.4 / 34.2 vs v1 34.6 / 34.5).
# Run 6 (docs/benchmarks/int4-cuda.md "INT4 CUDA kernel tuning (run 6 ...)", first sweep at 16db4d8 with its confirm pass) changed two points, the lm_head
# shape 4096x128256 at M = 1 and 2 -> 17 (stream-K): 99.0 / 99.1 and 100.3 / 100.4 us vs v10 103.9 / 114.0 and
# 104.0 / 114.2 in the two passes (v17's code is unchanged since: identical SASS).
# Run 6b (second sweep at 688daaf, variants 37-49 against these defaults, bench/results/int4_tune_h200_run6b.*)
# changed seven points, each faster than the previous default in both passes: the lm_head shape 4096x128256 at
# M = 1-8 -> 5 (95.1 / 98.6 us vs v17 100.8 / 101.5 at M = 1; 97.2-101.5 vs 102.4-106.1 at M = 2-8) and
# 4096x6144 at M = 2-8 -> 37 (lean, 1 block x 8 K-warps: 10.5-10.8 vs v10 10.8-11.7).
# Run 7a (2026-12-01, commit 546ed8d, bench/results/int4_tune_h200_run7a.*): M = 9-16 default -> 37, faster than the
# previous config in both passes on 14336x4096 (22.0 / 22.2 vs v2 25.1 / 25.2 us), 4096x4096 (11.1 / 11.0 vs v10
# 12.4 / 12.6) and 4096x28672 (39.0 / 39.3 vs v5 39.9 / 40.2); the lm_head shape at M = 9-16 -> 5 (110.5 / 109.9 vs
# v2 138.4 / 137.4). 8192x10240 and 4096x6144 keep their M = 16 configs (not timed in that run).
# Run 7c (36ae57a, bench/results/int4_tune_h200_run7c.*: 37 and 42 at M = 17-32 against variant 0): M = 17-32 -> 37 on
# the three narrow shapes, at M = 24 / 32: 14336x4096 37.8 / 38.9 us vs v0 38.4 / 44.5, 4096x4096 16.4 / 17.5 vs
# 28.5 / 34.7, 4096x6144 20.1 / 20.5 vs 28.6 / 33.2; v0 stays faster on the 28672-wide and 8192-deep shapes.
# Run 7d (74514b0, bench/results/int4_tune_h200_run7d.*, one pass: int4_tune's proposal covered M <= 16 then): the
# cp.async variant 2 at four tiles, M = 24 / 32: 4096x28672 53.7 / 54.9 us vs v0 54.6 / 61.1 (bf16 57.4 / 57.6),
# 14336x4096 34.8 / 37.8 vs v37 37.9 / 39.4 and v0 38.4 / 45.1 (bf16 31.9 / 33.5), 8192x10240 46.8 / 50.4 vs v0
# 53.3 / 61.0 (bf16 48.9 / 50.1) -> bucket 32 = 2 there.
# 4096x6144 at M = 9-16 -> the default 37 (it kept run 4's v4 until 7e): v37 15.3 / 14.7 us in runs 7a / 7e against
# bf16 16.2 / 15.4 in the same runs, where v4 took 17.4 against bf16's 15.7 in run 5 (slower than bf16).
# 2026-12-01 (858258f, bench/ab_build.py: the direct kernel of a73e897 and of this tree built side by side in one
# process, outputs bit-identical): the direct kernel after the set_x_smem change (activations still through L1) is
# 7-12% faster on the large shapes at M = 1-4 (8192x28672 50.8 -> 44.9 us, 28672x8192 47.1 -> 41.8, 4096x28672 27.0 ->
# 24.2); the cause is the compiled code (the same with the 16 KB shared-memory reservation compiled out), not the
# machine. With it v10 beat the stream-K / cp.async configs of 8192x28672 (M = 1: v17 48.9) and 28672x8192 (M = 1-2: v5
# 44.8 / 45.8 against v10 42.0 / 42.5) in bench/x_smem.py's run, so those points moved to v10.
# 2026-12-02 (int4_tune runs 9-10, trees 8957ea5 / 2a51ef5, bench/results/int4_tune_h200_run{9_tight,10_tight_raw}.*):
# the tight kernel (variants 38-41, csrc/w4a16_tight.cuh) beat v10 at M = 1-8 on every shape but 4096x4096 (a tie),
# both runs and both confirm passes: 8192x28672 M = 1 39.0 / 39.3 us vs v10 45.2 / 45.9, 28672x8192 37.4 vs 42.3,
# 4096x28672 21.6-21.8 vs 24.3-24.8 -> M = 1-8 default 38 (2 blocks x 4 K-warps). The lm_head shape -> 39 (75.8-79.1
# us vs v38 78.5-82.3 and v12 87.4-88.0), 4096x6144 M = 1 -> 40 (9.1-9.2 vs v38 9.9 and v11 9.9); 4096x6144 M = 8
# keeps 37 (10.5-10.6 vs v38 11.1). The raw-code twins 43-44 were 3-6% slower than 38-39 at M = 1-8.
DEFAULT_CONFIGS = {1: 38, 2: 38, 4: 38, 8: 38, 16: 37}
SHAPE_CONFIGS: dict = {  # (K, N, M bucket) -> config
    (4096, 6144, 1): 40,
    (8192, 28672, 16): 5, (28672, 8192, 16): 5, (8192, 10240, 16): 0,
    (4096, 128256, 1): 39, (4096, 128256, 2): 39, (4096, 128256, 4): 39, (4096, 128256, 8): 39, (4096, 128256, 16): 5,
    (4096, 6144, 8): 37,
    (14336, 4096, 32): 2, (4096, 4096, 32): 37, (4096, 6144, 32): 37, (4096, 28672, 32): 2, (8192, 10240, 32): 2,
}
# fp16 where SHAPE_CONFIGS holds a per-weight-scale variant (see WSCALE_TWIN): the config fp16 had before, since the
# fp32-group-sum twin was much slower there in bf16 (v13 56.7 us vs v5 49.7 at 8192x28672 M=1, run 5)
FP16_SHAPE_CONFIGS: dict = {}  # (8192, 28672, 1) -> 5 until that point moved from v17 to v10


# Programmatic dependent launch of variants 0-12 (cp.async and direct kernels): 0 off (default), 1 on, 2 on + early
# trigger.
_PDL = [0]


def set_pdl(enabled: bool, early_trigger: bool = False) -> int:
    """Launch variants 0-12, 38-41, 43-44 and 50-61 with programmatic dependent launch from now on in this process: a kernel may
    start while the previous kernel of the stream finishes; the direct (8-12) and bulk-copy (50-61) kernels request
    their first weights, then wait
    (``griddepcontrol.wait``) before it reads activations, the cp.async kernel (0-7) waits at its start; each lets
    the next kernel launch after its main loop (``early_trigger``: right after its wait). It pays when the kernels around it are PDL-aware too (inductor's
    ``triton.enable_pdl``). Read at launch time, so set it before a CUDA graph is captured. Returns the previous
    setting (0 off, 1 on, 2 on with the early trigger)."""
    old = _PDL[0]
    _PDL[0] = (2 if early_trigger else 1) if enabled else 0
    return old


def _pdl_mode() -> int:
    """The launch's PDL mode: set_pdl's, or 3 (the tight kernel triggers before its prologue; the others as 2) with
    the early trigger and SDQUANT_GEMM_TRIGGER=first (measurements, read at launch time)."""
    v = os.environ.get("SDQUANT_GEMM_TRIGGER") or "wait"
    if v not in ("wait", "first"):
        raise ValueError(f"SDQUANT_GEMM_TRIGGER={v}: must be 'wait' or 'first'")
    return 3 if _PDL[0] == 2 and v == "first" else _PDL[0]


# Activations of the direct kernel (variants 8-12) staged in shared memory (1) or read through L1 every K step (0,
# the measured default). bench/read_order.py --factors (H200, 2026-12-01) found the M = 1 activation reads alone
# taking the bare weight stream from 29.7 to 52.3 us on 8192x28672.
_XS = [0]


def set_x_smem(enabled: bool) -> int:
    """The direct kernel (variants 8-12) copies its CTA's activation range to shared memory once and reads its MMA
    fragments there (when it fits in 16 KB: M x the CTA's K range), from now on in this process. Read at launch
    time, so set it before a CUDA graph is captured. Returns the previous setting."""
    old = _XS[0]
    _XS[0] = 1 if enabled else 0
    return old


# A last, part-filled 128-token tile of a wgmma launch (M > 128) computes a whole tile however few of its rows are real.
# Where that tile costs more than a small-M launch of its rows, they run as one: -1 (the default) by the automatic
# rules of ``remainder_rows``, 0 never, 1..127 always where the tile holds at most that many rows (A/B runs).
_REM = [-1]
# At M > 256 on the one-launch path: split off at most this many rows, where the tile adds a wave to <= 2 waves
WAVE_TAIL_ROWS = 64


def set_wgmma_remainder(rows: int) -> int:
    """From now on in this process, how a wgmma launch (variants 62-63, automatic or given) of M > 128 rows treats a
    last 128-token tile of 1..127 rows: -1 (the default) the automatic rules of ``remainder_rows``; 0 never splits
    it off; 1..127 runs those rows as a second launch with the small-M kernels' automatic config wherever they are at
    most that many. Returns the previous setting. For A/B runs (bench/int4_wgmma.py --schedule rem0 / rem32 /
    rem64)."""
    if not -1 <= int(rows) < 128:
        raise ValueError(f"rows: {rows} is not in -1..127")
    old = _REM[0]
    _REM[0] = int(rows)
    return old


def remainder_rows(m: int, config: int, tail: int = 0, n: int = 0, sms: int = 0, one_launch: bool = False) -> int:
    """The rows of M that ``w4a16_cuda`` runs as a launch of their own (0: none): r = M mod 128 at M > 128 on a
    wgmma config (62 / 63), where
    * ``set_wgmma_remainder`` set a limit: r <= it (A/B runs);
    * automatic, M = 129-256: r <= ``tail``, the op's argument (a layer plan's ``dispatch.cuda_tail_rows``, from the
      crossover table's times);
    * automatic, M > 256 where the first M - r rows run in one launch (``one_launch``; N features, ``sms`` SMs, one
      CTA a SM): r <= 64 and the last tile's row of N / 256 tiles raises the waves from at most 2. H100, int4_wgmma
      run 45 (us, as now -> split), M = 1040 / 1088: 4096x4096 99.3 / 108.3 -> 57.8 / 63.8 and 14336x4096 238.6 /
      246.3 -> 180.1 / 194.8 (144 tiles fill 2 waves too thinly for one launch, so M ran as 256-row launches, while
      the 128 tiles of M = 1024 run as one); 28672x8192 937.4 / 881.5 -> 739.5 / 747.1 (2 -> 3 waves); level or
      2-5% faster on 8192x28672 and 4096x28672 (7 -> 8 waves); 5-13% slower on 8192x10240 and 4096x6144 (no added
      wave)."""
    r = m % 128
    if m <= 128 or r == 0 or split_config(config)[0] not in WGMMA_VARIANTS or _REM[0] == 0:
        return 0
    if _REM[0] > 0:
        return r if r <= _REM[0] else 0
    if m <= 256:
        return r if r <= tail else 0
    if not one_launch or sms <= 0 or n < 256 or r > WAVE_TAIL_ROWS:
        return 0
    full, last = (m // 128) * (n // 256), n // 256
    w_full, w_all = -(-full // sms), -(-(full + last) // sms)
    return r if w_all > w_full and w_full <= 2 else 0


WGMMA_SCHEDULES = {"auto": 0, "split": 1, "stream": 2, "ws": 3, "wssk": 4}


def set_wgmma_schedule(mode: str) -> str:
    """How variant 62-63's 128-token tile (M = 65-256) runs, for launches and split / grid queries from now on in this
    process: "auto" (the default: csrc/w4a16.h ``sdq_wg_ws_auto`` picks the warp-specialized split-K for variant 63
    where it was measured faster, else ``wg_stream_k`` picks stream-K at M > 128 where split-K would leave more than a
    tenth of the resident slots idle over its waves -- for variant 63, with groups a multiple of 128 and K of 128, the
    stream-K over the warp-specialized pipeline -- else split-K), "split" (split-K, the single-role pipeline),
    "stream" (stream-K) or "ws" (variant 63's warp-specialized split-K: a producer warpgroup issues TMA copies; groups a
    multiple of 128 and K of 128, else split-K) or "wssk" (variant 63's stream-K over that pipeline: one CTA a SM, each
    an equal range of the (tile, stage) units, M <= 256; groups a multiple of 128 and K of 128, else split-K). For A/B runs (bench/int4_wgmma.py --schedule). Read at launch time, so
    set it before a CUDA graph is captured. Returns the previous mode ("auto" where the extension is not built)."""
    if mode not in WGMMA_SCHEDULES:
        raise ValueError(f"mode: {mode!r} is not one of {sorted(WGMMA_SCHEDULES)}")
    ext = extension()
    if ext is None:
        return "auto"
    old = int(ext.set_wg_schedule(WGMMA_SCHEDULES[mode]))
    return {v: k for k, v in WGMMA_SCHEDULES.items()}[old]


def _ext_set(setter: str, value, without):
    """Call the extension's process setting ``setter`` with int(value) and return what it held before, or ``without``
    where the extension is not built (the setting's default)."""
    ext = extension()
    return without if ext is None else getattr(ext, setter)(int(value))


def set_wgmma_rows(rows: int) -> int:
    """Rows a launch of the wgmma kernel (variants 62-63) takes from now on in this process: 0 (the default: every row
    in one launch where variant 63's warp-specialized kernel runs that M, else 256 rows a launch) or 256 (always
    256-row launches, the rule before). For A/B runs (bench/int4_wgmma.py --rows). Read at launch time, so set it
    before a CUDA graph is captured. Returns the previous setting (0 where the extension is not built)."""
    if rows not in (0, 256):
        raise ValueError(f"rows: {rows!r} must be 0 (automatic) or 256")
    return int(_ext_set("set_wg_rows", rows, 0))


def set_wgmma_one_launch_k(k_max: int) -> int:
    """From now on in this process, variant 63 runs every row of M > 256 in one launch wherever K <= ``k_max``, whatever
    its fill test says (csrc/w4a16.h ``sdq_wg_one_launch_short_k``); 4096 by default (measured: docs/benchmarks/pending.md
    Pending 42), 0 turns it off (bench/int4_wgmma.py --schedule k0). Read at launch time, so set it before a CUDA graph
    is captured. Returns the previous setting (0 where the extension is not built)."""
    if int(k_max) < 0:
        raise ValueError(f"k_max: {k_max!r} must be >= 0 (0: off)")
    return int(_ext_set("set_wg_one_launch_k", k_max, 0))


def m_bucket(m: int) -> int:
    for b in (1, 2, 4, 8, 16):
        if m <= b:
            return b
    return 32


# Stream-K variants that multiply each dequantized weight by its scale in the activation dtype ("WSCALE", see
# csrc/w4a16_streamk.cuh) -> their twin with fp32 group sums. fp16 products of (code - zero) and a scale below
# ~6e-5 would be subnormal, so auto_config sends fp16 activations to the twin (bf16 has fp32's range).
WSCALE_TWIN = {14: 13, 15: 16, 17: 13, 18: 16, 20: 19, 22: 19, 23: 24, 27: 26}


def tuned_configs(path) -> tuple:
    """(DEFAULT_CONFIGS, SHAPE_CONFIGS) proposed by a ``bench/int4_tune.py`` run (its JSON's "chosen" entry,
    from the sweep's confirm pass), in this module's format. Raises ConfigError when the file holds none."""
    import json
    from pathlib import Path

    from sdquant.errors import ConfigError
    try:
        chosen = json.loads(Path(path).read_text()).get("chosen") or {}
        defaults = {int(b): int(c) for b, c in chosen["DEFAULT_CONFIGS"].items()}
        shapes = {}
        for key, c in chosen["SHAPE_CONFIGS"].items():
            kn, b = key.split(":M")
            k, n = (int(v) for v in kn.split("x"))
            shapes[(k, n, int(b))] = int(c)
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise ConfigError("int4 tuned configs", f"{path}: no proposed defaults from bench/int4_tune.py "
                                                f"({type(e).__name__}: {e})") from None
    return defaults, shapes


def use_configs(defaults: dict, shapes: dict) -> tuple:
    """Make ``auto_config`` use these (DEFAULT_CONFIGS, SHAPE_CONFIGS) in this process (e.g. a fresh tuning
    run's, before they are committed); returns the previous pair so that it can be restored."""
    global DEFAULT_CONFIGS, SHAPE_CONFIGS
    old = (DEFAULT_CONFIGS, SHAPE_CONFIGS)
    DEFAULT_CONFIGS, SHAPE_CONFIGS = dict(defaults), dict(shapes)
    return old


# The wgmma kernel (variants 62-63, csrc/w4a16_wgmma.cuh) over the configs above, where it was measured faster
# (bench/int4_wgmma.py, H200 runs 2-11, docs/benchmarks/int4-wgmma.md "INT4 wgmma kernel"; raw bench/results/int4_wgmma_h200_run*):
# every M > 32 (the older kernels re-read the weights once per 32 rows there), and at M = 9-32 on the shapes listed.
# Needs N % 256 == 0. 63 (split-K summed by a second kernel) is the default above M = 32 and wins on the narrow shapes
# (run 11, M = 32: 4096x4096 12.5 us vs the previous config's 17.3, 4096x6144 14.2 vs 20.1, 14336x4096 22.0 vs 37.3);
# 62 (summed in the last CTA of a tile) where it was faster or the two tie (run 11, M = 32: 8192x28672 62.2 vs 66.5,
# 4096x28672 36.5 vs 37.5, 28672x8192 59.1 vs 59.7). At M = 9-16 where either beat the previous config by > 3% (run 11:
# 14336x4096 19.5 vs 21.6, 8192x28672 53.0 vs 65.0); 4096x4096 kept v37 there (10.7 vs 63's 10.7) until run 18.
WGMMA_DEFAULT = {64: 63, 128: 63, 256: 63}
WGMMA_SHAPE_CONFIGS: dict = {
    (8192, 28672, 32): 62, (4096, 28672, 32): 62,
    # 63 since the cheaper stage copies (2026-12-07): ab_build runs 24-25 (H100, same process, us, 62 / 63 at
    # M = 32) 28672x8192 60.4 / 58.9 and 60.2 / 58.2, 8192x10240 27.9 / 26.8 and 27.8 / 27.0
    (28672, 8192, 32): 63, (8192, 10240, 32): 63,
    (14336, 4096, 32): 63, (4096, 4096, 32): 63, (4096, 6144, 32): 63,
    (4096, 28672, 16): 62, (28672, 8192, 16): 62, (8192, 28672, 16): 62, (8192, 10240, 16): 63, (4096, 6144, 16): 63,
    (14336, 4096, 16): 63,  # run 7: 19.8 / 20.2 us (runs 7 / 9) vs v37's 21.6
    (4096, 4096, 16): 63,  # run 18: 10.1 us vs v37's 10.9 in the same process (the split-K rule of run 17)
    (4096, 28672, 128): 63,  # run 21: v63 (128-K stages) 63.6 us vs v62 66.4 in the same process (run 11: 62)
    (4096, 128256, 32): 62,  # lm_head, run 6: 139.7 us vs v0 153.9 (v63 145.5; M = 64: 62 175.0, 63 176.6)
}


def wgmma_bucket(m: int) -> int:
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        if m <= b:
            return b
    return 256


def auto_config(m: int, n: int, k: int, dtype=torch.bfloat16, wgmma: bool = True) -> int:
    """The kernel config the op uses when called with config=-1 (measured winners; at M = 17-32 variant 0 or one of
    NT4_VARIANTS; the wgmma kernel where WGMMA_* say, unless ``wgmma`` is False: the choice before it existed)."""
    if wgmma and n % 256 == 0:
        bw = wgmma_bucket(m)
        c = WGMMA_SHAPE_CONFIGS.get((k, n, bw), WGMMA_DEFAULT.get(bw))
        if c is not None:
            return c
    b = m_bucket(m)
    c = SHAPE_CONFIGS.get((k, n, b), DEFAULT_CONFIGS.get(b, 0))
    if b > 16 and c % 64 not in NT4_VARIANTS:
        return 0
    if dtype == torch.float16 and c % 64 in WSCALE_TWIN:
        c = FP16_SHAPE_CONFIGS.get((k, n, b), WSCALE_TWIN[c % 64] + 64 * (c // 64))
    return c


def make_config(variant: int, target: int = 0) -> int:
    """(variant, target) -> config (target = 2 x CTAs per SM for the automatic split-K / stream-K grid)."""
    return variant + 64 * target


def split_config(config: int) -> tuple:
    """config -> (variant, target); bad values fall back to (0, 0)."""
    if config < 0:
        return 0, 0
    v, t = config % 64, config // 64
    return (v if v < N_VARIANTS else 0), (t if t < 64 else 0)


def auto_splits(m: int, n: int, k: int, group_size: int, config: int = 0, dtype=torch.bfloat16) -> int:
    ext = extension()
    v, t = split_config(config)
    return 1 if ext is None else int(ext.auto_splits(m, n, k, group_size // 16, dtype == torch.bfloat16, v, t))


def set_wgmma_cluster(on: bool) -> bool:
    """Whether variant 63's warp-specialized split-K (the 128-token tile, 2-8 splits) sums its splits inside a
    thread-block cluster through distributed shared memory (True, the default: no fp32 partials in global memory, no
    second kernel, the same bits) or through [splits, m, n] partials and ``wg_reduce_kernel`` (False), from now on in
    this process. For A/B runs (bench/int4_wgmma.py --schedule nocl). Returns the previous setting (True where the
    extension is not built)."""
    return bool(_ext_set("set_wg_cluster", bool(on), True))


def set_wgmma_cluster_rows(min_rows: int) -> int:
    """From now on in this process, the fewest rows at which variant 63's 128-token tile sums its warp-specialized
    split-K inside a cluster (csrc/w4a16.h ``sdq_wg_cluster_fit_splits``): 65 by default (M = 65-256; at 65-96 only
    on shapes the warp-specialized split-K's own rule leaves alone, K * N < 2^25), 97 the rule before 2026-12-07
    (bench/int4_wgmma.py --schedule cr97), 257 never. Read at launch time, so set it before a CUDA graph is captured.
    Returns the previous setting (65 where the extension is not built)."""
    if not 65 <= int(min_rows) <= 257:
        raise ValueError(f"min_rows: {min_rows!r} must be 65-257 (the 128-token tile's rows; 257: never)")
    return int(_ext_set("set_wg_cluster_rows", min_rows, 65))


WGMMA_PATHS = {0: "split", 1: "stream", 2: "ws", 3: "ws-cluster", 4: "ws-stream"}


def wgmma_path(m: int, n: int, k: int, group_size: int, config: int = 63, dtype=torch.bfloat16,
               splits: int = 0) -> str:
    """Which path a launch of the wgmma kernel (variants 62-63) of m rows takes with this many splits (0: automatic):
    "split" (split-K), "stream" (stream-K), "ws" (the warp-specialized split-K, splits summed by a second kernel) or
    "ws-cluster" (summed inside a cluster) or "ws-stream" (stream-K over the warp-specialized pipeline); "" where the extension is not built or the config is another kernel."""
    ext = extension()
    if ext is None:
        return ""
    r = int(ext.wg_path(m, n, k, group_size // 16, dtype == torch.bfloat16, split_config(config)[0], int(splits)))
    return WGMMA_PATHS.get(r, "")


def set_wgmma_wave_splits(on: bool) -> bool:
    """Whether the wgmma kernel's one-launch path at M > 256 runs two splits summed in clusters of 2 where its tiles
    alone leave the last wave part-empty (csrc/w4a16.h ``sdq_wg_wave_splits``; on by default, measured in
    docs/benchmarks/int4-wgmma.md "Two splits for the one-launch path's last wave"), from now on in this process. For A/B runs
    (bench/int4_wgmma.py --schedule nowave). Returns the previous setting (True where the extension is not built)."""
    return bool(_ext_set("set_wg_wave_splits", bool(on), True))


def set_wgmma_wave_cost(stages: int) -> int:
    """From now on in this process, what ``set_wgmma_wave_splits``' rule charges the two splits' cluster sum, in
    128-K stages (csrc/w4a16.h ``sdq_wg_wave_splits``): it splits only where the waves of half the work plus this cost
    take less time than the waves of whole tiles. 4 by default (measured: docs/benchmarks/pending.md Pending 42); 0 leaves the
    fill rule alone, the rule before 2026-12-07 (bench/int4_wgmma.py --schedule wc0). Returns the previous setting (4
    where the extension is not built)."""
    if int(stages) < 0:
        raise ValueError(f"stages: {stages!r} must be >= 0 (0: the fill rule alone)")
    return int(_ext_set("set_wg_wave_cost", stages, 4))


def set_wgmma_stream_k_above_256(on: bool) -> bool:
    """Whether variant 63 runs M > 256 as stream-K over the warp-specialized pipeline where its one launch would leave
    the last wave part-empty (csrc/w4a16.h ``sdq_wg_ws_sk_big``; on by default, measured in docs/benchmarks/int4-wgmma.md
    "Stream-K above 256 rows"), from now on in this process. For A/B runs (bench/int4_wgmma.py --schedule nosk).
    Returns the previous setting (True where the extension is not built)."""
    return bool(_ext_set("set_wg_sk_big", bool(on), True))


WGMMA_TWO_MODES = {"never": 0, "auto": 1, "always": 2}


def set_wgmma_two_warpgroups(mode: str) -> str:
    """Whether the wgmma kernel's 32- and 64-token tiles, and its raw 16-token kernel (groups a multiple of 128, K of
    128), run two warpgroups of 128 features a CTA instead of one of 256, from now on in this process: "auto" (the
    default: where the one-warpgroup split-K grid would hold at most one CTA a SM, csrc/w4a16.h ``sdq_wg_two_wg``;
    4096x4096 at M = 17-64 among the Llama shapes), "never" (the kernel before 2026-12-07 15:30 UTC) or "always". For
    A/B runs (bench/int4_wgmma.py --schedule 1wg / 2wg). Read at launch time, so set it before a CUDA graph is
    captured. Returns the previous mode ("auto" where the extension is not built)."""
    if mode not in WGMMA_TWO_MODES:
        raise ValueError(f"mode: {mode!r} is not one of {sorted(WGMMA_TWO_MODES)}")
    old = int(_ext_set("set_wg_two", WGMMA_TWO_MODES[mode], 1))
    return {v: k for k, v in WGMMA_TWO_MODES.items()}.get(old, "auto")


def wgmma_max_clusters(size: int, dtype=torch.bfloat16) -> int:
    """Clusters of ``size`` (2-8) CTAs of the warp-specialized kernel's cluster-sum form resident at once on this
    device (the occupancy calculator's answer; the form runs only where every tile's cluster fits); 0 without the
    extension."""
    ext = extension()
    return 0 if ext is None else int(ext.wg_max_clusters(int(size), dtype == torch.bfloat16))


def launch_rows(m: int, n: int, k: int, group_size: int, config: int, dtype=torch.bfloat16) -> int:
    """Rows one launch of the op takes at this M with this config (32 for variants 0-61; 256 for 62-63, or M where
    the warp-specialized kernel runs it in one launch; see ``set_wgmma_rows``); 0 where the extension is not built."""
    ext = extension()
    if ext is None:
        return 0
    return int(ext.launch_rows(m, n, k, group_size // 16, dtype == torch.bfloat16, split_config(config)[0]))


def occupancy(m: int, group_size: int, config: int = 0, dtype=torch.bfloat16) -> int:
    """Resident CTAs per SM of the kernel that config runs at this M (the occupancy calculator's answer)."""
    ext = extension()
    if ext is None:
        return 0
    return int(ext.occupancy(m, group_size // 16, dtype == torch.bfloat16, split_config(config)[0]))


def read_probe(x: torch.Tensor, layout: dict, kind: int = 0, ctas: int = 0) -> torch.Tensor:
    """Read-bandwidth probe over a CUDA layout's fragments (not a GEMM; the result is meaningless): kind 0 = the
    whole qweight buffer read in order by a grid-stride kernel; 1-6 = the stream-K kernel's loads without the
    arithmetic (csrc/w4a16_kernel.cuh P1-P6) on ``ctas`` CTAs (0 = the probe kernel's resident slots)."""
    ext = extension()
    if ext is None:
        raise RuntimeError(f"int4_cuda unavailable: {_STATE.get('reason')}")
    return ext.read_probe(x, layout["qweight"], layout["scales"], layout["zeros"], int(kind), int(ctas))


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


_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (cached)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def _split_rows(m: int, n: int, k: int, group_size: int, config: int, tail: int, dtype, device) -> int:
    """The rows ``w4a16_cuda`` runs as a launch of their own (``remainder_rows``), with the launch facts that rule
    needs: above 256 rows, whether the full tiles run in one launch, and not where the whole M runs stream-K (its
    ranges spread the last tile's work already)."""
    head = m - m % 128  # the rows before a part-filled last tile: do they run in one launch? (only the wave rule asks)
    one = m > 256 and head < m and _REM[0] < 0 and launch_rows(head, n, k, group_size, config, dtype) >= head
    if one and wgmma_path(m, n, k, group_size, config, dtype) == "ws-stream":
        one = False
    return remainder_rows(m, config, tail, n, _sm_count(device) if one else 0, one)


@torch.library.custom_op("sdquant::w4a16_cuda", mutates_args=())
def w4a16_cuda(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               perm: Optional[torch.Tensor], locks: torch.Tensor, bias: Optional[torch.Tensor],
               splits: int = 0, evict_first: bool = False, config: int = -1, tail: int = 0) -> torch.Tensor:
    """y = x @ W.T + bias over the CUDA fragment layout (see module docstring). ``tail``: at M = 129-256 on the wgmma
    kernel, a last 128-token tile of at most that many rows runs as a small-M launch of its own (``remainder_rows``)."""
    k, n = _check(x, qweight, scales, zeros, perm)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if perm is not None:
        x2 = x2.index_select(1, perm.long() if x2.device.type == "cpu" else perm)
    ext = extension() if x.is_cuda else None
    if ext is None:
        layout = {"qweight": qweight, "scales": scales, "zeros": zeros, "perm": None}
        y = torch.nn.functional.linear(x2, int4_layout.dequantize_cuda(layout).to(x.dtype),
                                       None if bias is None else bias.to(x.dtype))
        return y.reshape(*lead, n)
    x2 = x2.contiguous()
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    if config < 0:
        config = auto_config(x2.shape[0], n, k, x2.dtype)

    def launch(rows: torch.Tensor, sp: int, cfg: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return ext.w4a16(rows, qweight, scales, zeros, locks, sp, bool(evict_first), *split_config(cfg), _pdl_mode(),
                         _XS[0], out)

    m = x2.shape[0]
    r = _split_rows(m, n, k, k // scales.shape[0], int(config), int(tail), x2.dtype, x2.device)
    if r:  # the full 128-token tiles, then the last r rows with their own config, each into its rows of y (row
        # slices of x and y stay 16-byte aligned: K and N are multiples of 64)
        y = x2.new_empty((m, n))
        launch(x2[:-r], int(splits), int(config), y[:-r])
        launch(x2[-r:], 0, auto_config(r, n, k, x2.dtype), y[-r:])
    else:
        y = launch(x2, int(splits), int(config))
    if bias is not None:
        y += bias
    return y.reshape(*lead, n)


@w4a16_cuda.register_fake
def _(x, qweight, scales, zeros, perm, locks, bias, splits=0, evict_first=False, config=-1, tail=0):
    return x.new_empty((*x.shape[:-1], qweight.shape[0] * 64))


# ------------------------------------------------------------------------------------------------------------------
# The fused decode-block op (csrc/w4a16_tight.cuh's TFused kernel, w4a16.h's SdqW4A16FusedParams). A batch-1 decode step
# otherwise runs an add + RMSNorm kernel before qkv and gate/up and a SiLU * up kernel before down, each a few
# microseconds of launch and latency for 8-28 KB of data; here the GEMMs absorb them:
#   producer (o, down; resid, gamma): y = round(x @ W.T) + resid; y2 = round(y * gamma) (the next RMSNorm's input with
#       its weight applied); ss = the sums of squares of y's 64-column blocks [..., N / 64] fp32 (its statistic, in parts)
#   consumer (qkv, gate/up, lm_head; rms_ss = a producer's ss): y = rsqrt(sum(rms_ss) / K + eps) * (x @ W.T), x being
#       the producer's y2; silu: W's 64-row blocks alternate gate, up (interleave_gate_up): y = silu(y_gate) * y_up
FUSED_MAX_M = 8
FUSED_BLOCK = 64  # the gate / up interleave of a silu consumer, and the producer's sum-of-squares blocks
FUSED_T_MAX = 256  # partial sums a row the consumer takes (an RMSNorm input of up to 16384 features)


def fused_config(m: int, n: int, k: int, dtype=torch.bfloat16) -> int:
    """The config the fused op runs: ``auto_config``'s where that is a tight variant, else 38 (the M <= 8 default)."""
    c = auto_config(m, n, k, dtype)
    return c if c % 64 in TIGHT_VARIANTS else 38


def fused_supported(m: int, n: int, k: int, group_size: int) -> Optional[str]:
    """Why the fused op cannot run this shape (None: it can). ``group_size`` -1 = per channel."""
    g = k if group_size in (-1, 0) else group_size
    if not 1 <= m <= FUSED_MAX_M:
        return f"M={m} (the fused kernel takes 1..{FUSED_MAX_M} rows)"
    if n % 128:
        return f"N={n} is not a multiple of 128"
    if k % 64 or g % 64 or k % g:
        return f"K={k} with group {group_size}: K and the group size must be multiples of 64"
    return None


def interleave_gate_up(n_half: int, block: int = FUSED_BLOCK) -> torch.Tensor:
    """Row order of a gate/up weight [2 * n_half, K] (gate rows first) for the silu consumer: 64-row blocks alternating
    gate, up. ``deinterleave_gate_up`` undoes it on the output."""
    if n_half % block:
        raise ShapeError(f"gate/up interleave: {n_half} features is not a multiple of {block}")
    b = torch.arange(n_half).view(-1, block)
    return torch.stack([b, b + n_half], dim=1).reshape(-1)


def deinterleave_gate_up(y: torch.Tensor, block: int = FUSED_BLOCK):
    """(gate, up) of an interleaved gate/up output y [..., 2 * n_half]."""
    lead, n = y.shape[:-1], y.shape[-1]
    v = y.reshape(*lead, n // (2 * block), 2, block)
    return v[..., 0, :].reshape(*lead, n // 2), v[..., 1, :].reshape(*lead, n // 2)


def block_sumsq(y: torch.Tensor, block: int = FUSED_BLOCK) -> torch.Tensor:
    """[..., N] -> fp32 [..., N / block]: the sums of squares of y's column blocks (a producer's ``ss``; one block of
    any width for the first layer's input)."""
    yf = y.float()
    return yf.pow(2).reshape(*y.shape[:-1], -1, block).sum(-1)


def fused_reference(x2, qweight, scales, zeros, rms_ss, rms_eps, silu, resid, gamma):
    """The fused op's maths in PyTorch (CPU tensors, and the tests' reference): fp32 products and the kernel's rounding
    order. Returns (y, y2, ss) with y2 and ss empty without gamma."""
    layout = {"qweight": qweight, "scales": scales, "zeros": zeros, "perm": None}
    y = x2.float() @ int4_layout.dequantize_cuda(layout).float().t()
    if rms_ss is not None:
        y = y * torch.rsqrt(rms_ss.float().sum(-1, keepdim=True) / x2.shape[-1] + rms_eps)
    if silu:
        g, u = deinterleave_gate_up(y)
        y = torch.nn.functional.silu(g) * u
    out = y.to(x2.dtype)
    if resid is not None:
        out = (out.float() + resid.float()).to(x2.dtype)
    if gamma is None:
        return out, out.new_empty((0,)), out.new_empty((0,), dtype=torch.float32)
    return out, (out.float() * gamma.float()).to(x2.dtype), block_sumsq(out)


def _fused_args(name, x, qweight, scales, zeros, rms_ss, config):
    """The fused ops' shared checks: (x2 [M, K], rms_ss as [M, T] or None, N)."""
    k, n = _check(x, qweight, scales, zeros, None)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    why = fused_supported(m, n, k, k // scales.shape[0])
    if why is not None:
        raise ShapeError(f"{name}: {why}")
    if config >= 0 and config % 64 not in TIGHT_VARIANTS:
        raise ShapeError(f"{name}: config {config} is not a tight-kernel variant {TIGHT_VARIANTS}")
    s2 = None if rms_ss is None else rms_ss.reshape(m, -1)
    if s2 is not None and not 1 <= s2.shape[1] <= FUSED_T_MAX:
        raise ShapeError(f"{name}: rms_ss has {s2.shape[1]} partial sums a row (1..{FUSED_T_MAX})")
    return x2, s2, n


def _fused_launch(x2, n, s2, config):
    """The extension's leading arguments for a fused launch: (x2 contiguous and 16-byte aligned, variant, target, pdl,
    rms_ss fp32 contiguous or None); config -1 = ``fused_config``."""
    if config < 0:
        config = fused_config(x2.shape[0], n, x2.shape[1], x2.dtype)
    variant, target = split_config(int(config))
    x2 = x2.contiguous()
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    return x2, variant, target, _pdl_mode(), None if s2 is None else s2.float().contiguous()


@torch.library.custom_op("sdquant::w4a16_cuda_fused", mutates_args=())
def w4a16_cuda_fused(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     locks: torch.Tensor, rms_ss: Optional[torch.Tensor], rms_eps: float, silu: bool,
                     resid: Optional[torch.Tensor], gamma: Optional[torch.Tensor],
                     config: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, y2, ss) over the CUDA fragment layout with the fused RMSNorm / SiLU / residual ends (see above). x [..., K]
    with at most ``FUSED_MAX_M`` rows; rms_ss fp32 [..., T] (T <= 256); resid [..., N_out]; gamma [N_out]; y2 and ss
    (fp32 [..., N_out / 64]) are empty without gamma. N_out = N / 2 with ``silu``. config: a tight variant
    (+ 64 * target), -1 = ``fused_config``."""
    x2, s2, n = _fused_args("w4a16_cuda_fused", x, qweight, scales, zeros, rms_ss, config)
    lead, m = x.shape[:-1], x2.shape[0]
    n_out = n // 2 if silu else n
    d2 = None if resid is None else resid.reshape(-1, n_out)
    if d2 is not None and d2.shape[0] != m:
        raise ShapeError(f"w4a16_cuda_fused: resid must have the {m} rows of x")
    if gamma is not None and gamma.numel() != n_out:
        raise ShapeError(f"w4a16_cuda_fused: gamma has {gamma.numel()} values, the output {n_out} columns")
    ext = extension() if x.is_cuda else None
    if ext is None:
        y, y2, ss = fused_reference(x2, qweight, scales, zeros, s2, rms_eps, silu, d2, gamma)
    else:
        cont = lambda t: None if t is None else t.contiguous()  # noqa: E731
        xl, variant, target, pdl, sl = _fused_launch(x2, n, s2, config)
        y, y2, ss = ext.w4a16_fused(xl, qweight, scales, zeros, locks, variant, target, pdl, sl, float(rms_eps),
                                    bool(silu), cont(d2), cont(gamma), None, None, None, None, 0)
    if gamma is None:
        return y.reshape(*lead, n_out), y2, ss
    return y.reshape(*lead, n_out), y2.reshape(*lead, n_out), ss.reshape(*lead, n_out // FUSED_BLOCK)


@w4a16_cuda_fused.register_fake
def _(x, qweight, scales, zeros, locks, rms_ss, rms_eps, silu, resid, gamma, config=-1):
    n_out = qweight.shape[0] * 64 // (2 if silu else 1)
    y = x.new_empty((*x.shape[:-1], n_out))
    if gamma is None:
        return y, x.new_empty((0,)), x.new_empty((0,), dtype=torch.float32)
    return y, x.new_empty((*x.shape[:-1], n_out)), x.new_empty((*x.shape[:-1], n_out // FUSED_BLOCK),
                                                                dtype=torch.float32)


# The consumer with a decode step's RoPE and KV-cache write in its epilogue (the qkv projection of a layer whose heads
# have 128 features): y = [rope(q), rope(k), v] of the consumer's output, and rope(k), v also stored at slot input_pos
# of the layer's cache kv [2, B, nkv, T, 128]. So no kernel runs between the qkv GEMM and the attention, which reads
# the rotated q from y (docs/benchmarks/pending.md, Pending 26).
ROPE_HEAD_DIM = 128


def rope_why_not(n: int, q_cols: int, kv: torch.Tensor, m: int) -> Optional[str]:
    """Why the RoPE epilogue cannot serve a qkv output of n columns with q_cols query columns into cache kv (None: it
    can)."""
    if kv.dim() != 5 or kv.shape[0] != 2 or kv.shape[4] != ROPE_HEAD_DIM:
        return f"the cache must be [2, B, nkv, T, {ROPE_HEAD_DIM}], got {list(kv.shape)}"
    if q_cols % ROPE_HEAD_DIM or q_cols + 2 * kv.shape[2] * ROPE_HEAD_DIM != n:
        return f"{q_cols} query columns + 2 x {kv.shape[2]} KV heads of {ROPE_HEAD_DIM} do not make the {n} outputs"
    if m > kv.shape[1]:
        return f"{m} rows for a cache of batch {kv.shape[1]}"
    return None


def fused_rope_reference(x2, qweight, scales, zeros, rms_ss, rms_eps, kv, input_pos, cos, sin, q_cols):
    """The RoPE op's maths in PyTorch (CPU tensors, and the tests' reference): the consumer's rounded output, each query
    and key head rotated in fp32 (``decode_attention.rope_q``) and rounded once; writes the cache and returns y."""
    from sdquant.kernels.decode_attention import rope_q
    y = fused_reference(x2, qweight, scales, zeros, rms_ss, rms_eps, False, None, None)[0]
    m, hd = y.shape[0], ROPE_HEAD_DIM
    qk = q_cols + kv.shape[2] * hd
    rot = rope_q(y[:, :qk].reshape(m, -1, hd), cos.reshape(-1), sin.reshape(-1)).to(y.dtype).reshape(m, qk)
    out = torch.cat([rot, y[:, qk:]], dim=1)
    pos = input_pos.reshape(1).to(kv.device)
    for i, part in enumerate((out[:, q_cols:qk], out[:, qk:])):
        kv[i, :m].index_copy_(2, pos, part.reshape(m, -1, 1, hd).to(kv.dtype))
    return out


@torch.library.custom_op("sdquant::w4a16_cuda_fused_rope", mutates_args=("kv",))
def w4a16_cuda_fused_rope(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          locks: torch.Tensor, rms_ss: Optional[torch.Tensor], rms_eps: float, kv: torch.Tensor,
                          input_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_cols: int,
                          config: int = -1) -> torch.Tensor:
    """The consumer (rms_ss, rms_eps: see ``w4a16_cuda_fused``) with the RoPE / KV-cache epilogue: x [B, 1, K] or
    [B, K] (B <= ``FUSED_MAX_M``) -> y [..., N] = [rope(q), rope(k), v]; kv [2, B', nkv, T, 128] (B' >= B) gets
    rope(k), v at slot input_pos (int64 [1]); cos / sin: that position's 128 RoPE values, x's dtype."""
    x2, s2, n = _fused_args("w4a16_cuda_fused_rope", x, qweight, scales, zeros, rms_ss, config)
    lead = x.shape[:-1]
    why = rope_why_not(n, q_cols, kv, x2.shape[0])
    if why is None and (input_pos.numel() != 1 or cos.numel() != ROPE_HEAD_DIM or sin.numel() != ROPE_HEAD_DIM):
        why = f"one position and {ROPE_HEAD_DIM} cos / sin values, got {input_pos.numel()}, {cos.numel()}, {sin.numel()}"
    if why is None and not (kv.dtype == cos.dtype == sin.dtype == x.dtype):
        why = f"kv, cos and sin must have x's dtype {x.dtype}, got {kv.dtype}, {cos.dtype}, {sin.dtype}"
    if why is not None:
        raise ShapeError(f"w4a16_cuda_fused_rope: {why}")
    ext = extension() if x.is_cuda else None
    if ext is None:
        return fused_rope_reference(x2, qweight, scales, zeros, s2, rms_eps, kv, input_pos, cos, sin,
                                    q_cols).reshape(*lead, n)
    xl, variant, target, pdl, sl = _fused_launch(x2, n, s2, config)
    y = ext.w4a16_fused(xl, qweight, scales, zeros, locks, variant, target, pdl, sl, float(rms_eps), False, None, None,
                        kv, input_pos.reshape(1).long(), cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous(),
                        int(q_cols))[0]
    return y.reshape(*lead, n)


@w4a16_cuda_fused_rope.register_fake
def _(x, qweight, scales, zeros, locks, rms_ss, rms_eps, kv, input_pos, cos, sin, q_cols, config=-1):
    return x.new_empty((*x.shape[:-1], qweight.shape[0] * 64))
