// Experiment (bench/narrow_tile.py, not part of the sdquant extension): the M <= 8 decode GEMM over 16-feature tiles,
// with no split-K.
//
// Why: at M = 1 a shipped tight-kernel GEMM pays ~4.7 us besides its bytes, ~1.4 us of it the split-K tail (the
// count-in, the last CTA's L2 reads of the partials; docs/benchmarks/int4-cuda.md, "What a small M = 1 GEMM costs besides its
// bytes"). Its 64-feature blocks give N = 4096 only 64 blocks, so o (4096x4096) and down (14336x4096) run 8 splits to
// fill the SMs. Tiles of 16 features (one m16n8k16 row tile) give 256 of them: every CTA can own a tile's whole K,
// its K-warps summing through shared memory, and no CTA waits on another.
//
// Layout ("narrow", bench/narrow_tile.py narrow_from_cuda, a permutation of int4_layout.repack_cuda's words): int32
// [n / 16, k / 64, 32, 4]. Lane l's 16 bytes of (tile t, chunk c) are the four K steps of c for row tile t: word kk is
// the shipped layout's word (block t / 4, K step 4 c + kk, lane l, row tile t % 4), same nibble order. Scales fp16 and
// zeros [G, n / 16, 8, 2]: one half2 / bf162 a lane and group (rows g8, g8 + 8 of its tile).
//
// CTA = TW tiles x KW K-warps; warp (tw, kw) streams chunks [c0, c0 + nc) of tile blockIdx.x * TW + tw through a ring
// of D 16-byte words a lane (the tight loop's static-index ring), the exact (code - zero) values into two fp32 group
// sums (K steps of even / odd parity), folded into acc with the group's scale at each group end. The K-warps' sums
// meet in shared memory in kw order (deterministic) and warp kw = 0 stores the tile.
#include "w4a16_kernel.cuh"
#include "w4a16_narrow.h"

namespace sdq_w4a16 {
namespace {

template <int TW_, int KW_, int D_, int MINB_>
struct NCfg {
  static constexpr int TW = TW_, KW = KW_, D = D_, MINB = MINB_;
  static constexpr int WARPS = TW * KW, THREADS = 32 * WARPS;
  static constexpr int SMEM = (KW - 1) * TW * 32 * 4 * 4;  // kw > 0: a float4 a lane
  static_assert(D % 2 == 0, "the activation registers alternate by chunk parity");
};

template <typename T, typename C>
__global__ void __launch_bounds__(C::THREADS, C::MINB) w4a16_narrow_kernel(const SdqNarrowParams p) {
  constexpr int TW = C::TW, KW = C::KW, D = C::D;
  extern __shared__ __align__(16) float red[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tw = warp % TW, kw = warp / TW;
  const int g8 = lane / 4, t4 = lane % 4;
  const int ntile = p.n / 16;
  const int tile = blockIdx.x * TW + tw;
  const bool active = tile < ntile;
  const int tl = active ? tile : 0;
  const int chunks = p.k / 64;
  const int c0 = (chunks * kw) / KW;
  const int nc = active ? (chunks * (kw + 1)) / KW - c0 : 0;
  const int gc = p.group_k16 / 4;  // chunks a group
  const int m = p.m;

  const uint4* wsrc = reinterpret_cast<const uint4*>(p.b) + (static_cast<size_t>(tl) * chunks + c0) * 32 + lane;
  const T* xsrc = reinterpret_cast<const T*>(p.a) + static_cast<size_t>(min(g8, m - 1)) * p.k +
                  static_cast<size_t>(c0) * 64 + 2 * t4;
  const size_t gstride = static_cast<size_t>(ntile) * 8;
  const uint32_t* ssrc = reinterpret_cast<const uint32_t*>(p.s) + static_cast<size_t>(tl) * 8 + g8;
  const uint32_t* zsrc = reinterpret_cast<const uint32_t*>(p.z) + static_cast<size_t>(tl) * 8 + g8;

  uint4 wq[D];
  uint32_t xq[2][4][2];
  auto load_x = [&](int c, uint32_t (&xx)[4][2]) {  // chunk c, clamped to the warp's last
    const int cc = c < nc ? c : nc - 1;
    const unsigned int* w = reinterpret_cast<const unsigned int*>(xsrc + cc * 64);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      xx[kk][0] = __ldg(w + kk * 8);
      xx[kk][1] = __ldg(w + kk * 8 + 4);
    }
  };
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, accg[2][4] = {};
  float sf[2] = {0.f, 0.f};
  uint32_t zl[2] = {0u, 0u}, zh[2] = {0u, 0u};
  uint32_t s_next = 0u, z_next = 0u;
  auto load_sz = [&](int g) {
    s_next = __ldg(ssrc + static_cast<size_t>(g) * gstride);
    z_next = __ldg(zsrc + static_cast<size_t>(g) * gstride);
  };
  auto begin = [&]() {  // a group starts: its scales and zero pairs from s_next / z_next
    const float2 f = __half22float2(*reinterpret_cast<const half2*>(&s_next));
    sf[0] = f.x;
    sf[1] = f.y;
    Ops<T>::zero_pairs(z_next, 0, zl[0], zh[0]);
    Ops<T>::zero_pairs(z_next, 1, zl[1], zh[1]);
  };
  auto flush = [&]() {  // acc += scale * (the group's two parity sums)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[e] = fmaf(sf[e >> 1], accg[0][e] + accg[1][e], acc[e]);
      accg[0][e] = accg[1][e] = 0.f;
    }
  };

  int grp = c0 / gc, cig = c0 % gc;
  // weights, scales and zeros do not depend on the previous kernel: in flight before the wait
#pragma unroll
  for (int j = 0; j < D; ++j) ldg_stream16_if(wq[j], wsrc + j * 32, j < nc);
  if (nc > 0) load_sz(grp);
  griddep_wait();
  if (p.pdl == 2) griddep_launch_dependents();
  if (nc > 0) {
    load_x(0, xq[0]);
    begin();
    if (gc - cig < nc) load_sz(grp + 1);
  }
  for (int base = 0; base < nc; base += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int c = base + j;
      if (c < nc) {
        if (cig == 0 && c > 0) {  // a new group: fold the last one in, unpack this one's, fetch the next one's
          flush();
          begin();
          if (c + gc < nc) load_sz(grp + 1);
        }
        load_x(c + 1, xq[(j + 1) % 2]);
        const uint4 w = wq[j];
        ldg_stream16_if(wq[j], wsrc + static_cast<size_t>(c + D) * 32, c + D < nc);
        const uint32_t q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          uint32_t cd[4];
          Ops<T>::codes(q[kk], zl, zh, cd);
          const uint32_t af[4] = {cd[0], cd[2], cd[1], cd[3]};
          Ops<T>::mma(accg[kk & 1], af, xq[j % 2][kk][0], xq[j % 2][kk][1]);
        }
        if (++cig == gc) {
          cig = 0;
          ++grp;
        }
      }
    }
  }
  flush();
  griddep_launch_dependents();  // the next kernel may start its prologue during this epilogue

  if constexpr (KW > 1) {
    float4* r4 = reinterpret_cast<float4*>(red);
    if (kw > 0) r4[((kw - 1) * TW + tw) * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (kw == 0) {
#pragma unroll
      for (int q = 1; q < KW; ++q) {
        const float4 v = r4[((q - 1) * TW + tw) * 32 + lane];
        acc[0] += v.x;
        acc[1] += v.y;
        acc[2] += v.z;
        acc[3] += v.w;
      }
    }
  }
  if (kw == 0 && active) {
    T* out = reinterpret_cast<T*>(p.out);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = 2 * t4 + (e & 1);
      if (tok < m) out[static_cast<size_t>(tok) * p.n + tile * 16 + g8 + 8 * (e >> 1)] = Ops<T>::one(acc[e]);
    }
  }
}

// variant -> CTA shape (tiles x K-warps), ring depth, CTAs a SM for __launch_bounds__
using N0 = NCfg<1, 8, 8, 2>;
using N1 = NCfg<1, 8, 4, 3>;
using N2 = NCfg<1, 4, 8, 4>;
using N3 = NCfg<2, 4, 8, 2>;
using N4 = NCfg<1, 16, 4, 1>;
using N5 = NCfg<4, 2, 8, 2>;
using N6 = NCfg<8, 1, 8, 2>;
using N7 = NCfg<1, 8, 8, 3>;
constexpr int NARROW_VARIANTS = 8;

}  // namespace
}  // namespace sdq_w4a16

template <typename T, typename C>
int narrow_launch_c(const SdqNarrowParams& p, cudaStream_t stream) {
  using namespace sdq_w4a16;
  const auto kern = w4a16_narrow_kernel<T, C>;
  if (C::SMEM > 48 * 1024) return -1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((p.n / 16 + C::TW - 1) / C::TW);
  cfg.blockDim = dim3(C::THREADS);
  cfg.dynamicSmemBytes = C::SMEM;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kern, p);
  return e != cudaSuccess ? static_cast<int>(e) : static_cast<int>(cudaGetLastError());
}

template <typename T>
int narrow_launch_t(const SdqNarrowParams& p, cudaStream_t stream) {
  using namespace sdq_w4a16;
  switch (p.variant) {
    case 0: return narrow_launch_c<T, N0>(p, stream);
    case 1: return narrow_launch_c<T, N1>(p, stream);
    case 2: return narrow_launch_c<T, N2>(p, stream);
    case 3: return narrow_launch_c<T, N3>(p, stream);
    case 4: return narrow_launch_c<T, N4>(p, stream);
    case 5: return narrow_launch_c<T, N5>(p, stream);
    case 6: return narrow_launch_c<T, N6>(p, stream);
    case 7: return narrow_launch_c<T, N7>(p, stream);
    default: return -1;
  }
}

extern "C" int sdq_narrow_launch(const SdqNarrowParams* pp, int is_bf16, cudaStream_t stream) {
  using namespace sdq_w4a16;
  const SdqNarrowParams& p = *pp;
  if (p.m < 1 || p.m > 8 || p.n % 16 || p.k % 64 || p.group_k16 < 4 || p.group_k16 % 4 || p.variant < 0 ||
      p.variant >= NARROW_VARIANTS)
    return -1;
  return is_bf16 ? narrow_launch_t<__nv_bfloat16>(p, stream) : narrow_launch_t<half>(p, stream);
}
