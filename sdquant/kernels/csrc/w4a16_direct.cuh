// sdquant W4A16 "direct" decode kernel (variants 8+): no shared-memory weight pipeline. Included by
// w4a16_kernel.cuh inside its namespace, after Ops / cp.async helpers.
//
// Why: the cp.async kernel reads every fragment twice (global -> shared -> registers), waits on a CTA-wide
// barrier per stage and keeps its warps in lock step, so at 2.5 warps per scheduler the dequantize -> MMA chains
// stall with nothing else to issue (ncu, run 3). Here each warp streams its own fragments straight into
// registers with 16-byte non-allocating loads, DEPTH stages of two K steps (DEPTH * 1 KB per warp) ahead of the
// MMAs (two steps a stage: divides every group, and keeps the register ring small enough for 2-3 CTAs per SM);
// activations come through L1 (every warp of the grid reads the same few KB), scales/zeros are fetched a group
// ahead. Warps are independent until the end: the KW warps of a 64-feature block take contiguous K ranges of the
// CTA's split and are summed through shared memory; global split-K and its reduction are the cp.async kernel's.
template <int WNN_, int KW_, int DEPTH_, int MINB_>
struct DCfg {
  static constexpr int WNN = WNN_, KW = KW_, DEPTH = DEPTH_, MINB = MINB_;  // MINB: at one token tile only
  static constexpr int WARPS = WNN * KW;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int STAGES = 1, PRE = 1;
  static constexpr bool DIRECT = true;
  static constexpr int KIND = 1;
};

#ifndef SDQ_DIRECT_XS_BYTES
#define SDQ_DIRECT_XS_BYTES 16384
#endif
template <typename C, int NT>
struct DSmem {
  static constexpr int RED_BYTES = (C::KW - 1) * C::WNN * NT * 16 * 32 * 4;
  static constexpr int XS_BYTES = SDQ_DIRECT_XS_BYTES;  // p.xs: the CTA's activation rows x K range (+ 8) if they fit
  static constexpr int TOTAL = RED_BYTES + XS_BYTES;
};

__device__ __forceinline__ uint4 ldg_stream16(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

template <typename T, typename C, int NT>
__global__ void __launch_bounds__(C::THREADS, NT == 1 ? C::MINB : 1) w4a16_direct_kernel(const SdqW4A16Params p) {
  constexpr int WNN = C::WNN, KW = C::KW, D = C::DEPTH, THREADS = C::THREADS;
  constexpr int KS = 2;  // K steps per register stage
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_last;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wn = warp % WNN, kw = warp / WNN;
  const int g8 = lane / 4, t4 = lane % 4;
  const int nblk = p.n / 64;
  const int nb = blockIdx.x * WNN + wn;
  const bool active = nb < nblk;
  const int kb_total = p.k / 16;
  const int split = blockIdx.y;
  int a, iters;  // this warp's stages
  warp_stages<KS, KW>(p, kw, active, a, iters);
  const int m = p.m;
  const int gs_st = p.group_k16 / KS;

  const uint4* wsrc = reinterpret_cast<const uint4*>(p.b) +
                      (static_cast<size_t>(active ? nb : 0) * kb_total + static_cast<size_t>(a) * KS) * 32 + lane;
  const T* xsrc = reinterpret_cast<const T*>(p.a) + static_cast<size_t>(a) * KS * 16 + 2 * t4;
  // p.xs: the CTA's K range of the activations in shared memory (all its warps' stages lie inside the split's range)
  const int stages_total = p.k / 16 / KS;
  const int cst0 = static_cast<int>((static_cast<long long>(stages_total) * split) / p.splits);
  const int cst1 = static_cast<int>((static_cast<long long>(stages_total) * (split + 1)) / p.splits);
  const int xrange = (cst1 - cst0) * KS * 16, xstride = xrange + 8, xrows = m < NT * 8 ? m : NT * 8;
  const bool xs_on = p.xs && xrows * xstride * 2 <= DSmem<C, NT>::XS_BYTES;
  T* xsm = reinterpret_cast<T*>(smem + DSmem<C, NT>::RED_BYTES);
  const T* xss = xsm + (a - cst0) * KS * 16 + 2 * t4;

  uint4 wq[D][KS];
  uint32_t xq[D][KS][NT][2];
  auto issue_w = [&](int s, uint4 (&w)[KS]) {  // weight loads of relative stage s
    const uint4* src = wsrc + static_cast<size_t>(s) * KS * 32;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      w[kk] = ldg_stream16(src + kk * 32);
    }
  };
  auto issue_x = [&](int s, uint32_t (&xx)[KS][NT][2]) {  // activation loads of relative stage s
    if (xs_on) load_x_rows<T, NT, KS, true>(xss, xstride, s * KS * 16, g8, m, xx);  // the padded rows: no bank conflicts
    else load_x_steps<T, NT, KS>(p, xsrc, s * KS * 16, g8, m, xx);
  };

  float acc[NT][4][4], accg[NT][4][4];
  frag_each<NT>([&](int i, int j, int e) { acc[i][j][e] = accg[i][j][e] = 0.f; });
  float sf[4][2] = {};
  uint32_t zl[4][2] = {}, zh[4][2] = {};

  uint4 s_next = make_uint4(0, 0, 0, 0), z_next = s_next;  // scales / zeros of group `grp`, fetched ahead
  auto load_sz = [&](int g) { load_group_sz(p, g, nblk, nb, g8, s_next, z_next); };

  int rem = a % gs_st, grp = a / gs_st;
  bool first = true;
  // The prologue's weights, scales and zeros do not depend on the previous kernel: under programmatic dependent
  // launch they are in flight while it finishes; the activations are read only after griddep_wait.
#pragma unroll
  for (int j = 0; j < D; ++j)
    if (j < iters) issue_w(j, wq[j]);
  if (iters > 0) load_sz(grp);
  griddep_wait();
  if (p.pdl >= 2) griddep_launch_dependents();  // early trigger: the next kernel may launch now (and wait)
  if (xs_on) {  // the CTA's activation range, 16 bytes a thread at a time
    const int cpr = xrange / 8;
    const T* x0 = reinterpret_cast<const T*>(p.a) + static_cast<size_t>(cst0) * KS * 16;
    for (int i = threadIdx.x; i < xrows * cpr; i += THREADS) {
      const int r = i / cpr, c = i - r * cpr;
      *reinterpret_cast<uint4*>(xsm + r * xstride + c * 8) =
          __ldg(reinterpret_cast<const uint4*>(x0 + static_cast<size_t>(r) * p.k + c * 8));
    }
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < D; ++j)
    if (j < iters) issue_x(j, xq[j]);

  // the main loop (issue_x chooses the activations' source, shared memory or L1, at every K step: one loop a source
  // was 0-8% slower on the H200, docs/benchmarks/int4-cuda.md "M = 1: the compute-only probe ...")
  for (int base = 0; base < iters; base += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int it = base + j;
      if (it < iters) {
        if (rem == 0 || first) {
          if (!first) group_flush<NT>(acc, accg, sf);
          group_begin<T>(s_next, z_next, sf, zl, zh);
          if ((grp + 1) * gs_st < a + iters) load_sz(grp + 1);
        }
        uint4 wc[KS];
        uint32_t xc[KS][NT][2];
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
          wc[kk] = wq[j][kk];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            xc[kk][nt][0] = xq[j][kk][nt][0];
            xc[kk][nt][1] = xq[j][kk][nt][1];
          }
        }
        if (it + D < iters) {
          issue_w(it + D, wq[j]);
          issue_x(it + D, xq[j]);
        }
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) group_step<T, NT>(wc[kk], xc[kk], zl, zh, accg);
        first = false;
        if (++rem == gs_st) {
          rem = 0;
          ++grp;
        }
      }
    }
  }
  group_flush<NT>(acc, accg, sf);
  griddep_launch_dependents();  // the next kernel may start its own prologue during this epilogue (no-op if done)

  if constexpr (KW > 1) reduce_k_warps<NT, WNN, KW>(acc, smem, kw, wn, lane);  // into warp kw = 0
  store_output<T, NT, WNN, THREADS>(p, acc, active && kw == 0, nb, split, s_last);
}
