// sdquant W4A16 "lean" direct decode kernel (variants 28+). Included by w4a16_kernel.cuh inside its namespace, after
// w4a16_streamk.cuh (uses Ops, ldg_stream16, reduce_k_warps, store_output).
//
// Why (bench/read_order.py, H200): streaming 8192x28672's fragments one warp per contiguous stream reads at
// 29-33 us with ~14-27 warps/SM and 30-40+ us below that; what the GPU needs is many concurrent warps with a few KB
// each in flight, not a particular read order. The direct kernels hold 16 warps/SM at 127 registers (the register
// ring, two accumulator sets, zero/scale pairs fetched a group ahead). This kernel keeps the same fragment stream
// (each warp one 64-feature block, a contiguous K range, 16-byte non-allocating loads) but trims registers so that
// 20-24 warps fit per SM at <= 80-96 registers:
// * a ring of R single K steps (R x 512 B a warp in flight), each slot refilled right after its MMAs, so the
//   registers are R slots, not R + one stage being computed;
// * WSCALE (bf16 only): each dequantized pair is multiplied by its group scale in bf16 (one mul a pair) and fed to
//   the MMA, so there is one accumulator set (fp16 keeps fp32 group sums: (code - zero) * scale can be subnormal);
// * scales/zeros are loaded when a group starts (no registers held a group ahead); their lines were prefetched to
//   L2 up to 8 groups ahead, so the load is an L2 hit while the ring's loads keep DRAM busy;
// * no activation ring: each K step's activations come one step ahead from L1 (every warp reads the same few KB).
//   Rows past M are clamped to row M - 1 (no predicates): their MMA columns are junk that is never stored.
// Split-K: grid (tiles, S); the S CTAs of a tile are launched as one thread-block cluster when S <= CL, and reduce
// through distributed shared memory (every CTA sums a slice of the tile over the cluster's CTAs and K-warps in a
// fixed order and writes it): no fp32 partials in global memory, no lock, no serial last-CTA tail. S > CL (or a
// launch that cannot take a cluster) falls back to the fp32 partials + lock of store_output. Deterministic either way.
// RAW = 1 (both dtypes; WSCALE ignored): the MMA takes the raw magic-number codes (128 + c in bf16, 1024 + c in fp16:
// exact) with no zero subtraction, 7 instructions per 32-bit word instead of 11 (bf16); a fifth MMA per K step with
// an all-ones A fragment sums the activations, and each group folds in as acc += s * sum - s * (magic + z) * sum(x),
// in fp32. The cancellation costs ~5 (bf16) / ~8 (fp16) of fp32's 24 bits.
// FLAT = 1 (KW = 1, no clusters): w4a16_lean_flat_kernel, a persistent grid of the resident slots whose W warps each
// take W-th of the flattened (block, K step) space (see there).
// Measured (H200, run 6, docs/benchmarks/int4-cuda.md "INT4 CUDA kernel tuning (run 6 ...)"; variants 28-37 at commit 16db4d8, before the RAW codes and the
// step-loop trim): no WSCALE variant beat the direct kernel v10 at any M = 1-8 point except 4096x6144 M = 2-8 (v37,
// 10.4-10.6 vs 10.8-11.5 us); more warps per SM at the same bytes per SM did not help (v34: 32 warps x 1 KB, 52.2 us
// vs v10's 16 x 2 KB, 51.7, on 8192x28672); the cluster reduction was a large loss (v30 vs the same kernel without
// clusters, v37: 14.8 vs 9.1 us on 4096x4096, 30.9 vs 18.2 on 14336x4096). Per K step (bf16, one token tile, ptxas
// SASS, steady state without the group-start code): v10 84 instructions, v17 110, WSCALE lean 88, RAW lean 59-61,
// flat RAW 61-64. Run 6b (688daaf) timed the RAW and flat variants (38-49): none won at any shape or M = 1-8 (geo-mean
// time / best at M = 1: v10 1.03, v39 RAW 1.22, v45 1.25); v37 won 4096x6144 at M = 2-8 and is its default there.
// (Ids 38-41 and 43-44 now name the tight kernel, w4a16_tight.cuh; the RAW lean configs keep 46-48.)
template <int WNN_, int KW_, int R_, int MINB_, int MINB2_, int HMINB_, int WSCALE_, int CL_ = 8, int RAW_ = 0,
          int FLAT_ = 0>
struct LCfg {  // MINB / MINB2: min CTAs per SM for ptxas at one / two token tiles in bf16; HMINB: fp16 at one tile
  static constexpr int WNN = WNN_, KW = KW_, R = R_, MINB = MINB_, MINB2 = MINB2_, HMINB = HMINB_;
  static constexpr int WSCALE = WSCALE_, CL = CL_, RAW = RAW_, FLAT = FLAT_;
  static_assert(FLAT == 0 || (KW == 1 && CL == 0), "FLAT: one warp a stream, fp32 partials");
  static constexpr int WARPS = WNN * KW;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int STAGES = 1, PRE = 1;
  static constexpr bool DIRECT = false;
  static constexpr int KIND = 3;
};

template <typename C>
constexpr bool lean_flat() {  // any kernel config: is it a flat lean one
  if constexpr (C::KIND == 3) return C::FLAT != 0;
  else return false;
}

template <typename C, int NT>
constexpr int lean_smem() { return C::WARPS * NT * 16 * 32 * 4; }  // every warp's accumulators, [warp][nt*16+r][lane]

template <typename T, typename C, int NT>
constexpr int lean_minb() {
  return std::is_same<T, half>::value ? (NT == 1 ? C::HMINB : 1) : (NT == 1 ? C::MINB : C::MINB2);
}

__device__ __forceinline__ void prefetch_l2_line(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

__device__ __forceinline__ unsigned cluster_ctas() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
  return r;
}

// One warp: acc = its block nb's sum over K steps [a, a + iters) (iters = 0: acc = 0, no loads).
template <typename T, typename C, int NT>
__device__ __forceinline__ void lean_segment(const SdqW4A16Params& p, float (&acc)[NT][4][4], int nb, int a, int iters) {
  constexpr int R = C::R;
  constexpr bool RAW = C::RAW != 0;
  constexpr bool WS = !RAW && C::WSCALE && std::is_same<T, __nv_bfloat16>::value;
  constexpr float MAGIC = std::is_same<T, half>::value ? 1024.f : 128.f;
  using O = Ops<T>;
  const int lane = threadIdx.x % 32, g8 = lane / 4, t4 = lane % 4;
  const int nblk = p.n / 64, kb_total = p.k / 16, m = p.m, gk = p.group_k16;

  static_assert(R % 2 == 0, "the activation double buffer is indexed by the parity of the unrolled step");
  const uint4* wsrc = reinterpret_cast<const uint4*>(p.b) +
                      (static_cast<size_t>(nb) * kb_total + static_cast<size_t>(a)) * 32 + lane;
  // activation rows past M are clamped to row M - 1: a token column of the MMA depends only on its own B column, so
  // those columns hold finite junk that is never stored, and the loads need no predicate
  const T* xr[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    xr[nt] = reinterpret_cast<const T*>(p.a) + static_cast<size_t>(min(nt * 8 + g8, m - 1)) * p.k +
             static_cast<size_t>(a) * 16 + 2 * t4;

  // scales / zeros of this warp's groups: L2 prefetch of the first 8 groups now (lanes 0-15: s, z of one group each);
  // the group changes before step `ngs` (relative), so the per-step test is one compare
  int grp = a / gk, ngs = gk - (a - grp * gk);
  const int g_last = iters > 0 ? (a + iters - 1) / gk : grp - 1;
  auto sz_off = [&](int g) { return (static_cast<size_t>(g) * nblk + nb) * 8; };  // uint4 index of (g, nb), 128 B
  if (lane < 16 && grp + lane / 2 <= g_last)
    prefetch_l2_line(reinterpret_cast<const uint4*>(lane & 1 ? p.zs : p.s) + sz_off(grp + lane / 2));

  uint4 wq[R];
  auto issue = [&](int s, uint4& w) { w = ldg_stream16(wsrc + static_cast<size_t>(s) * 32); };
  auto load_x = [&](int s, uint32_t (&xx)[NT][2]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const T* x = xr[nt] + s * 16;
      xx[nt][0] = __ldg(reinterpret_cast<const unsigned int*>(x));
      xx[nt][1] = __ldg(reinterpret_cast<const unsigned int*>(x + 8));
    }
  };

  constexpr int NG = WS ? 1 : NT;  // fp32 group sums (unused with WS)
  float accg[NG][4][4];
  frag_each<NT>([&](int i, int j, int e) { acc[i][j][e] = 0.f; });
#pragma unroll
  for (int i = 0; i < NG; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) accg[i][j][e] = 0.f;
  float xs[NT][4];         // RAW: this group's activation sums, xs[nt][e] = sum of x[token nt * 8 + 2t + (e & 1)]
  float nz[4][2] = {};     // RAW: -s * (magic + z) of rows (w, h)
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) xs[i][e] = 0.f;
  float sf[4][2] = {};     // fp32 scales (group-sum mode)
  uint32_t s2[4][2] = {};  // scale pairs in T (WS)
  uint32_t zl[4][2] = {}, zh[4][2] = {};
  auto flush = [&]() {
    if constexpr (!WS) group_flush<NT, RAW>(acc, accg, sf, nz, xs);
  };
  auto start_group = [&]() {  // this group's scales / zeros (an L2 hit: prefetched), the prefetch 8 groups ahead
    const size_t o = sz_off(grp) + g8;
    const uint4 s4 = __ldg(reinterpret_cast<const uint4*>(p.s) + o);
    const uint4 z4 = __ldg(reinterpret_cast<const uint4*>(p.zs) + o);
    if (lane < 2 && grp + 8 <= g_last)
      prefetch_l2_line(reinterpret_cast<const uint4*>(lane ? p.zs : p.s) + sz_off(grp + 8));
    const uint32_t sp[4] = {s4.x, s4.y, s4.z, s4.w};
    const uint32_t zp[4] = {z4.x, z4.y, z4.z, z4.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 f = __half22float2(*reinterpret_cast<const half2*>(&sp[w]));
      if constexpr (WS) {
        const typename O::T2 lo = O::pack(f.x, f.x), hi = O::pack(f.y, f.y);
        s2[w][0] = *reinterpret_cast<const uint32_t*>(&lo);
        s2[w][1] = *reinterpret_cast<const uint32_t*>(&hi);
      } else {
        sf[w][0] = f.x;
        sf[w][1] = f.y;
      }
      if constexpr (RAW) {  // zeros are stored in T: (z_g, z_g+8)
        const typename O::T2 zz = *reinterpret_cast<const typename O::T2*>(&zp[w]);
        nz[w][0] = -f.x * (MAGIC + __low2float(zz));
        nz[w][1] = -f.y * (MAGIC + __high2float(zz));
      } else {
        O::zero_pairs(zp[w], 0, zl[w][0], zh[w][0]);
        O::zero_pairs(zp[w], 1, zl[w][1], zh[w][1]);
      }
    }
  };

#pragma unroll
  for (int j = 0; j < R; ++j)
    if (j < iters) issue(j, wq[j]);
  uint32_t xb[2][NT][2];  // activations of steps it (xb[it & 1]) and it + 1
  if (iters > 0) {
    load_x(0, xb[0]);
    start_group();
  }

  for (int base = 0; base < iters; base += R) {  // base is a multiple of R (even): the step's parity is j's
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int it = base + j;
      if (it < iters) {
        if (it == ngs) {  // a new group: fold the last one in (group sums), fetch this one's scales/zeros
          flush();
          ++grp;
          ngs += gk;
          start_group();
        }
        load_x(min(it + 1, iters - 1), xb[(j + 1) & 1]);  // one step ahead (the last step reloads itself)
        const uint32_t q[4] = {wq[j].x, wq[j].y, wq[j].z, wq[j].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          uint32_t c[4];
          if constexpr (RAW) raw_codes<T>(q[w], c);
          else O::codes(q[w], zl[w], zh[w], c);
          if constexpr (WS) {
#pragma unroll
            for (int i = 0; i < 4; ++i) c[i] = O::mul2(c[i], s2[w][i >> 1]);
          }
          const uint32_t af[4] = {c[0], c[2], c[1], c[3]};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if constexpr (WS) O::mma(acc[nt][w], af, xb[j & 1][nt][0], xb[j & 1][nt][1]);
            else O::mma(accg[nt][w], af, xb[j & 1][nt][0], xb[j & 1][nt][1]);
          }
        }
        if constexpr (RAW) {  // activation sums: an all-ones A (1.0 pairs) against this step's B fragments
          constexpr uint32_t ONE2 = std::is_same<T, half>::value ? 0x3c003c00u : 0x3f803f80u;
          const uint32_t ones[4] = {ONE2, ONE2, ONE2, ONE2};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) O::mma(xs[nt], ones, xb[j & 1][nt][0], xb[j & 1][nt][1]);
        }
        if (it + R < iters) issue(it + R, wq[j]);  // the slot is free again: refill it R steps ahead
      }
    }
  }
  flush();
}

template <typename T, typename C, int NT>
__global__ void __launch_bounds__(C::THREADS, lean_minb<T, C, NT>()) w4a16_lean_kernel(const SdqW4A16Params p) {
  constexpr int WNN = C::WNN, KW = C::KW, THREADS = C::THREADS;
  using O = Ops<T>;
  extern __shared__ __align__(16) uint8_t ln_dyn[];
  __shared__ int s_last;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wn = warp % WNN, kw = warp / WNN;
  const int g8 = lane / 4, t4 = lane % 4;
  const int nblk = p.n / 64;
  const int nb = blockIdx.x * WNN + wn;
  const bool active = nb < nblk;
  const int kb_total = p.k / 16;
  const int S = p.splits, split = blockIdx.y;
  const int qi = split * KW + kw, Q = S * KW;  // this warp's share of the tile's K steps: [a, b)
  const int a = static_cast<int>((static_cast<long long>(kb_total) * qi) / Q);
  const int b = static_cast<int>((static_cast<long long>(kb_total) * (qi + 1)) / Q);
  const int iters = active ? b - a : 0;
  const int m = p.m;

  float acc[NT][4][4];
  lean_segment<T, C, NT>(p, acc, active ? nb : 0, a, iters);

  // ---- epilogue: sum the tile's S x KW warps per block in a fixed order (split-major, then K-warp)
  const unsigned ncl = cluster_ctas();
  if (S > 1 && ncl != static_cast<unsigned>(S)) {  // no cluster: K-warps through shared memory, then fp32 partials
    if constexpr (KW > 1) reduce_k_warps<NT, WNN, KW>(acc, ln_dyn, kw, wn, lane);
    store_output<T, NT, WNN, THREADS>(p, acc, active && kw == 0, nb, split, s_last);
    return;
  }
  float* red = reinterpret_cast<float*>(ln_dyn);  // [warp][NT * 16][32]
  frag_each<NT>([&](int nt, int w, int e) { red[((warp * NT + nt) * 16 + w * 4 + e) * 32 + lane] = acc[nt][w][e]; });
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  if (S > 1) cluster.sync();  // every CTA's sums are in its shared memory (release / acquire across the cluster)
  else __syncthreads();
  // quads of 4 lanes: u -> (wn, r = nt * 16 + w * 4 + e, lanes 4g .. 4g + 3); this CTA sums quads [u0, u1)
  constexpr int E4 = WNN * NT * 16 * 8;
  const int rank = S > 1 ? static_cast<int>(cluster.block_rank()) : 0;
  const int u0 = E4 * rank / S, u1 = E4 * (rank + 1) / S;
  T* out = reinterpret_cast<T*>(p.c);
  for (int u = u0 + static_cast<int>(threadIdx.x); u < u1; u += THREADS) {
    const int uw = u / (NT * 16 * 8), r = (u / 8) % (NT * 16), g = u % 8;
    const int nbo = blockIdx.x * WNN + uw;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int qq = 0; qq < S; ++qq) {
      const float* src = S > 1 ? cluster.map_shared_rank(red, qq) : red;
#pragma unroll
      for (int k2 = 0; k2 < KW; ++k2) {
        const float4 v = *reinterpret_cast<const float4*>(src + (((k2 * WNN + uw) * NT) * 16 + r) * 32 + 4 * g);
        sum.x += v.x;
        sum.y += v.y;
        sum.z += v.z;
        sum.w += v.w;
      }
    }
    if (nbo < nblk) {
      const int nt = r / 16, w = (r / 4) % 4, e = r % 4;
      const int col = nbo * 64 + 16 * w + 8 * (e >> 1) + g;
      const float vv[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
      for (int l = 0; l < 4; ++l) {  // lane 4g + l: token nt * 8 + 2l + (e & 1)
        const int tok = nt * 8 + 2 * l + (e & 1);
        if (tok < m) out[static_cast<size_t>(tok) * p.n + col] = O::one(vv[l]);
      }
    }
  }
  if (S > 1) cluster.sync();  // no CTA leaves while another still reads its shared memory
}

// Flat lean kernel (FLAT = 1): the tiled grid above rounds blocks x splits onto the resident warps (8192x28672: 448
// blocks -> 85% of the slots busy whatever the split); here the grid is G = p.splits CTAs (the resident slots) and warp
// w of W = G * WARPS takes the K steps [w * U / W, (w + 1) * U / W) of the flattened (block, K step) space,
// U = N/64 * K/16, block-major: every warp streams the same bytes (+-1 K step) -- stream-K at warp granularity. A warp
// whose range covers a whole block writes y; the <= 2 partial segments of a warp go to fp32 partials
// (p.partial[(w * 2 + first/last) * m * 64]), counted per block on p.locks[block]; the last of a block's segments to
// arrive sums them in warp order (deterministic, no spin-wait) and resets the counter.
__host__ __device__ __forceinline__ long long lean_units(int n, int k) {
  return static_cast<long long>(n / 64) * (k / 16);
}
__host__ __device__ __forceinline__ int lean_flat_grid(int requested, long long units, int warps) {
  long long g = requested < 1 ? 1 : requested;
  if (g * warps > units) g = units / warps;  // every warp gets at least one K step
  return g < 1 ? 1 : static_cast<int>(g);
}

// The output of one flat-grid segment (warp w of W, block nb, K steps [a, e) of kbt): the whole block writes y;
// otherwise the segment's fp32 partial goes to p.partial[(w * 2 + first/last) * m * 64], counted on p.locks[nb], and
// the last of the block's segments to arrive sums them in warp order and resets the counter. Warp-collective.
template <typename T, int NT>
__device__ __forceinline__ void flat_segment_out(const SdqW4A16Params& p, const float (&acc)[NT][4][4], int nb, int a,
                                                 int e, long long U, int W, int w) {
  using O = Ops<T>;
  const int lane = threadIdx.x % 32, g8 = lane / 4, t4 = lane % 4;
  const int kbt = p.k / 16, m = p.m, n = p.n;
  T* out = reinterpret_cast<T*>(p.c);
  if (a == 0 && e == kbt) {  // the whole block: write y
    frag_each<NT>([&](int nt, int w4, int q) {
      const int tok = nt * 8 + 2 * t4 + (q & 1);
      if (tok < m) out[static_cast<size_t>(tok) * n + nb * 64 + 16 * w4 + 8 * (q >> 1) + g8] = O::one(acc[nt][w4][q]);
    });
    return;
  }
  const bool first_seg = nb == static_cast<int>(sk_begin(U, W, w) / kbt);
  float* part = p.partial + (static_cast<size_t>(w) * 2 + (first_seg ? 0 : 1)) * m * 64;
  frag_each<NT>([&](int nt, int w4, int q) {
    const int tok = nt * 8 + 2 * t4 + (q & 1);
    if (tok < m) __stcg(part + tok * 64 + 16 * w4 + 8 * (q >> 1) + g8, acc[nt][w4][q]);
  });
  const long long bu0 = static_cast<long long>(nb) * kbt;
  const int c0 = sk_owner(U, W, bu0), c1 = sk_owner(U, W, bu0 + kbt - 1);  // the warps holding this block's segments
  __threadfence();  // this lane's partials are visible device-wide before the warp is counted
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(&p.locks[nb], 1) == c1 - c0;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return;
  __threadfence();
  const int c0_first = static_cast<int>(sk_begin(U, W, c0) / kbt);
  for (int i = lane; i < m * 32; i += 32) {  // (token, column pair); warps c0..c1 in order, 8 loads in flight
    const int row = i / 32, lc = 2 * (i % 32);
    const float2 sum = sum_segment_partials(p.partial, c0, c1, c0_first != nb, m, row, 64, lc);
    *reinterpret_cast<typename O::T2*>(out + static_cast<size_t>(row) * n + nb * 64 + lc) = O::pack(sum.x, sum.y);
  }
  __syncwarp();
  if (lane == 0) p.locks[nb] = 0;  // every segment of this block has arrived: reset for the next call
}

template <typename T, typename C, int NT>
__global__ void __launch_bounds__(C::THREADS, lean_minb<T, C, NT>()) w4a16_lean_flat_kernel(const SdqW4A16Params p) {
  const int kbt = p.k / 16;
  const long long U = lean_units(p.n, p.k);
  // W <= U: no warp has an empty range (the launcher's grid ensures it unless U < WARPS; then the extra warps idle)
  const int W = static_cast<int>(min(static_cast<long long>(p.splits) * C::WARPS, U));
  if (static_cast<int>(blockIdx.x * C::WARPS + threadIdx.x / 32) >= W) return;  // no barriers below: warps are independent
  const int u1 = static_cast<int>(sk_begin(U, W, blockIdx.x * C::WARPS + threadIdx.x / 32 + 1));  // U < 2^31
  for (int u = static_cast<int>(sk_begin(U, W, blockIdx.x * C::WARPS + threadIdx.x / 32)); u < u1;) {
    const int nb = u / kbt;
    const int a = u - nb * kbt;
    const int e = min(kbt, a + (u1 - u));
    u += e - a;
    float acc[NT][4][4];
    lean_segment<T, C, NT>(p, acc, nb, a, e - a);
    flat_segment_out<T, NT>(p, acc, nb, a, e, U, W, blockIdx.x * C::WARPS + threadIdx.x / 32);
  }
}
