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
//   m64 x NTOK cover the CTA's 256 features. At NTOK = 128 the CTA has two warpgroups (WGS = 2): warpgroup w takes
//   words 2w, 2w + 1 (an 8-byte shared-memory read) and keeps two accumulator sets, 128 registers a thread.
// * Swap-AB: weights are wgmma's 64-row A operand (from registers, dequantized), the tokens its N (16-128),
//   the activation tile B comes from shared memory through a descriptor (K-major, 128-byte swizzle, written by
//   cp.async with the swizzle applied to the address).
// * Dequantization per weight, in the activation dtype: the exact (code - zero) from the magic-number conversion
//   (Ops<T>::codes, shared with the other kernels), times the group scale (one mul per pair). The wgmma sums in
//   fp32 over the whole K range; no per-group fp32 sums.
// * Except at the 16-token tile (RAW, groups a multiple of 128): there a stage's code has about 40% fewer instructions
//   a K step (SASS, bf16: ~56 against ~92). The raw magic-number codes (magic + code: a shift and a lop3 a pair, no
//   zero, no scale) go into the wgmmas of a group-wide accumulator set accg, and a fifth wgmma a K step with an
//   all-ones A fragment sums the activations into accx. At the end of each 128-K stage (one group) the accumulators
//   fold in fp32: acc += s * accg - s * (magic + z) * accx. ncu (int4_wgmma run 27) had the 16-64-token tiles
//   waiting on their own ALU chains (fixed-latency and issue stalls, DRAM at 36-51%), not on memory. At 32 tokens the
//   second accumulator set takes the kernel to 255 registers and it was slower (docs/benchmarks/int4-wgmma.md, "The raw codes in
//   the wgmma kernel").
// * One pipeline for everything: STAGES shared-memory stages of 64 K (weights 8 KB, activations NTOK x 128 B,
//   scales/zeros of the <= 2 groups a stage touches), filled by cp.async STAGES - 2 stages ahead, so a stage is
//   overwritten only after the wgmmas that read it (waited for one K step later) are complete. Variant 63's split-K
//   at 128 tokens uses stages of 128 K (half the CTA-wide barriers; the activation tile as two 64-K sub-tiles). A
//   stage's weight words are read from shared memory four K steps at a time, ahead of their dequantization.
// * The dequantization of K step t overlaps the wgmmas of step t - 1: two register sets of A fragments, and a
//   wgmma.wait_group 1 before a set is rewritten. ptxas keeps that pipeline only if no branch sits between a wgmma
//   and the wait that retires it (else it serializes every wgmma, warning C7513, which the CI compile test rejects):
//   so the group's scales are loaded once a stage where a stage lies inside one group (ONE_GROUP: group a multiple
//   of 64), and reloaded branch-free every K step otherwise (groups 32, 96, ...). The first version waited for every
//   wgmma before the next dequantization (a data-dependent group branch sat in the loop): docs/benchmarks/int4-wgmma.md.
//   A shared-memory-A variant (SS wgmmas) was slower: docs/benchmarks/int4-wgmma.md "INT4 wgmma kernel".
// * Split-K over gridDim.z, deterministic (fixed split order). Variant 62: fp32 partials stored in register order;
//   the last CTA of a (feature tile, token tile) -- counted on a lock it resets -- sums them, one launch. Variant 63:
//   plain [splits, m, n] partials summed by wg_reduce_kernel over the whole GPU (better where tiles are few and
//   splits many, e.g. N = 4096).
// * Stream-K instead at the 128-token tile where split-K would leave resident slots idle (wg_stream_k, M > 128): a
//   grid of the slots over the (tile, stage) units, a tile cut between CTAs summed in CTA order by the last of them
//   (two partial slots a CTA: the first segment's and the last's); for variant 63 where groups are a multiple of 128
//   and K of 128, stream-K over the warp-specialized pipeline instead (wg_ws_sk, w4a16_wgmma_tma_sk_kernel below).
// * Variant 63's split-K at the 128-token tile is warp-specialized where wg_ws picks it (w4a16_wgmma_tma_kernel below):
//   a producer warpgroup issues every stage's copies by TMA, the two consumer warpgroups run the same stage steps
//   (wg_stage_mma) with no CTA-wide barrier; 18-26% faster on the large shapes at M = 96-256.
// * Token tiles over gridDim.x (fastest), so the CTAs that share a weight tile run together and share it in L2.
#pragma once
#include "w4a16_kernel.cuh"
#include "w4a16_wgmma_mma.cuh"

#include "w4a16_ranges.h"
#include <cudaTypedefs.h>  // CUtensorMap, PFN_cuTensorMapEncodeTiled (the TMA pipeline; header only)

#include <algorithm>

namespace sdq_w4a16 {
namespace {

constexpr int WG_BLOCKS = 4;  // 64-feature blocks per CTA, one per warp
constexpr int WG_KS = 4;      // 16-deep K steps per stage (a stage = 64 K; 128 K where wgmma_run_k says)

// SMs of the current device (a process may drive several)
inline int sm_count_now() {
  int dev = 0, sms = 132;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}

template <int NTOK, int STAGES, int KS = WG_KS>
struct WgSmem {
  static constexpr int X_BYTES = NTOK * 128 * (KS / 4);      // [64-K sub-tile][NTOK rows][64 K], 128-byte swizzled
  static constexpr int W_BYTES = WG_BLOCKS * KS * 512;       // [warp][K step][lane] 16 B
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
// N = 4 or 2 consecutive 32-bit words from shared memory (one 16- or 8-byte load)
template <int N>
__device__ __forceinline__ void ld_shared_words(uint32_t a, uint32_t (&w)[N]) {
  if constexpr (N == 4) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(a)
                 : "memory");
  } else {
    static_assert(N == 2, "4 or 2 words");
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(w[0]), "=r"(w[1]) : "r"(a) : "memory");
  }
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

// One stage's copies by the CTA's NT threads: weights (4 blocks x KS K steps), scales/zeros of the stage's first and
// last group, ga and gb (WITH_X = false), or the activation tile (WITH_X = true). Each source is a per-stage base plus
// an offset that does not change from stage to stage (ptxas keeps or rebuilds it cheaply), and the caller tracks the
// groups (SdqStageGroups, w4a16_ranges.h). Rebuilding the 64-bit addresses and dividing by the group size twice a
// stage had cost 4-11% of the main loops' instructions (SASS, 2026-12-07; ab_build run 24). At 128-K stages each
// copy's block, sub-tile and row are compile-time constants plus tid (tid < NT, which ptxas cannot know from a
// division by NT): 6-15% fewer loop instructions, 192 against 221 registers in the raw 16-token kernel, bit-identical
// outputs and 0.984-1.000x the time at M = 16 (ab_build run 26, H100; docs/benchmarks/pending.md Pending 43).
template <int NTOK, int NT, bool WITH_X, int KS>
__device__ __forceinline__ void wg_load_stage(const SdqW4A16Params& p, uint32_t st, int ks0, int nb0, int m0,
                                              int tid, int ga = 0, int gb = 0) {
  using L = WgSmem<NTOK, 2, KS>;
  const uint32_t kb = static_cast<uint32_t>(p.k) / 16;
  if constexpr (!WITH_X) {
    // block nb0's K step ks0; block nb0 + w is w * kb * 512 bytes on (32-bit: w < 4, kb * 512 = K * 32 bytes)
    const char* b = static_cast<const char*>(p.b) + (static_cast<size_t>(nb0) * kb + static_cast<uint32_t>(ks0)) * 512;
    constexpr int CPB = KS * 32;  // 16-byte chunks of a block's stage (contiguous in the layout)
    if constexpr (KS == WG_KS) {  // the 64-K form as it was: the generic one changed ptxas's register allocation
      const uint32_t off = (tid & 127) * 16;
#pragma unroll
      for (int i = 0; i < WG_BLOCKS * 128 / NT; ++i) {  // block w: thread tid's 16 bytes at offset tid % 128
        const int w = NT == 128 ? i : i * (NT / 128) + (tid >> 7);
        cp_async16_s(st + L::X_BYTES + w * 2048 + off, b + (w * kb * 512 + off));
      }
    } else {  // block w = i / R, offset (i % R) NT + tid: the block and a constant part of the offset
      static_assert(CPB % NT == 0, "whole rounds of a block's chunks");
      constexpr int R = CPB / NT;
#pragma unroll
      for (int i = 0; i < WG_BLOCKS * R; ++i) {
        const int w = i / R, off = (i % R) * NT * 16;
        cp_async16_s(st + L::X_BYTES + tid * 16 + (w * (CPB * 16) + off), b + (w * kb * 512 + tid * 16 + off));
      }
    }
    if (NT > 128 && tid >= 128) return;
    const int gsel = tid >> 6, which = (tid >> 5) & 1, w = (tid >> 3) & 3, g8 = tid & 7;
    const int grp = gsel ? gb : ga;
    const char* src = static_cast<const char*>(which ? p.zs : p.s) +
                      ((static_cast<size_t>(grp) * (p.n / 64) + nb0 + w) * 8 + g8) * 16;
    cp_async16_s(st + L::X_BYTES + L::W_BYTES + tid * 16, src);
  } else {
    const char* a = static_cast<const char*>(p.a) + static_cast<size_t>(ks0) * 32;  // K step ks0 of row 0
    constexpr int CPR = 2 * KS;  // 16-byte chunks of a row (8 a 64-K sub-tile)
    static_assert(NTOK * CPR % NT == 0 || NT > NTOK * CPR, "whole rounds of 16-byte chunks");
#pragma unroll
    for (int i = 0; i < (NTOK * CPR + NT - 1) / NT; ++i) {
      const int ci = tid + NT * i, r = ci >> 3, c = ci & 7;
      if (NT > NTOK * CPR && ci >= NTOK * CPR) break;
      if constexpr (KS == WG_KS) {  // (as above)
        const int row = m0 + r;
        const bool valid = row < p.m;
        const char* src = a + (static_cast<size_t>(valid ? row : 0) * p.k + c * 8) * 2;
        cp_async16_zfill(st + r * 128 + ((c ^ (r & 7)) << 4), src, valid);
      } else if constexpr (8 * NTOK < NT) {  // a round covers NT / (8 NTOK) sub-tiles (the raw 16-token kernel in two
        // warpgroups): chunk ci is chunk ci % 8 of row ci / 8 % NTOK of 64-K sub-tile ci / (8 NTOK)
        static_assert(NT % (8 * NTOK) == 0, "whole sub-tiles a round");
        const int sub = ci / (8 * NTOK), rr = (ci >> 3) % NTOK, row = m0 + rr, cc = ci & 7;
        const bool valid = row < p.m;
        const char* src = a + (static_cast<size_t>(valid ? row : 0) * p.k + sub * 64 + cc * 8) * 2;
        cp_async16_zfill(st + sub * (NTOK * 128) + rr * 128 + ((cc ^ (rr & 7)) << 4), src, valid);
      } else {  // chunk ci = i NT + tid: 64-K sub-tile i / Q, row (i % Q) NT / 8 + tid / 8 (its swizzle tid / 8 % 8,
                // NT / 8 being a multiple of 8), chunk tid % 8 of it
        static_assert(8 * NTOK % NT == 0 && NT % 64 == 0, "whole rounds of a sub-tile's chunks");
        constexpr int Q = 8 * NTOK / NT;
        const int sub = i / Q, rr = (i % Q) * (NT / 8) + (tid >> 3), row = m0 + rr, cc = tid & 7;
        const bool valid = row < p.m;
        const char* src = a + (static_cast<size_t>(valid ? row : 0) * p.k + sub * 64 + cc * 8) * 2;
        cp_async16_zfill(st + (sub * (NTOK * 128) + (i % Q) * (NT / 8) * 128) + (tid >> 3) * 128 +
                             ((cc ^ ((tid >> 3) & 7)) << 4), src, valid);
      }
    }
  }
}

// The scales of group slot gsel (0: the stage's first group, 1: its last) of the stage at st as activation-dtype pairs,
// and the zero pairs of the magic-number conversion; warpgroup wg owns row tiles NU * wg .. NU * wg + NU - 1
template <typename T, int NU, typename L>
__device__ __forceinline__ void wg_load_group(uint32_t st, int gsel, int wg, int warp, int g8, uint32_t (&sp)[NU][2],
                                              uint32_t (&zl)[NU][2], uint32_t (&zh)[NU][2]) {
  const uint32_t sz = st + L::X_BYTES + L::W_BYTES + gsel * 1024 + warp * 128 + g8 * 16;
  uint32_t sw[NU], zw[NU];
  ld_shared_words<NU>(sz + 4 * NU * wg, sw);
  ld_shared_words<NU>(sz + 512 + 4 * NU * wg, zw);
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    sp[u][0] = wg_scale_pair<T>(sw[u], 0);
    sp[u][1] = wg_scale_pair<T>(sw[u], 1);
    Ops<T>::zero_pairs(zw[u], 0, zl[u][0], zh[u][0]);
    Ops<T>::zero_pairs(zw[u], 1, zl[u][1], zh[u][1]);
  }
}

// The KS K steps of the stage at st. A stage's weight words are read from shared memory four K steps at a time, ahead
// of their dequantization (one load a step, issued where ptxas put it after the previous step's wgmma fence, cost 2-6%:
// bench/int4_wgmma.py run 15; at KS = 8 in two batches of four, for the registers). Step t is dequantized into
// af[t & 1] (dequant(q, f)) while the wgmmas of step t - 1 run; the wait<1> before it retires step t - 2, the last
// reader of af[t & 1]; mma(f, desc) issues the step's wgmmas with their fences and commit. No branch may sit between a
// wgmma and the wait that retires it (ptxas then serializes them, C7513), so the hooks are straight-line: before(k0)
// ahead of a step's wait (wgmma_body's per-step group reload), after(k0) right after it (the warp-specialized
// consumer's slot release).
template <int NTOK, int KS, int NU, typename L, typename Dequant, typename Mma, typename Before, typename After>
__device__ __forceinline__ void wg_stage_steps(uint32_t st, int wg, int warp, int lane, uint32_t (&af)[2][NU][4],
                                               Dequant&& dequant, Mma&& mma, Before&& before, After&& after) {
  const uint64_t desc = wg_desc(st);
  uint32_t qs[4][NU];
  const auto words = [&](int k0) {  // K steps k0 .. k0 + 3: this lane's words of warpgroup wg's row tiles
#pragma unroll
    for (int j = 0; j < 4; ++j)
      ld_shared_words<NU>(st + L::X_BYTES + (warp * KS + k0 + j) * 512 + lane * 16 + 4 * NU * wg, qs[j]);
  };
  words(0);
#pragma unroll
  for (int k0 = 0; k0 < KS; ++k0) {
    if (k0 % 4 == 0 && k0 > 0) words(k0);
    before(k0);
    const uint32_t(&q)[NU] = qs[k0 % 4];
    wg_wait<1>();
    after(k0);
    uint32_t(&f)[NU][4] = af[k0 & 1];
    dequant(q, f);
    mma(f, desc + ((k0 / 4) * NTOK * 128 >> 4) + 2 * (k0 % 4));  // +32 B along K a step, the next 64-K sub-tile
  }                                                                // every 4 steps
}

// A K step's A fragments: word u of q converted by conv(u, word, c) into its four pairs c = (row g, k lo) (row g, k hi)
// (row g+8, k lo) (row g+8, k hi), as the conversions give them, then placed in the fragment's order as g(u, pair, h),
// h = 0 for row g, 1 for row g + 8
template <int NU, typename Conv, typename G>
__device__ __forceinline__ void wg_frags(const uint32_t (&q)[NU], uint32_t (&f)[NU][4], Conv&& conv, G&& g) {
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    uint32_t c[4];
    conv(u, q[u], c);
    f[u][0] = g(u, c[0], 0);
    f[u][1] = g(u, c[2], 1);
    f[u][2] = g(u, c[1], 0);
    f[u][3] = g(u, c[3], 1);
  }
}

// The wgmmas of one K step into the accumulator sets acc[u] (A fragment f[u]), with their fences and commit
template <typename T, int NTOK, int NU>
__device__ __forceinline__ void wg_step_mma(float (&acc)[NU][NTOK / 2], const uint32_t (&f)[NU][4], uint64_t desc) {
#pragma unroll
  for (int u = 0; u < NU; ++u) wg_fence_acc(acc[u]);
  wg_fence();
#pragma unroll
  for (int u = 0; u < NU; ++u) WgMma<T, NTOK>::mma(acc[u], f[u], desc);
  wg_commit();
#pragma unroll
  for (int u = 0; u < NU; ++u) wg_fence_acc(acc[u]);
}

// The stage's K steps into acc: exact (code - zero) times the group scale, in the activation dtype
template <typename T, int NTOK, int KS, int NU, typename L, typename Before, typename After>
__device__ __forceinline__ void wg_stage_mma(uint32_t st, int wg, int warp, int lane, float (&acc)[NU][NTOK / 2],
                                             uint32_t (&af)[2][NU][4], const uint32_t (&sp)[NU][2],
                                             const uint32_t (&zl)[NU][2], const uint32_t (&zh)[NU][2], Before&& before,
                                             After&& after) {
  using O = Ops<T>;
  wg_stage_steps<NTOK, KS, NU, L>(
      st, wg, warp, lane, af,
      [&](const uint32_t(&q)[NU], uint32_t(&f)[NU][4]) {
        wg_frags(q, f, [&](int u, uint32_t word, uint32_t(&c)[4]) { O::codes(word, zl[u], zh[u], c); },
                 [&](int u, uint32_t v, int h) { return O::mul2(v, sp[u][h]); });
      },
      [&](const uint32_t(&f)[NU][4], uint64_t desc) { wg_step_mma<T, NTOK, NU>(acc, f, desc); }, before, after);
}

// The early trigger at M <= SDQ_WG_EARLY_TRIGGER_MAX_M (default 16; 0: never, the form before 2026-12-08; 256: at every
// M). Under PDL with the early trigger (p.pdl >= 2, the decode runtime's mode), as the mma.sync kernels do:
// * wgmma_body's CTAs let the next kernel launch right after their wait instead of after their main loop;
// * variant 63's split-K sum (wg_reduce_kernel) lets it launch right after its wait instead of at its end.
// A launch's dependents start only once every CTA of it has triggered or exited, so they take no slot from its own CTAs;
// they take the slots it leaves free and request their first weights while it runs (their own wait still waits for it
// to finish). H100, ab_build runs 31 and 33 (docs/benchmarks/int4-wgmma.md, "Early triggers under PDL at M = 9-64"), at
// the configs the op picks: at M = 12-16 0.94x the time (0.85-1.00x at all 14 points, both runs); at M = 32-64 0.98-0.99x
// in geometric mean but 1.03-1.19x at four points (8192x10240 M = 32: the next kernel's CTAs share SMs with the sum's,
// and variant 63's grid, sized to the free slots, no longer fits one wave), hence the bound. The wgmma trigger alone
// (without the sum's) was 0.995x.
#ifndef SDQ_WG_EARLY_TRIGGER_MAX_M
#define SDQ_WG_EARLY_TRIGGER_MAX_M 16
#endif
__device__ __forceinline__ void wg_early_trigger(const SdqW4A16Params& p) {
  if (SDQ_WG_EARLY_TRIGGER_MAX_M > 0 && p.pdl >= 2 && p.m <= SDQ_WG_EARLY_TRIGGER_MAX_M) griddep_launch_dependents();
}
#ifndef SDQ_WG_RAW  // 0: the 16-token tile dequantizes as the others do (A/B builds: bench/ab_build.py --new-defines)
#define SDQ_WG_RAW 1
#endif
// RAW: the stage's group as fp32 row scales sf and nz = -s * (magic + z), rows (u, h) as wg_load_group's
template <typename T, int NU, typename L>
__device__ __forceinline__ void wg_load_group_raw(uint32_t st, int wg, int warp, int g8, float (&sf)[NU][2],
                                                  float (&nz)[NU][2]) {
  constexpr float MAGIC = std::is_same<T, half>::value ? 1024.f : 128.f;
  const uint32_t sz = st + L::X_BYTES + L::W_BYTES + warp * 128 + g8 * 16;
  uint32_t sw[NU], zw[NU];
  ld_shared_words<NU>(sz + 4 * NU * wg, sw);
  ld_shared_words<NU>(sz + 512 + 4 * NU * wg, zw);
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    const float2 f = __half22float2(*reinterpret_cast<const half2*>(&sw[u]));
    const typename Ops<T>::T2 z = *reinterpret_cast<const typename Ops<T>::T2*>(&zw[u]);
    sf[u][0] = f.x;
    sf[u][1] = f.y;
    nz[u][0] = -f.x * (MAGIC + __low2float(z));
    nz[u][1] = -f.y * (MAGIC + __high2float(z));
  }
}
// RAW: the stage's K steps with the raw codes (magic + code, no zero, no scale) into accg, and a fifth wgmma a K step
// with an all-ones A fragment summing the activations into accx (every row holds the same sums)
template <typename T, int NTOK, int KS, int NU, typename L>
__device__ __forceinline__ void wg_stage_mma_raw(uint32_t st, int wg, int warp, int lane, float (&accg)[NU][NTOK / 2],
                                                 float (&accx)[NTOK / 2], uint32_t (&af)[2][NU][4]) {
  constexpr uint32_t ONE2 = std::is_same<T, half>::value ? 0x3c003c00u : 0x3f803f80u;
  const uint32_t ones[4] = {ONE2, ONE2, ONE2, ONE2};
  wg_stage_steps<NTOK, KS, NU, L>(
      st, wg, warp, lane, af,
      [&](const uint32_t(&q)[NU], uint32_t(&f)[NU][4]) {
        wg_frags(q, f, [](int, uint32_t word, uint32_t(&c)[4]) { raw_codes<T>(word, c); },
                 [](int, uint32_t v, int) { return v; });
      },
      [&](const uint32_t(&f)[NU][4], uint64_t desc) {
#pragma unroll
        for (int u = 0; u < NU; ++u) wg_fence_acc(accg[u]);
        wg_fence_acc(accx);
        wg_fence();
#pragma unroll
        for (int u = 0; u < NU; ++u) WgMma<T, NTOK>::mma(accg[u], f[u], desc);
        WgMma<T, NTOK>::mma(accx, ones, desc);
        wg_commit();
#pragma unroll
        for (int u = 0; u < NU; ++u) wg_fence_acc(accg[u]);
        wg_fence_acc(accx);
      },
      [](int) {}, [](int) {});
}

// A split's fp32 partial as a thread's accumulators sit in registers: float4 i = u NC + c (acc[u][4c .. 4c + 3]) at
// base[i * NT], base = the slot + the thread's index among the NT threads (coalesced, constant offsets)
template <int NU, int ND, int NT>
__device__ __forceinline__ void acc_store_partial(float4* base, const float (&acc)[NU][ND]) {
  constexpr int NC = ND / 4;
#pragma unroll
  for (int u = 0; u < NU; ++u)
#pragma unroll
    for (int c = 0; c < NC; ++c)
      __stcg(base + (u * NC + c) * NT,
             make_float4(acc[u][4 * c], acc[u][4 * c + 1], acc[u][4 * c + 2], acc[u][4 * c + 3]));
}
// acc += a partial stored so
template <int NU, int ND, int NT>
__device__ __forceinline__ void acc_add_partial(const float4* base, float (&acc)[NU][ND]) {
  constexpr int NC = ND / 4;
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    asm volatile("" ::: "memory");  // loads in batches of one u (ND registers), not all at once
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const float4 v = __ldcg(base + (u * NC + c) * NT);
      acc[u][4 * c] += v.x;
      acc[u][4 * c + 1] += v.y;
      acc[u][4 * c + 2] += v.z;
      acc[u][4 * c + 3] += v.w;
    }
  }
}

template <typename T, int NTOK, int STAGES, int KS, bool ONE_GROUP, bool SEPARATE, int WGS, bool SK, bool RAW = false>
__device__ __forceinline__ void wgmma_body(const SdqW4A16Params& p) {
  using O = Ops<T>;
  using L = WgSmem<NTOK, STAGES, KS>;
  constexpr int NT = 128 * WGS;   // threads
  constexpr int NU = 4 / WGS;     // wgmma row tiles (words of a lane's 16 fragment bytes) per warpgroup
  constexpr int PF = STAGES - 2;  // stages requested ahead of the one computed
  constexpr int ND = NTOK / 2;    // accumulator registers per wgmma
  static_assert(WGS == 1 || WGS == 2, "one or two warpgroups");
  static_assert(STAGES >= 3, "the pipeline needs a slack stage");
  extern __shared__ uint8_t wg_smem_raw[];
  const uint32_t sraw = smem_addr(wg_smem_raw);
  const uint32_t sbase = (sraw + 1023u) & ~1023u;

  // warpgroup wg owns row tiles u = NU * wg + j (j < NU): word u of each lane's fragment, features 16u..16u+15 of
  // every block; warp v of a warpgroup brings block nb0 + v (rows 16v..16v+15 of each of its m64 tiles)
  const int tid = threadIdx.x, wg = WGS == 1 ? 0 : tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g8 = lane >> 2,
            t4 = lane & 3;

  float acc[NU][ND];
  const auto zero_acc = [&]() {
#pragma unroll
    for (int u = 0; u < NU; ++u)
#pragma unroll
      for (int i = 0; i < ND; ++i) acc[u][i] = 0.f;
  };

  uint32_t sp[NU][2], zl[NU][2], zh[NU][2];  // the current group (wg_load_group)
  const auto load_group = [&](uint32_t st, int gsel) { wg_load_group<T, NU, L>(st, gsel, wg, warp, g8, sp, zl, zh); };
  uint32_t af[2][NU][4];  // A fragments of two K steps (wg_stage_mma)

  // The main loop: stages [st0, st1) (16 KS K each) of the tile at tokens m0, blocks nb0, added into acc; every
  // wgmma retired on return.
  const auto mainloop = [&](int m0, int nb0, int st0, int st1) {
    const int nst = st1 - st0;
    SdqStageGroups grp(st0 * KS, KS, p.group_k16);
    const auto load_w = [&](uint32_t st, int ks0) {  // the next stage's weights, scales and zeros
      wg_load_stage<NTOK, NT, false, KS>(p, st, ks0, nb0, m0, tid, grp.first(), grp.last());
      grp.next();
    };
    // prologue: the first PF stages' weights before the PDL wait (they do not depend on the previous kernel),
    // then their activations; group s holds stage s (group 0 also the later stages' weights: waits stay
    // conservative)
#pragma unroll
    for (int s = 0; s < PF; ++s)
      if (s < nst) load_w(sbase + s * L::STAGE, (st0 + s) * KS);
    if (p.pdl) griddep_wait();
    wg_early_trigger(p);
#pragma unroll
    for (int s = 0; s < PF; ++s) {
      if (s < nst) wg_load_stage<NTOK, NT, true, KS>(p, sbase + s * L::STAGE, (st0 + s) * KS, nb0, m0, tid);
      cp_async_commit();
    }
    for (int s = 0; s < nst; ++s) {
      cp_async_wait<PF - 1>();
      __syncthreads();  // stage s landed for every thread; stage s - 2 is no longer read (<= 1 wgmma step in flight)
      {
        const int sn = s + PF;
        if (sn < nst) {
          const uint32_t st = sbase + (sn % STAGES) * L::STAGE;
          load_w(st, (st0 + sn) * KS);
          wg_load_stage<NTOK, NT, true, KS>(p, st, (st0 + sn) * KS, nb0, m0, tid);
        }
        cp_async_commit();
      }
      const uint32_t st = sbase + (s % STAGES) * L::STAGE;
      const int ks0 = (st0 + s) * KS;
      if constexpr (RAW) {  // the stage is one whole group: raw sums, then acc += s * accg + nz * accx in fp32
        static_assert(ONE_GROUP && KS == 8, "RAW: 128-K stages, one group each");
        float sf[NU][2], nz[NU][2], accg[NU][ND], accx[ND];
#pragma unroll
        for (int i = 0; i < ND; ++i) accx[i] = 0.f;
#pragma unroll
        for (int u = 0; u < NU; ++u)
#pragma unroll
          for (int i = 0; i < ND; ++i) accg[u][i] = 0.f;
        wg_load_group_raw<T, NU, L>(st, wg, warp, g8, sf, nz);
        wg_stage_mma_raw<T, NTOK, KS, NU, L>(st, wg, warp, lane, accg, accx, af);
        wg_wait<0>();
#pragma unroll
        for (int u = 0; u < NU; ++u) wg_fence_acc(accg[u]);
        wg_fence_acc(accx);
#pragma unroll
        for (int u = 0; u < NU; ++u)
#pragma unroll
          for (int i = 0; i < ND; ++i) {
            const int h = (i >> 1) & 1;  // acc[u][4c + 2h + e]: row 16u + 8h + g8
            acc[u][i] = fmaf(sf[u][h], accg[u][i], fmaf(nz[u][h], accx[i], acc[u][i]));
          }
      } else {
        if constexpr (ONE_GROUP) load_group(st, 0);
        wg_stage_mma<T, NTOK, KS, NU, L>(
            st, wg, warp, lane, acc, af, sp, zl, zh,
            [&](int k0) {
              if constexpr (!ONE_GROUP) load_group(st, (ks0 + k0) / p.group_k16 != ks0 / p.group_k16);
            },
            [](int) {});
      }
    }
    wg_wait<0>();
#pragma unroll
    for (int u = 0; u < NU; ++u) wg_fence_acc(acc[u]);
  };

  // acc[j][4c + 2h + e] = y[token m0 + 8c + 2t4 + e][feature 64 (nb0 + warp) + 16u + 8h + g8], u = NU wg + j;
  // wg_pos(q, ...) is that element's offset in split q's partial ([splits, m, n] fp32), wg_pos(0, ...) its offset
  // in y
  T* y = static_cast<T*>(p.c);
  const auto wg_pos = [&](int m0, int nb0, int q, int u, int c, int h, int e) -> size_t {
    return (static_cast<size_t>(q) * p.m + m0 + 8 * c + 2 * t4 + e) * p.n + 64 * (nb0 + warp) + g8 + 16 * u + 8 * h;
  };
  // f(u, c, h, e, accumulator) for every accumulator element of a token below m
  const auto each_valid = [&](int m0, auto&& f) {
#pragma unroll
    for (int j = 0; j < NU; ++j)
#pragma unroll
      for (int c = 0; c < NTOK / 8; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (m0 + 8 * c + 2 * t4 + e < p.m) f(NU * wg + j, c, h, e, acc[j][4 * c + 2 * h + e]);
  };
  const auto store_y = [&](int m0, int nb0) {
    each_valid(m0, [&](int u, int c, int h, int e, float v) { y[wg_pos(m0, nb0, 0, u, c, h, e)] = O::one(v); });
  };
  // Partial slots (acc_store_partial's layout), `slot` float4s a CTA
  constexpr size_t slot = static_cast<size_t>(ND) * 128;
  float4* part = reinterpret_cast<float4*>(p.partial);
  const auto write_slot = [&](size_t sl) { acc_store_partial<NU, ND, NT>(part + sl * slot + tid, acc); };
  const auto add_slot = [&](size_t sl) { acc_add_partial<NU, ND, NT>(part + sl * slot + tid, acc); };
  // after write_slot: true in the one CTA that arrives last of `count` on the lock (which it then owns)
  __shared__ int s_last;
  const auto last_of = [&](int* lock, int count) -> bool {
#if SDQ_SPLIT_TAIL
    return split_count_in(lock, count, s_last);
#else
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(lock, 1) == count - 1;
    __syncthreads();
    const bool last = s_last;
    if (last) __threadfence();
    return last;
#endif
  };

  if constexpr (SK) {
    // Stream-K (the 128-token tile): a grid of G = p.splits CTAs over the U = tiles x stages (tile, stage) units
    // in tile order (token tiles fastest, as gridDim.x of the split-K grid); CTA g takes units
    // [U g / G, U (g + 1) / G). A tile cut between CTAs is summed in CTA order by the last of them to arrive
    // (deterministic, whichever is last); each CTA has two partial slots, its first segment's and its last's.
    const int tt = (p.m + NTOK - 1) / NTOK, nst_all = p.k / (16 * KS), grid = p.splits, g = blockIdx.x;
    const long long units = static_cast<long long>(tt) * (p.n / 256) * nst_all;
    const auto start_of = [&](int cta) { return units * cta / grid; };
    const auto cta_of = [&](long long unit) {  // the CTA whose range holds unit
      return static_cast<int>(((unit + 1) * grid + units - 1) / units - 1);
    };
    long long u = start_of(g);
    const long long u_end = start_of(g + 1);
    for (bool first = true; u < u_end; first = false) {
      const int t = static_cast<int>(u / nst_all);
      const int sa = static_cast<int>(u - static_cast<long long>(t) * nst_all);
      const int sb = static_cast<int>(min(static_cast<long long>(nst_all), u_end - static_cast<long long>(t) * nst_all));
      const int m0 = (t % tt) * NTOK, nb0 = (t / tt) * WG_BLOCKS;
      zero_acc();
      mainloop(m0, nb0, sa, sb);
      if (sa == 0 && sb == nst_all) {
        store_y(m0, nb0);
      } else {
        write_slot(2 * static_cast<size_t>(g) + (first ? 0 : 1));
        const long long t0 = static_cast<long long>(t) * nst_all;
        const int ga = cta_of(t0), gb = cta_of(t0 + nst_all - 1);
        if (last_of(p.locks + t, gb - ga + 1)) {
          zero_acc();
          for (int q = ga; q <= gb; ++q) add_slot(2 * static_cast<size_t>(q) + (start_of(q) >= t0 ? 0 : 1));
          store_y(m0, nb0);
          if (tid == 0) p.locks[t] = 0;
        }
      }
      u = static_cast<long long>(t + 1) * nst_all;
      __syncthreads();  // the next segment's copies overwrite the stages this one read
    }
    if (p.pdl) griddep_launch_dependents();
    return;
  }

  const int m0 = blockIdx.x * NTOK;
  const int nb0 = blockIdx.y * WG_BLOCKS;
  const int split = blockIdx.z;
  const int nst_all = p.k / (16 * KS);
  zero_acc();
  mainloop(m0, nb0, static_cast<int>(static_cast<long long>(nst_all) * split / p.splits),
           static_cast<int>(static_cast<long long>(nst_all) * (split + 1) / p.splits));
  if (p.pdl) griddep_launch_dependents();

  if (p.splits == 1) {
    store_y(m0, nb0);
    return;
  }
  if constexpr (SEPARATE) {  // variant 63: plain [splits, m, n] fp32 partials, summed by wg_reduce_kernel
    each_valid(m0, [&](int u, int c, int h, int e, float v) {
      __stcg(p.partial + wg_pos(m0, nb0, split, u, c, h, e), v);
    });
    return;
  }
  // Split-K: every CTA writes its accumulators to its partial slot; the last of the tile's splits (counted on the
  // lock, which it resets) re-sums every split's slot in split order into its registers and writes y. The order is
  // fixed whichever CTA is last. Scratch: [splits, N / 256, token tiles, NTOK * 256] fp32.
  const size_t tile_id = static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const size_t tiles = static_cast<size_t>(gridDim.y) * gridDim.x;
  write_slot(split * tiles + tile_id);
  int* lock = p.locks + blockIdx.y * WG_BLOCKS + blockIdx.x;
  if (!last_of(lock, p.splits)) return;
  zero_acc();
  for (int q = 0; q < p.splits; ++q) add_slot(q * tiles + tile_id);
  store_y(m0, nb0);
  if (tid == 0) *lock = 0;
}

template <typename T, int NTOK, int STAGES, int KS, bool ONE_GROUP, bool SEPARATE, int WGS, bool SK>
__global__ void __launch_bounds__(128 * WGS) w4a16_wgmma_kernel(const SdqW4A16Params p) {
  wgmma_body<T, NTOK, STAGES, KS, ONE_GROUP, SEPARATE, WGS, SK>(p);
}
// The raw-code form (one warpgroup, 128-K stages of one group each), declared as measured (bench/ab_build.py run 11):
// its launch bounds name a minimum of one CTA a SM, which changes ptxas's register assignment (not the count)
// SDQ_WG_RAW_OCC=3 (an A/B build, docs/benchmarks/pending.md Pending 44): 3 stages and launch bounds of 3 CTAs a SM (168
// registers, no spills). On the H100 it was 1.016x the time at M = 16 (0.944-1.086; ab_build run 26), where this
// kernel reads DRAM at ~75% of peak; on the H200, where the same kernel is bound per SM, it is still to be timed.
#ifndef SDQ_WG_RAW_OCC
#define SDQ_WG_RAW_OCC 1  // 4 stages, 2 CTAs a SM
#endif
// WGS = 2 (wg_two): two warpgroups of 128 features, each with its own all-ones wgmma for the activation sums (118-121
// registers, two CTAs a SM as the one-warpgroup form: the same split counts). H100 int4_wgmma run 70 (same process,
// M = 12-16): 0.994x the one-warpgroup time (0.955-1.023; docs/benchmarks/int4-wgmma.md "The raw 16-token kernel in two
// warpgroups"); H200 int4_wgmma run 73: 2-10% slower on five of seven shapes, 2-4% faster only on 4096x4096 ("The H200's
// A/Bs of 2026-12-07"). So sdq_wg_two_wg leaves it off; set_wg_two(2) (int4_wgmma --schedule 2wg) still runs it.
template <typename T, int NTOK, int STAGES, bool SEPARATE, int WGS = 1>
__global__ void __launch_bounds__(128 * WGS, WGS == 1 ? SDQ_WG_RAW_OCC : 1)
    w4a16_wgmma_raw_kernel(const SdqW4A16Params p) {
  wgmma_body<T, NTOK, STAGES, 8, true, SEPARATE, WGS, false, true>(p);
}

// Variant 63's split-K reduction: y = sum over splits of [splits, m, n] fp32 partials, in split order (deterministic),
// four outputs a thread, over the whole GPU (the last-CTA fix-up of variant 62 reads every split's partial tile in one
// CTA, which costs most where the tiles are few and the splits many: N = 4096 at M >= 32).
// (At M <= SDQ_WG_EARLY_TRIGGER_MAX_M under the early trigger it lets the next kernel launch right after its wait;
// otherwise the next kernel launches when it ends.)
template <typename T>
__global__ void __launch_bounds__(256) wg_reduce_kernel(const SdqW4A16Params p) {
  if (p.pdl) griddep_wait();
  wg_early_trigger(p);
  const size_t n4 = static_cast<size_t>(p.m) * p.n / 4;
  const size_t stride = static_cast<size_t>(p.m) * p.n / 4;
  const float4* part = reinterpret_cast<const float4*>(p.partial);
  T* y = static_cast<T*>(p.c);
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float4 a = __ldcg(part + i);
    for (int q = 1; q < p.splits; ++q) {
      const float4 b = __ldcg(part + q * stride + i);
      a.x += b.x;
      a.y += b.y;
      a.z += b.z;
      a.w += b.w;
    }
    const auto lo = Ops<T>::pack(a.x, a.y), hi = Ops<T>::pack(a.z, a.w);
    uint2 o;
    o.x = *reinterpret_cast<const uint32_t*>(&lo);
    o.y = *reinterpret_cast<const uint32_t*>(&hi);
    reinterpret_cast<uint2*>(y)[i] = o;
  }
}

// ------------------------------------------------------------------ the warp-specialized TMA pipeline (128 tokens)
// Variant 63's split-K at the 128-token tile (128-K stages; groups a multiple of 128 K) runs this kernel instead of
// wgmma_body where wg_ws says (docs/benchmarks/int4-wgmma.md "INT4 wgmma kernel, warp-specialized": 8192x28672 M = 128 126 -> 98
// us). Why: wgmma_body's pipeline has a CTA-wide barrier a stage (its largest stall, ncu run 20) and every thread
// issues ~9 cp.async a stage. Warp-specialized: one thread of a producer warpgroup issues a
// stage with 9 copies -- the activation tile by a 2-D TMA copy (a CUtensorMap with the 128-byte swizzle wgmma's
// descriptor expects; rows past M are zero-filled by the TMA unit), the four blocks' weights and the scales / zeros by
// 1-D bulk copies -- all completing on the stage's "full" mbarrier, and refills a slot once every consumer warp has
// arrived on its "empty" mbarrier (the wgmmas that read it retired). No CTA-wide barrier in the loop. The wgmmas are
// wgmma_body's, in the same order: the output is bit-identical to variant 63's.
// History: the first form issued the copies from inside the consumers (commit 8a6be7a, 1.12x slower geo-mean): a
// producer warpgroup under setmaxnreg had been dropped because ptxas serialized the wgmmas (C7512). The cause was the
// deadlock __trap() in ring_wait: with it, ptxas allocates under the launch bound's cap (see ws_wait). At 64 tokens
// the same pipeline was slower than wgmma_body (one consumer warpgroup, 2 CTAs a SM: 8192x28672 M = 64 75.6 -> 82.1
// us; two of 128 features, 1 CTA a SM: 98.5), so it serves the 128-token tile only.
// One producer warpgroup (the last) whose thread 0 issues every stage's copies, and two consumer warpgroups (128
// features each) that only wait on a stage's "full" barrier, compute, and free it. The producer gives its registers to
// the consumers (setmaxnreg 24 / 240; 384 threads, one CTA a SM).
// Experimental (-DSDQ_WS_SMALL=1): the same pipeline at the 16-64-token tiles too, with SDQ_WS_WGS_SMALL consumer
// warpgroups, SDQ_WS_MINB_SMALL CTAs a SM and up to SDQ_WS_STAGES_SMALL 64-K stages. Measured (ab_build run 7,
// 2026-12-02): both forms tried (1 warpgroup x 2 CTAs x 8 stages; 2 warpgroups x 1 CTA x 16 stages) were slower than
// variant 63 at every point of M = 16 / 32 / 64 on the seven Llama shapes (the better form by 0.9-25%; 28672x8192
// M = 16 46.8 -> 57.8 / 85.6 us), so it stays off.
#ifndef SDQ_WS_SMALL
#define SDQ_WS_SMALL 0
#endif
#ifndef SDQ_WS_WGS_SMALL
#define SDQ_WS_WGS_SMALL 1
#endif
#ifndef SDQ_WS_MINB_SMALL
#define SDQ_WS_MINB_SMALL 2
#endif
#ifndef SDQ_WS_STAGES_SMALL
#define SDQ_WS_STAGES_SMALL 8
#endif
// Two consumer warpgroups at the 128-token tile. Four of one 64-feature row tile each (640 threads, 112 registers a
// consumer thread, no spills) gave bit-identical outputs and were 0-5% slower on the large shapes at M = 128 / 1024
// (ab_build run 21, H100: 8192x28672 M = 1024 707.8 -> 721.0 us); that build's define is at 1cceba2.
// Freeing a ring slot sooner (before waiting on a stage that has not landed, or at each stage's end) was -4% to +3% by
// point (ab_build run 22, H100) and was removed; its define (SDQ_WS_FREE) is at c833727.
template <int NTOK>
struct WsRegs {
  static constexpr int WGS = NTOK == 128 ? 2 : SDQ_WS_WGS_SMALL;
  static constexpr int THREADS = 128 * (WGS + 1), MINB = NTOK == 128 ? 1 : SDQ_WS_MINB_SMALL;
  // setmaxnreg moves registers within the CTA's launch allocation (the launch bound's cap, a multiple of 8, a thread):
  // the consumers' increase must fit in what the producer gives back, or setmaxnreg.inc waits forever (a first
  // 3-CTA form that asked for 144 with an 80 cap hung on the GPU, ab_build run 6)
  static constexpr int CAP = (65536 / (MINB * THREADS)) / 8 * 8;
  static constexpr int PROD = 24, FIT = ((WGS + 1) * CAP - PROD) / WGS / 8 * 8;  // a consumer's share, rounded
  static constexpr int CONS = FIT > 240 ? 240 : FIT;
  static_assert(PROD + WGS * CONS <= (WGS + 1) * CAP, "the consumers' registers come from the producer's");
};
#ifndef SDQ_WS_TRACE  // (bench/ws_trace.py's build; the trace itself is described above ws_trace below)
#define SDQ_WS_TRACE 0
#endif
// The 128-token tile's stage depth: 8 K steps (four 128-K stages of 50 KB). Eight 64-K stages of 26 KB in the same
// shared memory (the same bytes in flight, each slot freed half a stage sooner) were 5-45% slower at M = 128 / 1024 on
// every Llama shape (ab_build run 20, H100; the build define is at 49e7b03).
constexpr int WS_KS128 = 8;
template <int NTOK, int KS>
struct TmaSmem {
  using L = WgSmem<NTOK, 1, KS>;
  static constexpr int FIT = (225 * 1024 / WsRegs<NTOK>::MINB - 1024 - 256) / L::STAGE;
  static constexpr int WANT = NTOK == 128 ? (KS == 8 ? 4 : 8) : SDQ_WS_STAGES_SMALL;
  static constexpr int STAGES = WANT < FIT ? WANT : FIT;
  static_assert(STAGES >= 3 && (NTOK != 128 || KS == 8 || KS == 4), "128 tokens: 128-K or 64-K stages, one CTA a SM");
  static constexpr int BAR_AT = STAGES * L::STAGE;    // full[STAGES], then empty[STAGES]
  static constexpr int STAMPS = SDQ_WS_TRACE ? 8 * STAGES : 0;  // trace builds: each slot's last issue clock
  static constexpr int TOTAL = BAR_AT + 16 * STAGES + STAMPS + 1024;
  static constexpr uint32_t TX = L::X_BYTES + L::W_BYTES + L::SZ_BYTES;  // bytes a stage's copies bring
};
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool on) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %1, 0;\n @q mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
      "r"(static_cast<int>(on))
      : "memory");
}
// A stage's copies, each predicated on `on` (thread 0 when the slot is free): the weights and scales / zeros
// (with_w), the activation tile (with_x); the expect_tx arrival goes with the first part issued (with_w).
template <int NTOK, int KS>
__device__ __forceinline__ void tma_issue_stage(const SdqW4A16Params& p, const CUtensorMap* tx, uint32_t st,
                                                uint32_t full, int ks0, int nb0, int m0, bool on, bool with_w,
                                                bool with_x) {
  using L = WgSmem<NTOK, 1, KS>;
  const int q = on ? 1 : 0;
  if (with_w) {
    asm volatile(
        "{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n}\n" ::
            "r"(full),
        "r"(TmaSmem<NTOK, KS>::TX), "r"(q)
        : "memory");
    const char* b = static_cast<const char*>(p.b) + (static_cast<size_t>(nb0) * (p.k / 16) + ks0) * 512;
#pragma unroll
    for (int w = 0; w < WG_BLOCKS; ++w)
      asm volatile(
          "{\n .reg .pred q;\n setp.ne.b32 q, %4, 0;\n"
          " @q cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n}\n" ::"r"(
              st + L::X_BYTES + w * (KS * 512)),
          "l"(b + static_cast<size_t>(w) * (p.k / 16) * 512), "r"(KS * 512), "r"(full), "r"(q)
          : "memory");
    const int ga = ks0 / p.group_k16, gb = (ks0 + KS - 1) / p.group_k16;
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // (group slot, scales / zeros): the four blocks' 4 x 128 contiguous bytes
      const char* src = static_cast<const char*>((j & 1) ? p.zs : p.s) +
                        (static_cast<size_t>((j >> 1) ? gb : ga) * (p.n / 64) + nb0) * 128;
      asm volatile(
          "{\n .reg .pred q;\n setp.ne.b32 q, %4, 0;\n"
          " @q cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n}\n" ::"r"(
              st + L::X_BYTES + L::W_BYTES + j * 512),
          "l"(src), "r"(512), "r"(full), "r"(q)
          : "memory");
    }
  }
  if (with_x)
#pragma unroll
    for (int sub = 0; sub < KS / 4; ++sub)  // 64-K sub-tiles of NTOK x 128 bytes
      asm volatile(
          "{\n .reg .pred q;\n setp.ne.b32 q, %4, 0;\n"
          " @q cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%5];\n}\n" ::
              "r"(st + sub * NTOK * 128),
          "l"(reinterpret_cast<uint64_t>(tx)), "r"(ks0 * 16 + sub * 64), "r"(m0), "r"(q), "r"(full)
          : "memory");
}

// Phase trace of the warp-specialized kernel (bench/ws_trace.py; -DSDQ_WS_TRACE=1 builds only, none of this code
// exists otherwise). Each CTA writes 32 u64 at trace[32 * linear CTA id] when the host has set a buffer
// (sdq_w4a16_set_ws_trace): 0 globaltimer at entry, 1 clock64 at entry, 2 after the barrier init, 3 consumer 0 past
// its first full barrier (first stage in shared memory), 4 consumer 0 past its main loop, 5 past the first cluster
// barrier (= 4 without the cluster sum), 6 consumer 0 at its end, 7 globaltimer there, 8 SM id, 9 producer after the
// prologue's copies, 10 producer after its last copy, 11 stages, 12 consumer 0's cycles waiting on full barriers,
// 13 consumer warpgroup 1 past its main loop, 14 split, 15 feature tile, 16 the part of 12 in stages from 2 x STAGES on
// (the ring's steady state, past the prologue's requests), 17 consumer 0's cycles from a late stage's issue to its
// wait's end, summed over those stages, 18 their count, 19 the same sum over the late stages it waited for (> 64
// cycles), 20 their count, 21 the producer's cycles waiting for free slots, 22 consumer warpgroup 1's late waits (16's
// counterpart), 23-31 unused. Clocks are the SM's own (compare within a CTA).
#if SDQ_WS_TRACE
__device__ unsigned long long* sdq_ws_trace_ptr;
void* ws_trace_sent = nullptr;  // this translation unit's sdq_ws_trace_ptr, as last copied
__device__ __forceinline__ unsigned long long ws_gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void ws_trace(int slot, unsigned long long v) {
  if (sdq_ws_trace_ptr)
    sdq_ws_trace_ptr[32ull * (blockIdx.x + gridDim.x * (blockIdx.y + static_cast<unsigned long long>(gridDim.y) *
                                                                            blockIdx.z)) + slot] = v;
}
#define SDQ_WS_T(slot, v) ws_trace(slot, static_cast<unsigned long long>(v))
// the end of a CTA without a cluster sum (slot 5 = slot 6: no cluster barrier), stamped by thread 0
__device__ __forceinline__ void ws_trace_end(int tid) {
  if (tid != 0) return;
  const unsigned long long c = clock64();
  SDQ_WS_T(5, c);
  SDQ_WS_T(6, c);
  SDQ_WS_T(7, ws_gtime());
}
#define SDQ_WS_T_END(tid) ws_trace_end(tid)
#else
#define SDQ_WS_T(slot, v) \
  do {                    \
  } while (0)
#define SDQ_WS_T_END(tid) \
  do {                    \
  } while (0)
#endif

// ring_wait without its deadlock trap: a __trap() reachable after setmaxnreg makes ptxas 13.0 allocate the whole kernel
// under the launch bound's cap (168 / 128 registers here): it then spills and serializes the wgmmas (C7512)
__device__ __forceinline__ void ws_wait(uint32_t bar, uint32_t phase) {
  while (!mbar_try_wait(bar, phase)) {
  }
}
// Split-K summed inside a thread-block cluster (CL; the splits of a tile are one cluster of p.splits CTAs, 2-8): every
// CTA leaves its fp32 accumulators in its own shared memory (the stages are spent by then), and after a cluster barrier
// CTA r of the cluster sums accumulator positions r, r + S, ... of every split in split order through distributed shared
// memory and writes y. No [splits, m, n] partials in global memory and no second kernel (wg_reduce_kernel); the same
// sums in the same order, so the same bits.
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t dsmem_map(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ float4 ld_dsmem4(uint32_t remote) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}
// The output tile through shared memory (the warp-specialized kernel's epilogue at one split). A consumer thread's
// accumulators are 8 x 8 blocks of the wgmma fragment, rows = features and columns = tokens. Written straight to y,
// each store put 2 bytes into 4 rows at once, 128 stores a thread, and a CTA's epilogue took ~8 us (bench/ws_trace.py,
// H100: 8192x28672 and 4096x4096 at one split). Instead stmatrix .trans writes each block transposed into a
// [token][256 features] tile in the activation dtype (rows padded by 16 bytes, so a block's eight 16-byte rows land in
// different banks), and the consumers copy the tile's rows to y 16 bytes a thread, a warp one whole 512-byte row. Same
// values, same rounding (Ops<T>::pack). The cluster sum keeps its direct stores: a CTA there stores 1/S of the tile
// (16-64 a thread), and staging them measured -5..+5% (ab_build run 15).
constexpr int WS_OUT_ROWB = 256 * 2 + 16;
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(addr), "r"(r0), "r"(r1)
               : "memory");
}
template <typename T>
__device__ __forceinline__ uint32_t pack_out(float x, float y) {
  const auto v = Ops<T>::pack(x, y);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
// The two blocks (h = 0, 1) of accumulator vector (j, c): f = acc[j][4c .. 4c + 3] = (h0 e0, h0 e1, h1 e0, h1 e1) for
// tokens 8c + 2 t4 + e and features 64 warp + 16 (NU wg + j) + 8 h + g8. Lanes 0-15 give the rows' addresses: lane
// 8h + i row i (token 8c + i) of block h.
template <typename T, int NU>
__device__ __forceinline__ void stage_out(uint32_t tile, int wg, int warp, int lane, int j, int c, float f0, float f1,
                                          float f2, float f3) {
  const int i = lane & 7, h = (lane >> 3) & 1;
  const uint32_t at = tile + static_cast<uint32_t>((8 * c + i) * WS_OUT_ROWB + 2 * (64 * warp + 16 * (NU * wg + j) + 8 * h));
  stmatrix_x2_trans(at, pack_out<T>(f0, f1), pack_out<T>(f2, f3));
}
// Rows r0 .. r1 - 1 of the staged tile (tokens m0 + r, rows past m skipped) to y's 256 columns from 64 nb0, by the
// NT consumer threads (ct = their index), after a barrier among them: 16-byte pieces, 32 a row (y 16-byte aligned:
// TmaKern::launch refuses other outputs)
template <typename T, int NT>
__device__ __forceinline__ void copy_out(const SdqW4A16Params& p, uint32_t tile, int r0, int r1, int m0, int nb0,
                                         int ct) {
  T* y = static_cast<T*>(p.c) + static_cast<size_t>(m0) * p.n + 64 * nb0;
  const int rend = r1 < p.m - m0 ? r1 : p.m - m0;
  for (int idx = ct; idx < (rend - r0) * 32; idx += NT) {
    const int r = r0 + idx / 32, q = idx % 32;
    *reinterpret_cast<uint4*>(y + static_cast<size_t>(r) * p.n + 8 * q) =
        lds128(tile + static_cast<uint32_t>(r * WS_OUT_ROWB + 16 * q));
  }
}
// The cluster's sum for one consumer thread: its 4-accumulator vectors r, r + S, ... (NV of them) of every split, read
// S at a time (independent loads in flight) and added in split order; store(v, sum) writes one vector's outputs
template <int S, int NV, int NT, typename Store>
__device__ __forceinline__ void cluster_sum(uint32_t sbase, int tid, Store&& store) {
  uint32_t base[S];
#pragma unroll
  for (int q = 0; q < S; ++q) base[q] = dsmem_map(sbase, static_cast<uint32_t>(q)) + 16u * static_cast<uint32_t>(tid);
  const int r = static_cast<int>(cluster_rank());
#pragma unroll 2
  for (int v = r; v < NV; v += S) {
    float4 part[S];
#pragma unroll
    for (int q = 0; q < S; ++q) part[q] = ld_dsmem4(base[q] + 16u * static_cast<uint32_t>(v * NT));
    float4 a = part[0];
#pragma unroll
    for (int q = 1; q < S; ++q) {
      a.x += part[q].x;
      a.y += part[q].y;
      a.z += part[q].z;
      a.w += part[q].w;
    }
    store(v, a);
  }
}

// A warp-specialized CTA's ring in dynamic shared memory: the stages from a 1024-byte-aligned base, then the full and
// empty mbarriers (TmaSmem's layout)
template <int NTOK, int KS>
struct WsRing {
  uint32_t sbase, full0, empty0;
  __device__ __forceinline__ WsRing(uint8_t* raw) {
    sbase = (smem_addr(raw) + 1023u) & ~1023u;
    full0 = sbase + TmaSmem<NTOK, KS>::BAR_AT;
    empty0 = full0 + 8 * TmaSmem<NTOK, KS>::STAGES;
  }
  // thread 0: full barriers count the issuer's expect_tx arrival, empty ones an arrival a consumer warp (the caller
  // syncs the CTA before anyone waits on them)
  __device__ __forceinline__ void init() const {
    for (int s = 0; s < TmaSmem<NTOK, KS>::STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 4 * WsRegs<NTOK>::WGS);
    }
    mbar_fence_init();
  }
};
template <typename T, int NTOK, int KS, bool CL>
__device__ __forceinline__ void ws_consumer(const SdqW4A16Params& p, uint32_t sbase, uint32_t full0, uint32_t empty0,
                                            int nst, int m0, int nb0, int split);
template <typename T, int NTOK, int KS, bool CL = false>
__global__ void __launch_bounds__(WsRegs<NTOK>::THREADS, WsRegs<NTOK>::MINB) w4a16_wgmma_tma_kernel(
    const SdqW4A16Params p, const __grid_constant__ CUtensorMap tx) {
  using L = WgSmem<NTOK, 1, KS>;
  constexpr int WGS = WsRegs<NTOK>::WGS;
  constexpr int STAGES = TmaSmem<NTOK, KS>::STAGES;
  extern __shared__ uint8_t wg_smem_raw[];
  const WsRing<NTOK, KS> ring(wg_smem_raw);
  const uint32_t sbase = ring.sbase, full0 = ring.full0, empty0 = ring.empty0;
  const int tid = threadIdx.x;
  const int m0 = blockIdx.x * NTOK, nb0 = blockIdx.y * WG_BLOCKS, split = blockIdx.z;
  const int nst_all = p.k / (16 * KS);
  const int st0 = static_cast<int>(static_cast<long long>(nst_all) * split / p.splits);
  const int nst = static_cast<int>(static_cast<long long>(nst_all) * (split + 1) / p.splits) - st0;
#if SDQ_WS_TRACE
  if (tid == 0) {
    SDQ_WS_T(0, ws_gtime());
    SDQ_WS_T(1, clock64());
    uint32_t smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    SDQ_WS_T(8, smid);
    SDQ_WS_T(11, nst);
    SDQ_WS_T(14, split);
    SDQ_WS_T(15, blockIdx.y);
  }
#endif
  if (tid == 0) ring.init();
  __syncthreads();
  if (tid == 0) SDQ_WS_T(2, clock64());
  const int role = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform warpgroup index
  if (role == WGS) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WsRegs<NTOK>::PROD));
    if (tid == 128 * WGS) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tx)) : "memory");
      const int pre = nst < STAGES ? nst : STAGES;
      // The prologue stage by stage: the first stage's weights before the PDL wait (they do not depend on the previous
      // kernel), then its activations, then each later stage whole. With every stage's weights first (the form before
      // 2026-12-06) a CTA's first stage landed behind its other stages' weights, 3-6 us into the CTA (bench/ws_trace.py);
      // stage by stage measured 2-9% faster at 18 of 21 points, bit-identical (ab_build run 19, H100).
      for (int s = 0; s < pre; ++s) {
        tma_issue_stage<NTOK, KS>(p, &tx, sbase + s * L::STAGE, full0 + 8 * s, (st0 + s) * KS, nb0, m0, true, true,
                                  false);
        if (s == 0 && p.pdl) griddep_wait();
        tma_issue_stage<NTOK, KS>(p, &tx, sbase + s * L::STAGE, full0 + 8 * s, (st0 + s) * KS, nb0, m0, true, false,
                                  true);
      }
      if (pre == 0 && p.pdl) griddep_wait();
      SDQ_WS_T(9, clock64());
#if SDQ_WS_TRACE
      unsigned pwait = 0;  // (32-bit clocks: the producer has 24 registers)
#endif
      for (int r = STAGES; r < nst; ++r) {  // refill a slot once every consumer warp has freed it
        const int slot = r % STAGES;
        // (ring_wait's trap here, in the producer, leaves the consumers' allocation alone: a consumer that never frees
        // its slot ends the kernel with an error instead of hanging it)
#if SDQ_WS_TRACE
        const unsigned p0 = static_cast<unsigned>(clock64());
        ring_wait(empty0 + 8 * slot, ((r / STAGES) - 1) & 1);
        const unsigned p1 = static_cast<unsigned>(clock64());
        pwait += p1 - p0;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(empty0 + 8 * STAGES + 8 * slot), "r"(p1) : "memory");
#else
        ring_wait(empty0 + 8 * slot, ((r / STAGES) - 1) & 1);
#endif
        tma_issue_stage<NTOK, KS>(p, &tx, sbase + slot * L::STAGE, full0 + 8 * slot, (st0 + r) * KS, nb0, m0, true,
                                  true, true);
      }
      SDQ_WS_T(10, clock64());
      SDQ_WS_T(21, pwait);
    }
    if constexpr (CL) {  // the consumers' two cluster barriers (their partials written; every split's read)
      cluster_sync_all();
      cluster_sync_all();
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WsRegs<NTOK>::CONS));
    ws_consumer<T, NTOK, KS, CL>(p, sbase, full0, empty0, nst, m0, nb0, split);
  }
}
template <typename T, int NTOK, int KS, bool CL>
__device__ __forceinline__ void ws_consumer(const SdqW4A16Params& p, uint32_t sbase, uint32_t full0, uint32_t empty0,
                                            int nst, int m0, int nb0, int split) {
  using O = Ops<T>;  // (the cluster sum's stores)
  using L = WgSmem<NTOK, 1, KS>;
  constexpr int WGS = WsRegs<NTOK>::WGS, NU = 4 / WGS, ND = NTOK / 2, NC = NTOK / 8;
  constexpr int STAGES = TmaSmem<NTOK, KS>::STAGES;
  const int tid = threadIdx.x;

  const int wg = WGS == 1 ? 0 : tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;
  float acc[NU][ND];
#pragma unroll
  for (int u = 0; u < NU; ++u)
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[u][i] = 0.f;
  uint32_t sp[NU][2], zl[NU][2], zh[NU][2];
  uint32_t af[2][NU][4];
#if SDQ_WS_TRACE
  long long waited = 0, waited_late = 0;
  unsigned age = 0, age_n = 0, age_w = 0, age_wn = 0;  // (32 bits hold one launch's sums)
#endif
  for (int s = 0; s < nst; ++s) {
    const int slot = s % STAGES;
    const uint32_t st = sbase + slot * L::STAGE;
#if SDQ_WS_TRACE
    const long long w0 = clock64();
    ws_wait(full0 + 8 * slot, (s / STAGES) & 1);
    const long long dw = clock64() - w0;
    waited += dw;
    if (s >= 2 * STAGES) {  // (the stamp was stored before the slot's expect_tx arrival, so the wait has seen it)
      waited_late += dw;
      unsigned issued;  // (the low 32 bits of the producer's clock64: differences wrap correctly)
      asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(issued) : "r"(empty0 + 8 * STAGES + 8 * slot) : "memory");
      const unsigned a = static_cast<unsigned>(w0 + dw) - issued;
      age += a;
      ++age_n;
      if (dw > 64) {
        age_w += a;
        ++age_wn;
      }
    }
    if (s == 0 && tid == 0) SDQ_WS_T(3, clock64());
#else
    ws_wait(full0 + 8 * slot, (s / STAGES) & 1);
#endif
    wg_load_group<T, NU, L>(st, 0, wg, warp, g8, sp, zl, zh);  // (one group a stage: the group is a multiple of it)
    wg_stage_mma<T, NTOK, KS, NU, L>(st, wg, warp, lane, acc, af, sp, zl, zh, [](int) {}, [&](int k0) {
      // at step 1 every wgmma of the previous stage has retired: free its slot
      if (k0 == 1) mbar_arrive_if(empty0 + 8 * ((s + STAGES - 1) % STAGES), s > 0 && lane == 0);
    });
  }
  wg_wait<0>();
#pragma unroll
  for (int u = 0; u < NU; ++u) wg_fence_acc(acc[u]);
  if (p.pdl) griddep_launch_dependents();
#if SDQ_WS_TRACE
  if (tid == 0) {
    SDQ_WS_T(4, clock64());
    SDQ_WS_T(12, waited);
    SDQ_WS_T(16, waited_late);
    SDQ_WS_T(17, age);
    SDQ_WS_T(18, age_n);
    SDQ_WS_T(19, age_w);
    SDQ_WS_T(20, age_wn);
  }
  if (tid == 128) {
    SDQ_WS_T(13, clock64());
    SDQ_WS_T(22, waited_late);
  }
#endif

  if constexpr (CL) {
    constexpr int NT = 128 * WGS, NA = NU * ND;  // consumer threads; accumulators a thread
    // both consumer warpgroups are past their last wgmma (the last stage's tiles are read until then)
    asm volatile("bar.sync 1, %0;\n" ::"n"(NT) : "memory");
#pragma unroll
    for (int j = 0; j < NU; ++j)
#pragma unroll
      for (int i = 0; i < ND; i += 4)  // vector v = (j * ND + i) / 4 of every thread: 16 contiguous bytes a thread
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                         sbase + 16u * static_cast<uint32_t>(((j * ND + i) / 4) * NT + tid)),
                     "f"(acc[j][i]), "f"(acc[j][i + 1]), "f"(acc[j][i + 2]), "f"(acc[j][i + 3])
                     : "memory");
    cluster_sync_all();
    if (tid == 0) SDQ_WS_T(5, clock64());
    // vector v holds acc[j][4c .. 4c + 3] (j = v / (ND / 4), c = v % (ND / 4)): rows 8c + 2 t4 + e, columns + 8 h
    T* y = static_cast<T*>(p.c);
    auto store = [&](int v, const float4& a) {
      const int j = v / (ND / 4), c = v % (ND / 4);
      const float f[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int row = m0 + 8 * c + 2 * t4 + e;
          if (row < p.m)
            y[static_cast<size_t>(row) * p.n + 64 * (nb0 + warp) + g8 + 16 * (NU * wg + j) + 8 * h] = O::one(f[2 * h + e]);
        }
    };
    constexpr int NV = NA / 4;
    switch (p.splits) {
      case 2: cluster_sum<2, NV, NT>(sbase, tid, store); break;
      case 3: cluster_sum<3, NV, NT>(sbase, tid, store); break;
      case 4: cluster_sum<4, NV, NT>(sbase, tid, store); break;
      case 5: cluster_sum<5, NV, NT>(sbase, tid, store); break;
      case 6: cluster_sum<6, NV, NT>(sbase, tid, store); break;
      case 7: cluster_sum<7, NV, NT>(sbase, tid, store); break;
      default: cluster_sum<8, NV, NT>(sbase, tid, store); break;
    }
    cluster_sync_all();  // no CTA leaves while another still reads its shared memory
#if SDQ_WS_TRACE
    if (tid == 0) {
      SDQ_WS_T(6, clock64());
      SDQ_WS_T(7, ws_gtime());
    }
#endif
    return;
  }
  if (p.splits == 1) {  // y through the staged tile (the stages are spent once both warpgroups pass the barrier)
    constexpr int NT = 128 * WGS;
    static_assert(NTOK * WS_OUT_ROWB <= TmaSmem<NTOK, KS>::BAR_AT, "the staged tile fits the stages");
    asm volatile("bar.sync 1, %0;\n" ::"n"(NT) : "memory");
#pragma unroll
    for (int j = 0; j < NU; ++j)
#pragma unroll
      for (int c = 0; c < NC; ++c)
        stage_out<T, NU>(sbase, wg, warp, lane, j, c, acc[j][4 * c], acc[j][4 * c + 1], acc[j][4 * c + 2],
                         acc[j][4 * c + 3]);
    asm volatile("bar.sync 1, %0;\n" ::"n"(NT) : "memory");
    copy_out<T, NT>(p, sbase, 0, NTOK, m0, nb0, tid);
    SDQ_WS_T_END(tid);
    return;
  }
  // split `split`'s plain fp32 partial ([splits, m, n], summed by wg_reduce_kernel)
#pragma unroll
  for (int j = 0; j < NU; ++j)
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int row = m0 + 8 * c + 2 * t4 + e;
          if (row < p.m) {
            const size_t at = static_cast<size_t>(row) * p.n + 64 * (nb0 + warp) + g8 + 16 * (NU * wg + j) + 8 * h;
            __stcg(p.partial + static_cast<size_t>(split) * p.m * p.n + at, acc[j][4 * c + 2 * h + e]);
          }
        }
  SDQ_WS_T_END(tid);
}

// ------------------------------------------------------------------ stream-K over the warp-specialized pipeline
// The 128-token tile's (tile, 128-K stage) units in tile order (token tiles fastest), cut into p.splits equal ranges,
// one a CTA (grid = one CTA a SM): CTA g takes units [U g / G, U (g + 1) / G). Why: at M = 65-256 the tiles are few
// and even (8192x28672 M = 128: 112 tiles of 64 stages on 132 SMs, so 20 SMs idle whatever the split-K; M = 256: 224
// tiles = 1.7 waves), and the split-K or cluster forms keep every CTA's work a whole tile or an equal share of one.
// The producer's ring runs across the tiles of a CTA's range (a stage's copies name their own tile); the consumers
// compute a tile's segment, then write y where the segment is the whole tile; a tile cut between CTAs is finished by its
// owner, the CTA holding its first unit, at the end of its range, after its peers (whose ranges start inside the tile)
// have left their fp32 partials and counted in (w4a16_ranges.h describes the protocol; it is deterministic). Its outputs
// are not bit-identical to the split-K forms' (other partial sums), only as close to the reference.
// Scratch [G, 128 * 256] fp32 (one partial a CTA) and one lock a CTA (p.locks, left at zero).
// Where the tiles make two or more waves (M > 256), every CTA first runs whole tiles data-parallel, round i taking tile
// i G + g, and only the last one to two waves' worth is cut into ranges (sdq_sk_range_dp). Ranges over every tile
// leave each CTA walking its own run of ~tiles / G tiles, so at any moment the grid touches every feature tile's
// weights and every token tile's activations: ncu on 8192x28672 at M = 4096 read 7.3 GB from DRAM at an L2 hit rate of
// 37%, against the one launch's 2.0 GB and 72%, 13% slower (int4_wgmma run 58). With the rounds: 0.97-1.05 of the one
// launch at M = 4096 (run 59).
// A first form had every part of a cut tile leave a partial and the last CTA to arrive re-read them all (wgmma_body's
// protocol): twice the partial traffic, 4-50% slower than the automatic schedule on the H100 except 8192x10240 at
// M = 256 (int4_wgmma run 42).
// The launch's partition (w4a16_ranges.h, CPU-tested): (token tiles x feature tiles) tiles of p.k / 16 KS stages
// (the hybrid form, sdq_sk_range_dp: data-parallel rounds of whole tiles first where the tiles make two or more waves)
__device__ __forceinline__ SdqSkRange ws_sk_range(const SdqW4A16Params& p, int ks) {
  return sdq_sk_range_dp((p.m + 127) / 128 * (p.n / 256), p.k / (16 * ks), p.splits);
}
template <typename T, int KS>
__device__ __forceinline__ void ws_sk_consumer(const SdqW4A16Params& p, uint32_t sbase, uint32_t full0, uint32_t empty0);
template <typename T, int KS>
__global__ void __launch_bounds__(WsRegs<128>::THREADS, 1) w4a16_wgmma_tma_sk_kernel(
    const SdqW4A16Params p, const __grid_constant__ CUtensorMap tx) {
  constexpr int NTOK = 128;
  using L = WgSmem<NTOK, 1, KS>;
  constexpr int WGS = WsRegs<NTOK>::WGS;
  constexpr int STAGES = TmaSmem<NTOK, KS>::STAGES;
  extern __shared__ uint8_t wg_smem_raw[];
  const WsRing<NTOK, KS> ring(wg_smem_raw);
  const uint32_t sbase = ring.sbase, full0 = ring.full0, empty0 = ring.empty0;
  const int tid = threadIdx.x;
  if (tid == 0) ring.init();
  __syncthreads();
  const int role = __shfl_sync(0xffffffffu, tid >> 7, 0);
  if (role == WGS) {  // the producer: the range's stages in order, whatever tile each belongs to
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WsRegs<NTOK>::PROD));
    if (tid == 128 * WGS) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tx)) : "memory");
      // The entries in order: the data-parallel rounds' whole tiles (round i: tile i G + g), then the stream-K range
      // from unit usk of the launch (tiles in order, token tiles fastest: token rows m0, feature blocks nb0). The
      // producer has 24 registers and divides nowhere in its loop: the next entry's stage s, m0 and nb0 advance one
      // stage at a time. What a tile's end needs stays in 32 bytes of shared memory after the consumers' staging
      // buffer: {ndp, entries, dm, dnb} (the rounds' stages, the range's entries, the G-tile step as token rows and
      // feature blocks) and {s, m0, nb0} of the stream-K range's first unit. p.k / (16 KS), p.m are re-read.
      const uint32_t keep = full0 + 16 * STAGES + 32 * WS_OUT_ROWB;
      int s, m0, nb0;
      {
        const SdqSkRange rg = ws_sk_range(p, KS);
        const int g = blockIdx.x, u0 = rg.start(g), ndp = rg.dp * rg.nst, tt = (p.m + NTOK - 1) / NTOK;
        const int usk = rg.dp * rg.grid * rg.nst + u0, tsk = usk / rg.nst;
        asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(keep), "r"(ndp),
                     "r"(ndp + rg.start(g + 1) - u0), "r"((rg.grid % tt) * NTOK), "r"((rg.grid / tt) * WG_BLOCKS)
                     : "memory");
        asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %3};\n" ::"r"(keep + 16), "r"(usk % rg.nst),
                     "r"((tsk % tt) * NTOK), "r"((tsk / tt) * WG_BLOCKS) : "memory");
        s = ndp > 0 ? 0 : usk % rg.nst;
        m0 = ndp > 0 ? (g % tt) * NTOK : (tsk % tt) * NTOK;
        nb0 = ndp > 0 ? (g / tt) * WG_BLOCKS : (tsk / tt) * WG_BLOCKS;
      }
      const auto kept = [&](int i) {  // word i of the kept values
        int v;
        asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(keep + 4 * i) : "memory");
        return v;
      };
      const auto entries = [&] { return kept(1); };
      const auto issue = [&](int r, bool with_w, bool with_x) {  // ring entry r
        tma_issue_stage<NTOK, KS>(p, &tx, sbase + (r % STAGES) * L::STAGE, full0 + 8 * (r % STAGES), s * KS, nb0, m0,
                                  true, with_w, with_x);
        if (with_x && ++s == p.k / (16 * KS)) {  // entry r ends its tile: the next entry's tile
          s = 0;
          const int ndp = kept(0);
          if (r + 1 < ndp) {  // the next data-parallel round's tile: G tiles on
            m0 += kept(2);
            nb0 += kept(3);
            if (m0 >= p.m) {
              m0 -= (p.m + NTOK - 1) / NTOK * NTOK;
              nb0 += WG_BLOCKS;
            }
          } else if (r + 1 == ndp) {  // the stream-K range's first unit
            s = kept(4);
            m0 = kept(5);
            nb0 = kept(6);
          } else if ((m0 += NTOK) >= p.m) {  // the next tile in order
            m0 = 0;
            nb0 += WG_BLOCKS;
          }
        }
      };
      const int pre = entries() < STAGES ? entries() : STAGES;
      for (int r = 0; r < pre; ++r) {  // (the prologue stage by stage, as the split-K kernel's)
        issue(r, true, false);
        if (r == 0 && p.pdl) griddep_wait();
        issue(r, false, true);
      }
      if (pre == 0 && p.pdl) griddep_wait();
      for (int r = STAGES; r < entries(); ++r) {
        ring_wait(empty0 + 8 * (r % STAGES), ((r / STAGES) - 1) & 1);
        issue(r, true, true);
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WsRegs<NTOK>::CONS));
    ws_sk_consumer<T, KS>(p, sbase, full0, empty0);
  }
}
template <typename T, int KS>
__device__ __forceinline__ void ws_sk_consumer(const SdqW4A16Params& p, uint32_t sbase, uint32_t full0,
                                               uint32_t empty0) {
  constexpr int NTOK = 128;
  using L = WgSmem<NTOK, 1, KS>;
  constexpr int WGS = WsRegs<NTOK>::WGS, NU = 4 / WGS, ND = NTOK / 2, NC = NTOK / 8, NT = 128 * WGS;
  constexpr int STAGES = TmaSmem<NTOK, KS>::STAGES;
  const int tid = threadIdx.x;  // (consumer threads are 0 .. NT - 1)
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g8 = lane >> 2;
  const SdqSkRange rg = ws_sk_range(p, KS);
  const int g = blockIdx.x, u_end = rg.start(g + 1), tt = (p.m + NTOK - 1) / NTOK;
  float acc[NU][ND];
  uint32_t sp[NU][2], zl[NU][2], zh[NU][2];
  uint32_t af[2][NU][4];
  float4* part = reinterpret_cast<float4*>(p.partial);
  constexpr size_t SLOT = static_cast<size_t>(NTOK) * 256 / 4;  // float4s a partial slot
  // y through the kernel's own 32-row staging buffer (after the ring's barriers; the stages are being refilled), 32
  // tokens a pass: stmatrix .trans of the fragment blocks c = 4P .. 4P + 3 into rows 8c + i - 32P, then 16-byte rows to
  // y as the one-split epilogue does (direct 2-byte stores from the fragments cost that epilogue 8 us a tile)
  const uint32_t out = full0 + 16 * STAGES;
  const auto store_y = [&](int m0, int nb0) {
#pragma unroll
    for (int P = 0; P < NC / 4; ++P) {
      const uint32_t tile = out - static_cast<uint32_t>(32 * P * WS_OUT_ROWB);  // row r at out + (r - 32P) ROWB
      asm volatile("bar.sync 1, %0;\n" ::"n"(NT) : "memory");  // the buffer's previous rows are out
#pragma unroll
      for (int j = 0; j < NU; ++j)
#pragma unroll
        for (int c = 4 * P; c < 4 * P + 4; ++c)
          stage_out<T, NU>(tile, wg, warp, lane, j, c, acc[j][4 * c], acc[j][4 * c + 1], acc[j][4 * c + 2],
                           acc[j][4 * c + 3]);
      asm volatile("bar.sync 1, %0;\n" ::"n"(NT) : "memory");
      copy_out<T, NT>(p, tile, 32 * P, 32 * P + 32, m0, nb0, tid);
    }
  };
  int r = 0;  // ring entry of the next stage
  const auto stages = [&](int sa, int sb) {  // stages [sa, sb) of a tile into fresh accumulators
#pragma unroll
    for (int j = 0; j < NU; ++j)
#pragma unroll
      for (int i = 0; i < ND; ++i) acc[j][i] = 0.f;
    for (int s = sa; s < sb; ++s, ++r) {
      const int slot = r % STAGES;
      const uint32_t st = sbase + slot * L::STAGE;
      ws_wait(full0 + 8 * slot, (r / STAGES) & 1);
      wg_load_group<T, NU, L>(st, 0, wg, warp, g8, sp, zl, zh);
      wg_stage_mma<T, NTOK, KS, NU, L>(st, wg, warp, lane, acc, af, sp, zl, zh, [](int) {}, [&](int k0) {
        // at step 1 every wgmma of the previous ring entry has retired (the segment's first: since the previous
        // segment's end): free its slot
        if (k0 == 1) mbar_arrive_if(empty0 + 8 * ((r + STAGES - 1) % STAGES), r > 0 && lane == 0);
      });
    }
    wg_wait<0>();
#pragma unroll
    for (int j = 0; j < NU; ++j) wg_fence_acc(acc[j]);
  };
  for (int i = 0; i < rg.dp; ++i) {  // the data-parallel rounds: whole tile i G + g, then its y
    const int t = i * rg.grid + g;
    stages(0, rg.nst);
    store_y((t % tt) * NTOK, (t / tt) * WG_BLOCKS);
  }
  const int base = rg.dp * rg.grid;  // the stream-K range's tile t is the launch's tile base + t
  for (int u = rg.start(g); u < u_end;) {
    int t, sa, sb;
    rg.segment(g, u, t, sa, sb);
    const int t0 = t * rg.nst, m0 = ((base + t) % tt) * NTOK, nb0 = ((base + t) / tt) * WG_BLOCKS;
    stages(sa, sb);
    u = t0 + rg.nst;
    if (u >= u_end && p.pdl) griddep_launch_dependents();  // (the next kernel's wait still waits for this grid's end)
    if (sa == 0 && sb == rg.nst) {  // the whole tile
      store_y(m0, nb0);
      continue;
    }
    const int owner = rg.owner(t), peers = rg.peers(t);
    // A cut tile's lock is its owner's, p.locks[owner]: a CTA owns at most one cut tile (its range's last segment),
    // so the grid's CTAs (<= SDQ_LOCKS_MIN) need that many locks whatever the number of tiles.
    if (g != owner) {  // a peer (its range's first segment): the partial into slot g, float4 i of thread tid at
                       // i * NT + tid, then count in on the owner's lock. The barrier orders every consumer thread's
                       // stores before thread 0's release, as split_count_in does.
      acc_store_partial<NU, ND, NT>(part + static_cast<size_t>(g) * SLOT + tid, acc);
      asm volatile("bar.sync 1, %0;\n" ::"n"(NT) : "memory");
      if (tid == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(p.locks + owner) : "memory");
      continue;
    }
    // the owner (its range's last segment): wait until every peer has counted in (acquire), then add their partials
    // in CTA order and write y; the lock goes back to zero for the next launch
    if (tid == 0) {
      int n;
      do {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(n) : "l"(p.locks + g) : "memory");
      } while (n < peers);
      p.locks[g] = 0;
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(NT) : "memory");
    for (int q = owner + 1; q <= owner + peers; ++q)
      acc_add_partial<NU, ND, NT>(part + static_cast<size_t>(q) * SLOT + tid, acc);
    store_y(m0, nb0);
  }
}

// The activation tensor map of a launch: [m, k] row-major, boxes of 64 K x NTOK rows, 128-byte swizzle, rows past m
// read as zeros. cuTensorMapEncodeTiled through the runtime's driver entry point (no libcuda link).
inline int tma_x_map(const SdqW4A16Params& p, int ntok, CUtensorMap* map) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return -3;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.k), static_cast<cuuint64_t>(p.m)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.k) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(ntok)}, estr[2] = {1, 1};
  const CUresult r = encode(map, p.is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                            const_cast<void*>(p.a), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : -4;
}

// Host side shared by the wgmma kernels' launchers (D: kernel, THREADS, SMEM): the dynamic shared-memory opt-in and the
// resident CTAs per SM, each queried once per kernel and device (w4a16_host.h)
template <typename D>
struct WgHost {
  static int setup() {
    static int slot[SDQ_DEVICES] = {};
    return per_current_device(slot, [] {
      return set_smem_attrs(D::kernel, D::SMEM);
    });
  }
  static int per_sm() {  // (the schedule choice asks at every launch of the 128-token tile)
    static int slot[SDQ_DEVICES] = {};
    return per_current_device(slot, [] {
      if (setup()) return 0;
      int r = 0;
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r, D::kernel, D::THREADS, D::SMEM);
      return r;
    });
  }
  // a launch config, with programmatic dependent launch when p.pdl (attr outlives the launch)
  static cudaLaunchConfig_t config(dim3 grid, const SdqW4A16Params& p, cudaStream_t stream, cudaLaunchAttribute* attr) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(D::THREADS);
    cfg.dynamicSmemBytes = D::SMEM;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = p.pdl ? 1 : 0;
    return cfg;
  }
};
// Variant 63's second launch: the [splits, m, n] partials summed by wg_reduce_kernel (cfg: the main launch's, for its
// stream and dependent-launch attribute)
template <typename T>
int wg_launch_reduce(cudaLaunchConfig_t cfg, const SdqW4A16Params& p) {
  if (const cudaError_t e = cudaGetLastError()) return static_cast<int>(e);
  const long long n4 = static_cast<long long>(p.m) * p.n / 4;
  cfg.gridDim = dim3(static_cast<int>(std::min<long long>((n4 + 255) / 256, 4LL * sm_count_now())));
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = 0;
  cudaLaunchKernelEx(&cfg, wg_reduce_kernel<T>, p);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int NTOK, int KS, bool CL = false>
struct TmaKern : WgHost<TmaKern<T, NTOK, KS, CL>> {
  static constexpr int THREADS = WsRegs<NTOK>::THREADS;
  static constexpr int SMEM = TmaSmem<NTOK, KS>::TOTAL;
  static_assert(!CL || TmaSmem<NTOK, KS>::BAR_AT >= 4 * 128 * NTOK * 2, "a CTA's fp32 accumulators fit the stages");
  static constexpr auto kernel = w4a16_wgmma_tma_kernel<T, NTOK, KS, CL>;
  static int launch(const SdqW4A16Params& p, cudaStream_t stream) {
    if (const int rc = TmaKern::setup()) return rc;
    if (reinterpret_cast<uintptr_t>(p.c) % 16) return -1;  // copy_out's 16-byte stores (the op's outputs always are)
#if SDQ_WS_TRACE  // (a synchronous copy, only when the buffer changed: none inside a CUDA graph capture once set)
    if (void* want = sdq_w4a16_ws_trace(); want != ws_trace_sent) {
      cudaMemcpyToSymbol(sdq_ws_trace_ptr, &want, sizeof(want));
      ws_trace_sent = want;
    }
#endif
    CUtensorMap map;
    if (const int rc = tma_x_map(p, NTOK, &map)) return rc;
    cudaLaunchAttribute attr[2];
    cudaLaunchConfig_t cfg = TmaKern::config(dim3((p.m + NTOK - 1) / NTOK, p.n / 256, p.splits), p, stream, attr);
    if constexpr (CL) {  // the splits of a tile as one cluster
      attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
      attr[cfg.numAttrs].val.clusterDim.x = 1;
      attr[cfg.numAttrs].val.clusterDim.y = 1;
      attr[cfg.numAttrs].val.clusterDim.z = static_cast<unsigned>(p.splits);
      cfg.numAttrs += 1;
    }
    cudaLaunchKernelEx(&cfg, kernel, p, map);
    return !CL && p.splits > 1 ? wg_launch_reduce<T>(cfg, p) : static_cast<int>(cudaGetLastError());
  }
  // clusters of `size` CTAs that can be resident at once (0 where the launch could not run), once per size and device
  static int max_clusters(int size) {
    static int slot[9][SDQ_DEVICES] = {};
    if (size < 2 || size > 8 || TmaKern::setup()) return 0;
    return per_current_device(slot[size], [size] {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr[1];
      cfg.gridDim = dim3(1, 1, size);
      cfg.blockDim = dim3(THREADS);
      cfg.dynamicSmemBytes = SMEM;
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = 1;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = static_cast<unsigned>(size);
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int n = 0;
      if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
        cudaGetLastError();
        n = 0;
      }
      return n;
    });
  }
};

// Stream-K over the warp-specialized pipeline (w4a16_wgmma_tma_sk_kernel): a grid of p.splits CTAs
template <typename T, int KS>
struct TmaSkKern : WgHost<TmaSkKern<T, KS>> {
  static constexpr int THREADS = WsRegs<128>::THREADS;
  // + the 32-row staging buffer, and 32 bytes the producer keeps its range in
  static constexpr int SMEM = TmaSmem<128, KS>::TOTAL + 32 * WS_OUT_ROWB + 32;
  static_assert(SMEM <= 227 * 1024, "the ring, its barriers and the staging buffer fit one CTA's shared memory");
  static constexpr auto kernel = w4a16_wgmma_tma_sk_kernel<T, KS>;
  static int launch(const SdqW4A16Params& p, cudaStream_t stream) {
    if (const int rc = TmaSkKern::setup()) return rc;
    if (p.splits > SDQ_LOCKS_MIN) return -2;  // one lock a CTA of the grid (p.locks holds max(N / 64, SDQ_LOCKS_MIN))
    if (reinterpret_cast<uintptr_t>(p.c) % 16) return -1;  // copy_out's 16-byte stores
    CUtensorMap map;
    if (const int rc = tma_x_map(p, 128, &map)) return rc;
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = TmaSkKern::config(dim3(p.splits), p, stream, attr);
    cudaLaunchKernelEx(&cfg, kernel, p, map);
    return static_cast<int>(cudaGetLastError());
  }
};

// TWO: two warpgroups of 128 features at the 32- / 64-token tile or in the raw 16-token kernel (wg_two below); at 128
// tokens always two (128 accumulators a thread). At 64 tokens two warpgroups measured 4-16% slower than one of 256 on
// the large shapes (run 9, docs/benchmarks/int4-wgmma.md "INT4 wgmma kernel, runs 7-11"), so one is the default there.
template <typename T, int NTOK, int STAGES, int KS, bool ONE_GROUP, bool SEPARATE, bool SK, bool RAW = false,
          bool TWO = false>
struct WgKern : WgHost<WgKern<T, NTOK, STAGES, KS, ONE_GROUP, SEPARATE, SK, RAW, TWO>> {
  static_assert(!TWO || ((NTOK == 32 || NTOK == 64) && !RAW || NTOK == 16 && RAW) && !SK,
                "TWO: the 32- / 64-token split-K kernel or the raw 16-token one");
  static constexpr int WGS = NTOK > 64 || TWO ? 2 : 1;
  static constexpr int THREADS = 128 * WGS;
  static constexpr int SMEM = WgSmem<NTOK, STAGES, KS>::TOTAL;
  static constexpr auto kernel = [] {
    if constexpr (RAW) return w4a16_wgmma_raw_kernel<T, NTOK, STAGES, SEPARATE, WGS>;
    else return w4a16_wgmma_kernel<T, NTOK, STAGES, KS, ONE_GROUP, SEPARATE && !SK, WGS, SK>;
  }();
  static int launch(const SdqW4A16Params& p, cudaStream_t stream) {
    if (const int rc = WgKern::setup()) return rc;
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = WgKern::config(
        SK ? dim3(p.splits) : dim3((p.m + NTOK - 1) / NTOK, p.n / 256, p.splits), p, stream, attr);
    cudaLaunchKernelEx(&cfg, kernel, p);
    if (SEPARATE && !SK && p.splits > 1) return wg_launch_reduce<T>(cfg, p);
    return static_cast<int>(cudaGetLastError());
  }
};

constexpr int WG_STAGES = 4;  // 6 or 7-8 stages measured within 3% (bench/int4_wgmma.py run 14)


// Stream-K at the 128-token tile (M = 129-256: two token tiles) where split-K leaves more than a tenth of the resident
// slots idle over its waves (e.g. 8192x10240: 80 tiles on 132 slots; 8192x28672: 224 tiles = 1.7 waves), else
// split-K; int4_cuda.set_wgmma_schedule forces either. Run 15 (bench/int4_wgmma.py): stream-K at M = 256 8192x10240
// 122.6 -> 89.1 us, 8192x28672 245.4 -> 224.8; at M = 65-128, where the same rule would pick it on the N = 28672
// shapes, it won 2% on 8192x28672 and lost 5% on 4096x28672, and it lost 1-50% where split-K fills the slots.
template <typename T, int NTOK, bool SEP>
bool wg_stream_k(const SdqW4A16Params& p) {
  if constexpr (NTOK != 128) {
    return false;
  } else {
    const int mode = sdq_w4a16_wg_schedule();
    if (mode != 0) return mode == 2;
    if (p.m <= NTOK) return false;
    const int sms = sm_count_now();
    return !sdq_wg_split_fills(p.m, p.n, p.k, NTOK, sms * WgKern<T, NTOK, WG_STAGES, WG_KS, true, SEP, false>::per_sm(),
                               sms, 9, 10);
  }
}

// sdq_wg_cluster_fit_splits (w4a16.h) with this device's slots and cluster capacities; 0 where the cluster sum is off
template <typename T>
int wg_cluster_fit_splits(const SdqW4A16Params& p) {
  const int min_rows = sdq_w4a16_wg_cluster_rows();
  if (p.m < min_rows || p.m > 256 || p.group_k16 % 8 || p.k % 128 || !sdq_w4a16_wg_cluster()) return 0;  // (no query)
  const int sms = sm_count_now();
  int cap[9] = {};
  for (int sp = 2; sp <= 8; ++sp) cap[sp] = TmaKern<T, 128, WS_KS128, true>::max_clusters(sp);
  return sdq_wg_cluster_fit_splits(p.m, p.n, p.k, p.group_k16, sms * TmaKern<T, 128, WS_KS128>::per_sm(), sms, cap,
                                   min_rows);
}

// The warp-specialized split-K (TmaKern) for variant 63 at the 128-token tile where sdq_wg_ws_auto (w4a16.h) or
// wg_cluster_fit_splits says, or as int4_cuda.set_wgmma_schedule forces it; at 16-64 tokens only in the experimental
// -DSDQ_WS_SMALL=1 build.
template <typename T, int NTOK, bool SEP>
bool wg_ws(const SdqW4A16Params& p) {
  if constexpr (!SEP) {
    return false;
  } else if constexpr (NTOK != 128) {
    if (!SDQ_WS_SMALL || p.group_k16 % 4) return false;
    const int mode = sdq_w4a16_wg_schedule();
    return mode == 0 || mode == 3;
  } else {
    if (p.group_k16 % 8 || p.k % 128) return false;
    const int mode = sdq_w4a16_wg_schedule();
    if (mode != 0) return mode == 3;
    const int sms = sm_count_now();
    return sdq_wg_ws_auto(p.m, p.n, p.k, p.group_k16, sms * TmaKern<T, NTOK, WS_KS128>::per_sm(), sms) != 0 ||
           (SEP && wg_cluster_fit_splits<T>(p) >= 2) ||
           sdq_wg_one_launch_short_k(p.m, p.k, p.group_k16, sdq_w4a16_wg_one_launch_k());
  }
}

// Stream-K over the warp-specialized pipeline (TmaSkKern) for variant 63 at the 128-token tile, any M (a cut tile counts
// in on its owner CTA's lock: grids up to SDQ_LOCKS_MIN CTAs), groups a multiple of 128 and K of 128, and fewer than
// 2^31 / 1025 (tile, stage) units (its 32-bit range arithmetic, for grids up to 1024 CTAs): automatically at M = 129-256
// where sdq_wg_ws_sk_auto (w4a16.h) says, i.e. where variant 63 would otherwise take the single-role stream-K (not
// wg_ws, and wg_stream_k), or where int4_cuda.set_wgmma_schedule("wssk") forces it (mode 4; above 256 rows every row
// in one launch, wgmma_rows).
template <typename T, int NTOK, bool SEP>
bool wg_ws_sk(const SdqW4A16Params& p) {
  if constexpr (!SEP || NTOK != 128) {
    return false;
  } else {
    if (!sdq_wg_ws_sk_fits(p.m, p.n, p.k, p.group_k16)) return false;
    if (sm_count_now() * TmaSkKern<T, WS_KS128>::per_sm() > SDQ_LOCKS_MIN) return false;  // a lock a CTA of the grid
    const int mode = sdq_w4a16_wg_schedule();
    if (mode != 0) return mode == 4;
    if (p.m <= NTOK) return false;  // (before the queries)
    const int sms = sm_count_now();
    if (p.m > 256) {  // where the one launch runs without wave splits and its waves leave enough idle (w4a16.h)
      if (!sdq_w4a16_wg_sk_big() || !wg_ws<T, NTOK, SEP>(p)) return false;
      const int slots = sms * TmaKern<T, NTOK, WS_KS128>::per_sm();
      const int ws = sdq_w4a16_wg_wave_splits()  // (as the split query in w4a16_sm90.cu asks it)
                         ? sdq_wg_wave_splits(p.m, p.n, p.k, p.group_k16, slots,
                                              TmaKern<T, 128, WS_KS128, true>::max_clusters(2), sdq_w4a16_wg_wave_cost())
                         : 1;
      return sdq_wg_ws_sk_big(p.m, p.n, p.k, p.group_k16, sms * TmaSkKern<T, WS_KS128>::per_sm(), ws) != 0;
    }
    int cap[9] = {};
    if (sdq_w4a16_wg_cluster())
      for (int sp = 2; sp <= 8; ++sp) cap[sp] = TmaKern<T, 128, WS_KS128, true>::max_clusters(sp);
    return sdq_wg_ws_sk_auto(p.m, p.n, p.k, p.group_k16, sms * TmaKern<T, NTOK, WS_KS128>::per_sm(),
                             sms * WgKern<T, NTOK, WG_STAGES, WG_KS, true, SEP, false>::per_sm(), sms, cap,
                             sdq_w4a16_wg_cluster_rows()) != 0;
  }
}

// Whether the warp-specialized split-K sums its splits inside a cluster (CL above): sdq_w4a16_set_wg_cluster allows it, 2-8
// splits, and every tile's cluster resident at once (one wave, as split-K grids are; else the cluster form could take two).
template <typename K>
bool wg_cluster_ok(const SdqW4A16Params& p, int ntok) {
  if (!sdq_w4a16_wg_cluster() || p.splits < 2 || p.splits > 8) return false;
  const long long tiles = static_cast<long long>((p.m + ntok - 1) / ntok) * (p.n / 256);
  const int fit = K::max_clusters(p.splits);
  if (tiles <= fit) return true;
  // several waves of pairs (sdq_wg_wave_splits): clusters of 2 that pack the device run wave after wave
  return sdq_w4a16_wg_wave_splits() && p.m > 256 && p.splits == 2 && 20 * fit >= 9 * sm_count_now();
}

// op: 0 launch, 1 resident CTAs per SM, 2 blocks a CTA, 3 scratch floats, 4 kind, 5 warps (as run_op in
// w4a16_kernel.cuh), 6 whether this launch runs stream-K (p.splits is then the grid); the token tile from p.m.
// v = 62: the last CTA of a tile sums the splits; 63: a second kernel does.
// op 1 (resident CTAs per SM) or a launch of kernel K
template <typename K>
int wg_run_kern(int op, const SdqW4A16Params& p, cudaStream_t stream) {
  return op == 1 ? K::per_sm() : K::launch(p, stream);
}

// The raw 16-token kernel's stages (SDQ_WG_RAW_OCC=3: 3), and whether it takes p (groups a multiple of 128, K of 128)
constexpr int WG_RAW_STAGES = SDQ_WG_RAW_OCC >= 3 ? 3 : 4;
inline bool wg_raw_fits(const SdqW4A16Params& p) { return SDQ_WG_RAW && p.group_k16 % 8 == 0 && p.k % 128 == 0; }

// Whether the 32- / 64-token split-K kernel or the raw 16-token kernel runs two warpgroups of 128 features
// (sdq_w4a16_set_wg_two: 1 as sdq_wg_two_wg says over the one-warpgroup kernel's resident CTAs, 0 never, 2 always);
// never where stream-K runs, nor at 16 tokens where the raw kernel does not (the plain 16-token kernel keeps one).
template <typename T, int NTOK, bool SEP>
bool wg_two(const SdqW4A16Params& p) {
  if (NTOK == 16 && !wg_raw_fits(p)) return false;
  const int mode = sdq_w4a16_wg_two();
  if (mode != 1) return mode == 2;
  const int sms = sm_count_now();
  const int one = NTOK == 16 ? WgKern<T, 16, WG_RAW_STAGES, 8, true, SEP, false, true>::per_sm()
                             : WgKern<T, NTOK, WG_STAGES, WG_KS, true, SEP, false>::per_sm();
  return sdq_wg_two_wg(p.m, p.n, p.k, NTOK, sms * one, sms) != 0;
}

template <typename T, int NTOK, bool SEP, bool SK>
int wgmma_run_k(int op, const SdqW4A16Params& p, cudaStream_t stream) {
  if (op == 3) {  // fp32 scratch floats
    if (SK) return p.splits * 2 * NTOK * 256;  // [G, 2 slots, NTOK * 256]
    if (p.splits <= 1) return 0;
    if (SEP) return p.splits * p.m * p.n;  // [splits, m, n]
    return p.splits * ((p.m + NTOK - 1) / NTOK) * NTOK * p.n;  // [splits, N / 256, token tiles, NTOK * 256]
  }
  // Stages of 128 K (8 K steps) for variant 63's split-K at the 128-token tile, where a stage touches at most two
  // groups (group >= 64) and K divides: half the CTA-wide barriers, the largest stall there (ncu run 20). Run 21
  // (same process against 64-K stages): 0-5% faster on 5 of 7 shapes at M = 96-256 (28672x8192 M = 96 112.5 ->
  // 106.5 us, 8192x28672 M = 128 124.8 -> 119.9), 1-3% slower on 4096x6144; with stream-K 1-5% slower (152 bytes of
  // spills) and for variant 62 8 bytes of spills, so neither uses them.
  if constexpr (NTOK == 128 && SEP && !SK)
    if (p.group_k16 % 4 == 0 && p.k % 128 == 0)
      return p.group_k16 % 8 == 0 ? wg_run_kern<WgKern<T, NTOK, WG_STAGES, 8, true, SEP, SK>>(op, p, stream)
                                  : wg_run_kern<WgKern<T, NTOK, WG_STAGES, 8, false, SEP, SK>>(op, p, stream);
  // The raw codes at the 16-token tile (RAW: 128-K stages, each one group), where groups are a multiple of 128 and K of
  // 128. bench/ab_build.py run 11 (same process, M = 16): 7-8% faster on the N = 28672 shapes and 28672x8192
  // (8192x28672 v62 52.9 -> 49.2 us), 5-6% on 8192x10240, 0-3% on the N = 4096 / 6144 ones; at 32 tokens (255
  // registers) 2-5% slower, so not there; again after the per-stage load bases, 4 bytes of spills and 1-9% slower at
  // M = 24-32 on 27 of 28 points (ab_build run 25, H100).
  // In two warpgroups of 128 features where wg_two says.
  if constexpr (SDQ_WG_RAW && NTOK == 16 && !SK)
    if (wg_raw_fits(p)) {
      using One = WgKern<T, NTOK, WG_RAW_STAGES, 8, true, SEP, SK, true>;
      using Two = WgKern<T, NTOK, WG_RAW_STAGES, 8, true, SEP, SK, true, true>;
      return wg_two<T, NTOK, SEP>(p) ? wg_run_kern<Two>(op, p, stream) : wg_run_kern<One>(op, p, stream);
    }
  // Two warpgroups of 128 features at the 32- / 64-token tile where wg_two says (ab_build run 27)
  if constexpr ((NTOK == 32 || NTOK == 64) && !SK)
    if (wg_two<T, NTOK, SEP>(p))
      return p.group_k16 % WG_KS == 0
                 ? wg_run_kern<WgKern<T, NTOK, WG_STAGES, WG_KS, true, SEP, SK, false, true>>(op, p, stream)
                 : wg_run_kern<WgKern<T, NTOK, WG_STAGES, WG_KS, false, SEP, SK, false, true>>(op, p, stream);
  // ONE_GROUP: every 64-K stage inside one group
  return p.group_k16 % WG_KS == 0 ? wg_run_kern<WgKern<T, NTOK, WG_STAGES, WG_KS, true, SEP, SK>>(op, p, stream)
                                  : wg_run_kern<WgKern<T, NTOK, WG_STAGES, WG_KS, false, SEP, SK>>(op, p, stream);
}
template <typename T, int NTOK, bool SEP>
int wgmma_run_n(int op, const SdqW4A16Params& p, cudaStream_t stream) {
  constexpr bool WS = SEP && (NTOK == 128 || SDQ_WS_SMALL);  // (only these instantiate TmaKern)
  constexpr int WKS = NTOK == 128 ? WS_KS128 : 4;
  if constexpr (SEP && NTOK == 128)
    if (wg_ws_sk<T, NTOK, SEP>(p)) {  // (p.splits is its grid, as for stream-K)
      if (op == 0) return TmaSkKern<T, WKS>::launch(p, stream);
      if (op == 1) return TmaSkKern<T, WKS>::per_sm();
      if (op == 3) return p.splits * NTOK * 256;  // [G, NTOK * 256] fp32: one partial a CTA
      if (op == 6) return 1;
      if (op == 9) return 4;
      return 0;
    }
  const bool ws = WS && wg_ws<T, NTOK, SEP>(p);
  if constexpr (WS)
    if (op == 1 && ws) return TmaKern<T, NTOK, WKS>::per_sm();
  if (op == 1) return wgmma_run_k<T, NTOK, SEP, false>(op, p, stream);
  const bool sk = !ws && wg_stream_k<T, NTOK, SEP>(p);
  if (op == 6) return sk ? 1 : 0;
  if (op == 9) {  // the path a launch of p (its splits set) takes: 0 split-K, 1 stream-K, 2 warp-specialized, 3 its cluster
                 // sum (4: stream-K over the warp-specialized pipeline, above)
    if (!ws) return sk ? 1 : 0;
    if constexpr (WS && NTOK == 128)
      if (wg_cluster_ok<TmaKern<T, NTOK, WKS, true>>(p, NTOK)) return 3;
    return 2;
  }
  if constexpr (WS)
    if (ws) {  // (scratch: split-K's plain [splits, m, n] partials, as the single-role kernel's, cluster or not)
      if (op == 3) return wgmma_run_k<T, NTOK, SEP, false>(op, p, stream);
      if constexpr (NTOK == 128)
        if (wg_cluster_ok<TmaKern<T, NTOK, WKS, true>>(p, NTOK)) return TmaKern<T, NTOK, WKS, true>::launch(p, stream);
      return TmaKern<T, NTOK, WKS>::launch(p, stream);
    }
  if constexpr (NTOK == 128)
    if (sk) return wgmma_run_k<T, NTOK, SEP, true>(op, p, stream);
  return wgmma_run_k<T, NTOK, SEP, false>(op, p, stream);
}
template <typename T, bool SEP>
int wgmma_run_t(int op, const SdqW4A16Params& p, cudaStream_t stream) {
  switch (sdq_wg_ntok(p.m)) {
    case 16: return wgmma_run_n<T, 16, SEP>(op, p, stream);
    case 32: return wgmma_run_n<T, 32, SEP>(op, p, stream);
    case 128: return wgmma_run_n<T, 128, SEP>(op, p, stream);
    default: return wgmma_run_n<T, 64, SEP>(op, p, stream);
  }
}

// Rows a launch takes (op 8): every row of p.m > 256 where variant 63's warp-specialized kernel runs that M (wg_ws, with
// its split-K rule for the whole M, or its stream-K, wg_ws_sk: sdq_wg_ws_sk_big or forced), so the launch has one ramp
// and one tail instead of M / 256 launches of two token tiles each (1.7 waves each on 8192x28672, split or streamed);
// else 256. sdq_w4a16_set_wg_rows(256) restores the 256-row launches.
template <typename T>
int wgmma_rows(int v, const SdqW4A16Params& p) {
  return p.m > 256 && v == 63 && sdq_w4a16_wg_rows() != 256 && (wg_ws<T, 128, true>(p) || wg_ws_sk<T, 128, true>(p))
             ? p.m
             : 256;
}

template <typename T>
int wgmma_run(int v, int op, const SdqW4A16Params& p, cudaStream_t stream) {
  if (op == 2) return WG_BLOCKS;
  if (op == 4) return 4;  // kind: the wgmma kernel (tiles of 256 features x NTOK tokens, split-K)
  if (op == 5) {  // warps: two warpgroups at 128 tokens, and at 16 (the raw kernel) / 32 / 64 where wg_two says
    switch (sdq_wg_ntok(p.m)) {
      case 16: return (v == 63 ? wg_two<T, 16, true>(p) : wg_two<T, 16, false>(p)) ? 8 : 4;
      case 32: return (v == 63 ? wg_two<T, 32, true>(p) : wg_two<T, 32, false>(p)) ? 8 : 4;
      case 64: return (v == 63 ? wg_two<T, 64, true>(p) : wg_two<T, 64, false>(p)) ? 8 : 4;
      default: return 8;
    }
  }
  if (op == 8) return wgmma_rows<T>(v, p);
  if (op == 10) return TmaKern<T, 128, WS_KS128, true>::max_clusters(p.splits);  // clusters of p.splits CTAs resident at once
  if (op == 11) return v == 63 ? wg_cluster_fit_splits<T>(p) : 0;  // the cluster-fitting split count (M = 65-256)
  if (op == 0 && (p.n % 256 || p.k % 64 || p.group_k16 % 2 || (p.m > 256 && wgmma_rows<T>(v, p) < p.m))) return -1;
  return v == 63 ? wgmma_run_t<T, true>(op, p, stream) : wgmma_run_t<T, false>(op, p, stream);
}

}  // namespace
}  // namespace sdq_w4a16

// w4a16_part_wgmma_*.cu: one C entry per dtype (variants 62-63)
#define SDQ_W4A16_WGMMA_PART(T, NAME)                                                          \
  extern "C" int sdq_w4a16_part_##NAME(int v, int op, const SdqW4A16Params* p, cudaStream_t s) { \
    return sdq_w4a16::wgmma_run<T>(v, op, *p, s);                                             \
  }
