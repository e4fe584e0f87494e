// sdquant W4A16 decode GEMM for sm_90 (kernel templates; w4a16_part_*.cu instantiate them, w4a16_sm90.cu
// holds the C interface) (M <= 32 per launch, best at M <= 16): y[m, n] = sum_k x[m, k] W[n, k].
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
// * A multi-stage cp.async pipeline (STAGES deep) per CTA keeps ~(STAGES-1) * WNN * 2 KB of weights in flight
//   without holding registers; activations for the stage go to shared memory once and feed all warps. The
//   direct kernel (w4a16_direct.cuh, variants 8+) instead streams fragments into registers per warp.
// * Variants (Cfg / DCfg below, ids listed before V0) are chosen per call; bench/int4_tune.py measures them
//   and int4_cuda.DEFAULT_CONFIGS / SHAPE_CONFIGS hold the winners (H200 run 4).
// * Split-K over the grid's y dimension so every SM has work at M = 1 on K >> N shapes. Partial sums go to
//   an fp32 scratch; the last CTA of a column tile (counted on a lock that it resets) adds them in a fixed
//   order and writes the output: one launch, deterministic, no memset.
// * Optional L2 evict-first hint on weight copies (they are read exactly once); only used after
//   sdq_probe_evict_first ran on the device (a published kernel's hint raised "illegal instruction" there).
#pragma once
#include "w4a16.h"
#include "w4a16_host.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace sdq_w4a16 {
namespace {  // internal linkage: every translation unit keeps its own copies

// A kernel variant (Cfg): WNN 64-feature blocks per CTA (the CTA's column tile is 64 * WNN features), KW warps
// per block that split each stage's K steps between them (intra-CTA split-K: more warps in flight without a
// wider tile or more global splits; summed through shared memory at the end), STAGES cp.async stages, and
// PRE = 1 to read a warp's whole stage of fragments and activations from shared memory before the first
// dequantize/MMA (the loads' latency overlaps instead of sitting in each step's dependency chain).
template <int WNN_, int KW_, int STAGES_, int PRE_>
struct Cfg {
  static constexpr int WNN = WNN_, KW = KW_, STAGES = STAGES_, PRE = PRE_;
  static constexpr int WARPS = WNN * KW;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr bool DIRECT = false;
  static constexpr int KIND = 0;  // 0: cp.async pipeline, 1: direct (w4a16_direct.cuh), 2: stream-K (w4a16_streamk.cuh)
};

template <typename C, int NT, int KS>
struct Smem {
  static constexpr int B_BYTES = C::WNN * KS * 32 * 16;   // fragments
  static constexpr int S_BYTES = C::WNN * 16 * 16;        // 8 uint4 scales + 8 uint4 zs per 64-feature block
  static constexpr int A_STRIDE = KS * 16 + 8;            // halves; +16 B per row avoids bank conflicts
  static constexpr int A_BYTES = NT * 8 * A_STRIDE * 2;
  static constexpr int STAGE = B_BYTES + S_BYTES + A_BYTES;
  static constexpr int TOTAL = C::STAGES * STAGE;
  static constexpr int RED_BYTES = (C::KW - 1) * C::WNN * NT * 16 * 32 * 4;  // KW > 1: partial sums of warps kw > 0
  static_assert(RED_BYTES <= TOTAL, "reduction buffer must fit in the pipeline's shared memory");
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

// Programmatic dependent launch (PTX griddepcontrol, sm_90): both are no-ops when the kernel was launched
// without the attribute. wait: block until the previous kernel of the stream has finished and its writes are
// visible. launch_dependents: let the next kernel of the stream (if launched with the attribute) start now.
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

#ifndef SDQ_SPLIT_TAIL  // split-K count-in of the mma.sync kernels: 1 (default) split_count_in; 0 the form before it
#define SDQ_SPLIT_TAIL 1  // (every thread fences), for A/B builds
#endif
// After this CTA's threads stored their fp32 partials: counts the CTA in on `lock` and returns, in every thread, whether
// it arrived last of `count` (it then owns the lock, and every other CTA's partials are visible to its ld.cg loads). The
// barrier orders the CTA's stores before thread 0's acq_rel atomic (cumulativity: the pattern of CUTLASS's split-K
// semaphores), whose acquire half orders the partial loads after the second barrier. Form 0 (SDQ_SPLIT_TAIL=0, inline
// at the call sites) fenced (fence.sc) in every thread before the count and again after it when last. ab_build run 13
// (docs/benchmarks/int4-cuda.md, "The split-K count-in"): outputs bit-identical, 0.3-0.5 us faster a launch at M = 1-8 (4096x4096
// M = 1 v38 7.7 -> 7.3 us). Loading the last CTA's partials 8 at a time as well was level at M = 1 and up to 15%
// slower at M = 4-8 (registers), so the loads stay one split at a time.
__device__ __forceinline__ bool split_count_in(int* lock, int count, int& s_last) {
  __syncthreads();
  if (threadIdx.x == 0) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(lock) : "memory");
    s_last = old == count - 1;
  }
  __syncthreads();
  return s_last;
}
// sum over q < splits of f(q) (a float2 load), in split order: the result does not depend on arrival order
template <typename F>
__device__ __forceinline__ float2 split_sum(int splits, F&& f) {
  float2 s = make_float2(0.f, 0.f);
  for (int q = 0; q < splits; ++q) {
    const float2 v = f(q);
    s.x += v.x;
    s.y += v.y;
  }
  return s;
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
  __device__ __forceinline__ static uint32_t mul2(uint32_t a, uint32_t b) {
    const half2 r = __hmul2(*reinterpret_cast<const half2*>(&a), *reinterpret_cast<const half2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
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
  __device__ __forceinline__ static uint32_t mul2(uint32_t a, uint32_t b) {
    const __nv_bfloat162 r =
        __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
};

// f(nt, w, e) for every element of a lane's NT x 4 x 4 fragment array (token tile nt, 16-row tile w, element e:
// token nt * 8 + 2 t4 + (e & 1), row 16 w + 8 (e >> 1) + g8), fully unrolled. The output and K-warp reduction loops
// of the cp.async and stream-K kernels stay written out: through this helper ptxas scheduled them differently.
template <int NT, typename F>
__device__ __forceinline__ void frag_each(F&& f) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(nt, w, e);
}

// The direct-family kernels' group arithmetic (direct, bulk-copy and flat bulk-copy kernels): each K step's MMAs
// accumulate the exact (code - zero) x activation products into accg (group_step); when a group ends, group_flush adds
// scale x accg to acc once; group_begin unpacks the next group's scales and zero pairs. A lane holds those of its rows
// g8 and g8 + 8 in the four 16-row tiles of its block. (Free functions over the kernel's own arrays: a struct holding
// them changed the direct kernel's SASS.)
// RAW (the lean / stream-K raw-code kernels): the MMAs summed (magic + code) x activation, so each group also adds
// nz x (its activation sums xs) with nz = -scale * (magic + zero), and xs restarts from zero.
template <int NT, bool RAW = false>
__device__ __forceinline__ void group_flush(float (&acc)[NT][4][4], float (&accg)[NT][4][4], const float (&sf)[4][2],
                                            const float (*nz)[2] = nullptr, float (*xs)[4] = nullptr) {
  frag_each<NT>([&](int i, int w, int e) {
    acc[i][w][e] = fmaf(sf[w][e >> 1], accg[i][w][e], acc[i][w][e]);
    if constexpr (RAW) acc[i][w][e] = fmaf(nz[w][e >> 1], xs[i][e & 1], acc[i][w][e]);
    accg[i][w][e] = 0.f;
  });
  if constexpr (RAW) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) xs[i][e] = 0.f;
  }
}
// a group starts: its scales (fp16 pairs) and zeros (activation-dtype pairs) as load_group_sz fetched them
template <typename T>
__device__ __forceinline__ void group_begin(const uint4& s, const uint4& z, float (&sf)[4][2], uint32_t (&zl)[4][2],
                                            uint32_t (&zh)[4][2]) {
  const uint32_t sp[4] = {s.x, s.y, s.z, s.w};
  const uint32_t zp[4] = {z.x, z.y, z.z, z.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float2 f = __half22float2(*reinterpret_cast<const half2*>(&sp[w]));
    sf[w][0] = f.x;
    sf[w][1] = f.y;
    Ops<T>::zero_pairs(zp[w], 0, zl[w][0], zh[w][0]);
    Ops<T>::zero_pairs(zp[w], 1, zl[w][1], zh[w][1]);
  }
}
// one K step: the lane's 16 fragment bytes (four 16x16 tiles) against each token tile's activations
template <typename T, int NT>
__device__ __forceinline__ void group_step(const uint4& wq, const uint32_t (&x)[NT][2], const uint32_t (&zl)[4][2],
                                           const uint32_t (&zh)[4][2], float (&accg)[NT][4][4]) {
  const uint32_t q[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    uint32_t c[4];
    Ops<T>::codes(q[w], zl[w], zh[w], c);
    const uint32_t af[4] = {c[0], c[2], c[1], c[3]};  // (row g, k lo) (row g+8, k lo) (row g, k hi) (g+8, hi)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) Ops<T>::mma(accg[nt][w], af, x[nt][0], x[nt][1]);
  }
}

// The KS-step stages [a, a + iters) of warp kw of KW in split blockIdx.y of p.splits (direct and bulk-copy kernels):
// the split's stages are cut into KW contiguous ranges; inactive warps (past the last block) get none.
template <int KS, int KW>
__device__ __forceinline__ void warp_stages(const SdqW4A16Params& p, int kw, bool active, int& a, int& iters) {
  const int stages_total = p.k / 16 / KS;
  const int split = blockIdx.y;
  const int st0 = static_cast<int>((static_cast<long long>(stages_total) * split) / p.splits);
  const int st1 = static_cast<int>((static_cast<long long>(stages_total) * (split + 1)) / p.splits);
  a = st0 + ((st1 - st0) * kw) / KW;
  const int b = st0 + ((st1 - st0) * (kw + 1)) / KW;
  iters = active ? b - a : 0;
}

// The scales and zeros of group g of 64-feature block nb: lane g8's 16 bytes of each ([g, n/64, 8, 8] layouts).
__device__ __forceinline__ void load_group_sz(const SdqW4A16Params& p, int g, int nblk, int nb, int g8, uint4& s,
                                              uint4& z) {
  const size_t o = (static_cast<size_t>(g) * nblk + nb) * 8 + g8;
  s = __ldg(reinterpret_cast<const uint4*>(p.s) + o);
  z = __ldg(reinterpret_cast<const uint4*>(p.zs) + o);
}

// The B fragments (activations) of KS consecutive K steps at element offset off of xsrc = (row 0) + 2 t (+ a base),
// rows `stride` elements apart: rows past M read as zero. SMEM: xsrc is a shared-memory copy (plain loads), else
// global memory (read through L1). load_x_steps: the activations of p, rows p.k apart.
template <typename T, int NT, int KS, bool SMEM, typename Stride>
__device__ __forceinline__ void load_x_rows(const T* xsrc, Stride stride, int off, int g8, int m,
                                            uint32_t (&xx)[KS][NT][2]) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int r = nt * 8 + g8;
      const T* xr = xsrc + static_cast<Stride>(r) * stride + off + kk * 16;
      const unsigned int* w = reinterpret_cast<const unsigned int*>(xr);
      xx[kk][nt][0] = r < m ? (SMEM ? w[0] : __ldg(w)) : 0u;
      xx[kk][nt][1] = r < m ? (SMEM ? w[4] : __ldg(w + 4)) : 0u;
    }
}
template <typename T, int NT, int KS>
__device__ __forceinline__ void load_x_steps(const SdqW4A16Params& p, const T* xsrc, int off, int g8, int m,
                                             uint32_t (&xx)[KS][NT][2]) {
  load_x_rows<T, NT, KS, false>(xsrc, static_cast<size_t>(p.k), off, g8, m, xx);
}

// Epilogue shared by the kernels: acc[nt][w][2h + e] = y[token nt*8 + 2t + e][feature nb*64 + 16w + 8h + g].
// splits == 1: write y. Otherwise write this CTA's fp32 partial; the last CTA of a column tile (counted on a lock
// that it resets) adds the partials in a fixed order and writes y: deterministic, one launch, no memset.
// Every thread of the CTA must call it (barriers inside).
// Sum the accumulators of the KW warps that split one block's K steps into warp kw = 0, through shared memory
// (smem must hold (KW - 1) * WNN * NT * 16 * 32 floats and be free to overwrite). Both kernels end with it.
template <int NT, int WNN, int KW>
__device__ __forceinline__ void reduce_k_warps(float (&acc)[NT][4][4], void* smem, int kw, int wn, int lane) {
  float* red = reinterpret_cast<float*>(smem);
  if (kw > 0) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          red[((((kw - 1) * WNN + wn) * NT + i) * 16 + w * 4 + e) * 32 + lane] = acc[i][w][e];
  }
  __syncthreads();
  if (kw == 0) {
#pragma unroll
    for (int q = 1; q < KW; ++q)
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][w][e] += red[((((q - 1) * WNN + wn) * NT + i) * 16 + w * 4 + e) * 32 + lane];
  }
}

template <typename T, int NT, int WNN, int THREADS>
__device__ __forceinline__ void store_output(const SdqW4A16Params& p, const float (&acc)[NT][4][4], bool writer,
                                             int nb, int split, int& s_last) {
  using O = Ops<T>;
  const int m = p.m;
  const int g8 = (threadIdx.x % 32) / 4, t4 = threadIdx.x % 4;
  const int n = p.n;
  if (p.splits == 1) {
    if (writer) {
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
  if (writer) {
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
#if SDQ_SPLIT_TAIL
  if (!split_count_in(&p.locks[blockIdx.x], p.splits, s_last)) return;
#else  // (as measured; split_count_in's form 0 is this, but calling it reschedules the main loops in ptxas)
  __threadfence();  // this CTA's partials are visible device-wide before it is counted
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&p.locks[blockIdx.x], 1) == p.splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
#endif
  const int col0 = blockIdx.x * WNN * 64;
  const int ncols = min(WNN * 64, n - col0);
  const int pairs = ncols / 2;
  T* out = reinterpret_cast<T*>(p.c);
  for (int i = threadIdx.x; i < m * pairs; i += THREADS) {
    const int row = i / pairs, col = col0 + 2 * (i % pairs);
#if SDQ_SPLIT_TAIL
    const float2 sum = split_sum(p.splits, [&](int s) {
      return __ldcg(reinterpret_cast<const float2*>(p.partial + (static_cast<size_t>(s) * m + row) * n + col));
    });
#else
    float2 sum = make_float2(0.f, 0.f);
    for (int s = 0; s < p.splits; ++s) {  // fixed order: the result does not depend on arrival order
      const float2 v = __ldcg(reinterpret_cast<const float2*>(p.partial + (static_cast<size_t>(s) * m + row) * n + col));
      sum.x += v.x;
      sum.y += v.y;
    }
#endif
    *reinterpret_cast<typename O::T2*>(out + static_cast<size_t>(row) * n + col) = O::pack(sum.x, sum.y);
  }
  if (threadIdx.x == 0) p.locks[blockIdx.x] = 0;  // every CTA of this tile has arrived: reset for next call
}

// NT = token tiles of 8 (M <= 8 * NT). Warp (wn, kw): 64-feature block blockIdx.x * WNN + wn, K steps kw, kw + KW,
// ... of every stage. Lane (g, t): feature rows g and g+8 of each 16-row tile w of the block, tokens 2t and
// 2t+1 of each token tile.
template <typename T, typename C, int NT, int KS, bool EVICT>
__global__ void __launch_bounds__(C::THREADS) w4a16_kernel(const SdqW4A16Params p) {
  static_assert(KS % C::KW == 0, "the K steps of a stage must split evenly between a block's warps");
  constexpr int WNN = C::WNN, KW = C::KW, STAGES = C::STAGES, THREADS = C::THREADS;
  constexpr int KPW = KS / KW;  // K steps per warp and stage
  using S = Smem<C, NT, KS>;
  using O = Ops<T>;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_last;

  griddep_wait();  // programmatic dependent launch (p.pdl): the previous kernel's output is visible from here
  if (p.pdl >= 2) griddep_launch_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wn = warp % WNN, kw = warp / WNN;
  const int g8 = lane / 4, t4 = lane % 4;
  const int nblk = p.n / 64;
  const int nb = blockIdx.x * WNN + wn;  // this warp's 64-feature block
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
  // loop: at 4 K steps a stage, a runtime modulo cost as much as the dequantization). Each warp copies exactly
  // the fragments it will consume.
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
      for (int j = 0; j < KPW; ++j) {
        const int kk = kw + KW * j;
        cp_async16<EVICT>(&sb[(wn * KS + kk) * 32 + lane], ld_b + kk * 32, policy);
      }
      if (kw == 0 && (ld_rem == 0 || ld_first) && lane < 16) {
        const uint4* s_src = reinterpret_cast<const uint4*>(lane < 8 ? p.s : p.zs) +
                             (static_cast<size_t>(ld_g) * nblk + nb) * 8 + (lane & 7);
        cp_async16<false>(&ss[wn * 16 + lane], s_src, 0);
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
  frag_each<NT>([&](int i, int j, int e) { acc[i][j][e] = accg[i][j][e] = 0.f; });

  float sf[4][2] = {};                 // fp32 scales of rows (w, h)
  uint32_t zl[4][2] = {}, zh[4][2] = {};

  int cp_rem = st_begin % gs_st;
  bool cp_first = true;
  auto compute_next = [&](int slot) {
    const uint8_t* base = smem + slot * S::STAGE;
    const uint4* sb = reinterpret_cast<const uint4*>(base);
    const uint4* ss = reinterpret_cast<const uint4*>(base + S::B_BYTES);
    const T* sa = reinterpret_cast<const T*>(base + S::B_BYTES + S::S_BYTES);
    if (cp_rem == 0 || cp_first) {  // a new group: fold the last one in, load this one's scales and zeros
      if (!cp_first) group_flush<NT>(acc, accg, sf);  // acc += scale * group sum
      group_begin<T>(ss[wn * 16 + g8], ss[wn * 16 + 8 + g8], sf, zl, zh);
    }
    // PRE: every shared-memory read of this stage is issued before the first dequantize/MMA
    constexpr int NB = C::PRE ? KPW : 1;
    uint4 bq_pre[NB];
    uint32_t xb_pre[NB][NT][2];
    auto read_step = [&](int j, uint4& bq, uint32_t (&xb)[NT][2]) {
      const int kk = kw + KW * j;
      bq = sb[(wn * KS + kk) * 32 + lane];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int r = nt * 8 + g8, col = kk * 16 + 2 * t4;
        xb[nt][0] = r < m ? *reinterpret_cast<const uint32_t*>(sa + r * S::A_STRIDE + col) : 0u;
        xb[nt][1] = r < m ? *reinterpret_cast<const uint32_t*>(sa + r * S::A_STRIDE + col + 8) : 0u;
      }
    };
    if constexpr (C::PRE) {
#pragma unroll
      for (int j = 0; j < KPW; ++j) read_step(j, bq_pre[j], xb_pre[j]);
    }
#pragma unroll
    for (int j = 0; j < KPW; ++j) {
      const int jj = C::PRE ? j : 0;
      if constexpr (!C::PRE) read_step(j, bq_pre[0], xb_pre[0]);
      group_step<T, NT>(bq_pre[jj], xb_pre[jj], zl, zh, accg);  // word w: feature rows 16w + g (+8)
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
  group_flush<NT>(acc, accg, sf);
  griddep_launch_dependents();  // the next kernel may launch during this epilogue (no-op without PDL)

  if constexpr (KW > 1) {  // fold the K-split warps of each block into warp kw = 0 through shared memory
    __syncthreads();       // every warp is done reading the pipeline's shared memory
    reduce_k_warps<NT, WNN, KW>(acc, smem, kw, wn, lane);
  }
  store_output<T, NT, WNN, THREADS>(p, acc, active && kw == 0, nb, split, s_last);
}

#include "w4a16_direct.cuh"  // the direct (no shared-memory pipeline) kernel, same namespace
#include "w4a16_streamk.cuh"  // the stream-K direct kernel and the read probes, same namespace
#include "w4a16_lean.cuh"     // the lean direct kernel (variants 28+), same namespace
#include "w4a16_bulk.cuh"     // the bulk-copy kernel (variants 50+), same namespace
#include "w4a16_tight.cuh"    // the tight direct kernel (variants 38-41, 43-44), same namespace
#include "w4a16_feed.cuh"     // the feed kernel (variants 60-61), same namespace

// ------------------------------------------------------------------------------------------------ variants
// Variant ids are part of the tuning interface (bench/int4_tune.py, int4_cuda.auto_config): append, never renumber.
//   0: 4 blocks x 1 warp, 5 stages            (the run-3 kernel; the only one for M > 16 and evict-first)
//   1: 4 x 1, 5 stages, stage-wide smem reads  2: 4 x 2 warps, 5 stages, PRE     3: 4 x 2, 8 stages, PRE
//   4: 2 x 2, 8 stages, PRE                    5: 8 x 1, 4 stages, PRE           6: 4 x 1, 8 stages, PRE
//   7: 2 x 4 (KS = 4 only), 8 stages, PRE
// direct kernel (w4a16_direct.cuh): blocks x warps per block, 2-step register stages ahead, min CTAs/SM for ptxas:
//   8: 4 x 2, 4 ahead, 1      9: 4 x 2, 2 ahead, 2      10: 2 x 4, 2 ahead, 2      11: 4 x 1, 4 ahead, 3
//   12: 8 x 1, 2 ahead, 2
// stream-K direct kernel (w4a16_streamk.cuh; grid = resident slots, flattened tile x K walk): blocks (= warps) per
// CTA, 2-step stages ahead, min CTAs/SM for ptxas at 1 / 2 token tiles, WSCALE (scale per weight, one accumulator set):
//   13: 8, 2 ahead, 2/1        14: 4, 3 ahead, 3/2        15: 4, 4 ahead, 2/1        16: 8, 3 ahead, 2/1, WSCALE
//   17: 4, 2 ahead, 4/2, WSCALE                            18: 2, 2 ahead, 6/3
// the same with a per-warp shared-memory ring of cp.async stages instead of the register ring (RING stages deep):
//   19: 4, 8 stages, 4/2        20: 4, 8 stages, 4/3, WSCALE        21: 8, 6 stages, 2/1        22: 4, 12, 4/3, WSCALE
// 14, 13 and 16 with an L2 bulk prefetch 8 stages (8 KB a warp) ahead: 23 (= 14), 24 (= 13), 25 (= 16)
// one 64-feature block a CTA, its KWI warps taking 4-stage chunks round robin (one contiguous stream a CTA):
//   26: 4 warps, 2 ahead, 3/2        27: 8 warps, 2 ahead, 2/1, WSCALE
// lean direct kernel (w4a16_lean.cuh; grid = tiles x S splits, the splits of a tile one cluster reducing through
// DSMEM when S <= 8): blocks x K-warps per CTA, ring of K steps in flight per warp, min CTAs/SM for ptxas (bf16 one
// tile / two tiles / fp16 one tile), WSCALE (bf16 only):
//   28: 4 x 1, ring 4, 6/3/4, WSCALE (24 warps/SM)      29: 4 x 1, ring 4, 5/3/4, group sums (20 warps/SM)
//   30: 1 x 8, ring 4, 3/1/2, WSCALE                    31: 1 x 4, ring 4, 6/3/4, WSCALE
//   32: 2 x 2, ring 4, 6/3/4, WSCALE                    33: 4 x 1, ring 8, 5/2/4, WSCALE (4 KB a warp in flight)
//   34: 4 x 1, ring 2, 8/4/5, WSCALE (32 warps/SM)      35: 2 x 4, ring 4, 3/1/2, WSCALE
//   36: 1 x 8, ring 2, 4/2/2, WSCALE (32 warps/SM)      37: = 30 without clusters (fp32 partials + lock)
// (run 6 measured the clusters as a loss: e.g. 30 vs 37 on 4096x4096 M = 1, 14.8 vs 9.1 us; the ids below use none)
//   42: = 28 without clusters (WSCALE, 24 warps/SM)
// (ids 38-41 and 43-44 held RAW-code lean configs until 2026-12-02; they won nowhere in run 6b and now name the tight
// kernel below)
// tight (w4a16_tight.cuh: the direct kernel's stream in a loop of static indices, chunks of 4 K steps, D chunks a warp
// in flight; blocks x K-warps, D, min CTAs/SM at one tile):
//   38: 2 x 4, 2, 2 (the M = 1-8 default)   39: 4 x 2, 2, 2   40: 4 x 1, 2, 3   41: 8 x 1, 2, 2
//   43: = 38 with RAW codes               44: = 39 with RAW codes
// stream-K with RAW codes (scales/zeros fetched when their group starts): 45: 4 blocks, 2 ahead, 3/2 (v14's geometry;
// at v17's 8 blocks and 2 CTAs/SM it spills)
// flat lean (w4a16_lean_flat_kernel: grid = resident slots, every warp W-th of the flattened block x K-step space):
//   46: 4 warps, ring 4, RAW, 4/3/4        47: 8 warps, ring 4, RAW, 2/1/2        48: 4 warps, ring 8, RAW, 4/2/3
//   49: 4 warps, ring 4, WSCALE, 5/3/4
// bulk-copy kernel (w4a16_bulk.cuh; the direct kernel's grid and arithmetic, each warp's fragments through its own
// shared-memory ring filled by cp.async.bulk): blocks x K-warps, chunk (K steps), ring slots, min CTAs/SM at one tile:
//   50: 2 x 4, 4, 6, 2 (12 KB a warp in flight, 16 warps/SM)     51: 2 x 4, 8, 3, 2 (4 KB copies)
//   52: 4 x 1, 4, 6, 4                                            53: 1 x 8, 4, 6, 2
//   54: 2 x 4, 2, 12, 2 (1 KB copies)                             55: 2 x 2, 2, 12, 4 (1 KB copies)
//   56: 4 x 2, 4, 6, 2                                            57: = 50 without the L2 evict-first hint
// flat bulk-copy kernel (w4a16_bulk_flat_kernel: the flat lean grid, every warp an equal contiguous byte range of the
// fragments through its ring, K steps one at a time): warps, chunk (K steps), ring slots, min CTAs/SM at one tile:
//   58: 4, 4, 6, 4 (16 warps/SM, 192 KB/SM)     59: 8, 4, 6, 2
// (60 and 61 were two more flat bulk-copy configs, 4 warps with 1 KB and 4 KB copies; they won nowhere in run 7b)
// feed kernel (w4a16_feed.cuh, M <= 8: one CTA a SM, one contiguous stage range a CTA, a producer thread's bulk copies
// into an S-stage ring, CW consumer warps of KPW K steps a stage); CW, KPW, S:
//   60: 16, 4, 6 (32 KB stages, K % 1024 == 0)     61: 16, 2, 12 (16 KB stages, K % 512 == 0)
// probes (not GEMMs; sdq_w4a16_probe only): P7 = 50's copies and shared-memory reads (grid: 50's split-K), P8 = 58's
// (grid: 58's resident slots); P1 = 13's loads, P2 = 15's loads, P3 = 4 warps 8 stages deep in
// registers, P4 = 19's loads (shared-memory ring), P5 = 23's loads (with the L2 prefetch), P6 = 26's loads;
// xor only
using V0 = Cfg<4, 1, 5, 0>;
using V1 = Cfg<4, 1, 5, 1>;
using V2 = Cfg<4, 2, 5, 1>;
using V3 = Cfg<4, 2, 8, 1>;
using V4 = Cfg<2, 2, 8, 1>;
using V5 = Cfg<8, 1, 4, 1>;
using V6 = Cfg<4, 1, 8, 1>;
using V7 = Cfg<2, 4, 8, 1>;
using V8 = DCfg<4, 2, 4, 1>;
using V9 = DCfg<4, 2, 2, 2>;
using V10 = DCfg<2, 4, 2, 2>;
using V11 = DCfg<4, 1, 4, 3>;
using V12 = DCfg<8, 1, 2, 2>;
using V13 = SKCfg<4, 3, 3, 2, 0, 0, 0, 2, 2>;
using V14 = SKCfg<4, 2, 4, 2, 1, 0, 0, 3, 2>;
using V15 = SKCfg<4, 2, 4, 2, 1, 1, 0, 3, 1>;
using V16 = SKCfg<2, 2, 6, 3, 0, 1>;
using V17 = SKCfg<8, 2, 2, 1, 1, 0>;
using V18 = SKCfg<2, 3, 6, 3, 1, 1>;
using V19 = SKCfg<4, 0, 4, 2, 0, 0, 0, 4, 2, 8>;
using V20 = SKCfg<4, 0, 4, 3, 1, 0, 0, 4, 3, 8>;
using V21 = SKCfg<8, 0, 2, 1, 0, 0, 0, 2, 1, 6>;
using V22 = SKCfg<4, 0, 4, 3, 1, 0, 0, 4, 3, 12>;
using V23 = SKCfg<4, 2, 4, 2, 1, 0, 0, 3, 2, 0, 8>;
using V24 = SKCfg<4, 3, 3, 2, 0, 0, 0, 2, 2, 0, 8>;
using V25 = SKCfg<2, 2, 6, 3, 0, 1, 0, 6, 3, 0, 8>;
using V26 = SKCfg<1, 2, 3, 2, 0, 0, 0, 2, 2, 0, 0, 4>;
using V27 = SKCfg<1, 2, 2, 1, 1, 0, 0, 1, 1, 0, 0, 8>;
using V28 = LCfg<4, 1, 4, 6, 3, 4, 1>;
using V29 = LCfg<4, 1, 4, 5, 3, 4, 0>;
using V30 = LCfg<1, 8, 4, 3, 1, 2, 1>;
using V31 = LCfg<1, 4, 4, 6, 3, 4, 1>;
using V32 = LCfg<2, 2, 4, 6, 3, 4, 1>;
using V33 = LCfg<4, 1, 8, 5, 2, 4, 1>;
using V34 = LCfg<4, 1, 2, 8, 4, 5, 1>;
using V35 = LCfg<2, 4, 4, 3, 1, 2, 1>;
using V36 = LCfg<1, 8, 2, 4, 2, 2, 1>;
using V37 = LCfg<1, 8, 4, 3, 1, 2, 1, 0>;
using V38 = TCfg<2, 4, 2, 2>;  // 38-41: the tight kernel (w4a16_tight.cuh); were raw-code lean configs (run 6b)
using V39 = TCfg<4, 2, 2, 2>;
using V40 = TCfg<4, 1, 2, 3>;
using V41 = TCfg<8, 1, 2, 2>;
using V42 = LCfg<4, 1, 4, 6, 3, 4, 1, 0>;
using V43 = TCfg<2, 4, 2, 2, 1>;  // 43-44: the tight kernel with raw codes; were raw-code lean configs (run 6b)
using V44 = TCfg<4, 2, 2, 2, 1>;
using V45 = SKCfg<4, 2, 3, 2, 0, 0, 0, 3, 2, 0, 0, 1, 1>;
using V46 = LCfg<4, 1, 4, 4, 3, 4, 0, 0, 1, 1>;
using V47 = LCfg<8, 1, 4, 2, 1, 2, 0, 0, 1, 1>;
using V48 = LCfg<4, 1, 8, 4, 2, 3, 0, 0, 1, 1>;
using V49 = LCfg<4, 1, 4, 5, 3, 4, 1, 0, 0, 1>;
using V50 = BCfg<2, 4, 4, 6, 2>;
using V51 = BCfg<2, 4, 8, 3, 2>;
using V52 = BCfg<4, 1, 4, 6, 4>;
using V53 = BCfg<1, 8, 4, 6, 2>;
using V54 = BCfg<2, 4, 2, 12, 2>;
using V55 = BCfg<2, 2, 2, 12, 4>;
using V56 = BCfg<4, 2, 4, 6, 2>;
using V57 = BCfg<2, 4, 4, 6, 2, 0>;
using V58 = BCfg<4, 1, 4, 6, 4, 1, 0, 1>;
using V59 = BCfg<8, 1, 4, 6, 2, 1, 0, 1>;
#ifndef SDQ_FEED60_KPW  // experiments (bench/ab_build.py --new-defines): variant 60's K steps a warp and stages
#define SDQ_FEED60_KPW 4
#endif
#ifndef SDQ_FEED60_S
#define SDQ_FEED60_S 6
#endif
using V60 = FCfg<16, SDQ_FEED60_KPW, SDQ_FEED60_S>;  // 60-61: the feed kernel (w4a16_feed.cuh); were flat
                                                                    // bulk-copy configs
#ifndef SDQ_FEED61_CW  // experiments: variant 61's warps a CTA, K steps a warp, stages, WS (scale on the weights), CTAs a SM
#define SDQ_FEED61_CW 16
#endif
#ifndef SDQ_FEED61_KPW
#define SDQ_FEED61_KPW 2
#endif
#ifndef SDQ_FEED61_S
#define SDQ_FEED61_S 12
#endif
#ifndef SDQ_FEED61_WS
#define SDQ_FEED61_WS 0
#endif
#ifndef SDQ_FEED61_MINB
#define SDQ_FEED61_MINB 1
#endif
using V61 = FCfg<SDQ_FEED61_CW, SDQ_FEED61_KPW, SDQ_FEED61_S, SDQ_FEED61_WS, SDQ_FEED61_MINB>;
using P7 = BCfg<2, 4, 4, 6, 2, 1, 1>;  // V50's copies
using P8 = BCfg<4, 1, 4, 6, 4, 1, 1, 1>;  // V58's copies
using P4 = SKCfg<4, 0, 4, 3, 0, 0, 1, 4, 3, 8>;  // V19's loads
using P6 = SKCfg<1, 2, 3, 2, 0, 0, 1, 3, 2, 0, 0, 4>;  // V26's loads
using P5 = SKCfg<4, 2, 4, 2, 1, 0, 1, 3, 2, 0, 8>;  // V23's loads
using P1 = SKCfg<4, 3, 3, 2, 0, 0, 1>;  // V13's loads
using P2 = SKCfg<4, 2, 4, 2, 1, 1, 1>;  // V14's / V15's loads
using P3 = SKCfg<4, 8, 2, 1, 0, 0, 1>;  // 8 stages (8 KB a warp) in flight
constexpr int N_VARIANTS = 64;  // 62-63: the wgmma kernel (w4a16_wgmma.cuh, its own translation units)
constexpr int PROBE_BASE = 100;  // variant ids PROBE_BASE + 1.. = P1.. (reached through sdq_w4a16_probe only)

template <typename T, typename C, int NT, int KS, bool EVICT>
struct Kern {
  static constexpr int SMEM = [] {
    if constexpr (C::KIND == 2) return sk_smem<C, NT>();
    else if constexpr (C::KIND == 4) return bulk_smem<C, NT>();
    else if constexpr (lean_flat<C>()) return 0;
    else if constexpr (C::KIND == 3) return lean_smem<C, NT>();
    else if constexpr (C::KIND == 5) return tight_smem<C, NT>();
    else if constexpr (C::KIND == 6) return C::SMEM;
    else if constexpr (C::DIRECT) return DSmem<C, NT>::TOTAL;
    else return Smem<C, NT, KS>::TOTAL;
  }();
  static constexpr int THREADS = [] {
    if constexpr (C::KIND == 2) return sk_threads<C, NT>();
    else return C::THREADS;
  }();
  static auto kernel() {
    if constexpr (C::KIND == 2) return w4a16_streamk_kernel<T, C, NT>;
    else if constexpr (bulk_flat<C>()) return w4a16_bulk_flat_kernel<T, C, NT>;
    else if constexpr (C::KIND == 4) return w4a16_bulk_kernel<T, C, NT>;
    else if constexpr (lean_flat<C>()) return w4a16_lean_flat_kernel<T, C, NT>;
    else if constexpr (C::KIND == 3) return w4a16_lean_kernel<T, C, NT>;
    else if constexpr (C::KIND == 5) return w4a16_tight_kernel<T, C, NT>;
    else if constexpr (C::KIND == 6) return w4a16_feed_kernel<T, C, NT>;
    else if constexpr (C::DIRECT) return w4a16_direct_kernel<T, C, NT>;
    else return w4a16_kernel<T, C, NT, KS, EVICT>;
  }
  static int configure() {  // once per instantiation and device: the attribute is per function, not per call
    static int slot[SDQ_DEVICES] = {};
    return per_current_device(slot, [] {
      return set_smem_attrs(kernel(), SMEM);
    });
  }
  static cudaLaunchAttribute pdl_attr() {  // programmatic dependent launch
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    return attr;
  }
  // cudaLaunchKernelEx with one launch attribute (a thread-block cluster, or programmatic dependent launch)
  static int launch_ex(dim3 grid, const cudaLaunchAttribute& attr, const SdqW4A16Params& p, cudaStream_t stream) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = SMEM;
    cfg.stream = stream;
    cudaLaunchAttribute attrs[1] = {attr};
    cfg.attrs = attrs;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel(), p);
  }
  static int launch(const SdqW4A16Params& p, cudaStream_t stream) {
    const int rc = configure();
    if (rc != cudaSuccess) return rc;
    if constexpr (C::KIND == 2) {  // stream-K: a 1-D grid of G CTAs, passed to the kernel as p.splits
      SdqW4A16Params q = p;
      q.splits = sk_grid(p.splits, sk_space(p.n, p.k, C::WNN).U);
      kernel()<<<q.splits, THREADS, SMEM, stream>>>(q);
    } else if constexpr (C::KIND == 6) {  // feed: a 1-D grid of G CTAs (at most one a stage), passed as p.splits
      SdqW4A16Params q = p;
      q.splits = feed_grid<C>(p.splits, p.n, p.k);
      if (p.pdl) {
        return launch_ex(dim3(q.splits), pdl_attr(), q, stream);
      }
      kernel()<<<q.splits, THREADS, SMEM, stream>>>(q);
    } else if constexpr (lean_flat<C>() || bulk_flat<C>()) {  // flat lean / bulk: a 1-D grid of G CTAs, as p.splits
      SdqW4A16Params q = p;
      q.splits = lean_flat_grid(p.splits, lean_units(p.n, p.k), C::WARPS);
      if (bulk_flat<C>() && p.pdl) {  // programmatic dependent launch, as the tiled kernels below
        return launch_ex(dim3(q.splits), pdl_attr(), q, stream);
      }
      kernel()<<<q.splits, THREADS, SMEM, stream>>>(q);
    } else if constexpr (C::KIND == 3) {  // lean: the S splits of a tile form one cluster when S <= CL
      const dim3 grid((p.n / 64 + C::WNN - 1) / C::WNN, p.splits);
      if (p.splits > 1 && p.splits <= C::CL) {
        cudaLaunchAttribute attr = {};
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = 1;
        attr.val.clusterDim.y = p.splits;
        attr.val.clusterDim.z = 1;
        return launch_ex(grid, attr, p, stream);
      }
      kernel()<<<grid, THREADS, SMEM, stream>>>(p);
    } else {  // cp.async (variants 0-7), direct (8-12) and bulk-copy (50-57) kernels
      const dim3 grid((p.n / 64 + C::WNN - 1) / C::WNN, p.splits);
      if (p.pdl) {  // programmatic dependent launch: the kernel waits (griddep_wait) before reading activations
        return launch_ex(grid, pdl_attr(), p, stream);
      }
      kernel()<<<grid, THREADS, SMEM, stream>>>(p);
    }
    return cudaGetLastError();
  }
  // fp32 scratch (p.partial) this launch needs, in floats
  static long long scratch(const SdqW4A16Params& p) {
    if constexpr (C::KIND == 2) {
      const long long g = sk_grid(p.splits, sk_space(p.n, p.k, C::WNN).U);
      return g * 2 * p.m * C::WNN * 64;
    } else if constexpr (C::KIND == 6) {
      return static_cast<long long>(feed_grid<C>(p.splits, p.n, p.k)) * 2 * p.m * 64;
    } else if constexpr (lean_flat<C>() || bulk_flat<C>()) {
      const long long g = lean_flat_grid(p.splits, lean_units(p.n, p.k), C::WARPS);
      return g * C::WARPS * 2 * p.m * 64;
    } else if constexpr (C::KIND == 3) {  // partials only when the splits do not form a cluster
      return (p.splits > 1 && p.splits > C::CL) ? static_cast<long long>(p.splits) * p.m * p.n : 0;
    } else {
      return p.splits > 1 ? static_cast<long long>(p.splits) * p.m * p.n : 0;
    }
  }
  static int per_sm() {  // resident CTAs per SM (registers and shared memory), per device
    static int slot[SDQ_DEVICES] = {};
    return per_current_device(slot, [] {
      int v = 1;
      if (configure() != cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel(), THREADS, SMEM) != cudaSuccess || v < 1)
        v = 1;
      return v;
    });
  }
};

// op: 0 = launch, 1 = resident CTAs per SM, 2 = 64-feature blocks per CTA, 3 = scratch floats (clamped to 2^31 - 1),
// 4 = 1 if the variant is a stream-K kernel (p.splits is then its grid size), 2 if a lean kernel (w4a16_lean.cuh),
// 3 if a flat lean kernel (p.splits is its grid size), 5 if the feed kernel (p.splits is its grid size), 5 = warps per
// CTA (at one token tile), 7 = the feed kernel's stages (0 for the others)
template <typename T, typename C, int NT, int KS>
int run_op(int op, const SdqW4A16Params& p, cudaStream_t stream) {
  using K = Kern<T, C, NT, KS, false>;
  if (op == 1) return K::per_sm();
  if (op == 2) return C::WNN;
  if (op == 3) {
    const long long f = K::scratch(p);
    return f > 2147483647LL ? 2147483647 : static_cast<int>(f);
  }
  if (op == 4)
    return C::KIND == 2 ? 1 : (C::KIND == 3 ? (lean_flat<C>() ? 3 : 2) : (bulk_flat<C>() ? 3 : (C::KIND == 6 ? 5 : 0)));
  if (op == 5) return C::WARPS;
  if (op == 7) {  // the feed kernel's stages (its most CTAs)
    if constexpr (C::KIND == 6) {
      const long long t = feed_stages<C>(p.n, p.k);
      return t > 2147483647LL ? 2147483647 : static_cast<int>(t);
    }
    return 0;
  }
  return K::launch(p, stream);
}

// The tight kernel's chunks need group % 64 == 0 (k % 64 == 0 then follows); otherwise its ids run the direct v10.
inline bool tight_ok(const SdqW4A16Params& p) { return p.group_k16 % TIGHT_U == 0 && p.k % (16 * TIGHT_U) == 0; }

template <typename T, int NT, int KS>
int dispatch_variant(int variant, int op, const SdqW4A16Params& p, cudaStream_t stream) {
  if constexpr (NT <= 2) switch (variant) {
    case 1: return run_op<T, V1, NT, KS>(op, p, stream);
    case 2: return run_op<T, V2, NT, KS>(op, p, stream);
    case 3: return run_op<T, V3, NT, KS>(op, p, stream);
    case 4: return run_op<T, V4, NT, KS>(op, p, stream);
    case 5: return run_op<T, V5, NT, KS>(op, p, stream);
    case 6: return run_op<T, V6, NT, KS>(op, p, stream);
    case 7:
      if constexpr (KS % 4 == 0) return run_op<T, V7, NT, KS>(op, p, stream);
      else return run_op<T, V4, NT, KS>(op, p, stream);  // group 32: two K steps a stage cannot feed 4 warps
    case 8: return run_op<T, V8, NT, 2>(op, p, stream);  // the direct kernel has its own 2-step stages
    case 9: return run_op<T, V9, NT, 2>(op, p, stream);
    case 10: return run_op<T, V10, NT, 2>(op, p, stream);
    case 11: return run_op<T, V11, NT, 2>(op, p, stream);
    case 12: return run_op<T, V12, NT, 2>(op, p, stream);
    case 13: return run_op<T, V13, NT, 2>(op, p, stream);
    case 14: return run_op<T, V14, NT, 2>(op, p, stream);
    case 15: return run_op<T, V15, NT, 2>(op, p, stream);
    case 16: return run_op<T, V16, NT, 2>(op, p, stream);
    case 17: return run_op<T, V17, NT, 2>(op, p, stream);
    case 18: return run_op<T, V18, NT, 2>(op, p, stream);
    case PROBE_BASE + 1: return run_op<T, P1, NT, 2>(op, p, stream);
    case PROBE_BASE + 2: return run_op<T, P2, NT, 2>(op, p, stream);
    case PROBE_BASE + 3: return run_op<T, P3, NT, 2>(op, p, stream);
    case PROBE_BASE + 4: return run_op<T, P4, NT, 2>(op, p, stream);
    case 19: return run_op<T, V19, NT, 2>(op, p, stream);
    case 20: return run_op<T, V20, NT, 2>(op, p, stream);
    case 21: return run_op<T, V21, NT, 2>(op, p, stream);
    case 22: return run_op<T, V22, NT, 2>(op, p, stream);
    case 23: return run_op<T, V23, NT, 2>(op, p, stream);
    case 24: return run_op<T, V24, NT, 2>(op, p, stream);
    case 25: return run_op<T, V25, NT, 2>(op, p, stream);
    case PROBE_BASE + 5: return run_op<T, P5, NT, 2>(op, p, stream);
    case PROBE_BASE + 6: return run_op<T, P6, NT, 2>(op, p, stream);
    case 26: return run_op<T, V26, NT, 2>(op, p, stream);
    case 27: return run_op<T, V27, NT, 2>(op, p, stream);
    case 28: return run_op<T, V28, NT, 2>(op, p, stream);
    case 29: return run_op<T, V29, NT, 2>(op, p, stream);
    case 30: return run_op<T, V30, NT, 2>(op, p, stream);
    case 31: return run_op<T, V31, NT, 2>(op, p, stream);
    case 32: return run_op<T, V32, NT, 2>(op, p, stream);
    case 33: return run_op<T, V33, NT, 2>(op, p, stream);
    case 34: return run_op<T, V34, NT, 2>(op, p, stream);
    case 35: return run_op<T, V35, NT, 2>(op, p, stream);
    case 36: return run_op<T, V36, NT, 2>(op, p, stream);
    case 37: return run_op<T, V37, NT, 2>(op, p, stream);
    case 38: return tight_ok(p) ? run_op<T, V38, NT, 2>(op, p, stream) : run_op<T, V10, NT, 2>(op, p, stream);
    case 39: return tight_ok(p) ? run_op<T, V39, NT, 2>(op, p, stream) : run_op<T, V10, NT, 2>(op, p, stream);
    case 40: return tight_ok(p) ? run_op<T, V40, NT, 2>(op, p, stream) : run_op<T, V10, NT, 2>(op, p, stream);
    case 41: return tight_ok(p) ? run_op<T, V41, NT, 2>(op, p, stream) : run_op<T, V10, NT, 2>(op, p, stream);
    case 42: return run_op<T, V42, NT, 2>(op, p, stream);
    case 43: return tight_ok(p) ? run_op<T, V43, NT, 2>(op, p, stream) : run_op<T, V10, NT, 2>(op, p, stream);
    case 44: return tight_ok(p) ? run_op<T, V44, NT, 2>(op, p, stream) : run_op<T, V10, NT, 2>(op, p, stream);
    case 45: return run_op<T, V45, NT, 2>(op, p, stream);
    case 46: return run_op<T, V46, NT, 2>(op, p, stream);
    case 47: return run_op<T, V47, NT, 2>(op, p, stream);
    case 48: return run_op<T, V48, NT, 2>(op, p, stream);
    case 49: return run_op<T, V49, NT, 2>(op, p, stream);
    case 50: return run_op<T, V50, NT, 2>(op, p, stream);
    case 51: return run_op<T, V51, NT, 2>(op, p, stream);
    case 52: return run_op<T, V52, NT, 2>(op, p, stream);
    case 53: return run_op<T, V53, NT, 2>(op, p, stream);
    case 54: return run_op<T, V54, NT, 2>(op, p, stream);
    case 55: return run_op<T, V55, NT, 2>(op, p, stream);
    case 56: return run_op<T, V56, NT, 2>(op, p, stream);
    case 57: return run_op<T, V57, NT, 2>(op, p, stream);
    case 58: return run_op<T, V58, NT, 2>(op, p, stream);
    case 59: return run_op<T, V59, NT, 2>(op, p, stream);
    case 60:  // the feed kernel: one token tile; otherwise the M = 1-8 default (tight, or direct v10)
    case 61:
      if constexpr (NT == 1) {
        if (variant == 60 && feed_ok<V60>(p)) return run_op<T, V60, NT, 2>(op, p, stream);
        if (variant == 61 && feed_ok<V61>(p)) return run_op<T, V61, NT, 2>(op, p, stream);
      }
      return tight_ok(p) ? run_op<T, V38, NT, 2>(op, p, stream) : run_op<T, V10, NT, 2>(op, p, stream);
    case PROBE_BASE + 7: return run_op<T, P7, NT, 2>(op, p, stream);
    case PROBE_BASE + 8: return run_op<T, P8, NT, 2>(op, p, stream);
    default: break;
  }
  if constexpr (NT == 4) switch (variant) {  // M = 17-32: the kernels that led at M = 16 (runs 5-7)
    case 2: return run_op<T, V2, NT, KS>(op, p, stream);
    case 5: return run_op<T, V5, NT, KS>(op, p, stream);
    case 37: return run_op<T, V37, NT, 2>(op, p, stream);
    case 42: return run_op<T, V42, NT, 2>(op, p, stream);
    default: break;
  }
  if (op == 2) return V0::WNN;
  if (op == 3) return p.splits > 1 ? p.splits * p.m * p.n : 0;
  if (op == 4) return 0;
  if (op == 5) return V0::WARPS;
  if (op == 1) return p.evict_first ? Kern<T, V0, NT, KS, true>::per_sm() : Kern<T, V0, NT, KS, false>::per_sm();
  return p.evict_first ? Kern<T, V0, NT, KS, true>::launch(p, stream) : Kern<T, V0, NT, KS, false>::launch(p, stream);
}

// Variant 0 serves every M <= 32 and the evict-first hint; 2, 5, 37 and 42 also M = 17-32 (NT4_VARIANTS); the
// others are instantiated for M <= 16 only.
template <typename T, int NT>
int dispatch_ks(int variant, int op, const SdqW4A16Params& p, cudaStream_t stream) {
  const bool ks4 = p.group_k16 % 4 == 0;
  if constexpr (NT > 2) {
    const int v = (variant == 2 || variant == 5 || variant == 37 || variant == 42) && !p.evict_first ? variant : 0;
    if (v == 37 || v == 42) return dispatch_variant<T, NT, 2>(v, op, p, stream);  // (the lean kernel's own K steps)
    return ks4 ? dispatch_variant<T, NT, 4>(v, op, p, stream) : dispatch_variant<T, NT, 2>(v, op, p, stream);
  } else {
    const int v = p.evict_first ? 0 : variant;
    return ks4 ? dispatch_variant<T, NT, 4>(v, op, p, stream) : dispatch_variant<T, NT, 2>(v, op, p, stream);
  }
}

}  // namespace
}  // namespace sdq_w4a16

namespace sdq_w4a16 {
namespace {
// The fused tight kernel (TFused<C>, one token tile): its own launch, since its parameter block is the larger
// SdqW4A16FusedParams. The grid, splits and scratch are the plain variant's.
template <typename T, typename C>
int launch_tight_fused(const SdqW4A16FusedParams& p, cudaStream_t stream) {
  using F = TFused<C>;
  constexpr int SMEM = tight_smem<F, 1>();
  const auto kern = w4a16_tight_kernel<T, F, 1>;
  static int slot[SDQ_DEVICES] = {};  // once per instantiation and device
  const int rc = per_current_device(slot, [&] {
    return set_smem_attrs(kern, SMEM);
  });
  if (rc != cudaSuccess) return rc;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((p.n / 64 + C::WNN - 1) / C::WNN, p.splits);
  cfg.blockDim = dim3(C::THREADS);
  cfg.dynamicSmemBytes = tight_ss_at<F, 1>() + (p.rms_ss != nullptr ? 4 * p.m * p.rms_t : 0);
  cfg.stream = stream;
  cudaLaunchAttribute attrs[1] = {};
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = p.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kern, p);
}

template <typename T>
int dispatch_fused(int variant, const SdqW4A16FusedParams& p, cudaStream_t stream) {
  switch (variant) {
    case 38: return launch_tight_fused<T, V38>(p, stream);
    case 39: return launch_tight_fused<T, V39>(p, stream);
    case 40: return launch_tight_fused<T, V40>(p, stream);
    case 41: return launch_tight_fused<T, V41>(p, stream);
    case 43: return launch_tight_fused<T, V43>(p, stream);
    case 44: return launch_tight_fused<T, V44>(p, stream);
    default: return -1;
  }
}
}  // namespace
}  // namespace sdq_w4a16

#define SDQ_W4A16_PART_FUSED(T, NAME)                                                                              \
  extern "C" int sdq_w4a16_part_fused_##NAME(int variant, const SdqW4A16FusedParams* p, cudaStream_t stream) { \
    return sdq_w4a16::dispatch_fused<T>(variant, *p, stream);                                                     \
  }

// One translation unit per (dtype, token tiles) so that the build compiles them in parallel.
#define SDQ_W4A16_PART(T, NT, NAME)                                                                         \
  extern "C" int sdq_w4a16_part_##NAME(int variant, int op, const SdqW4A16Params* p, cudaStream_t stream) { \
    return sdq_w4a16::dispatch_ks<T, NT>(variant, op, *p, stream);                                         \
  }
