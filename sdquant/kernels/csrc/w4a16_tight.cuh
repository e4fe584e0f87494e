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
  static_assert(D % 2 == 0, "the activation registers alternate by chunk parity");
};
constexpr int TIGHT_U = 4;  // K steps a chunk

template <typename C, int NT>
constexpr int tight_smem() { return (C::KW - 1) * C::WNN * NT * 16 * 32 * 4; }  // reduce_k_warps' buffer

// 16 bytes with a non-allocating load if `on`, else r unchanged (no branch)
__device__ __forceinline__ void ldg_stream16_if(uint4& r, const uint4* p, bool on) {
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
      " @q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
      : "l"(p), "r"(static_cast<int>(on)));
}

template <typename T, typename C, int NT>
__global__ void __launch_bounds__(C::THREADS, NT == 1 ? C::MINB : 1) w4a16_tight_kernel(const SdqW4A16Params p) {
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

  if constexpr (KW > 1) reduce_k_warps<NT, WNN, KW>(acc, smem, kw, wn, lane);  // into warp kw = 0
  store_output<T, NT, WNN, C::THREADS>(p, acc, active && kw == 0, nb, split, s_last);
}
