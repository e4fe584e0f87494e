"""Which read order lets a decode GEMM stream its weights at the copy bandwidth? (issue 4, H200)

Run 5's probes (docs/benchmarks/int4-cuda.md, "INT4 CUDA kernel tuning (run 5 ...)", its "What limits us") showed the
CUDA kernels' load pattern alone -- every warp its own contiguous stream of one 64-feature block's fragments, ~2,000
streams at once -- reading 8192x28672's 117 MB at 3.2 TB/s, against 4.3 TB/s for a grid-stride linear sweep of the
same bytes. This script varies one property of the per-warp pattern at a time, over the same bytes and in the same
process as the linear sweep:

* ``streams``: how many contiguous per-warp streams the buffer is cut into (one warp each, all resident);
* ``U``: 16-byte loads per lane issued together (a warp's burst = 512 * U contiguous bytes, all in flight);
* ``rot``: each stream starts ``rot * stream index`` bursts into its range (wrapping), so concurrent streams
  sit at unrelated offsets instead of in lockstep at equal power-of-two strides;
* ``order``: 0 = stream s owns the contiguous range s (today's fragment layout: block-major, K-steps inside);
  1 = "K-outer": burst i of stream s lies at (i * streams + s) -- the layout a kernel would get by storing the
  fragments step-major across blocks, so all warps sweep one address window together, like the linear read;
* ``mode`` (what the GEMM kernels add to the bare stream; run 7 found their own load patterns at 36-40 us on
  8192x28672 where this probe's bare streams read at 28-32): 0 = bare 16-byte loads; 1 = plus the M = 1
  activation reads of a decode kernel (per 512-byte row, lanes 0-3 read two 32-bit words of a K-long bf16 vector
  through L1); 2 = the bytes through a per-warp ring of 4 shared-memory slots filled by cp.async.bulk (TMA) with
  mbarriers, as the bulk-copy kernels (variants 50-61) do; 3 = 2 plus the activation reads;
* ``warps``: warps per CTA (the kernels run 4-8; the bare probe ran 2).

The probe kernels xor what they read and write nothing (a never-true branch keeps the loads). Timing as in
bench/gemm.py: buffers copied past 3x the 60 MB L2 and rotated, back-to-back launches in a CUDA graph, median of
5 replays. Prints a table last and writes JSON to --out.

    python3 bench/read_order.py --out $OUT            # on the GPU machine
    python3 bench/read_order.py --out $OUT --factors  # what the kernels add to the bare stream (modes, warps)
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

// the same stream with what the GEMM kernels add: XL = the M = 1 activation reads; TMA = the bytes through a per-warp
// ring of RING shared-memory slots of one burst each (8 KB a warp: 4 slots of 2 KB, 2 of 4 KB), filled by one
// cp.async.bulk per burst (lane 0) completing on the slot's mbarrier, read back with one 16-byte ld.shared per lane
// and row. (At 8 warps a CTA that is 64 KB: 3 CTAs, 24 warps an SM; more streams than that run in two waves.)
template <int U>
__host__ __device__ constexpr int ring_of() { return U >= 8 ? 2 : 4; }
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ bool mbar_try(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  return ok != 0;
}
template <int U, bool XL, bool TMA>
__global__ void stream_probe_k(const uint4* src, long long n16, int streams, int rot, int order,
                               const uint32_t* x, int xk, unsigned* sink) {
  extern __shared__ __align__(16) uint8_t ring_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int s = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (s >= streams) return;
  const long long burst16 = 32LL * U;
  const long long bursts = n16 / streams / burst16;  // per stream
  long long b = rot ? ((long long)s * rot) % bursts : 0;
  auto addr = [&](long long bb) {
    return src + (order == 0 ? (long long)s * bursts + bb : bb * streams + s) * burst16;
  };
  const uint32_t ring = smem_u32(ring_smem) + warp * ring_of<U>() * U * 512;
  const uint32_t bar0 = smem_u32(ring_smem + (blockDim.x >> 5) * ring_of<U>() * U * 512) + warp * ring_of<U>() * 8;
  auto issue = [&](long long i, int slot) {  // lane 0: burst i of this stream into slot
    long long bb = b + i;
    bb = bb >= bursts ? bb - bursts : bb;
    const uint32_t bar = bar0 + slot * 8;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(U * 512) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(ring + slot * U * 512), "l"(addr(bb)), "r"(U * 512), "r"(bar) : "memory");
  };
  if constexpr (TMA) {
    if (lane == 0) {
      for (int r = 0; r < ring_of<U>(); ++r) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar0 + r * 8) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      for (int r = 0; r < ring_of<U>() && r < bursts; ++r) issue(r, r);
    }
    __syncwarp();
  }
  uint32_t x_acc = 0;
  int slot = 0;
  uint32_t phase = 0;
  for (long long i = 0; i < bursts; ++i) {
    uint4 r[U];
    if constexpr (TMA) {
      while (!mbar_try(bar0 + slot * 8, phase)) {
      }
#pragma unroll
      for (int j = 0; j < U; ++j)
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[j].x), "=r"(r[j].y), "=r"(r[j].z), "=r"(r[j].w)
                     : "r"(ring + slot * U * 512 + j * 512 + lane * 16)
                     : "memory");
      __syncwarp();
      if (lane == 0 && i + ring_of<U>() < bursts) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        issue(i + ring_of<U>(), slot);
      }
      if (++slot == ring_of<U>()) { slot = 0; phase ^= 1u; }
    } else {
      const uint4* p = addr(b) + lane;
#pragma unroll
      for (int j = 0; j < U; ++j) r[j] = ldg16(p + j * 32);
      if (++b == bursts) b = 0;
    }
    if constexpr (XL) {  // a decode kernel's M = 1 activation reads: two words a row for lanes 0-3
#pragma unroll
      for (int j = 0; j < U; ++j) {
        const int kk = (int)((i * U + j) % (xk / 16));
        if (lane < 4) x_acc ^= __ldg(x + kk * 8 + lane) ^ __ldg(x + kk * 8 + lane + 4);
      }
    }
#pragma unroll
    for (int j = 0; j < U; ++j) x_acc ^= r[j].x ^ r[j].y ^ r[j].z ^ r[j].w;
  }
  if (x_acc == 0x9e3779b9u && n16 == 0) sink[0] = x_acc;
}

template <int U>
void launch_mode(int mode, int grid, int threads, cudaStream_t st, const uint4* src, long long n16, int streams,
                 int rot, int order, const uint32_t* x, int xk, unsigned* snk) {
  const int smem = (threads / 32) * ring_of<U>() * (U * 512 + 8);
  switch (mode) {
    case 1: stream_probe_k<U, true, false><<<grid, threads, 0, st>>>(src, n16, streams, rot, order, x, xk, snk); break;
    case 2:
      cudaFuncSetAttribute(stream_probe_k<U, false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      stream_probe_k<U, false, true><<<grid, threads, smem, st>>>(src, n16, streams, rot, order, x, xk, snk);
      break;
    case 3:
      cudaFuncSetAttribute(stream_probe_k<U, true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      stream_probe_k<U, true, true><<<grid, threads, smem, st>>>(src, n16, streams, rot, order, x, xk, snk);
      break;
    default: TORCH_CHECK(false, "stream_probe: mode must be 0-3");
  }
}

void linear(torch::Tensor buf, torch::Tensor sink, int64_t ctas) {
  const long long n16 = buf.numel() * buf.element_size() / 16;
  linear_probe<4><<<ctas, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(buf.data_ptr()), n16, reinterpret_cast<unsigned*>(sink.data_ptr()));
}

void streamed(torch::Tensor buf, torch::Tensor sink, int64_t streams, int64_t u, int64_t rot, int64_t order,
              int64_t warps, int64_t mode, torch::Tensor x) {
  const long long n16 = buf.numel() * buf.element_size() / 16;
  TORCH_CHECK(n16 % (streams * 32 * u) == 0, "stream_probe: buffer does not divide into streams x bursts");
  const int threads = 32 * warps;
  const int grid = (streams + warps - 1) / warps;
  auto st = at::cuda::getCurrentCUDAStream();
  auto src = reinterpret_cast<const uint4*>(buf.data_ptr());
  auto snk = reinterpret_cast<unsigned*>(sink.data_ptr());
  if (mode != 0) {
    auto xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
    const int xk = static_cast<int>(x.numel() * x.element_size() / 2);  // bf16 elements
    switch (u) {
      case 2: launch_mode<2>(mode, grid, threads, st, src, n16, streams, rot, order, xp, xk, snk); break;
      case 4: launch_mode<4>(mode, grid, threads, st, src, n16, streams, rot, order, xp, xk, snk); break;
      case 8: launch_mode<8>(mode, grid, threads, st, src, n16, streams, rot, order, xp, xk, snk); break;
      default: TORCH_CHECK(false, "stream_probe: modes 1-3 take U = 2, 4 or 8");
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
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
              int64_t warps, int64_t mode, torch::Tensor x);
"""

# K x N of the Llama decode shapes whose int4 fragments we stream (bytes = K * N / 2)
SHAPES = [(8192, 28672), (4096, 28672), (14336, 4096), (4096, 4096)]


def device_source() -> str:
    """The probe kernels alone (no torch headers), with the launch_mode instantiations: what CI compiles with nvcc
    for sm_90a (tests/kernels/test_read_order_probe.py), since the GPU machine is the only place that builds the
    extension."""
    body = CUDA_SRC[CUDA_SRC.index("__device__ __forceinline__ uint4 ldg16"):CUDA_SRC.index("void linear(torch::Tensor")]
    inst = "".join(f"template void launch_mode<{u}>(int, int, int, cudaStream_t, const uint4*, long long, int, int, "
                   f"int, const uint32_t*, int, unsigned*);\n" for u in (2, 4, 8))
    return ("#include <cuda_runtime.h>\n#include <stdint.h>\n"
            "#define TORCH_CHECK(c, m) do { if (!(c)) {} } while (0)\n" + body + inst)


def build():
    from torch.utils.cpp_extension import load_inline
    return load_inline(name="sdquant_read_order", cpp_sources=CPP_SRC, cuda_sources=CUDA_SRC,
                       functions=["linear", "streamed"], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
                       verbose=False)


def points(k: int, n: int, warps: int, factors: bool = False):
    """(streams, U, rot, order, mode, warps) to time: the kernels' ~2,000-stream pattern and its one-property
    variations; factors: instead, what the GEMM kernels add (mode 0-3) at 2 and 8 warps a CTA, over the stream counts
    and bursts nearest the kernels' (blocks x 4 and x 8 streams, 2 and 4 KB bursts)."""
    blocks = n // 64
    out = []
    if factors:
        for splits in (4, 8):
            for u in (4, 8):
                for mode in (0, 1, 2, 3):
                    for w in (2, 8):
                        if blocks * splits <= 8448:
                            out.append((blocks * splits, u, 0, 0, mode, w))
        return out
    for splits in (1, 2, 4, 8):
        streams = blocks * splits
        if streams > 8448:  # 64 resident warps x 132 SMs: all streams must run at once
            continue
        for u in (2, 4, 8):
            for rot in (0, 7):
                out.append((streams, u, rot, 0, 0, warps))
            out.append((streams, u, 0, 1, 0, warps))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--warps", type=int, default=2, help="warps per CTA of the stream probe")
    ap.add_argument("--factors", action="store_true", help="time what the GEMM kernels add to the bare stream "
                    "(activation reads, TMA rings, 8-warp CTAs) instead of the read-order variations")
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
        xvec = torch.randn(k, dtype=torch.bfloat16, device=dev)
        for streams, u, rot, order, mode, warps in points(k, n, args.warps, args.factors):
            if (nbytes // 16) % (streams * 32 * u):
                continue
            us = gemm.time_rotating(
                lambda i: ext.streamed(copies[i % nr], sink, streams, u, rot, order, warps, mode, xvec), nr)
            rows.append({"K": k, "N": n, "MB": nbytes / 1e6, "kind": "stream", "streams": streams, "U": u,
                         "rot": rot, "order": order, "mode": mode, "warps": warps, "us": us,
                         "TBps": nbytes / us / 1e6})
            gemm.log(f"{k}x{n} streams {streams:5d} U {u} rot {rot} order {order} mode {mode} warps {warps}: "
                     f"{us:.1f} us {nbytes / us / 1e6:.2f} TB/s")
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
            f"s{r['streams']} U{r['U']} r{r['rot']} o{r['order']} m{r['mode']} w{r['warps']} {r['us']:.1f} "
            f"({r['TBps']:.2f})" for r in best))


if __name__ == "__main__":
    main()
