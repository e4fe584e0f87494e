// Experiment (bench/mlp_fused.py, not part of the sdquant extension): a batch-1 decode MLP -- gate/up, SiLU * up and
// down -- in one kernel plus a small fixed-order sum, against the two tight kernels it would replace.
//
// Why: at M = 1 every CUDA GEMM pays ~4.7 us besides its bytes (docs/benchmarks/int4-cuda.md, "What a small M = 1 GEMM costs
// besides its bytes"): a launch, a fresh ramp of its weight stream, the split-K tail. The gate/up kernel at M = 1 runs
// one split (224 CTAs of 128 weight columns on 264 slots), so each CTA ends holding 64 finished SiLU * up features: the
// matching 64 rows of the down weight (a 64-K slice of every 64-column block, 128 KB) can be multiplied at once.
//
// One CTA (the tight kernel's variant 38 shape: 2 blocks x 4 K-warps, 2 chunks of 4 K steps in flight a warp):
// 1. the tight loop over the gate block and the up block of its 64 features (w4a16_tight.cuh's loop, one split); the
//    ring's refills run on past the warp's last gate/up chunk into its first down chunks, so the weight stream does not
//    restart;
// 2. the K-warps' sums through shared memory, h = round(silu(gate) * up) for the 64 features into shared memory (the
//    fused tight kernel's rounding, so h is the same bits as its SiLU epilogue's);
// 3. warp w: down blocks w, w + 8, ..., one chunk (64 K) each, the group arithmetic of the tight loop, and a 64-column
//    fp32 partial per block into partial[cta][m][n2].
// mlp_sum_kernel then adds the partials of every CTA in CTA order (deterministic) and rounds to the output dtype.
// Run 2 measured two more builds, both slower and removed after it (tree fd3cb40): down chunks staged in shared memory
// from the start, and the sum folded into the kernel by the last CTAs to finish (docs/benchmarks/decode.md).
// pdl: both launches with programmatic dependent launch -- the MLP kernel issues its first weight loads, then waits
// (griddepcontrol.wait) before it reads x or writes a partial and lets the sum kernel launch; the sum kernel waits
// first. sum_v: 0 the first sum (8 partials a warp in flight), 1 every partial of a warp in flight at once.
#include "w4a16_kernel.cuh"
#include "w4a16_mlp.h"

namespace sdq_w4a16 {
namespace {

constexpr int MLP_J = 8;  // down blocks a warp: n2 / 64 = 8 warps x 8

__device__ __forceinline__ void mlp_sz(const void* s, const void* z, int g, int nblk, int nb, int g8, uint4& so,
                                       uint4& zo) {
  const size_t o = (static_cast<size_t>(g) * nblk + nb) * 8 + g8;
  so = __ldg(reinterpret_cast<const uint4*>(s) + o);
  zo = __ldg(reinterpret_cast<const uint4*>(z) + o);
}

template <typename C>
constexpr int mlp_red_bytes() { return (C::KW - 1) * C::WNN * 16 * 32 * 4; }
template <typename C>
constexpr int mlp_smem() { return mlp_red_bytes<C>() + C::WNN * 8 * 64 * 4 + 8 * 64 * 2; }

template <typename T, typename C>
__global__ void __launch_bounds__(C::THREADS, C::MINB) w4a16_mlp_kernel(const SdqMlpParams p) {
  constexpr int WNN = C::WNN, KW = C::KW, D = C::D, U = TIGHT_U, WARPS = C::WARPS;
  static_assert(WNN == 2 && WARPS == 8 && D % 2 == 0 && MLP_J % D == 0, "one gate block and its up block, 8 warps");
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wn = warp % WNN, kw = warp / WNN;
  const int g8 = lane / 4, t4 = lane % 4;
  const int m = p.m;
  const int nblk1 = p.n1 / 64, nblk2 = p.n2 / 64, k2 = p.n1 / 2;
  const int nb = blockIdx.x * WNN + wn;
  const int chunks = p.k1 / (16 * U);
  const int c0 = (chunks * kw) / KW;
  const int nc = chunks / KW;  // the launcher requires chunks % (KW * D) == 0: every warp the same even count
  const int gc = p.g1_k16 / U;
  const int grp2 = blockIdx.x * 4 / p.g2_k16;  // the down group of this CTA's 64-K slice

  const uint4* w1 = reinterpret_cast<const uint4*>(p.b1) +
                    (static_cast<size_t>(nb) * (p.k1 / 16) + static_cast<size_t>(c0) * U) * 32 + lane;
  // down chunk j of this warp: block warp + 8 j, K steps 4 blockIdx.x .. + 3
  auto w2 = [&](int j) {
    return reinterpret_cast<const uint4*>(p.b2) +
           (static_cast<size_t>(warp + WARPS * j) * (k2 / 16) + static_cast<size_t>(blockIdx.x) * U) * 32 + lane;
  };
  auto src = [&](int c) { return c < nc ? w1 + static_cast<size_t>(c) * U * 32 : w2(c - nc); };
  const T* xsrc = reinterpret_cast<const T*>(p.x) + static_cast<size_t>(min(g8, m - 1)) * p.k1 +
                  static_cast<size_t>(c0) * U * 16 + 2 * t4;

  uint4 wq[D][U];
  uint32_t xq[2][U][1][2];
  auto load_x = [&](int c, uint32_t (&xx)[U][1][2]) {
    const int cc = c < nc ? c : nc - 1;
    const unsigned int* w = reinterpret_cast<const unsigned int*>(xsrc + cc * (U * 16));
#pragma unroll
    for (int kk = 0; kk < U; ++kk) {
      xx[kk][0][0] = __ldg(w + kk * 8);
      xx[kk][0][1] = __ldg(w + kk * 8 + 4);
    }
  };
  float acc[1][4][4], accg[1][4][4];
  frag_each<1>([&](int i, int j, int e) { acc[i][j][e] = accg[i][j][e] = 0.f; });
  float sf[4][2] = {};
  uint32_t zl[4][2] = {}, zh[4][2] = {};
  uint4 s_next, z_next;

  // 1. gate / up
  int grp = c0 / gc, cig = c0 % gc;
#pragma unroll
  for (int j = 0; j < D; ++j)
#pragma unroll
    for (int kk = 0; kk < U; ++kk) ldg_stream16_if(wq[j][kk], src(j) + kk * 32, true);
  mlp_sz(p.s1, p.z1, grp, nblk1, nb, g8, s_next, z_next);
  // everything above reads weights only; x and the partials belong to the kernels around this one (no-ops when
  // launched without programmatic dependent launch)
  griddep_wait();
  griddep_launch_dependents();
  load_x(0, xq[0]);
  group_begin<T>(s_next, z_next, sf, zl, zh);
  if (gc - cig < nc) mlp_sz(p.s1, p.z1, grp + 1, nblk1, nb, g8, s_next, z_next);
  for (int base = 0; base < nc; base += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int c = base + j;
      if (cig == 0 && c > 0) {
        group_flush<1>(acc, accg, sf);
        group_begin<T>(s_next, z_next, sf, zl, zh);
        if (c + gc < nc) mlp_sz(p.s1, p.z1, grp + 1, nblk1, nb, g8, s_next, z_next);
      }
      load_x(c + 1, xq[(j + 1) % 2]);
      const uint4* nxt = src(c + D);  // past the gate/up chunks: the first down chunks
#pragma unroll
      for (int kk = 0; kk < U; ++kk) {
        const uint4 w = wq[j][kk];
        group_step<T, 1>(w, xq[j % 2][kk], zl, zh, accg);
        ldg_stream16_if(wq[j][kk], nxt + kk * 32, true);
      }
      if (++cig == gc) {
        cig = 0;
        ++grp;
      }
    }
  }
  group_flush<1>(acc, accg, sf);
  // the ring's slots hold down chunks 0 .. D-1 now (the refills above); the first D down blocks' scales (none of it
  // depends on h, in flight through the epilogue below)
  uint4 s2[D], z2[D];
#pragma unroll
  for (int j = 0; j < D; ++j) mlp_sz(p.s2, p.z2, grp2, nblk2, warp + WARPS * j, g8, s2[j], z2[j]);

  // 2. h = silu(gate) * up for the CTA's 64 features
  reduce_k_warps<1, WNN, KW>(acc, smem, kw, wn, lane);
  float* xs = reinterpret_cast<float*>(smem + mlp_red_bytes<C>());  // [WNN][8 tokens][64]
  T* hs = reinterpret_cast<T*>(smem + mlp_red_bytes<C>() + WNN * 8 * 64 * 4);  // [8 tokens][64]
  if (kw == 0)
    frag_each<1>([&](int, int w, int e) {
      xs[(wn * 8 + 2 * t4 + (e & 1)) * 64 + 16 * w + 8 * (e >> 1) + g8] = acc[0][w][e];
    });
  __syncthreads();
  for (int i = threadIdx.x; i < 8 * 64; i += C::THREADS) hs[i] = Ops<T>::one(silu_mul(xs[i], xs[8 * 64 + i]));
  __syncthreads();
  uint32_t hx[U][1][2];
  {
    const unsigned int* w = reinterpret_cast<const unsigned int*>(hs + min(g8, m - 1) * 64 + 2 * t4);
#pragma unroll
    for (int kk = 0; kk < U; ++kk) {
      hx[kk][0][0] = w[kk * 8];
      hx[kk][0][1] = w[kk * 8 + 4];
    }
  }

  // 3. down: block warp + 8 j, one chunk each, a 64-column fp32 partial each
  float* part = p.partial + static_cast<size_t>(blockIdx.x) * m * p.n2;
  auto down_block = [&](int jj, const uint4 (&w)[U], const uint4& s, const uint4& z) {
    const int nb2 = warp + WARPS * jj;
    group_begin<T>(s, z, sf, zl, zh);
    frag_each<1>([&](int i, int ww, int e) { acc[i][ww][e] = accg[i][ww][e] = 0.f; });
#pragma unroll
    for (int kk = 0; kk < U; ++kk) group_step<T, 1>(w[kk], hx[kk], zl, zh, accg);
    group_flush<1>(acc, accg, sf);
    frag_each<1>([&](int, int ww, int e) {
      const int tok = 2 * t4 + (e & 1);
      if (tok < m) __stcg(part + static_cast<size_t>(tok) * p.n2 + nb2 * 64 + 16 * ww + 8 * (e >> 1) + g8, acc[0][ww][e]);
    });
  };
  for (int base = 0; base < MLP_J; base += D) {  // the ring of D
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int jj = base + j;
      const bool more = jj + D < MLP_J;
      uint4 w[U];
#pragma unroll
      for (int kk = 0; kk < U; ++kk) {
        w[kk] = wq[j][kk];
        ldg_stream16_if(wq[j][kk], w2(more ? jj + D : jj) + kk * 32, more);
      }
      const uint4 sj = s2[j % D], zj = z2[j % D];
      if (jj + D < MLP_J) mlp_sz(p.s2, p.z2, grp2, nblk2, warp + WARPS * (jj + D), g8, s2[j % D], z2[j % D]);
      down_block(jj, w, sj, zj);
    }
  }
}

// out[r, c] = round(sum over CTAs q (in order) of partial[q, r, c]); one CTA of 256 threads per 64 output columns of
// one row: 8 warps each add a contiguous eighth of the CTAs (a float2 a lane), then warp 0 adds the eight in order.
// ALL: every one of the warp's partials loaded before the first add (at most QMAX a warp), so the sum waits on one L2
// round trip instead of one per 8 partials; the adds keep the same order, so the bits are the same.
constexpr int MLP_QMAX = 32;
template <typename T, bool ALL>
__global__ void __launch_bounds__(256) mlp_sum_kernel(const float* __restrict__ partial, T* __restrict__ out, int ctas,
                                                       int m, int n) {
  __shared__ float2 red[8][32];
  griddep_wait();  // a no-op without programmatic dependent launch
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.y, col = blockIdx.x * 64 + 2 * lane;
  const int q0 = (ctas * warp) / 8, q1 = (ctas * (warp + 1)) / 8;
  float2 s = make_float2(0.f, 0.f);
  const float* src = partial + static_cast<size_t>(row) * n + col;
  if constexpr (ALL) {
    float2 v[MLP_QMAX];
#pragma unroll
    for (int i = 0; i < MLP_QMAX; ++i)
      if (q0 + i < q1) v[i] = __ldcg(reinterpret_cast<const float2*>(src + static_cast<size_t>(q0 + i) * m * n));
#pragma unroll
    for (int i = 0; i < MLP_QMAX; ++i)
      if (q0 + i < q1) {
        s.x += v[i].x;
        s.y += v[i].y;
      }
  } else {
#pragma unroll 8
    for (int q = q0; q < q1; ++q) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(src + static_cast<size_t>(q) * m * n));
      s.x += v.x;
      s.y += v.y;
    }
  }
  red[warp][lane] = s;
  __syncthreads();
  if (warp == 0) {
    float2 t = red[0][lane];
#pragma unroll
    for (int w = 1; w < 8; ++w) {
      t.x += red[w][lane].x;
      t.y += red[w][lane].y;
    }
    *reinterpret_cast<typename Ops<T>::T2*>(out + static_cast<size_t>(row) * n + col) = Ops<T>::pack(t.x, t.y);
  }
}

}  // namespace
}  // namespace sdq_w4a16

// cudaLaunchKernelEx, with programmatic dependent launch when pdl
template <typename K, typename... A>
int mlp_launch_ex(K kern, dim3 grid, dim3 block, int smem, bool pdl, cudaStream_t stream, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kern, args...));
}

template <typename T>
int mlp_launch_t(const SdqMlpParams& p, cudaStream_t stream) {
  using namespace sdq_w4a16;
  using C = V38;
  constexpr int SMEM = mlp_smem<C>();
  const auto kern = w4a16_mlp_kernel<T, C>;
  static int slot[SDQ_DEVICES] = {};
  const int rc = per_current_device(slot, [&] {
    return static_cast<int>(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  });
  if (rc != cudaSuccess) return rc;
  if (p.what & 1) {
    const int e = mlp_launch_ex(kern, dim3(p.n1 / 128), dim3(C::THREADS), SMEM, p.pdl, stream, p);
    if (e != cudaSuccess) return e;
  }
  if (p.what & 2) {
    T* out = reinterpret_cast<T*>(p.out);
    const int ctas = p.n1 / 128;
    const auto sum = p.sum_v ? mlp_sum_kernel<T, true> : mlp_sum_kernel<T, false>;
    const int e = mlp_launch_ex(sum, dim3(p.n2 / 64, p.m), dim3(256), 0, p.pdl, stream,
                                static_cast<const float*>(p.partial), out, ctas, p.m, p.n2);
    if (e != cudaSuccess) return e;
  }
  return static_cast<int>(cudaGetLastError());
}

extern "C" int sdq_mlp_launch(const SdqMlpParams* pp, int is_bf16, cudaStream_t stream) {
  using namespace sdq_w4a16;
  const SdqMlpParams& p = *pp;
  if (p.m < 1 || p.m > 8 || p.n1 % 128 || p.n2 != 64 * V38::WARPS * MLP_J ||
      p.k1 % (16 * TIGHT_U * V38::KW * V38::D) || p.g1_k16 % TIGHT_U || p.g2_k16 % TIGHT_U ||
      (p.sum_v && p.n1 / 128 > 8 * MLP_QMAX))
    return -1;
  return is_bf16 ? mlp_launch_t<__nv_bfloat16>(p, stream) : mlp_launch_t<half>(p, stream);
}
