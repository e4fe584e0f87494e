// sdquant W4A16 stream-K decode kernel (variants 13+) and the read-bandwidth probes. Included by w4a16_kernel.cuh
// inside its namespace, after w4a16_direct.cuh (uses Ops, ldg_stream16, the direct kernel's register ring).
//
// Why (run-4 notes): the split-K grids round tiles x splits onto 132 SMs x resident slots (e.g. 224 CTAs for 264
// slots on 8192x28672 with 2 blocks a CTA: 15% of the slots idle for the whole call), and the split-K second pass
// touches splits x M x N fp32 partials. Here the grid is exactly the resident slots (p.splits = G CTAs, chosen by
// sdq_w4a16_auto_splits from the occupancy calculator) and CTA c walks the units [c*U/G, (c+1)*U/G) of a flattened
// (tile, 2-K-step stage) space, U = tiles * K/32, tile-major: every CTA streams the same number of bytes (+-1
// stage), and only the <= 2 tiles a CTA shares with its neighbours need a fix-up (partials of the tile's
// segments, summed in a fixed order by the last segment to arrive: deterministic, one launch, no spin-wait).
//
// Each of the CTA's WNN warps owns one 64-feature block of the current tile and streams its fragments global ->
// registers exactly like the direct kernel (DEPTH stages of two K steps in flight, activations through L1, scales
// one group ahead); no shared memory, no barrier except at a split tile's fix-up.
// WSCALE = 1: the group scale multiplies each dequantized weight pair ((code - zero) * s rounded to the activation
// dtype, one extra mul per pair) instead of the fp32 group sums: no second accumulator set (32 fewer registers at
// two token tiles), so M = 9-16 keeps 2-3 CTAs per SM.
// PROBE = 1: the same loads in the same order, but only an xor of the loaded words (no dequantize, no MMA, no
// output): the read-bandwidth ceiling of this access pattern (bench/int4_tune.py reports it; not a GEMM).
// Measured (H200 run 5, docs/benchmarks/int4-cuda.md): only v17 on 8192x28672 M = 1 beat the earlier kernels (-2%); the
// load-only probes of these patterns top out at ~3.2 TB/s (36.4 us on 8192x28672) against 4.3 TB/s for a linear
// sweep of the same bytes (27.4 us), whatever the bytes in flight: the per-warp-stream read order is the first
// limiter, the arithmetic (0.55-0.62 issued instructions per scheduler-cycle) the second.
template <int WNN_, int DEPTH_, int MINB_, int MINB2_, int WSCALE_, int TSPLIT_, int PROBE_ = 0, int HMINB_ = MINB_,
          int HMINB2_ = MINB2_, int RING_ = 0, int PF_ = 0, int KWI_ = 1, int RAW_ = 0>
struct SKCfg {  // MINB / MINB2: min CTAs per SM for ptxas at one / two token tiles (HMINB*: the same for fp16, which
                // holds 8 more registers of zero pairs and can spill where bf16 fits)
  static constexpr int WNN = WNN_, KW = 1, DEPTH = DEPTH_, MINB = MINB_, MINB2 = MINB2_, WSCALE = WSCALE_;
  static constexpr int TSPLIT = TSPLIT_, PROBE = PROBE_, HMINB = HMINB_, HMINB2 = HMINB2_;
  // RING > 0: the fragments go through a per-warp shared-memory ring of RING stages (cp.async, each lane copies and
  // later reads back only its own 16 bytes, so no barrier: cp.async.wait_group makes a thread's copies visible to
  // it); bytes in flight then cost shared memory instead of registers (DEPTH is unused). No TSPLIT.
  static constexpr int RING = RING_;
  // PF > 0: lane 0 of each warp also asks the copy engine to pull its fragments PF stages (PF KB) ahead into L2
  // (cp.async.bulk.prefetch.L2, one instruction per 4 stages): DRAM reads in flight that hold no registers and no
  // shared memory; the ring's own loads then hit L2.
  static constexpr int PF = PF_;
  // KWI > 1: a CTA is KWI warps on ONE 64-feature block (WNN must be 1) that take the 4-stage (4 KB) chunks of the
  // CTA's K range round robin, so a CTA reads KWI * 4 KB of one contiguous stream at a time (the others read one
  // stream per warp); summed through shared memory at the end of each segment.
  static constexpr int KWI = KWI_;
  // RAW = 1 (no WSCALE): raw magic-number codes into the MMA, activation sums by a fifth MMA per K step, zero and scale
  // folded in per group in fp32 (see w4a16_lean.cuh's LCfg)
  static constexpr int RAW = RAW_;
  static_assert(RAW == 0 || (WSCALE_ == 0 && KWI == 1 && RING == 0), "RAW: fp32 group sums, register ring");
  static_assert(KWI == 1 || (WNN == 1 && RING == 0 && TSPLIT == 0 && PF == 0), "KWI: one block a CTA, register ring");
  static_assert(RING == 0 || TSPLIT == 0, "a shared-memory ring is per warp: no token-split warps");
  static constexpr int WARPS = WNN;  // at one token tile; TSPLIT doubles it at two (sk_threads)
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int STAGES = 1, PRE = 1;
  static constexpr bool DIRECT = false;
  static constexpr int KIND = 2;
};

// TSPLIT = 1: at M = 9-16 each 64-feature block gets two warps, one per token tile, that read the same fragments
// (L1-allocating loads, so the second read is mostly an L1 hit) and dequantize them each: registers stay at the
// one-token-tile level, so twice the warps stay resident.
template <typename C, int NT>
constexpr int sk_tt() { return (C::TSPLIT && NT == 2) ? 2 : 1; }  // warps per block
template <typename C, int NT>
constexpr int sk_threads() { return 32 * C::WNN * sk_tt<C, NT>() * C::KWI; }
template <typename C, int NT>
constexpr int sk_smem() {  // RING stages of 2 K steps a warp, or the KWI warps' reduction buffer
  return C::RING * 2 * 512 * C::WNN * sk_tt<C, NT>() + (C::KWI - 1) * NT * 16 * 32 * 4;
}

__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ uint4 ldg_l1_16(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Flattened work space of the stream-K kernels (host and device agree on it).
struct SKSpace {
  int tiles, S;  // S: 2-K-step stages per tile
  long long U;
};
__host__ __device__ __forceinline__ SKSpace sk_space(int n, int k, int wnn) {
  SKSpace s;
  s.tiles = (n / 64 + wnn - 1) / wnn;
  s.S = k / 32;
  s.U = static_cast<long long>(s.tiles) * s.S;
  return s;
}
// G CTAs: clamp the requested count so that every CTA gets at least one unit (then no CTA's range is empty and
// every segment of a tile is counted).
__host__ __device__ __forceinline__ int sk_grid(int requested, long long U) {
  long long g = requested < 1 ? 1 : requested;
  if (g > U) g = U;
  return static_cast<int>(g);
}
__device__ __forceinline__ long long sk_begin(long long U, int G, int c) { return U * c / G; }
// The fix-up sum of a tile split between segments c0..c1 (stream-K and flat grids): their fp32 partials at (row, column
// lc) of a tile tw wide, added in segment order (the result does not depend on arrival order). Segment cc's partial is
// p.partial[((cc * 2 + h) * m + row) * tw + lc], h = 1 only for c0 when the tile is the second one c0 touches.
// 8 loads in flight before their adds: a small shape can have tens of segments a tile.
__device__ __forceinline__ float2 sum_segment_partials(const float* partial, int c0, int c1, bool c0_second, int m,
                                                       int row, int tw, int lc) {
  float2 sum = make_float2(0.f, 0.f);
  for (int cc0 = c0; cc0 <= c1; cc0 += 8) {
    float2 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int cc = cc0 + j;
      const int wh = (cc == c0 && c0_second) ? 1 : 0;
      v[j] = cc <= c1 ? __ldcg(reinterpret_cast<const float2*>(partial + ((static_cast<size_t>(cc) * 2 + wh) * m + row) * tw + lc))
                      : make_float2(0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (cc0 + j <= c1) {
        sum.x += v[j].x;
        sum.y += v[j].y;
      }
  }
  return sum;
}
// the CTA whose range holds unit u: the largest c with c*U/G <= u
__device__ __forceinline__ int sk_owner(long long U, int G, long long u) {
  return static_cast<int>(((u + 1) * G + U - 1) / U - 1);
}

// RAW codes (lean variants 38+, stream-K 45+): o0 = (p0, p4) row g, o1 = (p1, p5) row g, o2 = (p2, p6) row g + 8,
// o3 = (p3, p7) row g + 8 (as Ops::codes), each the exact magic + code (128 + c in bf16, 1024 + c in fp16) with no
// zero subtracted; 3 shifts + 4 lop3 per 32-bit word
template <typename T>
__device__ __forceinline__ void raw_codes(uint32_t q, uint32_t (&o)[4]) {
  constexpr uint32_t MAGIC = std::is_same<T, half>::value ? 0x64006400u : 0x43004300u;
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = lop3<AND_OR>(q >> (4 * i), 0x000f000fu, MAGIC);
}

// One warp: acc = sum over stages [kb, kb + iters) of its block nb (iters = 0 for an inactive warp).
template <typename T, typename C, int NT, bool L1>
__device__ __forceinline__ void sk_segment(const SdqW4A16Params& p, float (&acc)[NT][4][4], uint32_t& probe, int nb,
                                           int kb, int iters, int tok0, uint4* ring, int kw = 0, int ke = 0) {
  // KWI: this warp's i-th stage is stage sabs(i) of the block (chunks kw, kw + KWI, ... of 4 stages from kb)
  constexpr int KWI = C::KWI;
  auto sabs = [&](int i) -> int {
    if constexpr (KWI == 1) return kb + i;
    else return kb + 4 * (kw + KWI * (i >> 2)) + (i & 3);
  };
  constexpr int D = C::RING > 0 ? C::RING : C::DEPTH, KS = 2;
  using O = Ops<T>;
  const int lane = threadIdx.x % 32, g8 = lane / 4, t4 = lane % 4;
  const int nblk = p.n / 64, kb_total = p.k / 16, m = p.m;
  const int gs_st = p.group_k16 / KS;
  const uint4* wsrc =
      reinterpret_cast<const uint4*>(p.b) + (static_cast<size_t>(nb) * kb_total + static_cast<size_t>(kb) * KS) * 32 + lane;
  const T* xsrc = reinterpret_cast<const T*>(p.a) + static_cast<size_t>(kb) * KS * 16 + 2 * t4;

  constexpr int DR = C::RING > 0 ? 1 : D;  // register ring depth
  uint4 wq[DR][KS];
  uint32_t xq[DR][KS][NT][2];
  auto load_x = [&](int s, uint32_t (&xx)[KS][NT][2]) {  // RING mode: activations one stage ahead in registers
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int r = tok0 + nt * 8 + g8;
        const T* xr = xsrc + static_cast<size_t>(r) * p.k + (sabs(s) - kb) * KS * 16 + kk * 16;
        xx[kk][nt][0] = r < m ? __ldg(reinterpret_cast<const unsigned int*>(xr)) : 0u;
        xx[kk][nt][1] = r < m ? __ldg(reinterpret_cast<const unsigned int*>(xr + 8)) : 0u;
      }
  };
  auto issue_ring = [&](int s, int slot) {  // RING mode: stage s -> slot, one commit group per stage (maybe empty)
    if (s < iters) {
      const uint4* src = wsrc + static_cast<size_t>(s) * KS * 32;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) cp_async16<false>(ring + (slot * KS + kk) * 32, src + kk * 32, 0);
    }
    cp_async_commit();
  };
  auto issue = [&](int s, uint4 (&w)[KS], uint32_t (&xx)[KS][NT][2]) {
    const int so = sabs(s) - kb;
    const uint4* src = wsrc + static_cast<size_t>(so) * KS * 32;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) w[kk] = L1 ? ldg_l1_16(src + kk * 32) : ldg_stream16(src + kk * 32);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int r = tok0 + nt * 8 + g8;
        const T* xr = xsrc + static_cast<size_t>(r) * p.k + so * KS * 16 + kk * 16;
        xx[kk][nt][0] = r < m ? __ldg(reinterpret_cast<const unsigned int*>(xr)) : 0u;
        xx[kk][nt][1] = r < m ? __ldg(reinterpret_cast<const unsigned int*>(xr + 8)) : 0u;
      }
  };

  constexpr int NG = C::WSCALE ? 1 : NT;  // group-sum accumulators (unused with WSCALE)
  float accg[NG][4][4];
  frag_each<NT>([&](int i, int j, int e) { acc[i][j][e] = 0.f; });
#pragma unroll
  for (int i = 0; i < NG; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) accg[i][j][e] = 0.f;
  constexpr bool RAW = C::RAW != 0;
  constexpr float MAGIC = std::is_same<T, half>::value ? 1024.f : 128.f;
  float xs[NT][4];          // RAW: the group's activation sums (per token column 2t + (e & 1))
  float nz[4][2] = {};      // RAW: -s * (magic + z)
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) xs[i][e] = 0.f;
  float sf[4][2] = {};      // fp32 scales (group-sum mode)
  uint32_t s2[4][2] = {};   // scale pairs in T (WSCALE mode)
  uint32_t zl[4][2] = {}, zh[4][2] = {};
  auto flush = [&]() {
    if constexpr (!C::WSCALE) group_flush<NT, RAW>(acc, accg, sf, nz, xs);
  };
  uint4 s_next = make_uint4(0, 0, 0, 0), z_next = s_next;
  auto load_sz = [&](int g) {
    const size_t o = (static_cast<size_t>(g) * nblk + nb) * 8 + g8;
    s_next = __ldg(reinterpret_cast<const uint4*>(p.s) + o);
    z_next = __ldg(reinterpret_cast<const uint4*>(p.zs) + o);
  };

  int rem = kb % gs_st, grp = (KWI == 1 ? kb : kb + 4 * kw) / gs_st;
  int g_end = 0;  // KWI: the stage where the current group ends
  bool first = true;
  if constexpr (C::RING > 0) {
#pragma unroll
    for (int j = 0; j < D - 1; ++j) issue_ring(j, j);
    if (iters > 0) load_x(0, xq[0]);
  } else {
#pragma unroll
    for (int j = 0; j < D; ++j)
      if (j < iters) issue(j, wq[j], xq[j]);
  }
  if (!RAW && iters > 0) load_sz(grp);  // RAW: fetched when its group starts (8 fewer registers held)
  // L2 prefetch window: stages [0, PF) now, then every 4th stage it the stages [it + PF, it + PF + 4)
  auto prefetch = [&](int s0, int s1) {  // stages [s0, min(s1, iters)), lane 0
    if (s1 > iters) s1 = iters;
    if (lane == 0 && s0 < s1)
      prefetch_l2_bulk(wsrc - lane + static_cast<size_t>(s0) * KS * 32, static_cast<uint32_t>(s1 - s0) * KS * 512);
  };
  if constexpr (C::PF > 0) prefetch(0, C::PF);

  for (int base = 0; base < iters; base += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int it = base + j;
      if (it < iters) {
        bool newg;
        if constexpr (KWI == 1) newg = rem == 0 || first;
        else newg = first || sabs(it) >= g_end;
        if (newg) {
          if (!first) flush();
          if constexpr (RAW) load_sz(grp);
          const uint32_t sp[4] = {s_next.x, s_next.y, s_next.z, s_next.w};
          const uint32_t zp[4] = {z_next.x, z_next.y, z_next.z, z_next.w};
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const float2 f = __half22float2(*reinterpret_cast<const half2*>(&sp[w]));
            if constexpr (C::WSCALE) {
              const typename O::T2 a = O::pack(f.x, f.x), b = O::pack(f.y, f.y);
              s2[w][0] = *reinterpret_cast<const uint32_t*>(&a);
              s2[w][1] = *reinterpret_cast<const uint32_t*>(&b);
            } else {
              sf[w][0] = f.x;
              sf[w][1] = f.y;
            }
            if constexpr (RAW) {  // zeros in T: (z_g, z_g+8)
              const typename O::T2 zz = *reinterpret_cast<const typename O::T2*>(&zp[w]);
              nz[w][0] = -f.x * (MAGIC + __low2float(zz));
              nz[w][1] = -f.y * (MAGIC + __high2float(zz));
            } else {
              O::zero_pairs(zp[w], 0, zl[w][0], zh[w][0]);
              O::zero_pairs(zp[w], 1, zl[w][1], zh[w][1]);
            }
          }
          if constexpr (KWI == 1) {
            if (!RAW && (grp + 1) * gs_st < kb + iters) load_sz(grp + 1);
          } else {  // the group of this warp's next stage after this group: in this chunk, or the next chunk's start
            const int sa = sabs(it), g = sa / gs_st;
            g_end = (g + 1) * gs_st;
            const int chunk_end = kb + 4 * (kw + KWI * (it >> 2)) + 4;
            const int nxt = g_end < chunk_end ? g_end : chunk_end - 4 + 4 * KWI;
            if (nxt < ke) load_sz(nxt / gs_st);
          }
        }
        if constexpr (C::PF > 0) {
          if ((it & 3) == 0) prefetch(it + C::PF, it + C::PF + 4);
        }
        uint4 wc[KS];
        uint32_t xc[KS][NT][2];
        if constexpr (C::RING > 0) {
          issue_ring(it + D - 1, (j + D - 1) % D);
          cp_async_wait<D - 1>();  // this thread's copies of stage it have landed
#pragma unroll
          for (int kk = 0; kk < KS; ++kk) {
            wc[kk] = ring[(j * KS + kk) * 32];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              xc[kk][nt][0] = xq[0][kk][nt][0];
              xc[kk][nt][1] = xq[0][kk][nt][1];
            }
          }
          if (it + 1 < iters) load_x(it + 1, xq[0]);
        } else {
#pragma unroll
          for (int kk = 0; kk < KS; ++kk) {
            wc[kk] = wq[DR > 1 ? j : 0][kk];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              xc[kk][nt][0] = xq[DR > 1 ? j : 0][kk][nt][0];
              xc[kk][nt][1] = xq[DR > 1 ? j : 0][kk][nt][1];
            }
          }
          if (it + D < iters) issue(it + D, wq[DR > 1 ? j : 0], xq[DR > 1 ? j : 0]);
        }
        if constexpr (C::PROBE) {
#pragma unroll
          for (int kk = 0; kk < KS; ++kk) {
            probe ^= wc[kk].x ^ wc[kk].y ^ wc[kk].z ^ wc[kk].w;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) probe ^= xc[kk][nt][0] ^ xc[kk][nt][1];
          }
        } else {
#pragma unroll
          for (int kk = 0; kk < KS; ++kk) {
            const uint32_t q[4] = {wc[kk].x, wc[kk].y, wc[kk].z, wc[kk].w};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
              uint32_t c[4];
              if constexpr (RAW) raw_codes<T>(q[w], c);
              else O::codes(q[w], zl[w], zh[w], c);
              if constexpr (C::WSCALE) {
#pragma unroll
                for (int i = 0; i < 4; ++i) c[i] = O::mul2(c[i], s2[w][i >> 1]);
              }
              const uint32_t af[4] = {c[0], c[2], c[1], c[3]};
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                if constexpr (C::WSCALE) O::mma(acc[nt][w], af, xc[kk][nt][0], xc[kk][nt][1]);
                else O::mma(accg[nt][w], af, xc[kk][nt][0], xc[kk][nt][1]);
              }
            }
            if constexpr (RAW) {  // activation sums: all-ones A against this K step's B fragments
              constexpr uint32_t ONE2 = std::is_same<T, half>::value ? 0x3c003c00u : 0x3f803f80u;
              const uint32_t ones[4] = {ONE2, ONE2, ONE2, ONE2};
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) O::mma(xs[nt], ones, xc[kk][nt][0], xc[kk][nt][1]);
            }
          }
        }
        first = false;
        if (++rem == gs_st) {
          rem = 0;
          ++grp;
        }
      }
    }
  }
  flush();
  if constexpr (C::PROBE) probe ^= s_next.x ^ z_next.y;
}

// Grid: G = p.splits CTAs (sk_grid-clamped by the launcher). Partials: p.partial[(c * 2 + which) * m * (WNN * 64)]
// for CTA c's first (which = 0) and last (which = 1) segment; locks[t] counts the segments of tile t that arrived.
template <typename T, typename C, int NT>
__global__ void __launch_bounds__(sk_threads<C, NT>(), std::is_same<T, half>::value ? (NT == 1 ? C::HMINB : C::HMINB2)
                                                                                    : (NT == 1 ? C::MINB : C::MINB2))
    w4a16_streamk_kernel(const SdqW4A16Params p) {
  constexpr int WNN = C::WNN, THREADS = sk_threads<C, NT>(), TW = WNN * 64;  // tile width in features
  constexpr int TT = sk_tt<C, NT>(), NTW = NT / TT;  // warps per block, token tiles per warp
  using O = Ops<T>;
  __shared__ int s_last;
  extern __shared__ __align__(16) uint8_t sk_dyn[];
  uint4* ring = reinterpret_cast<uint4*>(sk_dyn) + (threadIdx.x / 32) * (C::RING * 2 * 32) + threadIdx.x % 32;
  constexpr int KWI = C::KWI;
  const int warp = KWI > 1 ? 0 : threadIdx.x / 32 % WNN, tok0 = KWI > 1 ? 0 : threadIdx.x / 32 / WNN * 8;
  const int kw = KWI > 1 ? threadIdx.x / 32 : 0, lane = threadIdx.x % 32;
  const int g8 = lane / 4, t4 = lane % 4;
  const int nblk = p.n / 64, n = p.n, m = p.m;
  const SKSpace sp = sk_space(p.n, p.k, WNN);
  const int G = p.splits, c = blockIdx.x;
  const int u0 = static_cast<int>(sk_begin(sp.U, G, c)), u1 = static_cast<int>(sk_begin(sp.U, G, c + 1));
  const int first_tile = u0 / sp.S;
  uint32_t probe = 0;
  T* out = reinterpret_cast<T*>(p.c);

  for (int u = u0; u < u1;) {
    const int t = u / sp.S;
    const int kb = u - t * sp.S;
    const int ke = min(sp.S, kb + (u1 - u));
    u += ke - kb;
    const int nb = t * WNN + warp;
    const bool active = nb < nblk;
    float acc[NTW][4][4];
    int iters = active ? ke - kb : 0;
    if constexpr (KWI > 1) {  // this warp's chunks: kw, kw + KWI, ... of the ceil(L / 4) 4-stage chunks
      const int L = ke - kb, nch = (L + 3) / 4;
      iters = 0;
      if (active && kw < nch) {
        iters = 4 * ((nch - 1 - kw) / KWI + 1);
        if ((nch - 1) % KWI == kw) iters -= 4 * nch - L;  // the last, partial chunk is this warp's
      }
    }
    sk_segment<T, C, NTW, (TT > 1)>(p, acc, probe, active ? nb : 0, kb, iters, tok0, ring, kw, ke);
    if constexpr (C::PROBE) continue;
    if constexpr (KWI > 1) {  // fold the KWI warps into warp 0 (shared memory; free again after the barrier)
      reduce_k_warps<NTW, 1, KWI>(acc, sk_dyn, kw, 0, lane);
      __syncthreads();
    }
    if (kb == 0 && ke == sp.S) {  // the whole K of this tile: write y
      if (active && kw == 0) {
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
          for (int w = 0; w < 4; ++w)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int tok = tok0 + nt * 8 + 2 * t4 + (e & 1);
              const int col = nb * 64 + 16 * w + 8 * (e >> 1) + g8;
              if (tok < m) out[static_cast<size_t>(tok) * n + col] = O::one(acc[nt][w][e]);
            }
      }
      continue;
    }
    // a split tile: write this segment's partial, count it; the last of the tile's segments sums them in order
    const int which = t == first_tile ? 0 : 1;
    float* part = p.partial + (static_cast<size_t>(c) * 2 + which) * m * TW;
    if (active && kw == 0) {
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tok = tok0 + nt * 8 + 2 * t4 + (e & 1);
            const int col = warp * 64 + 16 * w + 8 * (e >> 1) + g8;
            if (tok < m) __stcg(part + static_cast<size_t>(tok) * TW + col, acc[nt][w][e]);
          }
    }
    const long long tu0 = static_cast<long long>(t) * sp.S;
    const int c0 = sk_owner(sp.U, G, tu0), c1 = sk_owner(sp.U, G, tu0 + sp.S - 1);  // this tile's segments
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&p.locks[t], 1) == c1 - c0;
    __syncthreads();
    if (!s_last) continue;
    __threadfence();
    const int col0 = t * TW;
    const int ncols = min(TW, n - col0);
    const int pairs = ncols / 2;
    const int c0_first = static_cast<int>(sk_begin(sp.U, G, c0) / sp.S);
    for (int i = threadIdx.x; i < m * pairs; i += THREADS) {
      const int row = i / pairs, lc = 2 * (i % pairs);
      const float2 sum = sum_segment_partials(p.partial, c0, c1, c0_first != t, m, row, TW, lc);
      *reinterpret_cast<typename O::T2*>(out + static_cast<size_t>(row) * n + col0 + lc) = O::pack(sum.x, sum.y);
    }
    if (threadIdx.x == 0) p.locks[t] = 0;  // every segment of this tile has arrived: reset for the next call
  }
  if constexpr (C::PROBE) {
    if (probe == 0x9e3779b9u && m < 0) out[threadIdx.x] = O::one(0.f);  // keeps the loads; never true (m >= 1)
  }
}

// The plain read ceiling: a persistent grid streams the whole buffer in order (consecutive threads, consecutive
// 16 bytes; UNROLL independent 16-byte loads in flight per thread), xor-reduces it and writes nothing.
template <int UNROLL>
__global__ void __launch_bounds__(256) linear_read_probe_kernel(const uint4* src, size_t n16, unsigned* sink) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t x = 0;
  for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
    uint4 r[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) r[j] = ldg_stream16(src + i + j * stride);
#pragma unroll
    for (int j = 0; j < UNROLL; ++j) x ^= r[j].x ^ r[j].y ^ r[j].z ^ r[j].w;
  }
  for (; i < n16; i += stride) {
    const uint4 r = ldg_stream16(src + i);
    x ^= r.x ^ r.y ^ r.z ^ r.w;
  }
  if (x == 0x9e3779b9u && n16 == 0) sink[0] = x;  // never true: keeps the loads
}
