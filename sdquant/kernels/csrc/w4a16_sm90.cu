// sdquant W4A16 decode GEMM for sm_90 (M <= 32 per launch, best at M <= 16): y[m, n] = sum_k x[m, k] W[n, k].
//
// Design (why each piece is there):
// * Swap-AB: the weight tile is the A operand of mma.m16n8k16 (16 features x 16 k) and the tokens are the
//   n8 B operand, so at M <= 8 a tensor-core instruction does 16 useful features instead of 8 padded rows.
// * Weights arrive fragment-ordered (int4_layout.repack_cuda): for each 64-feature block and 16-deep K step,
//   lane l of a warp owns 16 contiguous bytes that are exactly its A fragments for four 16x16 tiles, so a
//   warp reads 512 contiguous bytes per step and never shuffles.
// * int4 -> fp16/bf16 with lop3 + magic exponent: (q & 0x000f000f) | 0x6400_6400 is the half2 (1024 + c0,
//   1024 + c1); one sub with (1024 + zero) (one fma for the high nibbles) gives the exact (code - zero).
//   The group scale multiplies the fp32 group sums once per group (not once per weight).
// * A multi-stage cp.async pipeline (STAGES deep) per CTA keeps ~(STAGES-1) * 8 KB of weights in flight
//   without holding registers; activations for the stage go to shared memory once and feed all 4 warps.
// * Split-K over the grid's y dimension so every SM has work at M = 1 on K >> N shapes. Partial sums go to
//   an fp32 scratch; the last CTA of a column tile (counted on a lock that it resets) adds them in a fixed
//   order and writes the output: one launch, deterministic, no memset.
// * Optional L2 evict-first hint on weight copies (they are read exactly once); only used after
//   sdq_probe_evict_first ran on the device (a published kernel's hint raised "illegal instruction" there).
#include "w4a16.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int WN = 4;              // warps per CTA, each owns one 64-feature block
constexpr int THREADS = 32 * WN;
constexpr int STAGES = 5;

template <int NT, int KS>
struct Smem {
  static constexpr int B_BYTES = WN * KS * 32 * 16;      // fragments
  static constexpr int S_BYTES = WN * 16 * 16;           // 8 uint4 scales + 8 uint4 zs per warp
  static constexpr int A_STRIDE = KS * 16 + 8;           // halves; +16 B per row avoids bank conflicts
  static constexpr int A_BYTES = NT * 8 * A_STRIDE * 2;
  static constexpr int STAGE = B_BYTES + S_BYTES + A_BYTES;
  static constexpr int TOTAL = STAGES * STAGE;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <bool EVICT>
__device__ __forceinline__ void cp_async16(void* dst, const void* src, uint64_t policy) {
  if constexpr (EVICT) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "l"(policy));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}

template <int LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return r;
}
constexpr int AND_OR = (0xf0 & 0xcc) | 0xaa;  // (a & b) | c

template <typename T>
struct Ops;

// The weight is the MMA's A operand (16 output features x 16 k), the tokens its B operand (n8): at M <= 8
// one m16n8k16 covers 16 features instead of 8, half the tensor-core work of putting tokens on the M side.
// Codes are converted to exact (code - zero) values; the group scale multiplies the fp32 partial sums once per
// group, so the per-weight work is one lop3 and one sub/fma per pair.
template <>
struct Ops<half> {
  using T2 = half2;
  // zero pairs for a row: lo nibbles need (1024 + z), high nibbles -(64 + z)
  __device__ __forceinline__ static void zero_pairs(uint32_t zpair, int hi, uint32_t& zlo, uint32_t& zhi) {
    const half2 z = hi ? __high2half2(*reinterpret_cast<const half2*>(&zpair))
                       : __low2half2(*reinterpret_cast<const half2*>(&zpair));
    const half2 lo = __hadd2(z, __float2half2_rn(1024.f));
    const half2 h = __hneg2(__hadd2(z, __float2half2_rn(64.f)));
    zlo = *reinterpret_cast<const uint32_t*>(&lo);
    zhi = *reinterpret_cast<const uint32_t*>(&h);
  }
  // word -> (code - zero) pairs: o0 = (p0,p4) row g, o1 = (p1,p5) row g, o2 = (p2,p6) row g+8, o3 = (p3,p7) row g+8
  __device__ __forceinline__ static void codes(uint32_t q, const uint32_t (&zl)[2], const uint32_t (&zh)[2],
                                               uint32_t (&o)[4]) {
    const uint32_t lo0 = lop3<AND_OR>(q, 0x000f000fu, 0x64006400u);
    const uint32_t hi0 = lop3<AND_OR>(q, 0x00f000f0u, 0x64006400u);
    const uint32_t q8 = q >> 8;
    const uint32_t lo1 = lop3<AND_OR>(q8, 0x000f000fu, 0x64006400u);
    const uint32_t hi1 = lop3<AND_OR>(q8, 0x00f000f0u, 0x64006400u);
    const uint32_t k1_16 = 0x2c002c00u;
    const half2 r0 = __hsub2(*reinterpret_cast<const half2*>(&lo0), *reinterpret_cast<const half2*>(&zl[0]));
    const half2 r1 = __hfma2(*reinterpret_cast<const half2*>(&hi0), *reinterpret_cast<const half2*>(&k1_16),
                             *reinterpret_cast<const half2*>(&zh[0]));
    const half2 r2 = __hsub2(*reinterpret_cast<const half2*>(&lo1), *reinterpret_cast<const half2*>(&zl[1]));
    const half2 r3 = __hfma2(*reinterpret_cast<const half2*>(&hi1), *reinterpret_cast<const half2*>(&k1_16),
                             *reinterpret_cast<const half2*>(&zh[1]));
    o[0] = *reinterpret_cast<const uint32_t*>(&r0);
    o[1] = *reinterpret_cast<const uint32_t*>(&r1);
    o[2] = *reinterpret_cast<const uint32_t*>(&r2);
    o[3] = *reinterpret_cast<const uint32_t*>(&r3);
  }
  __device__ __forceinline__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static T2 pack(float x, float y) { return __floats2half2_rn(x, y); }
  __device__ __forceinline__ static half one(float x) { return __float2half_rn(x); }
};

template <>
struct Ops<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  // bf16 has 7 mantissa bits: the high-nibble trick does not fit, every nibble pair is shifted down and
  // uses the magic 128 + code; (code - zero) = v - (128 + z)
  __device__ __forceinline__ static void zero_pairs(uint32_t zpair, int hi, uint32_t& zlo, uint32_t& zhi) {
    const __nv_bfloat162 z = hi ? __high2bfloat162(*reinterpret_cast<const __nv_bfloat162*>(&zpair))
                                : __low2bfloat162(*reinterpret_cast<const __nv_bfloat162*>(&zpair));
    const __nv_bfloat162 lo = __hadd2(z, __float2bfloat162_rn(128.f));
    zlo = *reinterpret_cast<const uint32_t*>(&lo);
    zhi = zlo;
  }
  __device__ __forceinline__ static void codes(uint32_t q, const uint32_t (&zl)[2], const uint32_t (&zh)[2],
                                               uint32_t (&o)[4]) {
    (void)zh;
    const uint32_t k128 = 0x43004300u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = lop3<AND_OR>(q >> (4 * i), 0x000f000fu, k128);
      const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v),
                                       *reinterpret_cast<const __nv_bfloat162*>(&zl[i >> 1]));
      o[i] = *reinterpret_cast<const uint32_t*>(&r);
    }
  }
  __device__ __forceinline__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static T2 pack(float x, float y) { return __floats2bfloat162_rn(x, y); }
  __device__ __forceinline__ static __nv_bfloat16 one(float x) { return __float2bfloat16_rn(x); }
};

// NT = token tiles of 8 (M <= 8 * NT). Lane (g, t): feature rows g and g+8 of each 16-row tile w of its warp's
// 64-feature block, tokens 2t and 2t+1 of each token tile.
template <typename T, int NT, int KS, bool EVICT>
__global__ void __launch_bounds__(THREADS) w4a16_kernel(const SdqW4A16Params p) {
  using S = Smem<NT, KS>;
  using O = Ops<T>;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_last;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g8 = lane / 4, t4 = lane % 4;
  const int nblk = p.n / 64;
  const int nb = blockIdx.x * WN + warp;  // this warp's 64-feature block
  const bool active = nb < nblk;
  const int kb_total = p.k / 16;
  const int stages_total = kb_total / KS;
  const int split = blockIdx.y;
  const int st_begin = static_cast<int>((static_cast<long long>(stages_total) * split) / p.splits);
  const int st_end = static_cast<int>((static_cast<long long>(stages_total) * (split + 1)) / p.splits);
  const int iters = st_end - st_begin;
  const int m = p.m;
  uint64_t policy = 0;
  if constexpr (EVICT) policy = evict_first_policy();

  const uint4* gb = reinterpret_cast<const uint4*>(p.b);
  const T* ga = reinterpret_cast<const T*>(p.a);

  // Stage st = K steps [st*KS, st*KS + KS); KS divides group_k16, so a stage never straddles groups. The loader
  // and the consumer walk the stages in order and keep their own position in the group (no divisions in the
  // loop: at 4 K steps a stage, a runtime modulo cost as much as the dequantization).
  const int gs_st = p.group_k16 / KS;  // stages per group
  int ld_rem = st_begin % gs_st, ld_g = st_begin / gs_st;
  bool ld_first = true;
  const uint4* ld_b = gb + (static_cast<size_t>(nb) * kb_total + static_cast<size_t>(st_begin) * KS) * 32 + lane;
  const T* ld_a = ga + static_cast<size_t>(st_begin) * KS * 16;

  auto load_next = [&](int slot) {
    uint8_t* base = smem + slot * S::STAGE;
    uint4* sb = reinterpret_cast<uint4*>(base);
    uint4* ss = reinterpret_cast<uint4*>(base + S::B_BYTES);
    T* sa = reinterpret_cast<T*>(base + S::B_BYTES + S::S_BYTES);
    if (active) {
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) cp_async16<EVICT>(&sb[(warp * KS + kk) * 32 + lane], ld_b + kk * 32, policy);
      if ((ld_rem == 0 || ld_first) && lane < 16) {
        const uint4* s_src = reinterpret_cast<const uint4*>(lane < 8 ? p.s : p.zs) +
                             (static_cast<size_t>(ld_g) * nblk + nb) * 8 + (lane & 7);
        cp_async16<false>(&ss[warp * 16 + lane], s_src, 0);
      }
    }
    constexpr int CPR = KS * 2;  // 16-byte chunks per activation row
    for (int i = threadIdx.x; i < m * CPR; i += THREADS) {
      const int r = i / CPR, c = i % CPR;
      cp_async16<false>(sa + r * S::A_STRIDE + c * 8, ld_a + static_cast<size_t>(r) * p.k + c * 8, 0);
    }
    ld_first = false;
    ld_b += KS * 32;
    ld_a += KS * 16;
    if (++ld_rem == gs_st) {
      ld_rem = 0;
      ++ld_g;
    }
  };

  float acc[NT][4][4], accg[NT][4][4];  // totals, and the current group's sum of (code - zero) * x
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = accg[i][j][e] = 0.f;

  float sf[4][2] = {};                 // fp32 scales of rows (w, h)
  uint32_t zl[4][2] = {}, zh[4][2] = {};

  auto flush = [&]() {  // acc += scale * group sum
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[i][w][e] = fmaf(sf[w][e >> 1], accg[i][w][e], acc[i][w][e]);
          accg[i][w][e] = 0.f;
        }
  };

  int cp_rem = st_begin % gs_st;
  bool cp_first = true;
  auto compute_next = [&](int slot) {
    const uint8_t* base = smem + slot * S::STAGE;
    const uint4* sb = reinterpret_cast<const uint4*>(base);
    const uint4* ss = reinterpret_cast<const uint4*>(base + S::B_BYTES);
    const T* sa = reinterpret_cast<const T*>(base + S::B_BYTES + S::S_BYTES);
    if (cp_rem == 0 || cp_first) {  // a new group: fold the last one in, load this one's scales and zeros
      if (!cp_first) flush();
      const uint4 s4 = ss[warp * 16 + g8], z4 = ss[warp * 16 + 8 + g8];
      const uint32_t sp[4] = {s4.x, s4.y, s4.z, s4.w};
      const uint32_t zp[4] = {z4.x, z4.y, z4.z, z4.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 f = __half22float2(*reinterpret_cast<const half2*>(&sp[w]));
        sf[w][0] = f.x;
        sf[w][1] = f.y;
        O::zero_pairs(zp[w], 0, zl[w][0], zh[w][0]);
        O::zero_pairs(zp[w], 1, zl[w][1], zh[w][1]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const uint4 bq = sb[(warp * KS + kk) * 32 + lane];
      uint32_t xb[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int r = nt * 8 + g8, col = kk * 16 + 2 * t4;
        xb[nt][0] = r < m ? *reinterpret_cast<const uint32_t*>(sa + r * S::A_STRIDE + col) : 0u;
        xb[nt][1] = r < m ? *reinterpret_cast<const uint32_t*>(sa + r * S::A_STRIDE + col + 8) : 0u;
      }
      const uint32_t q[4] = {bq.x, bq.y, bq.z, bq.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {  // word w: feature rows 16w + g (+8)
        uint32_t c[4];
        O::codes(q[w], zl[w], zh[w], c);
        const uint32_t a[4] = {c[0], c[2], c[1], c[3]};  // (row g, k lo) (row g+8, k lo) (row g, k hi) (g+8, hi)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) O::mma(accg[nt][w], a, xb[nt][0], xb[nt][1]);
      }
    }
    cp_first = false;
    if (++cp_rem == gs_st) cp_rem = 0;
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < iters) load_next(s);
    cp_async_commit();
  }
  int ld_slot = STAGES - 1, cp_slot = 0;
  for (int it = 0; it < iters; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage `it` is visible to all warps; slot (it-1) % STAGES is free again
    if (it + STAGES - 1 < iters) load_next(ld_slot);
    ld_slot = ld_slot + 1 == STAGES ? 0 : ld_slot + 1;
    cp_async_commit();
    compute_next(cp_slot);
    cp_slot = cp_slot + 1 == STAGES ? 0 : cp_slot + 1;
  }
  cp_async_wait<0>();
  flush();

  // ------------------------------------------------------------------------------------------ epilogue
  // acc[nt][w][2h + e] = y[token nt*8 + 2t + e][feature nb*64 + 16w + 8h + g]
  const int n = p.n;
  if (p.splits == 1) {
    if (active) {
      T* out = reinterpret_cast<T*>(p.c);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tok = nt * 8 + 2 * t4 + (e & 1);
            const int col = nb * 64 + 16 * w + 8 * (e >> 1) + g8;
            if (tok < m) out[static_cast<size_t>(tok) * n + col] = O::one(acc[nt][w][e]);
          }
    }
    return;
  }
  float* part = p.partial + static_cast<size_t>(split) * m * n;
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = nt * 8 + 2 * t4 + (e & 1);
          const int col = nb * 64 + 16 * w + 8 * (e >> 1) + g8;
          if (tok < m) __stcg(part + static_cast<size_t>(tok) * n + col, acc[nt][w][e]);
        }
  }
  __threadfence();  // this CTA's partials are visible device-wide before it is counted
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&p.locks[blockIdx.x], 1) == p.splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const int col0 = blockIdx.x * WN * 64;
  const int ncols = min(WN * 64, n - col0);
  const int pairs = ncols / 2;
  T* out = reinterpret_cast<T*>(p.c);
  for (int i = threadIdx.x; i < m * pairs; i += THREADS) {
    const int row = i / pairs, col = col0 + 2 * (i % pairs);
    float2 sum = make_float2(0.f, 0.f);
    for (int s = 0; s < p.splits; ++s) {  // fixed order: the result does not depend on arrival order
      const float2 v = __ldcg(reinterpret_cast<const float2*>(p.partial + (static_cast<size_t>(s) * m + row) * n + col));
      sum.x += v.x;
      sum.y += v.y;
    }
    *reinterpret_cast<typename O::T2*>(out + static_cast<size_t>(row) * n + col) = O::pack(sum.x, sum.y);
  }
  if (threadIdx.x == 0) p.locks[blockIdx.x] = 0;  // every CTA of this tile has arrived: reset for next call
}

template <typename T, int NT, int KS, bool EVICT>
int launch_t(const SdqW4A16Params& p, cudaStream_t stream) {
  auto kern = w4a16_kernel<T, NT, KS, EVICT>;
  static bool configured = false;  // per instantiation; the attribute is per function, not per call
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, Smem<NT, KS>::TOTAL);
    if (e != cudaSuccess) return e;
    configured = true;
  }
  dim3 grid((p.n / 64 + WN - 1) / WN, p.splits);
  kern<<<grid, THREADS, Smem<NT, KS>::TOTAL, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int NT>
int launch_ks(const SdqW4A16Params& p, cudaStream_t stream) {
  const bool ks4 = p.group_k16 % 4 == 0;
  if (p.evict_first) return ks4 ? launch_t<T, NT, 4, true>(p, stream) : launch_t<T, NT, 2, true>(p, stream);
  return ks4 ? launch_t<T, NT, 4, false>(p, stream) : launch_t<T, NT, 2, false>(p, stream);
}

template <typename T>
int launch_m(const SdqW4A16Params& p, cudaStream_t stream) {
  if (p.m <= 8) return launch_ks<T, 1>(p, stream);
  if (p.m <= 16) return launch_ks<T, 2>(p, stream);
  if (p.m <= 32) return launch_ks<T, 4>(p, stream);
  return -2;
}

__global__ void probe_kernel(const uint4* src, uint4* dst) {
  __shared__ __align__(16) uint4 buf[32];
  const uint64_t pol = evict_first_policy();
  cp_async16<true>(&buf[threadIdx.x], src + threadIdx.x, pol);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  dst[threadIdx.x] = buf[threadIdx.x];
}

}  // namespace

extern "C" int sdq_w4a16_launch(const SdqW4A16Params* p, cudaStream_t stream) {
  if (p->m < 1 || p->n % 64 || p->k % 32 || p->group_k16 < 2 || p->group_k16 % 2 || p->splits < 1 ||
      p->k % (p->group_k16 * 16) || (p->group_k16 % 4 && p->k % 32) || (p->group_k16 % 4 == 0 && p->k % 64))
    return -1;
  return p->is_bf16 ? launch_m<__nv_bfloat16>(*p, stream) : launch_m<half>(*p, stream);
}

extern "C" int sdq_w4a16_auto_splits(int m, int n, int k, int group_k16, int is_bf16) {
  int dev = 0, sms = 132;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int ks = group_k16 % 4 == 0 ? 4 : 2;
  const int stages = k / 16 / ks;
  const int tiles = (n / 64 + WN - 1) / WN;
  // CTAs per SM: shared memory, and registers (ptxas: ~96 / ~148 / ~216 per thread for 1 / 2 / 4 token tiles)
  const int nt = m <= 8 ? 1 : (m <= 16 ? 2 : 4);
  const int stage_bytes = WN * ks * 512 + WN * 256 + nt * 8 * (ks * 16 + 8) * 2;
  const int reg_cap = nt == 1 ? 5 : (nt == 2 ? 3 : 2);
  int per_sm = (227 * 1024) / (STAGES * stage_bytes + 1024);
  per_sm = per_sm < 1 ? 1 : (per_sm > reg_cap ? reg_cap : per_sm);
  (void)is_bf16;
  const int slots = sms * per_sm;
  // Measured on the H200 (bench/gpu_check.py --sweep-splits): about 2.5 CTAs per SM is best; fewer leave
  // the memory system idle, CTAs beyond what fits at once form a second wave, and splits shorter than ~4
  // stages spend their time in the pipeline prologue.
  int splits = (5 * sms + tiles) / (2 * tiles);
  if (splits > slots / tiles) splits = slots / tiles;
  if (splits > stages / 4) splits = stages / 4;
  if (splits < 1) splits = 1;
  // short splits: prefer a divisor of the stage count (one split a stage longer than the rest sets the time)
  if (stages / splits < 16)
    for (int s = splits; 2 * s >= splits; --s)
      if (stages % s == 0) return s;
  return splits;
}

extern "C" int sdq_probe_evict_first(cudaStream_t stream) {
  uint4 *src = nullptr, *dst = nullptr;
  if (cudaMalloc(&src, 32 * sizeof(uint4)) != cudaSuccess) return -1;
  if (cudaMalloc(&dst, 32 * sizeof(uint4)) != cudaSuccess) return -1;
  cudaMemsetAsync(src, 0x5a, 32 * sizeof(uint4), stream);
  probe_kernel<<<1, 32, 0, stream>>>(src, dst);
  cudaError_t e = cudaStreamSynchronize(stream);
  uint4 host[32];
  if (e == cudaSuccess) e = cudaMemcpy(host, dst, sizeof(host), cudaMemcpyDeviceToHost);
  cudaFree(src);
  cudaFree(dst);
  if (e != cudaSuccess) return e;
  for (int i = 0; i < 32; ++i)
    if (host[i].x != 0x5a5a5a5au || host[i].w != 0x5a5a5a5au) return -3;
  return 0;
}
