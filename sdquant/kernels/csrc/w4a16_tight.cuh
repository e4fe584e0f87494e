// sdquant W4A16 "tight" decode kernel (variants 38-41, 43-44): the direct kernel's stream with a loop that issues fewer
// instructions a weight. Included by w4a16_kernel.cuh inside its namespace, after the direct kernel's helpers.
//
// Why: the direct kernel (v10) is issue-bound at M = 1. With every load removed it still takes 38.7 us on
// 8192x28672 (docs/BENCHMARKS.md, "M = 1: the compute-only probe"), and its SASS spends ~84 instructions a K step of
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

// Dynamic shared memory: reduce_k_warps' buffer, then (fused) the RMS partials and SiLU's up fragments
template <typename C, int NT>
constexpr int tight_red_bytes() { return (C::KW - 1) * C::WNN * NT * 16 * 32 * 4; }
template <typename C, int NT>
constexpr int tight_rms_floats() { return C::WARPS * 8 * NT; }
template <typename C, int NT>
constexpr int tight_rows_at() {  // (fused) the RMS rows' cp.async words, after the partials and SiLU's fragments
  return tight_red_bytes<C, NT>() + 4 * (tight_rms_floats<C, NT>() + (C::WNN / 2 > 0 ? C::WNN / 2 : 1) * NT * 16 * 32);
}
template <typename C, int NT>
constexpr int tight_rows_bytes(int m) { return m * 2 * C::THREADS * 16; }  // RMS_W = 2 words a thread and row
template <typename C, int NT>
constexpr int tight_smem() {  // the most a launch asks for (a fused launch passes tight_rows_at + its m's rows)
  return C::FUSED ? tight_rows_at<C, NT>() + tight_rows_bytes<C, NT>(8 * NT) : tight_red_bytes<C, NT>();
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
// (w4a16.h: p.rms_x, p.silu, p.resid, p.gamma / p.c2). A decode step's RMSNorm, SiLU * up and residual adds are
// otherwise kernels of their own between the GEMMs (64 add + RMSNorm and 32 SiLU * up kernels a Llama-3-8B token);
// here they cost the consumer GEMM one read of its input row (the RMS) and the producer an extra read and write in
// its store. Off (all null) the kernel runs store_output as before.
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

// The RMS of p.rms_x's rows, off the main loop's critical path. (A first version read the rows before the loop, one
// row after another: +0.8 us a consumer GEMM at M = 1, several at M = 8, e2e run 40.) rms_copy, right after
// griddep_wait, starts cp.async copies of the first RMS_W 16-byte words a thread reads of every row into shared memory
// (no registers held through the loop); rms_reduce, after the K-warp reduction, waits for them, sums their squares and
// those of any further words (read then), so that part[warp * ROWS + row] holds each warp's share: a fixed order, the
// same bits every run. Each thread reads back only what it copied, so no barrier is needed between the two.
constexpr int RMS_W = 2;
template <int THREADS>
__device__ __forceinline__ void rms_copy(const SdqW4A16FusedParams& p, uint4* rows) {
  const int k8 = p.k / 8;  // 16-byte words a row
  const uint4* src = reinterpret_cast<const uint4*>(p.rms_x);
  for (int r = 0; r < p.m; ++r)
#pragma unroll
    for (int j = 0; j < RMS_W; ++j) {
      const int i = threadIdx.x + j * THREADS;
      if (i < k8) cp_async16<false>(rows + (r * RMS_W + j) * THREADS + threadIdx.x, src + static_cast<size_t>(r) * k8 + i, 0);
    }
  cp_async_commit();
}
template <typename T>
__device__ __forceinline__ float sumsq16(const uint4& v, float s) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = pair_f<T>(w[j]);
    s = fmaf(f.x, f.x, s);
    s = fmaf(f.y, f.y, s);
  }
  return s;
}
template <typename T, int THREADS, int ROWS>
__device__ __forceinline__ void rms_reduce(const SdqW4A16FusedParams& p, const uint4* rows, float* part) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k8 = p.k / 8;
  const uint4* src = reinterpret_cast<const uint4*>(p.rms_x);
  cp_async_wait<0>();
  for (int r = 0; r < p.m; ++r) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < RMS_W; ++j)
      if (threadIdx.x + j * THREADS < k8) s = sumsq16<T>(rows[(r * RMS_W + j) * THREADS + threadIdx.x], s);
    for (int i = threadIdx.x + RMS_W * THREADS; i < k8; i += THREADS)
      s = sumsq16<T>(__ldg(src + static_cast<size_t>(r) * k8 + i), s);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) part[warp * ROWS + r] = s;
  }
}

template <int WARPS, int ROWS>
__device__ __forceinline__ float rms_scale(const SdqW4A16FusedParams& p, const float* part, int row) {
  if (p.rms_x == nullptr) return 1.f;
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) s += part[w * ROWS + row];
  return rsqrtf(s / static_cast<float>(p.k) + p.rms_eps);
}

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }

// Two adjacent outputs (row, oc), (row, oc + 1) of value v: rounded, the residual added, the second output scaled.
template <typename T>
__device__ __forceinline__ void fused_write2(const SdqW4A16FusedParams& p, int row, int oc, float2 v) {
  using O = Ops<T>;
  using T2 = typename O::T2;
  const int nout = p.silu ? p.n / 2 : p.n;
  const size_t at = static_cast<size_t>(row) * nout + oc;
  T2 y = O::pack(v.x, v.y);
  if (p.resid != nullptr) {
    const float2 d = pair_f<T>(*reinterpret_cast<const uint32_t*>(&y));
    const float2 r = pair_f<T>(*reinterpret_cast<const uint32_t*>(reinterpret_cast<const T*>(p.resid) + at));
    y = O::pack(d.x + r.x, d.y + r.y);
  }
  *reinterpret_cast<T2*>(reinterpret_cast<T*>(p.c) + at) = y;
  if (p.c2 != nullptr) {
    const float2 h = pair_f<T>(*reinterpret_cast<const uint32_t*>(&y));
    const float2 g = pair_f<T>(*reinterpret_cast<const uint32_t*>(reinterpret_cast<const T*>(p.gamma) + oc));
    *reinterpret_cast<T2*>(reinterpret_cast<T*>(p.c2) + at) = O::pack(h.x * g.x, h.y * g.y);
  }
}
template <typename T>
__device__ __forceinline__ void fused_write1(const SdqW4A16FusedParams& p, int row, int oc, float v) {
  const int nout = p.silu ? p.n / 2 : p.n;
  const size_t at = static_cast<size_t>(row) * nout + oc;
  T y = Ops<T>::one(v);
  if (p.resid != nullptr) y = Ops<T>::one(one_f<T>(y) + one_f<T>(reinterpret_cast<const T*>(p.resid)[at]));
  reinterpret_cast<T*>(p.c)[at] = y;
  if (p.c2 != nullptr)
    reinterpret_cast<T*>(p.c2)[at] = Ops<T>::one(one_f<T>(y) * one_f<T>(reinterpret_cast<const T*>(p.gamma)[oc]));
}

// store_output with the fused epilogue. One split: the writers' fragments go straight out (with SiLU, the up warp of
// each (gate, up) block pair hands its fragment to the gate warp through `xbuf`); more: fp32 partials as
// store_output, and the last CTA of the tile sums them and writes through fused_write2.
template <typename T, int NT, int WNN, int WARPS, int THREADS>
__device__ __forceinline__ void store_fused(const SdqW4A16FusedParams& p, const float (&acc)[NT][4][4], bool writer, int wn,
                                            int nb, int split, int& s_last, const float* part, float* xbuf) {
  constexpr int ROWS = 8 * NT;
  const int m = p.m, n = p.n;
  const int lane = threadIdx.x % 32, g8 = lane / 4, t4 = lane % 4;
  if (p.rms_x != nullptr) __syncthreads();  // every warp's rms_reduce share is in
  if (p.splits == 1) {
    if (p.silu) {
      if (writer && (wn & 1)) {
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
          for (int w = 0; w < 4; ++w)
#pragma unroll
            for (int e = 0; e < 4; ++e) xbuf[(((wn / 2) * NT + i) * 16 + w * 4 + e) * 32 + lane] = acc[i][w][e];
      }
      __syncthreads();
      if (!writer || (wn & 1)) return;
    } else if (!writer) {
      return;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        const int tok = nt * 8 + 2 * t4 + e1;
        if (tok >= m) continue;
        const float rs = rms_scale<WARPS, ROWS>(p, part, tok);
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int e = 2 * e2 + e1;
            float v = acc[nt][w][e] * rs;
            int oc = nb * 64 + 16 * w + 8 * e2 + g8;
            if (p.silu) {
              v = silu_mul(v, xbuf[(((wn / 2) * NT + nt) * 16 + w * 4 + e) * 32 + lane] * rs);
              oc = (nb / 2) * 64 + 16 * w + 8 * e2 + g8;
            }
            fused_write1<T>(p, tok, oc, v);
          }
      }
    return;
  }
  float* pout = p.partial + static_cast<size_t>(split) * m * n;
  if (writer) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = nt * 8 + 2 * t4 + (e & 1);
          const int col = nb * 64 + 16 * w + 8 * (e >> 1) + g8;
          if (tok < m) __stcg(pout + static_cast<size_t>(tok) * n + col, acc[nt][w][e]);
        }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&p.locks[blockIdx.x], 1) == p.splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const int col0 = blockIdx.x * WNN * 64;
  const int ncols = min(WNN * 64, n - col0);
  auto sum2 = [&](int row, int col) {  // fixed split order: the result does not depend on arrival order
    float2 s = make_float2(0.f, 0.f);
    for (int q = 0; q < p.splits; ++q) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(p.partial + (static_cast<size_t>(q) * m + row) * n + col));
      s.x += v.x;
      s.y += v.y;
    }
    return s;
  };
  const int pairs = (p.silu ? ncols / 2 : ncols) / 2;  // output column pairs of this tile
  for (int i = threadIdx.x; i < m * pairs; i += THREADS) {
    const int row = i / pairs, j = 2 * (i % pairs);
    const float rs = rms_scale<WARPS, ROWS>(p, part, row);
    if (p.silu) {  // output j of this tile: gate column 128 * (j / 64) + j % 64, up 64 past it
      const int gc = col0 + 128 * (j / 64) + j % 64;
      const float2 g = sum2(row, gc), u = sum2(row, gc + 64);
      fused_write2<T>(p, row, col0 / 2 + j,
                      make_float2(silu_mul(g.x * rs, u.x * rs), silu_mul(g.y * rs, u.y * rs)));
    } else {
      const float2 v = sum2(row, col0 + j);
      fused_write2<T>(p, row, col0 + j, make_float2(v.x * rs, v.y * rs));
    }
  }
  if (threadIdx.x == 0) p.locks[blockIdx.x] = 0;
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
  // The prologue's weights, scales and zeros do not depend on the previous kernel (programmatic dependent launch:
  // they are in flight while it finishes); the activations are read only after griddep_wait.
#pragma unroll
  for (int j = 0; j < D; ++j)
#pragma unroll
    for (int kk = 0; kk < U; ++kk) ldg_stream16_if(wq[j][kk], wsrc + (j * U + kk) * 32, j < nc);
  if (nc > 0) load_group_sz(p, grp, nblk, nb, g8, s_next, z_next);
  griddep_wait();
  if (p.pdl == 2) griddep_launch_dependents();
  if constexpr (C::FUSED) {
    if (p.rms_x != nullptr) rms_copy<C::THREADS>(p, reinterpret_cast<uint4*>(smem + tight_rows_at<C, NT>()));
  }
  if (nc > 0) {
    load_x(0, xq[0]);
    begin();
    if (gc - cig < nc) load_group_sz(p, grp + 1, nblk, nb, g8, s_next, z_next);
  }

  for (int base = 0; base < nc; base += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int c = base + j;
      if (c < nc) {
        if (cig == 0 && c > 0) {  // a new group: fold the last one in, unpack this one's, fetch the next one's
          flush();
          begin();
          if (c + gc < nc) load_group_sz(p, grp + 1, nblk, nb, g8, s_next, z_next);
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
        }
      }
    }
  }
  flush();
  griddep_launch_dependents();  // the next kernel may start its own prologue during this epilogue

  if constexpr (C::FUSED) {
    if constexpr (KW > 1) reduce_k_warps<NT, WNN, KW>(acc, smem, kw, wn, lane);  // into warp kw = 0
    float* rms = reinterpret_cast<float*>(smem + tight_red_bytes<C, NT>());
    if (p.rms_x != nullptr)
      rms_reduce<T, C::THREADS, 8 * NT>(p, reinterpret_cast<const uint4*>(smem + tight_rows_at<C, NT>()), rms);
    store_fused<T, NT, WNN, C::WARPS, C::THREADS>(p, acc, active && kw == 0, wn, nb, split, s_last, rms,
                                                  rms + tight_rms_floats<C, NT>());
  } else {
    if constexpr (KW > 1) reduce_k_warps<NT, WNN, KW>(acc, smem, kw, wn, lane);  // into warp kw = 0
    store_output<T, NT, WNN, C::THREADS>(p, acc, active && kw == 0, nb, split, s_last);
  }
}
