"""Which read order lets a decode GEMM stream its weights at the copy bandwidth? (issue 4, H200)

Run 5's probes (docs/BENCHMARKS.md, "What limits us") showed the CUDA kernels' load pattern alone -- every warp
its own contiguous stream of one 64-feature block's fragments, ~2,000 streams at once -- reading 8192x28672's
117 MB at 3.2 TB/s, against 4.3 TB/s for a grid-stride linear sweep of the same bytes. This script varies one
property of the per-warp pattern at a time, over the same bytes and in the same process as the linear sweep:

* ``streams``: how many contiguous per-warp streams the buffer is cut into (one warp each, all resident);
* ``U``: 16-byte loads per lane issued together (a warp's burst = 512 * U contiguous bytes, all in flight);
* ``rot``: each stream starts ``rot * stream index`` bursts into its range (wrapping), so concurrent streams
  sit at unrelated offsets instead of in lockstep at equal power-of-two strides;
* ``order``: 0 = stream s owns the contiguous range s (today's fragment layout: block-major, K-steps inside);
  1 = "K-outer": burst i of stream s lies at (i * streams + s) -- the layout a kernel would get by storing the
  fragments step-major across blocks, so all warps sweep one address window together, like the linear read.

The probe kernels xor what they read and write nothing (a never-true branch keeps the loads). Timing as in
bench/gemm.py: buffers copied past 3x the 60 MB L2 and rotated, back-to-back launches in a CUDA graph, median of
5 replays. Prints a table last and writes JSON to --out.

    python3 bench/read_order.py --out $OUT            # on the GPU machine
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm  # noqa: E402  (timing helpers)

CUDA_SRC = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <stdint.h>

__device__ __forceinline__ uint4 ldg16(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

template <int UNROLL>
__global__ void __launch_bounds__(256) linear_probe(const uint4* src, long long n16, unsigned* sink) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t x = 0;
  for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
    uint4 r[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) r[j] = ldg16(src + i + j * stride);
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) x ^= r[j].x ^ r[j].y ^ r[j].z ^ r[j].w;
  }
  if (x == 0x9e3779b9u && n16 == 0) sink[0] = x;
}

// one warp per stream; a burst = U consecutive 512-byte rows (lane l reads the l-th 16 bytes of each)
template <int U>
__global__ void stream_probe(const uint4* src, long long n16, int streams, int rot, int order, unsigned* sink) {
  const int lane = threadIdx.x & 31;
  const int s = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (s >= streams) return;
  const long long burst16 = 32LL * U;
  const long long bursts = n16 / streams / burst16;  // per stream
  long long b = rot ? ((long long)s * rot) % bursts : 0;
  uint32_t x = 0;
  for (long long i = 0; i < bursts; ++i) {
    const long long idx = order == 0 ? (long long)s * bursts + b : b * streams + s;
    const uint4* p = src + idx * burst16 + lane;
    uint4 r[U];
#pragma unroll
    for (int j = 0; j < U; ++j) r[j] = ldg16(p + j * 32);
#pragma unroll
    for (int j = 0; j < U; ++j) x ^= r[j].x ^ r[j].y ^ r[j].z ^ r[j].w;
    if (++b == bursts) b = 0;
  }
  if (x == 0x9e3779b9u && n16 == 0) sink[0] = x;
}

void linear(torch::Tensor buf, torch::Tensor sink, int64_t ctas) {
  const long long n16 = buf.numel() * buf.element_size() / 16;
  linear_probe<4><<<ctas, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(buf.data_ptr()), n16, reinterpret_cast<unsigned*>(sink.data_ptr()));
}

void streamed(torch::Tensor buf, torch::Tensor sink, int64_t streams, int64_t u, int64_t rot, int64_t order,
              int64_t warps) {
  const long long n16 = buf.numel() * buf.element_size() / 16;
  TORCH_CHECK(n16 % (streams * 32 * u) == 0, "stream_probe: buffer does not divide into streams x bursts");
  const int threads = 32 * warps;
  const int grid = (streams + warps - 1) / warps;
  auto st = at::cuda::getCurrentCUDAStream();
  auto src = reinterpret_cast<const uint4*>(buf.data_ptr());
  auto snk = reinterpret_cast<unsigned*>(sink.data_ptr());
  switch (u) {
    case 1: stream_probe<1><<<grid, threads, 0, st>>>(src, n16, streams, rot, order, snk); break;
    case 2: stream_probe<2><<<grid, threads, 0, st>>>(src, n16, streams, rot, order, snk); break;
    case 4: stream_probe<4><<<grid, threads, 0, st>>>(src, n16, streams, rot, order, snk); break;
    case 8: stream_probe<8><<<grid, threads, 0, st>>>(src, n16, streams, rot, order, snk); break;
    default: TORCH_CHECK(false, "stream_probe: U must be 1, 2, 4 or 8");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""
CPP_SRC = r"""
#include <torch/extension.h>
void linear(torch::Tensor buf, torch::Tensor sink, int64_t ctas);
void streamed(torch::Tensor buf, torch::Tensor sink, int64_t streams, int64_t u, int64_t rot, int64_t order,
              int64_t warps);
"""

# K x N of the Llama decode shapes whose int4 fragments we stream (bytes = K * N / 2)
SHAPES = [(8192, 28672), (4096, 28672), (14336, 4096), (4096, 4096)]


def build():
    from torch.utils.cpp_extension import load_inline
    return load_inline(name="sdquant_read_order", cpp_sources=CPP_SRC, cuda_sources=CUDA_SRC,
                       functions=["linear", "streamed"], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
                       verbose=False)


def points(k: int, n: int):
    """(streams, U, rot, order) to time: the kernels' ~2,000-stream pattern and its one-property variations."""
    blocks = n // 64
    out = []
    for splits in (1, 2, 4, 8):
        streams = blocks * splits
        if streams > 8448:  # 64 resident warps x 132 SMs: all streams must run at once
            continue
        for u in (2, 4, 8):
            for rot in (0, 7):
                out.append((streams, u, rot, 0))
            out.append((streams, u, 0, 1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--warps", type=int, default=2, help="warps per CTA of the stream probe")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    t0 = time.time()
    ext = build()
    gemm.log(f"build {time.time() - t0:.1f}s")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy_bw = gemm.copy_bandwidth(dev)
    sink = torch.zeros(4, dtype=torch.int32, device=dev)
    rows = []
    for spec in args.shapes.split(","):
        k, n = map(int, spec.split("x"))
        nbytes = k * n // 2
        copies = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=dev)
                  for _ in range(gemm.n_copies(nbytes))]
        nr = len(copies)
        us = gemm.time_rotating(lambda i: ext.linear(copies[i % nr], sink, sms * 8), nr)
        rows.append({"K": k, "N": n, "MB": nbytes / 1e6, "kind": "linear", "us": us, "TBps": nbytes / us / 1e6})
        gemm.log(f"{k}x{n} linear {us:.1f} us {nbytes / us / 1e6:.2f} TB/s")
        for streams, u, rot, order in points(k, n):
            if (nbytes // 16) % (streams * 32 * u):
                continue
            us = gemm.time_rotating(lambda i: ext.streamed(copies[i % nr], sink, streams, u, rot, order, args.warps), nr)
            rows.append({"K": k, "N": n, "MB": nbytes / 1e6, "kind": "stream", "streams": streams, "U": u,
                         "rot": rot, "order": order, "us": us, "TBps": nbytes / us / 1e6})
            gemm.log(f"{k}x{n} streams {streams:5d} U {u} rot {rot} order {order}: {us:.1f} us "
                     f"{nbytes / us / 1e6:.2f} TB/s")
        del copies
        torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "copy_TBps": copy_bw,
           "commit": os.environ.get("SDQUANT_COMMIT", "unknown"), "warps_per_cta": args.warps, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "read_order.json", "w") as f:
        json.dump(res, f, indent=1)
    gemm.log(f"\ncopy bandwidth {copy_bw:.2f} TB/s (read+write); µs (TB/s); order 0 = contiguous streams, 1 = K-outer")
    for spec in args.shapes.split(","):
        k, n = map(int, spec.split("x"))
        sub = [r for r in rows if r["K"] == k and r["N"] == n]
        lin = next(r for r in sub if r["kind"] == "linear")
        best = sorted((r for r in sub if r["kind"] == "stream"), key=lambda r: r["us"])[:4]
        gemm.log(f"{k}x{n}: linear {lin['us']:.1f} ({lin['TBps']:.2f}); best: " + "; ".join(
            f"s{r['streams']} U{r['U']} r{r['rot']} o{r['order']} {r['us']:.1f} ({r['TBps']:.2f})" for r in best))


if __name__ == "__main__":
    main()
