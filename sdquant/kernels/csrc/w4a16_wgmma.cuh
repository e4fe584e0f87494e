// sdquant W4A16 GEMM for sm_90a on the warpgroup MMA (wgmma), for M = 1-256 per launch (variants 62-63; built for
// the batched-decode range M = 17-256, where the mma.sync kernels of w4a16_kernel.cuh re-read every weight once per
// 32 tokens and run out of tensor-core issue).
//
// Design (why each piece is there):
// * Same fragment layout as the other kernels (int4_layout.repack_cuda), so a layer keeps one copy of its weights.
//   Word w of lane l's 16 bytes at (block, K step) is exactly the register-A fragment of an m64k16 wgmma for the
//   16 features 16w..16w+15 of the block -- if the warpgroup's warps each bring a *different* block. So warp v of
//   the CTA streams block 4 * tile + v (512 contiguous bytes a K step), and the CTA issues four wgmmas a K step:
//   wgmma u takes word u from every warp, i.e. rows 16u..16u+15 of each warp's block. Four accumulator sets of
//   m64 x NTOK cover the CTA's 256 features.
// * Swap-AB: weights are wgmma's 64-row A operand (from registers, dequantized), the tokens its N (16 / 32 / 64),
//   the activation tile B comes from shared memory through a descriptor (K-major, 128-byte swizzle, written by
//   cp.async with the swizzle applied to the address).
// * Dequantization per weight, in the activation dtype: the exact (code - zero) from the magic-number conversion
//   (Ops<T>::codes, shared with the other kernels), times the group scale (one mul per pair). The wgmma sums in
//   fp32 over the whole K range; no per-group fp32 sums.
// * One pipeline for everything: STAGES shared-memory stages of 64 K (weights 8 KB, activations NTOK x 128 B,
//   scales/zeros of the <= 2 groups a stage touches), filled by cp.async STAGES - 2 stages ahead, so a stage is
//   overwritten only after the wgmmas that read it (waited for one K step later) are complete.
// * Register-A wgmmas cannot overlap the dequantization in the same warpgroup (see the wait in the main loop); the
//   four wgmmas of a K step run back to back, and 2-3 CTAs per SM overlap each other's dequantization and MMAs.
// * Split-K over gridDim.z with fp32 partials stored in register order; the last CTA of a (feature tile, token tile)
//   -- counted on a lock it resets -- sums them in split order: deterministic, one launch.
// * Token tiles over gridDim.x (fastest), so the CTAs that share a weight tile run together and share it in L2.
#pragma once
#include "w4a16_kernel.cuh"
#include "w4a16_wgmma_mma.cuh"

namespace sdq_w4a16 {
namespace {

constexpr int WG_BLOCKS = 4;  // 64-feature blocks per CTA, one per warp
constexpr int WG_KS = 4;      // 16-deep K steps per stage (a stage = 64 K)

template <int NTOK, int STAGES>
struct WgSmem {
  static constexpr int X_BYTES = NTOK * 128;                 // NTOK rows x 64 K, 128-byte swizzled
  static constexpr int W_BYTES = WG_BLOCKS * WG_KS * 512;    // [warp][K step][lane] 16 B
  static constexpr int SZ_BYTES = 2 * 2 * WG_BLOCKS * 128;   // [group 0/1][scales/zeros][warp][g8] 16 B
  static constexpr int STAGE = (X_BYTES + W_BYTES + SZ_BYTES + 1023) / 1024 * 1024;
  static constexpr int TOTAL = STAGES * STAGE + 1024;        // + slack to align the base to 1024 B
};

__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async16_s(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t a) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a)
               : "memory");
  return r;
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void wg_fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major, 128-byte-swizzled tile (rows of 64 x 16-bit = 128 B, 8-row atoms
// of 1024 B): start address, leading offset unused (1), stride offset 1024 B, swizzle mode 1 (128 B).
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
  return static_cast<uint64_t>((saddr & 0x3FFFFu) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (1ull << 62);
}

// A group's scale of rows g8 (lo) / g8 + 8 (hi) of tile u as an activation-dtype pair (s, s)
template <typename T>
__device__ __forceinline__ uint32_t wg_scale_pair(uint32_t h2, int hi);
template <>
__device__ __forceinline__ uint32_t wg_scale_pair<half>(uint32_t h2, int hi) {
  const half2 v = *reinterpret_cast<const half2*>(&h2);
  const half2 r = hi ? __high2half2(v) : __low2half2(v);
  return *reinterpret_cast<const uint32_t*>(&r);
}
template <>
__device__ __forceinline__ uint32_t wg_scale_pair<__nv_bfloat16>(uint32_t h2, int hi) {
  const float f = hi ? __high2float(*reinterpret_cast<const half2*>(&h2))
                     : __low2float(*reinterpret_cast<const half2*>(&h2));
  const __nv_bfloat162 r = __float2bfloat162_rn(f);
  return *reinterpret_cast<const uint32_t*>(&r);
}

// One stage's copies: weights (4 blocks x 4 K steps), scales/zeros of the stage's first and last group
// (WITH_X = false) or the activation tile (WITH_X = true).
template <int NTOK, bool WITH_X>
__device__ __forceinline__ void wg_load_stage(const SdqW4A16Params& p, uint32_t st, int ks0, int nb0, int m0,
                                              int tid) {
  using L = WgSmem<NTOK, 2>;
  const int kb = p.k / 16;
  if constexpr (!WITH_X) {
    const char* b = static_cast<const char*>(p.b);
#pragma unroll
    for (int w = 0; w < WG_BLOCKS; ++w)
      cp_async16_s(st + L::X_BYTES + w * 2048 + tid * 16,
                   b + (static_cast<size_t>(nb0 + w) * kb + ks0) * 512 + tid * 16);
    const int gk = p.group_k16;
    const int ga = ks0 / gk, gb = (ks0 + WG_KS - 1) / gk;
    const int gsel = tid >> 6, which = (tid >> 5) & 1, w = (tid >> 3) & 3, g8 = tid & 7;
    const int grp = gsel ? gb : ga;
    const char* src = static_cast<const char*>(which ? p.zs : p.s) +
                      ((static_cast<size_t>(grp) * (p.n / 64) + nb0 + w) * 8 + g8) * 16;
    cp_async16_s(st + L::X_BYTES + L::W_BYTES + tid * 16, src);
  } else {
    const char* a = static_cast<const char*>(p.a);
#pragma unroll
    for (int i = 0; i < NTOK * 8 / 128; ++i) {
      const int ci = tid + 128 * i, r = ci >> 3, c = ci & 7;
      const int row = m0 + r;
      const bool valid = row < p.m;
      const char* src = a + (static_cast<size_t>(valid ? row : 0) * p.k + ks0 * 16 + c * 8) * 2;
      cp_async16_zfill(st + r * 128 + ((c ^ (r & 7)) << 4), src, valid);
    }
  }
}

template <typename T, int NTOK, int STAGES, int KB>
__global__ void __launch_bounds__(128) w4a16_wgmma_kernel(const SdqW4A16Params p) {
  using O = Ops<T>;
  using L = WgSmem<NTOK, STAGES>;
  constexpr int PF = STAGES - 2;  // stages requested ahead of the one computed
  constexpr int ND = NTOK / 2;    // accumulator registers per wgmma
  static_assert(STAGES >= 3, "the pipeline needs a slack stage");
  static_assert(WG_KS % KB == 0, "KB K steps a wgmma batch");
  extern __shared__ uint8_t wg_smem_raw[];
  const uint32_t sraw = smem_addr(wg_smem_raw);
  const uint32_t sbase = (sraw + 1023u) & ~1023u;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;
  const int m0 = blockIdx.x * NTOK;
  const int nb0 = blockIdx.y * WG_BLOCKS;
  const int split = blockIdx.z;
  const int nst_all = p.k / 64;
  const int st0 = static_cast<int>(static_cast<long long>(nst_all) * split / p.splits);
  const int st1 = static_cast<int>(static_cast<long long>(nst_all) * (split + 1) / p.splits);
  const int nst = st1 - st0;

  float acc[4][ND];
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[u][i] = 0.f;

  // prologue: the first PF stages' weights before the PDL wait (they do not depend on the previous kernel), then
  // their activations; group s holds stage s (group 0 also the later stages' weights: waits stay conservative)
#pragma unroll
  for (int s = 0; s < PF; ++s)
    if (s < nst) wg_load_stage<NTOK, false>(p, sbase + s * L::STAGE, (st0 + s) * WG_KS, nb0, m0, tid);
  if (p.pdl) griddep_wait();
#pragma unroll
  for (int s = 0; s < PF; ++s) {
    if (s < nst) wg_load_stage<NTOK, true>(p, sbase + s * L::STAGE, (st0 + s) * WG_KS, nb0, m0, tid);
    cp_async_commit();
  }

  uint32_t af[KB][4][4];
  for (int s = 0; s < nst; ++s) {
    cp_async_wait<PF - 1>();
    __syncthreads();  // stage s landed for every thread; stage s - 2 is no longer read by anyone
    {
      const int sn = s + PF;
      if (sn < nst) {
        const uint32_t st = sbase + (sn % STAGES) * L::STAGE;
        wg_load_stage<NTOK, false>(p, st, (st0 + sn) * WG_KS, nb0, m0, tid);
        wg_load_stage<NTOK, true>(p, st, (st0 + sn) * WG_KS, nb0, m0, tid);
      }
      cp_async_commit();
    }
    const uint32_t st = sbase + (s % STAGES) * L::STAGE;
    const uint64_t desc = wg_desc(st);
    const int ks0 = (st0 + s) * WG_KS;
    const int ga = ks0 / p.group_k16;
    uint32_t sp[4][2], zl[4][2], zh[4][2];
    int cur = -1;
#pragma unroll
    for (int k0 = 0; k0 < WG_KS; k0 += KB) {
      uint4 wq[KB];
#pragma unroll
      for (int j = 0; j < KB; ++j) wq[j] = ld_shared_v4(st + L::X_BYTES + (warp * WG_KS + k0 + j) * 512 + lane * 16);
      // Every earlier wgmma must be complete before af is rewritten: ptxas serializes the wgmmas (a wait after
      // each one, C7513) when a non-wgmma instruction defines their A registers while any wgmma is in flight, so the
      // dequantization of KB steps cannot overlap the previous steps' wgmmas in this warpgroup; the other CTAs on
      // the SM (2-4) fill the tensor cores meanwhile.
      wg_wait<0>();
#pragma unroll
      for (int j = 0; j < KB; ++j) {
        const int gsel = (ks0 + k0 + j) / p.group_k16 != ga;
        if (gsel != cur) {  // the group's scales and zero pairs (every stage starts one)
          cur = gsel;
          const uint32_t sz = st + L::X_BYTES + L::W_BYTES + gsel * 1024 + warp * 128 + g8 * 16;
          const uint4 s4 = ld_shared_v4(sz), z4 = ld_shared_v4(sz + 512);
          const uint32_t sw[4] = {s4.x, s4.y, s4.z, s4.w}, zw[4] = {z4.x, z4.y, z4.z, z4.w};
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            sp[u][0] = wg_scale_pair<T>(sw[u], 0);
            sp[u][1] = wg_scale_pair<T>(sw[u], 1);
            O::zero_pairs(zw[u], 0, zl[u][0], zh[u][0]);
            O::zero_pairs(zw[u], 1, zl[u][1], zh[u][1]);
          }
        }
        const uint32_t q[4] = {wq[j].x, wq[j].y, wq[j].z, wq[j].w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          uint32_t c[4];
          O::codes(q[u], zl[u], zh[u], c);  // (row g, k lo) (row g, k hi) (row g+8, k lo) (row g+8, k hi)
          af[j][u][0] = O::mul2(c[0], sp[u][0]);
          af[j][u][1] = O::mul2(c[2], sp[u][1]);
          af[j][u][2] = O::mul2(c[1], sp[u][0]);
          af[j][u][3] = O::mul2(c[3], sp[u][1]);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) wg_fence_acc(acc[u]);
      wg_fence();
#pragma unroll
      for (int j = 0; j < KB; ++j)
#pragma unroll
        for (int u = 0; u < 4; ++u)
          WgMma<T, NTOK>::mma(acc[u], af[j][u], desc + 2 * (k0 + j));  // +32 B along K a step
      wg_commit();
#pragma unroll
      for (int u = 0; u < 4; ++u) wg_fence_acc(acc[u]);
    }
  }
  wg_wait<0>();
#pragma unroll
  for (int u = 0; u < 4; ++u) wg_fence_acc(acc[u]);
  if (p.pdl) griddep_launch_dependents();

  // acc[u][4c + 2h + e] = y[token m0 + 8c + 2t4 + e][feature 64 (nb0 + warp) + 16u + 8h + g8]; wg_pos(q, ...) is
  // that element's offset in split q's partial ([splits, m, n] fp32), wg_pos(0, ...) its offset in y
  const int fbase = 64 * (nb0 + warp) + g8;
  T* y = static_cast<T*>(p.c);
  const auto wg_pos = [&](int q, int u, int c, int h, int e) -> size_t {
    return (static_cast<size_t>(q) * p.m + m0 + 8 * c + 2 * t4 + e) * p.n + fbase + 16 * u + 8 * h;
  };
  const auto tok_ok = [&](int c, int e) { return m0 + 8 * c + 2 * t4 + e < p.m; };
  const auto store_y = [&]() {
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int c = 0; c < NTOK / 8; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (tok_ok(c, e)) y[wg_pos(0, u, c, h, e)] = O::one(acc[u][4 * c + 2 * h + e]);
  };
  if (p.splits == 1) {
    store_y();
    return;
  }
  // Split-K: every CTA writes its accumulators to its partial slot as they sit in registers (float4 j of thread
  // tid at j * 128 + tid: coalesced, constant offsets); the last of the tile's splits (counted on the lock, which
  // it resets) re-sums every split's slot in split order into its registers and writes y. The order is fixed
  // whichever CTA is last. Scratch: [splits, N / 256, token tiles, NTOK * 256] fp32.
  constexpr int NC = NTOK / 8;
  const size_t slot = static_cast<size_t>(ND) * 128;  // float4s a CTA
  const size_t tile_id = static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const size_t tiles = static_cast<size_t>(gridDim.y) * gridDim.x;
  float4* part = reinterpret_cast<float4*>(p.partial);
  {
    float4* mine = part + (split * tiles + tile_id) * slot + tid;
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int c = 0; c < NC; ++c)
        __stcg(mine + (u * NC + c) * 128,
               make_float4(acc[u][4 * c], acc[u][4 * c + 1], acc[u][4 * c + 2], acc[u][4 * c + 3]));
  }
  __threadfence();
  __syncthreads();
  __shared__ int s_last;
  int* lock = p.locks + blockIdx.y * WG_BLOCKS + blockIdx.x;
  if (tid == 0) s_last = atomicAdd(lock, 1) == p.splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[u][i] = 0.f;
  for (int q = 0; q < p.splits; ++q) {
    const float4* src = part + (q * tiles + tile_id) * slot + tid;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      asm volatile("" ::: "memory");  // loads in batches of one u (NTOK / 2 registers), not all at once
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float4 v = __ldcg(src + (u * NC + c) * 128);
        acc[u][4 * c] += v.x;
        acc[u][4 * c + 1] += v.y;
        acc[u][4 * c + 2] += v.z;
        acc[u][4 * c + 3] += v.w;
      }
    }
  }
  store_y();
  if (tid == 0) *lock = 0;
}

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void st_shared_b32(uint32_t a, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(v) : "memory");
}

// Variant 63: the dequantized weights go through shared memory, and both wgmma operands come from there (SS). Two
// warpgroups a CTA. All eight warps dequantize a stage (warp w: block w % 4, K steps 2 (w / 4) and 2 (w / 4) + 1) into
// a double-buffered A tile (four 64 x 64 tiles, 128-byte swizzled like B); then each warpgroup issues its wgmmas.
// A registers are not wgmma operands here, so a warpgroup dequantizes stage s + 1 while its wgmmas of stage s run
// (wgmma.wait_group 1 before the A buffer of stage s - 1 is rewritten). TS = 2: the warpgroups take two 64-token halves
// of a 128-token tile (the weights dequantized once for both); TS = 1: the same tokens, K steps 0-1 / 2-3 of each
// stage, summed through shared memory at the end.
template <typename T, int NTOK, int TS, int STAGES>
__global__ void __launch_bounds__(256) w4a16_wgmma_ss_kernel(const SdqW4A16Params p) {
  using O = Ops<T>;
  constexpr int NX = NTOK * TS;  // tokens a CTA
  using L = WgSmem<NX, STAGES>;
  constexpr int PF = STAGES - 2;
  constexpr int ND = NTOK / 2;
  constexpr int A_TILE = 64 * 128, A_STAGE = 4 * A_TILE;
  static_assert(STAGES >= 3 && (TS == 1 || TS == 2), "bad wgmma SS config");
  static_assert(TS == 2 || STAGES * L::STAGE >= 128 * 4 * ND * 4, "the K-part reduction reuses the stages");
  extern __shared__ uint8_t wg_smem_raw[];
  const uint32_t sbase = (smem_addr(wg_smem_raw) + 1023u) & ~1023u;
  const uint32_t abase = sbase + STAGES * L::STAGE;

  const int tid = threadIdx.x, wg = tid >> 7, warp = tid >> 5, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;
  const int half = wg % TS, kpart = wg / TS;
  const bool owner = kpart == 0;  // holds the final sums of its token half
  const int v = warp & 3, kq = (warp >> 2) * 2;
  const int m0 = blockIdx.x * NX;
  const int nb0 = blockIdx.y * WG_BLOCKS;
  const int split = blockIdx.z;
  const int nst_all = p.k / 64;
  const int st0 = static_cast<int>(static_cast<long long>(nst_all) * split / p.splits);
  const int st1 = static_cast<int>(static_cast<long long>(nst_all) * (split + 1) / p.splits);
  const int nst = st1 - st0;

  float acc[4][ND];
#pragma unroll
  for (int u = 0; u < 4; ++u)
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[u][i] = 0.f;

  // warpgroup 0 copies weights and scales, warpgroup 1 activations (after the PDL wait)
#pragma unroll
  for (int s = 0; s < PF; ++s)
    if (s < nst && wg == 0) wg_load_stage<NX, false>(p, sbase + s * L::STAGE, (st0 + s) * WG_KS, nb0, m0, tid);
  if (p.pdl) griddep_wait();
#pragma unroll
  for (int s = 0; s < PF; ++s) {
    if (s < nst && wg == 1) wg_load_stage<NX, true>(p, sbase + s * L::STAGE, (st0 + s) * WG_KS, nb0, m0, tid - 128);
    cp_async_commit();
  }

  for (int s = 0; s < nst; ++s) {
    cp_async_wait<PF - 1>();
    wg_wait<1>();     // this warpgroup's wgmmas of stage s - 2 are done
    __syncthreads();  // everyone's; stage s landed
    {
      const int sn = s + PF;
      if (sn < nst) {
        const uint32_t stn = sbase + (sn % STAGES) * L::STAGE;
        if (wg == 0) wg_load_stage<NX, false>(p, stn, (st0 + sn) * WG_KS, nb0, m0, tid);
        else wg_load_stage<NX, true>(p, stn, (st0 + sn) * WG_KS, nb0, m0, tid - 128);
      }
      cp_async_commit();
    }
    const uint32_t st = sbase + (s % STAGES) * L::STAGE;
    const uint32_t at = abase + (s & 1) * A_STAGE;
    const int ks0 = (st0 + s) * WG_KS;
    const int ga = ks0 / p.group_k16;
    // dequantize this warp's two K steps of block v into A (row 16 v + g8 (+ 8), K chunk 2 kk (+ 1), swizzled);
    // one K step at a time (fewer live registers next to the NTOK * 2 accumulators)
#pragma unroll 1
    for (int j = 0; j < 2; ++j) {
      const int kk = kq + j;
      const uint4 wq = ld_shared_v4(st + L::X_BYTES + (v * WG_KS + kk) * 512 + lane * 16);
      const int gsel = (ks0 + kk) / p.group_k16 != ga;
      const uint32_t sz = st + L::X_BYTES + L::W_BYTES + gsel * 1024 + v * 128 + g8 * 16;
      const uint4 s4 = ld_shared_v4(sz), z4 = ld_shared_v4(sz + 512);
      const uint32_t sw[4] = {s4.x, s4.y, s4.z, s4.w}, zw[4] = {z4.x, z4.y, z4.z, z4.w};
      const uint32_t q[4] = {wq.x, wq.y, wq.z, wq.w};
      const uint32_t r0 = (16 * v + g8) * 128, r1 = r0 + 8 * 128;
      const uint32_t c0 = ((2 * kk) ^ g8) << 4, c1 = ((2 * kk + 1) ^ g8) << 4;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        uint32_t zl[2], zh[2], c[4];
        O::zero_pairs(zw[u], 0, zl[0], zh[0]);
        O::zero_pairs(zw[u], 1, zl[1], zh[1]);
        O::codes(q[u], zl, zh, c);  // (row g, k lo) (row g, k hi) (row g+8, k lo) (row g+8, k hi)
        const uint32_t s0 = wg_scale_pair<T>(sw[u], 0), s1 = wg_scale_pair<T>(sw[u], 1);
        const uint32_t au = at + u * A_TILE + 4 * t4;
        st_shared_b32(au + r0 + c0, O::mul2(c[0], s0));
        st_shared_b32(au + r1 + c0, O::mul2(c[2], s1));
        st_shared_b32(au + r0 + c1, O::mul2(c[1], s0));
        st_shared_b32(au + r1 + c1, O::mul2(c[3], s1));
      }
    }
    fence_proxy_async();  // the generic-proxy stores of A, visible to the wgmmas (async proxy)
    __syncthreads();
#pragma unroll
    for (int u = 0; u < 4; ++u) wg_fence_acc(acc[u]);
    wg_fence();
    const uint64_t db = wg_desc(st + half * NTOK * 128), da = wg_desc(at);
#pragma unroll
    for (int j = 0; j < 4 / (2 / TS); ++j) {
      const int kk = (TS == 2 ? 0 : 2 * kpart) + j;
#pragma unroll
      for (int u = 0; u < 4; ++u) WgMmaSS<T, NTOK>::mma(acc[u], da + (u * A_TILE >> 4) + 2 * kk, db + 2 * kk);
    }
    wg_commit();
#pragma unroll
    for (int u = 0; u < 4; ++u) wg_fence_acc(acc[u]);
  }
  wg_wait<0>();
#pragma unroll
  for (int u = 0; u < 4; ++u) wg_fence_acc(acc[u]);
  if (p.pdl) griddep_launch_dependents();

  if constexpr (TS == 1) {  // K parts: warpgroup 1 hands its sums to warpgroup 0 (fixed order: part 0 + part 1)
    __syncthreads();        // every wgmma (and the last reads of the stages) done
    float* red = reinterpret_cast<float*>(wg_smem_raw + (sbase - smem_addr(wg_smem_raw)));
    if (!owner) {
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int i = 0; i < ND; ++i) red[(u * ND + i) * 128 + (tid & 127)] = acc[u][i];
    }
    __syncthreads();
    if (owner) {
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[u][i] += red[(u * ND + i) * 128 + tid];
    }
  }

  // acc[u][4c + 2h + e] = y[token m0 + half NTOK + 8c + 2t4 + e][feature 64 (nb0 + warp % 4) + 16u + 8h + g8]
  const int fbase = 64 * (nb0 + v) + g8;
  const int mt = m0 + half * NTOK;
  T* y = static_cast<T*>(p.c);
  const auto store_y = [&]() {
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int c = 0; c < NTOK / 8; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tok = mt + 8 * c + 2 * t4 + e;
            if (tok < p.m) y[static_cast<size_t>(tok) * p.n + fbase + 16 * u + 8 * h] = O::one(acc[u][4 * c + 2 * h + e]);
          }
  };
  // split-K as in the RS kernel: partials in register order ([splits, N / 256, token tiles, NX * 256] fp32)
  if (p.splits > 1) {
    constexpr int NC = NTOK / 8;
    const size_t slot = static_cast<size_t>(TS) * ND * 128;
    const size_t tile_id = static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x;
    const size_t tiles = static_cast<size_t>(gridDim.y) * gridDim.x;
    float4* part = reinterpret_cast<float4*>(p.partial);
    const int lid = half * 128 + (tid & 127);
    if (owner) {
      float4* mine = part + (split * tiles + tile_id) * slot + lid;
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int c = 0; c < NC; ++c)
          __stcg(mine + (u * NC + c) * 128 * TS,
                 make_float4(acc[u][4 * c], acc[u][4 * c + 1], acc[u][4 * c + 2], acc[u][4 * c + 3]));
    }
    __threadfence();
    __syncthreads();
    __shared__ int s_last_ss;
    int* lock = p.locks + blockIdx.y * WG_BLOCKS + blockIdx.x;
    if (tid == 0) s_last_ss = atomicAdd(lock, 1) == p.splits - 1;
    __syncthreads();
    if (!s_last_ss || !owner) return;
    __threadfence();
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int i = 0; i < ND; ++i) acc[u][i] = 0.f;
    for (int q = 0; q < p.splits; ++q) {
      const float4* src = part + (q * tiles + tile_id) * slot + lid;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        asm volatile("" ::: "memory");  // loads in batches of one u, not all at once
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const float4 x4 = __ldcg(src + (u * NC + c) * 128 * TS);
          acc[u][4 * c] += x4.x;
          acc[u][4 * c + 1] += x4.y;
          acc[u][4 * c + 2] += x4.z;
          acc[u][4 * c + 3] += x4.w;
        }
      }
    }
    if (tid == 0) *lock = 0;
  }
  if (owner) store_y();
}

template <typename T, int NTOK, int TS, int STAGES>
struct WgSSKern {
  static constexpr int SMEM = WgSmem<NTOK * TS, STAGES>::STAGE * STAGES + 2 * 4 * 64 * 128 + 1024;
  static int setup() {
    static const int rc = static_cast<int>(cudaFuncSetAttribute(
        w4a16_wgmma_ss_kernel<T, NTOK, TS, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    return rc;
  }
  static int per_sm() {
    if (setup()) return 0;
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, w4a16_wgmma_ss_kernel<T, NTOK, TS, STAGES>, 256, SMEM);
    return n;
  }
  static int launch(const SdqW4A16Params& p, cudaStream_t stream) {
    if (const int rc = setup()) return rc;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((p.m + NTOK * TS - 1) / (NTOK * TS), p.n / 256, p.splits);
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = SMEM;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = p.pdl ? 1 : 0;
    cudaLaunchKernelEx(&cfg, w4a16_wgmma_ss_kernel<T, NTOK, TS, STAGES>, p);
    return static_cast<int>(cudaGetLastError());
  }
};

template <typename T, int NTOK, int STAGES, int KB>
struct WgKern {
  static constexpr int SMEM = WgSmem<NTOK, STAGES>::TOTAL;
  static int setup() {
    static const int rc = static_cast<int>(cudaFuncSetAttribute(
        w4a16_wgmma_kernel<T, NTOK, STAGES, KB>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    return rc;
  }
  static int per_sm() {
    if (setup()) return 0;
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, w4a16_wgmma_kernel<T, NTOK, STAGES, KB>, 128, SMEM);
    return n;
  }
  static int launch(const SdqW4A16Params& p, cudaStream_t stream) {
    if (const int rc = setup()) return rc;
    const dim3 grid((p.m + NTOK - 1) / NTOK, p.n / 256, p.splits);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(128);
    cfg.dynamicSmemBytes = SMEM;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = p.pdl ? 1 : 0;
    cudaLaunchKernelEx(&cfg, w4a16_wgmma_kernel<T, NTOK, STAGES, KB>, p);
    return static_cast<int>(cudaGetLastError());
  }
};

// Tokens a CTA of variant v at m rows (62: 16 / 32 / 64; 63: the same up to 64, then 128).
__host__ __device__ inline int wgmma_cta_tokens(int v, int m) {
  return m <= 16 ? 16 : (m <= 32 ? 32 : (m <= 64 || v != 63 ? 64 : 128));
}

// op: 0 launch, 1 resident CTAs per SM, 2 blocks a CTA, 3 scratch floats, 4 kind, 5 warps (as run_op in
// w4a16_kernel.cuh); the token tile from p.m.
template <typename T, int STAGES>
int wgmma_run(int v, int op, const SdqW4A16Params& p, cudaStream_t stream) {
  if (op == 3) {  // [splits, N / 256, token tiles, tokens a CTA * 256] fp32
    const int nx = wgmma_cta_tokens(v, p.m);
    return p.splits > 1 ? p.splits * ((p.m + nx - 1) / nx) * nx * p.n : 0;
  }
  if (op == 2) return WG_BLOCKS;
  if (op == 4) return 4;  // kind: a wgmma kernel (tiles of 256 features x wgmma_cta_tokens, split-K)
  if (op == 5) return v == 63 ? 8 : 4;  // warps
  if (op == 0 && (p.n % 256 || p.k % 64 || p.m > 256 || p.group_k16 % 2)) return -1;
  if (v == 63) {
    if (p.m <= 16) return op == 1 ? WgSSKern<T, 16, 1, STAGES>::per_sm() : WgSSKern<T, 16, 1, STAGES>::launch(p, stream);
    if (p.m <= 32) return op == 1 ? WgSSKern<T, 32, 1, STAGES>::per_sm() : WgSSKern<T, 32, 1, STAGES>::launch(p, stream);
    if (p.m <= 64) return op == 1 ? WgSSKern<T, 64, 1, STAGES>::per_sm() : WgSSKern<T, 64, 1, STAGES>::launch(p, stream);
    return op == 1 ? WgSSKern<T, 64, 2, STAGES>::per_sm() : WgSSKern<T, 64, 2, STAGES>::launch(p, stream);
  }
  if (p.m <= 16) return op == 1 ? WgKern<T, 16, STAGES, 1>::per_sm() : WgKern<T, 16, STAGES, 1>::launch(p, stream);
  if (p.m <= 32) return op == 1 ? WgKern<T, 32, STAGES, 1>::per_sm() : WgKern<T, 32, STAGES, 1>::launch(p, stream);
  return op == 1 ? WgKern<T, 64, STAGES, 1>::per_sm() : WgKern<T, 64, STAGES, 1>::launch(p, stream);
}

}  // namespace
}  // namespace sdq_w4a16

// w4a16_part_wgmma_*.cu: one C entry per dtype (variant 62: register-A kernel, 63: shared-memory-A kernel; 4 stages)
#define SDQ_W4A16_WGMMA_PART(T, NAME)                                                          \
  extern "C" int sdq_w4a16_part_##NAME(int v, int op, const SdqW4A16Params* p, cudaStream_t s) { \
    return sdq_w4a16::wgmma_run<T, 4>(v, op, *p, s);  \
  }
