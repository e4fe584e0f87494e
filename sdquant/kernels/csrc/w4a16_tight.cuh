// sdquant W4A16 "tight" decode kernel (variants 38-41, 43-44): the direct kernel's stream with a loop that issues fewer
// instructions a weight. Included by w4a16_kernel.cuh inside its namespace, after the direct kernel's helpers. A second
// build, TFused (w4a16_part_fused_*.cu, M <= 8), adds the fused decode-block ends (RMSNorm scale, SiLU * up, residual
// add and the next norm's input: "the fused decode-block prologue / epilogue" below).
//
// Why: the direct kernel (v10) is issue-bound at M = 1. With every load removed it still takes 38.7 us on
// 8192x28672 (docs/benchmarks/int4-cuda.md, "M = 1: the compute-only probe"), and its SASS spends ~84 instructions a K step of
// which only 44 dequantize and 4 multiply: the rest are register copies out of the load ring (its ring slot is
// refilled before the slot's words are used), a branch or two per K step for the group boundary and for the
// activation source, and predicated-row branches around the activation loads. This loop removes them by making every
// index static:
// * Work is cut in chunks of U = 4 K steps (64 K; requires group % 64 == 0, the launcher falls back to the direct
//   kernel otherwise). A warp's chunks stream through a ring of D chunks (D even), unrolled D at a time, so each ring
//   slot is a fixed register set; a K step's word is read by its dequantization and then the slot is refilled with
//   the word of chunk c + D (a predicated 16-byte load: no branch, no read past the warp's range).
// * Activations one chunk ahead in two fixed register sets (chunk parity). Rows past M are not predicated: the row
//   index is clamped to M - 1, so those lanes multiply real values into token columns that are never stored.
// * The group boundary is tested once a chunk (a uniform branch), not once a K step.
// Tried and removed: an L2 prefetch of the chunk two past the ring (16 lanes, one line each, once a chunk; commit
// 2558337): 2-11% slower than variant 38 at M = 1-8 on every shape (int4_tune run 13). The loop on a flat (stream-K)
// grid, every warp an equal share of the (block, chunk) units with the lean kernel's partial-segment fix-up (commit
// f52f355, 12 or 8 warps/SM for the registers it needs without spilling): 10-50% slower than 38 (run 14). The
// CTA's activation range copied to shared memory once and read there (commit 54aaf0f): 2-7% slower at M = 1-2,
// level at M = 4-8, where it did not fit and the loads went to global memory (run 15). A register-lean build (the
// group scale on the weights, 2-step chunks: 96 registers, 20 warps/SM, 2 KB a warp in flight; commit 1ab1249): level
// on the small shapes, 13-35% slower on the large ones (run 16).
// The group arithmetic (exact (code - zero) in the MMA, fp32 scale per group), the grid (blocks x K-warps x split-K),
// the K-warp reduction and the split-K epilogue are the direct kernel's.
// RAW = 1: the raw magic-number codes (128 + c in bf16, 1024 + c in fp16) go into the MMA with no zero subtraction
// (7 instructions a 32-bit word instead of 11 in bf16); a fifth MMA a K step with an all-ones A fragment sums the
// activations, and each group folds in as acc += s * sum - s * (magic + z) * sum(x) in fp32 (group_flush<NT, true>;
// the lean kernel's raw mode, whose loop was not lean enough for it to pay).
// SDQ_TIGHT_SZO = 1 (default): the next group's scale / zero offset is kept in a register and advanced a group at a
// time. ptxas had rebuilt it from the thread index at every group end (an S2R and ~20 integer instructions; v38's main
// loop 597 -> 551 SASS instructions, same 127 registers). Bit-identical outputs; ab_build run 29 (H100, 63 points, M =
// 1-8, configs 38-40): 0.996x the time in geometric mean (0.982-1.013); the fused decode chain under PDL (chain run 9)
// 54.8 / 54.75 -> 54.26 us a layer. 0: the build before, kept for A/B (ab_build --new-defines=-DSDQ_TIGHT_SZO=0).
#ifndef SDQ_TIGHT_SZO
#define SDQ_TIGHT_SZO 1
#endif
#ifndef SDQ_TIGHT_L2PF  // 1 (default): under PDL the prologue issues an L2 prefetch of its ring before griddep_wait
#define SDQ_TIGHT_L2PF 1  // (prefetch_l2_if); with it ptxas keeps the ring's loads ahead of the wait. 0: the earlier
#endif                    // build, kept for A/B (docs/benchmarks/pending.md, Pending 24: -3.9 us a layer in chain, +3.5% e2e)
template <int WNN_, int KW_, int D_, int MINB_, int RAW_ = 0>
struct TCfg {
  static constexpr int WNN = WNN_, KW = KW_, D = D_, MINB = MINB_;  // D: chunks of 4 K steps in flight a warp
  static constexpr int RAW = RAW_;
  static constexpr int WARPS = WNN * KW;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int STAGES = 1, PRE = 1;
  static constexpr bool DIRECT = false;
  static constexpr int KIND = 5;
  static constexpr bool FUSED = false;  // TFused<C>: the same loop with the fused prologue / epilogue (w4a16.h)
  using Params = SdqW4A16Params;
  static_assert(D % 2 == 0, "the activation registers alternate by chunk parity");
};
constexpr int TIGHT_U = 4;  // K steps a chunk

// The tight kernel with the fused decode-block prologue / epilogue (a kernel of its own, so that the plain one's code
// does not change; instantiated for one token tile, M <= 8)
template <typename C>
struct TFused : C {
  static constexpr bool FUSED = true;
  using Params = SdqW4A16FusedParams;
};

// Dynamic shared memory: reduce_k_warps' buffer, then (fused) the rest below
template <typename C, int NT>
constexpr int tight_red_bytes() { return (C::KW - 1) * C::WNN * NT * 16 * 32 * 4; }
// (fused) after reduce_k_warps' buffer: the row scales s_rs[8 NT], the one-split tile's values, the copied partial sums of
// squares [m, rms_t] (a launch passes tight_ss_at + 4 m rms_t bytes; tight_smem is the most)
constexpr int FUSED_T_MAX = 256;  // partial sums a row: an RMSNorm input of up to 256 x 64 = 16384 features
template <typename C, int NT>
constexpr int tight_xs_at() { return tight_red_bytes<C, NT>() + 4 * 8 * NT; }
template <typename C, int NT>
constexpr int tight_ss_at() { return tight_xs_at<C, NT>() + 4 * C::WNN * 8 * NT * 64; }  // xs: [WNN][8 NT][64]
template <typename C, int NT>
constexpr int tight_smem() {
  return C::FUSED ? tight_ss_at<C, NT>() + 4 * 8 * NT * FUSED_T_MAX : tight_red_bytes<C, NT>();
}

// An L2 prefetch of the line holding p when `on`. The prologue issues one for each word of its ring before
// griddep_wait, because ptxas sinks the ring's register loads below the wait in most builds (variants 38 / 39 and
// every fused build: the wait, ACQBULK, comes first in their SASS). A load placed after the wait then starts only
// when the previous kernel has finished, and under programmatic dependent launch the weights were meant to be in
// flight by then (docs/benchmarks/decode.md, "Where a batch-1 layer's GEMM time goes").
__device__ __forceinline__ void prefetch_l2_if(const void* p, bool on) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %1, 0;\n @q prefetch.global.L2 [%0];\n}\n" ::"l"(p), "r"(static_cast<int>(on)));
}
// 16 bytes with a non-allocating load if `on`, else r unchanged (no branch)
__device__ __forceinline__ void ldg_stream16_if(uint4& r, const uint4* p, bool on) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
      " @q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
      : "l"(p), "r"(static_cast<int>(on)));
}

// ------------------------------------------------------------------ the fused decode-block prologue / epilogue
// (w4a16.h: SdqW4A16FusedParams). A decode step's RMSNorms, SiLU * up and residual adds are otherwise kernels of their
// own between the GEMMs (64 add + RMSNorm and 32 SiLU * up kernels a Llama-3-8B token). Here:
// * a producer (o, down: resid, gamma) writes c = round(y) + resid, c2 = c * gamma (the next RMSNorm's input with its
//   weight applied) and ss_out, the sums of squares of c's 64-column blocks (the next RMSNorm's statistic, in parts);
// * a consumer (qkv, gate/up, lm_head: rms_ss) scales its rows by rsqrt(sum(ss) / k + eps), so it reads 4 rms_t bytes a
//   row instead of the row (a first version read whole rows in every CTA: 2-8 us slower at M = 8, e2e runs 40-41).
// The partial sums are copied by cp.async right after griddep_wait and summed in the epilogue.
template <typename T>
__device__ __forceinline__ float2 pair_f(uint32_t w) {
  if constexpr (std::is_same<T, half>::value) return __half22float2(*reinterpret_cast<const half2*>(&w));
  else return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
template <typename T>
__device__ __forceinline__ float one_f(T v) {
  if constexpr (std::is_same<T, half>::value) return __half2float(v);
  else return __bfloat162float(v);
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ uint32_t ldg_u32(const void* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); }

// prologue: the consumer's partial sums of squares [m, rms_t] into shared memory
template <int THREADS>
__device__ __forceinline__ void ss_copy(const SdqW4A16FusedParams& p, float* dst) {
  for (int i = threadIdx.x; i < p.m * p.rms_t; i += THREADS) cp_async4(dst + i, p.rms_ss + i);
  cp_async_commit();
}
// epilogue, after a barrier that follows every thread's cp_async_wait: s_rs[row] = rsqrt(sum / k + eps), published by
// the next barrier (store_fused's own: a barrier of its own here cost one more a CTA)
template <int WARPS>
__device__ __forceinline__ void ss_scales(const SdqW4A16FusedParams& p, const float* ss, float* s_rs) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < p.m; r += WARPS) {
    float s = 0.f;
    for (int t = lane; t < p.rms_t; t += 32) s += ss[r * p.rms_t + t];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) s_rs[r] = rsqrtf(s / static_cast<float>(p.k) + p.rms_eps);
  }
}

__device__ __forceinline__ float silu_mul(float g, float u) { return __fdividef(g, 1.f + __expf(-g)) * u; }

// The fused epilogue's RoPE / KV-cache units (SdqW4A16FusedParams::kv): a warp takes (row, 128-column head) units in
// turn (the tight tiles are 128-aligned: WNN is even), lane l output columns 2l, 2l + 1 of each half. A query or key
// head is rotated from its rounded values, out[d] = x[d] cos[d] - x[d + 64] sin[d], out[d + 64] = x[d + 64] cos[d + 64]
// + x[d] sin[d] with each product and the sum rounded in fp32 (no contraction: the reference's elementwise order);
// keys and values are also stored at slot pos of the cache.
template <typename T, typename F>
__device__ __forceinline__ void store_rope(const SdqW4A16FusedParams& p, int col0, int ncols, F&& fetch,
                                           const float* s_rs, int warp, int lane, int warps) {
  using O = Ops<T>;
  using T2 = typename O::T2;
  const long long pos = *p.pos;
  const T* cs = reinterpret_cast<const T*>(p.cos);
  const T* sn = reinterpret_cast<const T*>(p.sin);
  const float2 ca = pair_f<T>(ldg_u32(cs + 2 * lane)), cb = pair_f<T>(ldg_u32(cs + 64 + 2 * lane));
  const float2 sa = pair_f<T>(ldg_u32(sn + 2 * lane)), sb = pair_f<T>(ldg_u32(sn + 64 + 2 * lane));
  const int heads = ncols / 128;
  for (int u = warp; u < p.m * heads; u += warps) {
    const int row = u / heads, hh = u % heads;
    const int gc = col0 + 128 * hh;  // the head's first column
    const float rs = p.rms_ss != nullptr ? s_rs[row] : 1.f;
    const float2 a = fetch(row, 128 * hh + 2 * lane), b = fetch(row, 128 * hh + 64 + 2 * lane);
    T2 ya = O::pack(a.x * rs, a.y * rs), yb = O::pack(b.x * rs, b.y * rs);
    if (gc < p.rope_q + p.rope_kv) {
      const float2 fa = pair_f<T>(*reinterpret_cast<const uint32_t*>(&ya));
      const float2 fb = pair_f<T>(*reinterpret_cast<const uint32_t*>(&yb));
      ya = O::pack(__fadd_rn(__fmul_rn(fa.x, ca.x), -__fmul_rn(fb.x, sa.x)),
                   __fadd_rn(__fmul_rn(fa.y, ca.y), -__fmul_rn(fb.y, sa.y)));
      yb = O::pack(__fadd_rn(__fmul_rn(fb.x, cb.x), __fmul_rn(fa.x, sb.x)),
                   __fadd_rn(__fmul_rn(fb.y, cb.y), __fmul_rn(fa.y, sb.y)));
    }
    T* out = reinterpret_cast<T*>(p.c) + static_cast<size_t>(row) * p.n + gc + 2 * lane;
    *reinterpret_cast<T2*>(out) = ya;
    *reinterpret_cast<T2*>(out + 64) = yb;
    if (gc >= p.rope_q) {
      const int kc = gc - p.rope_q;
      const int which = kc >= p.rope_kv ? 1 : 0;
      const long long h = (kc - which * p.rope_kv) / 128;
      T* dst = reinterpret_cast<T*>(p.kv) + which * p.kv_sk + row * p.kv_sb + h * p.kv_sh + pos * p.kv_st + 2 * lane;
      *reinterpret_cast<T2*>(dst) = ya;
      *reinterpret_cast<T2*>(dst + 64) = yb;
    }
  }
}

// store_output with the fused epilogue, one compact loop for both split cases (a per-fragment writer path made ptxas
// schedule the main loop differently: fused_ops runs 3-5). One split: the writers' fragments go to shared memory
// (`xs`, [WNN][8 NT rows][64]); more: fp32 partials as store_output, summed by the last CTA of the tile. Then each warp
// takes (row, 64-output-column block) units in turn, lane l output columns 2l and 2l + 1 (SiLU: the gate block and the up
// block 64 weight columns past it).
template <typename T, int NT, int WNN, int WARPS, int THREADS>
__device__ __forceinline__ void store_fused(const SdqW4A16FusedParams& p, const float (&acc)[NT][4][4], bool writer,
                                            int wn, int nb, int split, int& s_last, const float* ss, float* s_rs,
                                            float* xs) {
  using O = Ops<T>;
  using T2 = typename O::T2;
  constexpr int ROWS = 8 * NT;
  const int m = p.m, n = p.n;
  const int nout = p.silu ? n / 2 : n, tout = nout / 64;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g8 = lane / 4, t4 = lane % 4;
  const bool one = p.splits == 1;
  if (p.rms_ss != nullptr) ss_scales<WARPS>(p, ss, s_rs);  // published by the barrier of either path below
  if (one) {
    if (writer)
      frag_each<NT>([&](int nt, int w, int e) {
        xs[(wn * ROWS + nt * 8 + 2 * t4 + (e & 1)) * 64 + 16 * w + 8 * (e >> 1) + g8] = acc[nt][w][e];
      });
    __syncthreads();
  } else {
    float* pout = p.partial + static_cast<size_t>(split) * m * n;
    if (writer)
      frag_each<NT>([&](int nt, int w, int e) {
        const int tok = nt * 8 + 2 * t4 + (e & 1);
        if (tok < m) __stcg(pout + static_cast<size_t>(tok) * n + nb * 64 + 16 * w + 8 * (e >> 1) + g8, acc[nt][w][e]);
      });
#if SDQ_SPLIT_TAIL
    if (!split_count_in(&p.locks[blockIdx.x], p.splits, s_last)) return;
#else
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&p.locks[blockIdx.x], 1) == p.splits - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
#endif
  }
  const int col0 = blockIdx.x * WNN * 64;
  const int ncols = min(WNN * 64, n - col0);
  const int obs = p.silu ? ncols / 128 : ncols / 64;  // output blocks of this tile
  const int oc0 = p.silu ? col0 / 2 : col0;
  const T* resid = reinterpret_cast<const T*>(p.resid);
  const T* gamma = reinterpret_cast<const T*>(p.gamma);
  auto fetch = [&](int row, int wc) {  // the tile's value pair at weight columns wc, wc + 1 (relative to col0)
    if (one) return *reinterpret_cast<const float2*>(xs + ((wc / 64) * ROWS + row) * 64 + wc % 64);
#if SDQ_SPLIT_TAIL
    return split_sum(p.splits, [&](int q) {  // fixed split order: the result does not depend on arrival order
      return __ldcg(reinterpret_cast<const float2*>(p.partial + (static_cast<size_t>(q) * m + row) * n + col0 + wc));
    });
#else
    float2 s = make_float2(0.f, 0.f);  // fixed split order: the result does not depend on arrival order
    for (int q = 0; q < p.splits; ++q) {
      const float2 v =
          __ldcg(reinterpret_cast<const float2*>(p.partial + (static_cast<size_t>(q) * m + row) * n + col0 + wc));
      s.x += v.x;
      s.y += v.y;
    }
    return s;
#endif
  };
  if (p.kv != nullptr) {  // RoPE and the cache write: a warp takes a (row, head) unit, both halves of the head
    store_rope<T>(p, col0, ncols, fetch, s_rs, warp, lane, WARPS);
    if (!one && threadIdx.x == 0) p.locks[blockIdx.x] = 0;
    return;
  }
  for (int u = warp; u < m * obs; u += WARPS) {
    const int row = u / obs, ob = u % obs;
    const int oc = oc0 + 64 * ob + 2 * lane;
    const size_t at = static_cast<size_t>(row) * nout + oc;
    // the residual and gamma pairs first: their loads overlap the values' (a prefetch before the CTA counted itself in
    // would add a round trip: the __threadfence there waits for every load in flight)
    const uint32_t rq = resid != nullptr ? ldg_u32(resid + at) : 0u;
    const uint32_t gq = gamma != nullptr ? ldg_u32(gamma + oc) : 0u;
    const float rs = p.rms_ss != nullptr ? s_rs[row] : 1.f;
    float2 v;
    if (p.silu) {
      const float2 g = fetch(row, 128 * ob + 2 * lane), up = fetch(row, 128 * ob + 64 + 2 * lane);
      v = make_float2(silu_mul(g.x * rs, up.x * rs), silu_mul(g.y * rs, up.y * rs));
    } else {
      v = fetch(row, 64 * ob + 2 * lane);
      v.x *= rs;
      v.y *= rs;
    }
    T2 y = O::pack(v.x, v.y);
    if (resid != nullptr) {
      const float2 d = pair_f<T>(*reinterpret_cast<const uint32_t*>(&y)), r = pair_f<T>(rq);
      y = O::pack(d.x + r.x, d.y + r.y);
    }
    *reinterpret_cast<T2*>(reinterpret_cast<T*>(p.c) + at) = y;
    const float2 h = pair_f<T>(*reinterpret_cast<const uint32_t*>(&y));
    if (p.c2 != nullptr) {
      const float2 g = pair_f<T>(gq);
      *reinterpret_cast<T2*>(reinterpret_cast<T*>(p.c2) + at) = O::pack(h.x * g.x, h.y * g.y);
    }
    if (p.ss_out != nullptr) {
      float sq = h.x * h.x + h.y * h.y;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
      if (lane == 0) p.ss_out[row * tout + oc / 64] = sq;
    }
  }
  if (!one && threadIdx.x == 0) p.locks[blockIdx.x] = 0;
}

template <typename T, typename C, int NT>
__global__ void __launch_bounds__(C::THREADS, NT == 1 ? C::MINB : 1) w4a16_tight_kernel(const typename C::Params p) {
  constexpr int WNN = C::WNN, KW = C::KW, D = C::D, U = TIGHT_U;
  constexpr bool RAW = C::RAW != 0;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_last;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wn = warp % WNN, kw = warp / WNN;
  const int g8 = lane / 4, t4 = lane % 4;
  const int nblk = p.n / 64;
  const int nb = blockIdx.x * WNN + wn;
  const bool active = nb < nblk;
  const int split = blockIdx.y;
  // this warp's chunks [c0, c0 + nc): the split's chunks cut into KW contiguous ranges. (The same arithmetic as
  // warp_stages<U, KW>; calling it reschedules v38's main loop in ptxas, 144 opcode differences, unmeasured, so the
  // measured form stays.)
  const int chunks = p.k / (16 * U);
  const int s0 = static_cast<int>((static_cast<long long>(chunks) * split) / p.splits);
  const int s1 = static_cast<int>((static_cast<long long>(chunks) * (split + 1)) / p.splits);
  const int c0 = s0 + ((s1 - s0) * kw) / KW;
  const int nc = active ? s0 + ((s1 - s0) * (kw + 1)) / KW - c0 : 0;
  const int gc = p.group_k16 / U;  // chunks a group
  const int m = p.m;

  const uint4* wsrc = reinterpret_cast<const uint4*>(p.b) +
                      (static_cast<size_t>(active ? nb : 0) * (p.k / 16) + static_cast<size_t>(c0) * U) * 32 + lane;
  const T* xsrc[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int r = min(nt * 8 + g8, m - 1);
    xsrc[nt] = reinterpret_cast<const T*>(p.a) + static_cast<size_t>(r) * p.k + static_cast<size_t>(c0) * U * 16 + 2 * t4;
  }

  uint4 wq[D][U];
  uint32_t xq[2][U][NT][2];
  auto load_x = [&](int c, uint32_t (&xx)[U][NT][2]) {  // chunk c (clamped to the warp's last: never past its range)
    const int cc = c < nc ? c : nc - 1;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const unsigned int* w = reinterpret_cast<const unsigned int*>(xsrc[nt] + cc * (U * 16));  // then immediates
#pragma unroll
      for (int kk = 0; kk < U; ++kk) {
        xx[kk][nt][0] = __ldg(w + kk * 8);
        xx[kk][nt][1] = __ldg(w + kk * 8 + 4);
      }
    }
  };

  float acc[NT][4][4], accg[NT][4][4];
  frag_each<NT>([&](int i, int j, int e) { acc[i][j][e] = accg[i][j][e] = 0.f; });
  float sf[4][2] = {};
  uint32_t zl[4][2] = {}, zh[4][2] = {};
  float nz[4][2] = {}, xs[NT][4];  // RAW: -s * (magic + z) of rows (w, h); this group's activation sums
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) xs[i][e] = 0.f;
  uint4 s_next = make_uint4(0, 0, 0, 0), z_next = s_next;
  auto begin = [&]() {  // a group starts: its scales and zeros as fetched into s_next / z_next
    if constexpr (RAW) {
      constexpr float MAGIC = std::is_same<T, half>::value ? 1024.f : 128.f;
      const uint32_t sp[4] = {s_next.x, s_next.y, s_next.z, s_next.w};
      const uint32_t zp[4] = {z_next.x, z_next.y, z_next.z, z_next.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 f = __half22float2(*reinterpret_cast<const half2*>(&sp[w]));
        const typename Ops<T>::T2 zz = *reinterpret_cast<const typename Ops<T>::T2*>(&zp[w]);  // (z_g, z_g+8)
        sf[w][0] = f.x;
        sf[w][1] = f.y;
        nz[w][0] = -f.x * (MAGIC + __low2float(zz));
        nz[w][1] = -f.y * (MAGIC + __high2float(zz));
      }
    } else {
      group_begin<T>(s_next, z_next, sf, zl, zh);
    }
  };
  auto step = [&](const uint4& wq1, const uint32_t (&x)[NT][2]) {  // one K step into accg (and xs)
    if constexpr (RAW) {
      const uint32_t q[4] = {wq1.x, wq1.y, wq1.z, wq1.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t c[4];
        raw_codes<T>(q[w], c);
        const uint32_t af[4] = {c[0], c[2], c[1], c[3]};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) Ops<T>::mma(accg[nt][w], af, x[nt][0], x[nt][1]);
      }
      constexpr uint32_t ONE2 = std::is_same<T, half>::value ? 0x3c003c00u : 0x3f803f80u;
      const uint32_t ones[4] = {ONE2, ONE2, ONE2, ONE2};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) Ops<T>::mma(xs[nt], ones, x[nt][0], x[nt][1]);
    } else {
      group_step<T, NT>(wq1, x, zl, zh, accg);
    }
  };
  auto flush = [&]() { group_flush<NT, RAW != 0>(acc, accg, sf, nz, xs); };

  int grp = c0 / gc, cig = c0 % gc;  // the current group, and the chunk's place in it
#if SDQ_TIGHT_SZO
  // load_group_sz's offset of group grp + 1 (lane g8's 16 bytes of block nb), advanced with grp
  const uint32_t sz_step = static_cast<uint32_t>(nblk) * 8u;
  uint32_t sz_next = (static_cast<uint32_t>(grp + 1) * static_cast<uint32_t>(nblk) + static_cast<uint32_t>(nb)) * 8u +
                     static_cast<uint32_t>(g8);
  auto load_next_sz = [&]() {
    s_next = __ldg(reinterpret_cast<const uint4*>(p.s) + sz_next);
    z_next = __ldg(reinterpret_cast<const uint4*>(p.zs) + sz_next);
  };
#else
  auto load_next_sz = [&]() { load_group_sz(p, grp + 1, nblk, nb, g8, s_next, z_next); };
#endif
  // The prologue's weights, scales and zeros do not depend on the previous kernel (programmatic dependent launch:
  // they are meant to be in flight while it finishes; without the L2 prefetch below ptxas places the wait before them
  // in v38 / v39 and every fused build); the activations are read only after griddep_wait.
  if (p.pdl == 3) griddep_launch_dependents();  // trigger first: the next kernel may launch before this one's wait
#if SDQ_TIGHT_L2PF
  if (p.pdl) {
#pragma unroll
    for (int j = 0; j < D; ++j)
#pragma unroll
      for (int kk = 0; kk < U; ++kk) prefetch_l2_if(wsrc + (j * U + kk) * 32, j < nc);
  }
#endif
#pragma unroll
  for (int j = 0; j < D; ++j)
#pragma unroll
    for (int kk = 0; kk < U; ++kk) ldg_stream16_if(wq[j][kk], wsrc + (j * U + kk) * 32, j < nc);
  if (nc > 0) load_group_sz(p, grp, nblk, nb, g8, s_next, z_next);
  griddep_wait();
  if (p.pdl == 2) griddep_launch_dependents();
  if constexpr (C::FUSED) {
    if (p.rms_ss != nullptr) ss_copy<C::THREADS>(p, reinterpret_cast<float*>(smem + tight_ss_at<C, NT>()));
  }
  if (nc > 0) {
    load_x(0, xq[0]);
    begin();
    if (gc - cig < nc) load_next_sz();
  }

  for (int base = 0; base < nc; base += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int c = base + j;
      if (c < nc) {
        if (cig == 0 && c > 0) {  // a new group: fold the last one in, unpack this one's, fetch the next one's
          flush();
          begin();
          if (c + gc < nc) load_next_sz();
        }
        load_x(c + 1, xq[(j + 1) % 2]);
        const uint4* nxt = wsrc + static_cast<size_t>(c + D) * U * 32;
#pragma unroll
        for (int kk = 0; kk < U; ++kk) {
          const uint4 w = wq[j][kk];
          step(w, xq[j % 2][kk]);
          ldg_stream16_if(wq[j][kk], nxt + kk * 32, c + D < nc);
        }
        if (++cig == gc) {
          cig = 0;
          ++grp;
#if SDQ_TIGHT_SZO
          sz_next += sz_step;
#endif
        }
      }
    }
  }
  flush();
  griddep_launch_dependents();  // the next kernel may start its own prologue during this epilogue

  if constexpr (C::FUSED) {
    if (p.rms_ss != nullptr) cp_async_wait<0>();  // this thread's copies; the barrier below publishes them all
    if constexpr (KW > 1) reduce_k_warps<NT, WNN, KW>(acc, smem, kw, wn, lane);  // into warp kw = 0
    else if (p.rms_ss != nullptr) __syncthreads();
    store_fused<T, NT, WNN, C::WARPS, C::THREADS>(p, acc, active && kw == 0, wn, nb, split, s_last,
                                                  reinterpret_cast<const float*>(smem + tight_ss_at<C, NT>()),
                                                  reinterpret_cast<float*>(smem + tight_red_bytes<C, NT>()),
                                                  reinterpret_cast<float*>(smem + tight_xs_at<C, NT>()));
  } else {
    if constexpr (KW > 1) reduce_k_warps<NT, WNN, KW>(acc, smem, kw, wn, lane);  // into warp kw = 0
    store_output<T, NT, WNN, C::THREADS>(p, acc, active && kw == 0, nb, split, s_last);
  }
}
