// sdquant W4A16 "feed" decode kernel (variants 60-61, M <= 8): one CTA a SM streams one contiguous byte range of the
// fragments through a deep shared-memory ring filled by large bulk copies (the 1-D TMA), while its CW warps run the
// direct kernel's arithmetic out of the ring. Included by w4a16_kernel.cuh inside its namespace, after w4a16_bulk.cuh
// (mbarrier and bulk-copy helpers) and w4a16_streamk.cuh (sk_begin / sk_owner / sum_segment_partials).
//
// Why (docs/benchmarks/int4-cuda.md, "M = 1-8: the tight kernel" and the read-order probes): the tight kernel reads 8192x28672 at
// ~3.1 TB/s with 16 warps a SM each keeping <= 4 KB in flight in registers; ncu puts 42% of its stall cycles on memory.
// Every earlier attempt at more bytes in flight kept one stream a warp (~2,000 streams of 1-4 KB copies or loads): the
// per-warp bulk-copy rings' copies alone took 36.7-40 us (P7 / P8), and more warps cost registers. Here the streams
// are few and long: the flattened (block, K step) space, block-major, is cut into stages of SK = CW x KPW K steps of one
// 64-feature block (SK x 512 contiguous bytes; since a block's K steps are a multiple of SK, stage t lies at byte
// t x SK x 512), and CTA c of the G-CTA grid takes the stages [NS c / G, NS (c + 1) / G): one contiguous range, copied
// S stages ahead (S x SK x 512 bytes in flight a SM, 192 KB for the shipped configs) at no register cost.
//
// No producer warp (a 17th warp would cut every thread to 96 registers): thread 0 requests the first S stages, and
// afterwards the last warp to finish reading a slot (a counter in shared memory, acquire-release) refills it with one
// bulk copy (L2 evict-first) that completes on the slot's mbarrier. Warp w takes the KPW K steps [w KPW, (w + 1) KPW) of
// every stage (16-byte ld.shared a lane and K step: lane l reads its own fragment, conflict-free) and keeps the direct
// kernel's fp32 group sums (group_step / group_flush; needs group % KPW == 0, so a warp's K steps of one stage share a
// group). Scales / zeros and activations are fetched one stage ahead through L1. When a block ends (or the CTA's range
// does), the warps sum their accumulators through shared memory (CTA barriers) and write y, or, for a block shared
// with another CTA, an fp32 partial that the last CTA of the block to arrive adds up in CTA order (stream-K's fix-up:
// deterministic, no spin-wait).
// WS = 1: the group scale multiplies each dequantized weight pair in the activation dtype ((code - zero) * s rounded,
// one multiply a pair, as the lean kernels' WSCALE) instead of fp32 group sums: one accumulator set, fewer registers,
// so MINB CTAs of CW warps fit a SM (e.g. 3 x 8 warps at <= 80 registers).
// Measured (H200, docs/benchmarks/int4-cuda.md "Tried: the feed kernel"): correct (48/48 GPU checks) but 1.36x (60) and 1.58x
// (61) v38's time at M = 1 (8192x28672 49.9 / 61.8 against 38.8 us). The probes split it: the copies alone take 36.5 us
// (3.2 TB/s; 34.1 at 3 CTAs x 8 warps), the arithmetic alone 35.7 (37.8 at 24 warps with WS), while v38 overlaps the
// two in 38.4. Of the arithmetic's 35.7 us, 19.3 are the loop's skeleton (probe 5: a group end, a group start and a
// global scale fetch every stage of 4 K steps at group 128). Off every default. The probes that split it (PROBE 1-5:
// copies without arithmetic, arithmetic without copies, dequantization or MMAs alone, the skeleton) were removed on
// 2026-12-06 after d589f29; build that tree to re-measure them.
template <int CW_, int KPW_, int S_, int WS_ = 0, int MINB_ = 1>
struct FCfg {
  static constexpr int CW = CW_, KPW = KPW_, S = S_, WS = WS_;
  static constexpr int WNN = 1, KW = CW;  // (blocks a CTA for run_op's queries; every warp one K slice)
  static constexpr int WARPS = CW;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int STAGES = 1, PRE = 1, MINB = MINB_;  // MINB: CTAs a SM (ptxas's register cap)
  static constexpr bool DIRECT = false;
  static constexpr int KIND = 6;
  static constexpr int SK = CW * KPW;            // K steps a stage
  static constexpr int STAGE_BYTES = SK * 512;   // one block's fragments over SK K steps
  static constexpr int RED_BYTES = CW * 16 * 32 * 4;  // the warps' accumulators (one token tile)
  static constexpr int SMEM = S * STAGE_BYTES + RED_BYTES + S * 8 + S * 4;  // + full barriers, freed counters
  static_assert(CW >= 1 && CW * 32 <= 16 * 32 * 2, "the block sum gives each thread <= 2 outputs");
  static_assert(MINB * (SMEM + 1024) <= 228 * 1024, "MINB CTAs' rings, reduction buffers and barriers fit in one SM");
};

// Whether the feed kernel can run p (one token tile, whole stages a block, a warp's K steps inside one group)
template <typename C>
__host__ __device__ __forceinline__ bool feed_ok(const SdqW4A16Params& p) {
  return p.m >= 1 && p.m <= 8 && p.k % (16 * C::SK) == 0 && p.group_k16 % C::KPW == 0;
}
// Stages of the flattened space, and the grid: the requested CTAs (p.splits), at most one a stage
template <typename C>
__host__ __device__ __forceinline__ long long feed_stages(int n, int k) {
  return static_cast<long long>(n / 64) * (k / 16 / C::SK);
}
template <typename C>
__host__ __device__ __forceinline__ int feed_grid(int requested, int n, int k) {
  const long long t = feed_stages<C>(n, k);
  const long long g = requested < 1 ? 1 : (requested > t ? t : requested);
  return g < 1 ? 1 : static_cast<int>(g);
}

// old value of *p, then *p += v; acquire-release at CTA scope (the warps' slot reads before the refill's copy)
__device__ __forceinline__ int atom_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.cta.shared::cta.add.s32 %0, [%1], %2;\n"
               : "=r"(old)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))), "r"(v)
               : "memory");
  return old;
}

template <typename T, typename C, int NT>
__global__ void __launch_bounds__(C::THREADS, C::MINB) w4a16_feed_kernel(const SdqW4A16Params p) {
  static_assert(NT == 1, "one token tile (M <= 8)");
  constexpr int CW = C::CW, KPW = C::KPW, S = C::S, SK = C::SK, SB = C::STAGE_BYTES;
  constexpr int CT = C::THREADS;
  using O = Ops<T>;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_last;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kst = p.k / 16, spb = kst / SK, nblk = p.n / 64, m = p.m, n = p.n;
  const long long NS = static_cast<long long>(nblk) * spb;  // stages of the whole space
  const int G = p.splits, c = blockIdx.x;
  const long long u0 = sk_begin(NS, G, c), u1 = sk_begin(NS, G, c + 1);
  const int ns = static_cast<int>(u1 - u0);  // this CTA's stages
  const uint32_t ring = smem_addr(smem);
  float* red = reinterpret_cast<float*>(smem + S * SB);
  const uint32_t full0 = smem_addr(smem + S * SB + C::RED_BYTES);
  int* freed = reinterpret_cast<int*>(smem + S * SB + C::RED_BYTES + S * 8);  // consumer warps done with a slot
  const uint8_t* src = reinterpret_cast<const uint8_t*>(p.b) + u0 * SB;      // this CTA's stages, contiguous
  auto issue = [&](int i) {  // stage i of this CTA into slot i % S (one thread)
    const uint32_t bar = full0 + 8 * (i % S);
    mbar_arrive_expect_tx(bar, SB);
    bulk_copy_g2s<1>(ring + (i % S) * SB, src + static_cast<size_t>(i) * SB, SB, bar, evict_first_policy());
  };
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      mbar_init(full0 + 8 * s, 1);
      freed[s] = 0;
    }
    mbar_fence_init();
  }
  __syncthreads();
  // the first S stages: the weights do not depend on the previous kernel, so before griddep_wait
  if (threadIdx.x == 0)
    for (int i = 0; i < S && i < ns; ++i) issue(i);

  const int g8 = lane / 4, t4 = lane % 4;
  const int gk = p.group_k16, wk = warp * KPW;  // this warp's K steps of a stage start at wk
  const T* xrow = reinterpret_cast<const T*>(p.a) + static_cast<size_t>(min(g8, m - 1)) * p.k + 2 * t4;
  uint32_t xq[KPW][1][2], xn[KPW][1][2];
  auto load_x = [&](int sib, uint32_t (&xx)[KPW][1][2]) {  // stage sib of a block
    const unsigned int* w = reinterpret_cast<const unsigned int*>(xrow + (sib * SK + wk) * 16);
#pragma unroll
    for (int kk = 0; kk < KPW; ++kk) {
      xx[kk][0][0] = __ldg(w + kk * 8);
      xx[kk][0][1] = __ldg(w + kk * 8 + 4);
    }
  };
  float acc[1][4][4], accg[1][4][4];
  frag_each<1>([&](int i, int j, int e) { acc[i][j][e] = accg[i][j][e] = 0.f; });
  float sf[4][2] = {};
  uint32_t s2[4][2] = {};  // WS: the scale pairs in T
  uint32_t zl[4][2] = {}, zh[4][2] = {};
  uint4 s_next = make_uint4(0, 0, 0, 0), z_next = s_next;

  // the stage's block, its place in the block and this warp's group there (int counters: no 64-bit division a stage)
  int nb = static_cast<int>(u0 / spb), sib = static_cast<int>(u0 % spb);
  int g = (sib * SK + wk) / gk;
  griddep_wait();  // activations, the output and the partials belong to the stream's order
  if (p.pdl >= 2) griddep_launch_dependents();
  load_x(sib, xn);
  load_group_sz(p, g, nblk, nb, g8, s_next, z_next);
  int grp = -1;  // the group whose scales are unpacked (-1: none; a new block always starts one)
  T* out = reinterpret_cast<T*>(p.c);
  for (int i = 0; i < ns; ++i) {
    int nb1 = nb, sib1 = sib + 1;  // the next stage's
    if (sib1 == spb) {
      sib1 = 0;
      ++nb1;
    }
    const int g1 = (sib1 * SK + wk) / gk;
#pragma unroll
    for (int kk = 0; kk < KPW; ++kk) {
      xq[kk][0][0] = xn[kk][0][0];
      xq[kk][0][1] = xn[kk][0][1];
    }
    if (g != grp) {  // uniform: fold the last group in, unpack this one's scales and zeros
      if constexpr (C::WS) {
        const uint32_t sp[4] = {s_next.x, s_next.y, s_next.z, s_next.w};
        const uint32_t zp[4] = {z_next.x, z_next.y, z_next.z, z_next.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float2 f = __half22float2(*reinterpret_cast<const half2*>(&sp[w]));
          const typename O::T2 a = O::pack(f.x, f.x), b = O::pack(f.y, f.y);
          s2[w][0] = *reinterpret_cast<const uint32_t*>(&a);
          s2[w][1] = *reinterpret_cast<const uint32_t*>(&b);
          O::zero_pairs(zp[w], 0, zl[w][0], zh[w][0]);
          O::zero_pairs(zp[w], 1, zl[w][1], zh[w][1]);
        }
      } else {
        if (grp >= 0) group_flush<1>(acc, accg, sf);
        group_begin<T>(s_next, z_next, sf, zl, zh);
      }
      grp = g;
    }
    if (i + 1 < ns) {  // the next stage's activations, scales and zeros (L1 / L2)
      load_x(sib1, xn);
      load_group_sz(p, g1, nblk, nb1, g8, s_next, z_next);
    }
    const int s = i % S;
    uint4 wq[KPW];
    ring_wait(full0 + 8 * s, (i / S) & 1);
    const uint32_t at = ring + s * SB + wk * 512 + lane * 16;
#pragma unroll
    for (int kk = 0; kk < KPW; ++kk) wq[kk] = lds128(at + kk * 512);
    __syncwarp();
    // the last warp done with the slot refills it (the counter only grows: arrivals i / S * CW + 0 .. CW - 1)
    if (lane == 0 && (atom_add_acq_rel(freed + s, 1) + 1) % CW == 0 && i + S < ns) issue(i + S);
#pragma unroll
    for (int kk = 0; kk < KPW; ++kk) {
      if constexpr (C::WS) {
        const uint32_t q[4] = {wq[kk].x, wq[kk].y, wq[kk].z, wq[kk].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          uint32_t cq[4];
          O::codes(q[w], zl[w], zh[w], cq);
#pragma unroll
          for (int j = 0; j < 4; ++j) cq[j] = O::mul2(cq[j], s2[w][j >> 1]);
          const uint32_t af[4] = {cq[0], cq[2], cq[1], cq[3]};
          O::mma(acc[0][w], af, xq[kk][0][0], xq[kk][0][1]);
        }
      } else group_step<T, 1>(wq[kk], xq[kk], zl, zh, accg);
    }
    const int nb_done = nb;
    nb = nb1;
    sib = sib1;
    g = g1;
    if (sib1 != 0 && i + 1 < ns) continue;
    // ---- the block (or this CTA's part of it) ends: sum the consumer warps' accumulators, write y or a partial
    if constexpr (!C::WS) group_flush<1>(acc, accg, sf);
    grp = -1;
    frag_each<1>([&](int, int w, int e) {
      red[((warp * 16) + w * 4 + e) * 32 + lane] = acc[0][w][e];
      acc[0][w][e] = 0.f;
    });
    __syncthreads();
    const long long b0 = static_cast<long long>(nb_done) * spb;  // the block's first stage
    const bool whole = u0 <= b0 && u1 >= b0 + spb;
    const bool second = nb_done != static_cast<int>(u0 / spb);  // this CTA's second segment
    float* part = p.partial + (static_cast<size_t>(c) * 2 + (second ? 1 : 0)) * m * 64;
    for (int idx = threadIdx.x; idx < 16 * 32; idx += CT) {  // (fragment entry, lane) of the block's output
      const int e16 = idx / 32, ln = idx % 32;
      float v = 0.f;
#pragma unroll 4
      for (int q = 0; q < CW; ++q) v += red[(q * 16 + e16) * 32 + ln];  // fixed order
      const int tok = 2 * (ln % 4) + (e16 & 1);
      const int col = 16 * (e16 / 4) + 8 * ((e16 % 4) >> 1) + ln / 4;
      if (tok < m) {
        if (whole) out[static_cast<size_t>(tok) * n + nb_done * 64 + col] = O::one(v);
        else __stcg(part + tok * 64 + col, v);
      }
    }
    if (!whole) __threadfence();  // this CTA's partial is visible device-wide before it is counted
    __syncthreads();        // (also: red is free again)
    if (whole) continue;
    const int c0 = sk_owner(NS, G, b0), c1 = sk_owner(NS, G, b0 + spb - 1);  // the CTAs holding this block's segments
    if (threadIdx.x == 0) s_last = atomicAdd(&p.locks[nb_done], 1) == c1 - c0;
    __syncthreads();
    if (!s_last) continue;
    __threadfence();
    const bool c0_second = static_cast<int>(sk_begin(NS, G, c0) / spb) != nb_done;
    for (int idx = threadIdx.x; idx < m * 32; idx += CT) {  // (token, column pair), segments in CTA order
      const int row = idx / 32, lc = 2 * (idx % 32);
      const float2 sum = sum_segment_partials(p.partial, c0, c1, c0_second, m, row, 64, lc);
      *reinterpret_cast<typename O::T2*>(out + static_cast<size_t>(row) * n + nb_done * 64 + lc) = O::pack(sum.x, sum.y);
    }
    if (threadIdx.x == 0) p.locks[nb_done] = 0;  // every segment of this block has arrived: reset for the next call
  }
  griddep_launch_dependents();
}
