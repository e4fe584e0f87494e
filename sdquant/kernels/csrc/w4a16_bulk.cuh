// sdquant W4A16 "bulk" decode kernel (variants 50+): the direct kernel's grid and arithmetic, fed by the Hopper
// bulk-copy engine (cp.async.bulk, the 1-D form of TMA) instead of per-lane loads. Included by w4a16_kernel.cuh
// inside its namespace, after w4a16_lean.cuh (uses Ops, reduce_k_warps, store_output, griddep_*).
//
// Why (docs/benchmarks/int4-cuda.md, runs 5-6 and the read-order probes): the weight stream of every earlier kernel is capped
// by the bytes each SM keeps in flight. Per-lane loads hold them in registers (the direct kernel: ~16 warps x 2 KB
// per SM, 127 registers), per-lane cp.async costs one instruction and one LSU request per 16 bytes and lane, and
// the load-only probes put both patterns at 36-38 us on 8192x28672 against a 27 us linear read. Here each warp owns a
// ring of RING shared-memory slots of CH K steps (CH x 512 contiguous bytes of its block's fragments); lane 0 fills
// a slot with ONE bulk copy that signals the slot's mbarrier (complete_tx), so a warp keeps RING x CH x 512 bytes in
// flight at the cost of shared memory only (e.g. 16 warps x 12 KB = 192 KB per SM), with one instruction per chunk.
// A chunk is read back with one 16-byte ld.shared per lane and K step (lane l reads exactly its own fragment: no
// bank conflicts, no barrier between warps), and the slot is refilled right after those reads, before the chunk's
// arithmetic. Warps stay independent (per-warp barriers, no __syncthreads in the loop).
// Everything else is the direct kernel's: grid (tiles, splits), KW warps of a block split each CTA's K range,
// scales/zeros a group ahead in registers, activations one 2-step stage ahead from L1, fp32 group sums scaled once per
// group, fp32 partials + lock for split-K (store_output). Under programmatic dependent launch the ring's first RING
// chunks are requested before griddepcontrol.wait (they do not depend on the previous kernel).
// EV = 1: the bulk copies carry an L2 evict-first cache hint (the weights are read once a call).
// PROBE = 1: the same copies and shared-memory reads, no arithmetic (a read probe; sdq_w4a16_probe kinds 7, 8).
// FLAT = 1 (WNN = KW = 1 means WARPS = WNN; w4a16_bulk_flat_kernel): the lean flat kernel's grid -- G CTAs (the
// resident slots), warp w of W = G * WARPS takes the K steps [w * U / W, (w + 1) * U / W) of the flattened
// block-major (block, K step) space, which in this layout is one contiguous byte range: every warp streams the same
// bytes (+-512) in address order through its ring, switching blocks inside the stream; segments that do not cover a
// whole block are summed through fp32 partials (flat_segment_out, w4a16_lean.cuh).
template <int WNN_, int KW_, int CH_, int RING_, int MINB_, int EV_ = 1, int PROBE_ = 0, int FLAT_ = 0>
struct BCfg {
  static constexpr int WNN = WNN_, KW = KW_, CH = CH_, RING = RING_, MINB = MINB_, EV = EV_, PROBE = PROBE_;
  static constexpr int FLAT = FLAT_;
  static_assert(FLAT == 0 || KW == 1, "FLAT: one warp a stream");
  static_assert(FLAT || (CH % 2 == 0 && CH >= 2), "a chunk is whole 2-step stages");
  static constexpr int WARPS = WNN * KW;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int STAGES = 1, PRE = 1;
  static constexpr bool DIRECT = false;
  static constexpr int KIND = 4;
  static constexpr int CHUNK_BYTES = CH * 512;
  static constexpr int RING_BYTES = WARPS * RING * CHUNK_BYTES;
};

template <typename C, int NT>
constexpr int bulk_smem() {  // the rings, then one 8-byte mbarrier per slot; the K-warp reduction reuses the rings
  static_assert((C::KW - 1) * C::WNN * NT * 16 * 32 * 4 <= C::RING_BYTES, "reduction buffer must fit in the rings");
  return C::RING_BYTES + C::WARPS * C::RING * 8;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
// Orders this thread's earlier generic-proxy shared-memory accesses before its later async-proxy ones (the reads
// of a slot before the bulk copy that overwrites it).
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
template <int EV>
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                              uint64_t policy) {
  if constexpr (EV) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::
            "r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
  } else {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
  }
}
// Lane 0 of a warp: the R slot barriers of its ring initialized (one arrival each, the expect_tx of the copy) and
// the first min(R, nchunks) chunks requested (issue(chunk, slot)).
template <int R, typename Issue>
__device__ __forceinline__ void ring_start(uint32_t bar0, int nchunks, Issue&& issue) {
#pragma unroll
  for (int r = 0; r < R; ++r) mbar_init(bar0 + r * 8, 1);
  mbar_fence_init();
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (r < nchunks) issue(r, r);
}
// Every lane: wait until the copy of this phase has landed in the slot of barrier bar. A copy that never lands is a
// bug, not a slow GPU: trap after 2^22 failed polls instead of hanging.
__device__ __forceinline__ void ring_wait(uint32_t bar, uint32_t phase) {
  for (uint32_t spins = 0; !mbar_try_wait(bar, phase);)
    if (++spins == (1u << 22)) __trap();
}
// (a "memory" clobber: the compiler must not sink these reads below the __syncwarp that lets lane 0 refill the slot)
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(addr)
               : "memory");
  return r;
}

template <typename T, typename C, int NT>
__global__ void __launch_bounds__(C::THREADS, NT == 1 ? C::MINB : 1) w4a16_bulk_kernel(const SdqW4A16Params p) {
  constexpr int WNN = C::WNN, KW = C::KW, R = C::RING, THREADS = C::THREADS;
  constexpr int KS = 2;            // K steps per stage (every group is a whole number of stages)
  constexpr int SPC = C::CH / KS;  // stages per chunk
  constexpr int CB = C::CHUNK_BYTES;
  using O = Ops<T>;
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
  const int nchunks = (iters + SPC - 1) / SPC;
  const int m = p.m;
  const int gs_st = p.group_k16 / KS;

  const uint32_t ring = smem_addr(smem) + warp * R * CB;
  const uint32_t bar0 = smem_addr(smem) + C::RING_BYTES + warp * R * 8;
  const char* wsrc =
      reinterpret_cast<const char*>(p.b) + (static_cast<size_t>(active ? nb : 0) * kb_total + static_cast<size_t>(a) * KS) * 512;
  uint64_t policy = 0;
  if constexpr (C::EV) policy = evict_first_policy();
  auto issue = [&](int c, int slot) {  // lane 0: chunk c (its stages that exist) into `slot`
    const int s = c * SPC;
    const int ns = iters - s < SPC ? iters - s : SPC;
    const uint32_t bytes = static_cast<uint32_t>(ns) * KS * 512;
    const uint32_t bar = bar0 + slot * 8;
    mbar_arrive_expect_tx(bar, bytes);
    bulk_copy_g2s<C::EV>(ring + slot * CB, wsrc + static_cast<size_t>(s) * KS * 512, bytes, bar, policy);
  };
  if (lane == 0 && nchunks > 0) ring_start<R>(bar0, nchunks, issue);
  __syncwarp();

  const T* xsrc = reinterpret_cast<const T*>(p.a) + static_cast<size_t>(a) * KS * 16 + 2 * t4;
  auto issue_x = [&](int s, uint32_t (&xx)[KS][NT][2]) {  // activation loads of relative stage s
    load_x_steps<T, NT, KS>(p, xsrc, s * KS * 16, g8, m, xx);
  };

  float acc[NT][4][4] = {}, accg[NT][4][4] = {};
  float sf[4][2] = {};
  uint32_t zl[4][2] = {}, zh[4][2] = {};
  uint4 s_next = make_uint4(0, 0, 0, 0), z_next = s_next;  // scales / zeros of group `grp`, fetched ahead
  auto load_sz = [&](int g) { load_group_sz(p, g, nblk, nb, g8, s_next, z_next); };
  int rem = a % gs_st, grp = a / gs_st;
  bool first = true;
  if (iters > 0) load_sz(grp);
  griddep_wait();  // activations (and the output) belong to the previous kernel of the stream
  if (p.pdl >= 2) griddep_launch_dependents();
  uint32_t xq[KS][NT][2];
  if (iters > 0) issue_x(0, xq);
  uint32_t probe = 0;

  int slot = 0;
  uint32_t phase = 0;
  for (int c = 0; c < nchunks; ++c) {
    ring_wait(bar0 + slot * 8, phase);
    uint4 wc[SPC][KS];
#pragma unroll
    for (int j = 0; j < SPC; ++j)
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) wc[j][kk] = lds128(ring + slot * CB + (j * KS + kk) * 512 + lane * 16);
    __syncwarp();  // every lane's reads of the slot are done before it is refilled
    if (lane == 0 && c + R < nchunks) {
      fence_proxy_async_smem();
      issue(c + R, slot);
    }
    if (++slot == R) {
      slot = 0;
      phase ^= 1u;
    }
#pragma unroll
    for (int j = 0; j < SPC; ++j) {
      const int it = c * SPC + j;
      if (it < iters) {
        uint32_t xc[KS][NT][2];
#pragma unroll
        for (int kk = 0; kk < KS; ++kk)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            xc[kk][nt][0] = xq[kk][nt][0];
            xc[kk][nt][1] = xq[kk][nt][1];
          }
        if (it + 1 < iters) issue_x(it + 1, xq);
        if constexpr (C::PROBE) {
#pragma unroll
          for (int kk = 0; kk < KS; ++kk) {
            probe ^= wc[j][kk].x ^ wc[j][kk].y ^ wc[j][kk].z ^ wc[j][kk].w;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) probe ^= xc[kk][nt][0] ^ xc[kk][nt][1];
          }
          continue;
        }
        if (rem == 0 || first) {
          if (!first) group_flush<NT>(acc, accg, sf);
          group_begin<T>(s_next, z_next, sf, zl, zh);
          if ((grp + 1) * gs_st < a + iters) load_sz(grp + 1);
        }
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) group_step<T, NT>(wc[j][kk], xc[kk], zl, zh, accg);
        first = false;
        if (++rem == gs_st) {
          rem = 0;
          ++grp;
        }
      }
    }
  }
  group_flush<NT>(acc, accg, sf);
  griddep_launch_dependents();  // the next kernel may start its own prologue during this epilogue

  if constexpr (C::PROBE) {
    if (probe == 0x9e3779b9u && m < 0) reinterpret_cast<T*>(p.c)[threadIdx.x] = O::one(0.f);  // never true
    return;
  }
  if constexpr (KW > 1) {
    __syncthreads();  // every warp is done with its ring before the reduction overwrites it
    reduce_k_warps<NT, WNN, KW>(acc, smem, kw, wn, lane);
  }
  store_output<T, NT, WNN, THREADS>(p, acc, active && kw == 0, nb, split, s_last);
}

template <typename C>
constexpr bool bulk_flat() {  // any kernel config: is it a flat bulk-copy one
  if constexpr (C::KIND == 4) return C::FLAT != 0;
  else return false;
}

template <typename T, typename C, int NT>
__global__ void __launch_bounds__(C::THREADS, NT == 1 ? C::MINB : 1) w4a16_bulk_flat_kernel(const SdqW4A16Params p) {
  constexpr int R = C::RING, CH = C::CH, CB = C::CHUNK_BYTES;
  using O = Ops<T>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g8 = lane / 4, t4 = lane % 4;
  const int kbt = p.k / 16, m = p.m, nblk = p.n / 64, gk = p.group_k16;
  const long long U = lean_units(p.n, p.k);
  const int W = static_cast<int>(min(static_cast<long long>(p.splits) * C::WARPS, U));
  const int w = blockIdx.x * C::WARPS + warp;
  if (w >= W) return;  // no CTA barriers below: warps are independent
  const int u0 = static_cast<int>(sk_begin(U, W, w)), u1 = static_cast<int>(sk_begin(U, W, w + 1));  // U < 2^31
  const int total = u1 - u0;
  const int nchunks = (total + CH - 1) / CH;
  const uint32_t ring = smem_addr(smem) + warp * R * CB;
  const uint32_t bar0 = smem_addr(smem) + C::RING_BYTES + warp * R * 8;
  const char* wsrc = reinterpret_cast<const char*>(p.b) + static_cast<size_t>(u0) * 512;
  uint64_t policy = 0;
  if constexpr (C::EV) policy = evict_first_policy();
  auto issue = [&](int c, int slot) {  // lane 0: chunk c (its K steps that exist) into `slot`
    const int s = c * CH;
    const uint32_t bytes = static_cast<uint32_t>(total - s < CH ? total - s : CH) * 512;
    const uint32_t bar = bar0 + slot * 8;
    mbar_arrive_expect_tx(bar, bytes);
    bulk_copy_g2s<C::EV>(ring + slot * CB, wsrc + static_cast<size_t>(s) * 512, bytes, bar, policy);
  };
  if (lane == 0) ring_start<R>(bar0, nchunks, issue);
  __syncwarp();
  griddep_wait();  // activations (and the output) belong to the previous kernel of the stream
  if (p.pdl >= 2) griddep_launch_dependents();

  int slot = 0, off = 0, c = 0;
  uint32_t phase = 0, probe = 0;
  for (int u = u0; u < u1;) {
    const int nb = u / kbt;
    const int a = u - nb * kbt;
    const int e = min(kbt, a + (u1 - u));
    u += e - a;
    float acc[NT][4][4] = {}, accg[NT][4][4] = {};
    float sf[4][2] = {};
    uint32_t zl[4][2] = {}, zh[4][2] = {};
    uint4 s_next, z_next;  // scales / zeros of group `grp`, fetched ahead
    auto load_sz = [&](int g) { load_group_sz(p, g, nblk, nb, g8, s_next, z_next); };
    int grp = a / gk, rem = a - grp * gk;
    load_sz(grp);
    const T* xsrc = reinterpret_cast<const T*>(p.a) + 2 * t4;
    uint32_t xq[1][NT][2];  // the next K step's activations
    load_x_steps<T, NT, 1>(p, xsrc, a * 16, g8, m, xq);
    for (int ks = a; ks < e; ++ks) {
      if (rem == 0 || ks == a) {
        if (ks != a) group_flush<NT>(acc, accg, sf);
        group_begin<T>(s_next, z_next, sf, zl, zh);
        if ((grp + 1) * gk < e) load_sz(grp + 1);
      }
      if (off == 0) ring_wait(bar0 + slot * 8, phase);
      const uint4 wk = lds128(ring + slot * CB + off * 512 + lane * 16);
      if (++off == CH) {  // the slot is read: refill it with chunk c + R
        __syncwarp();
        if (lane == 0 && c + R < nchunks) {
          fence_proxy_async_smem();
          issue(c + R, slot);
        }
        off = 0;
        ++c;
        if (++slot == R) {
          slot = 0;
          phase ^= 1u;
        }
      }
      uint32_t xc[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        xc[nt][0] = xq[0][nt][0];
        xc[nt][1] = xq[0][nt][1];
      }
      if (ks + 1 < e) load_x_steps<T, NT, 1>(p, xsrc, (ks + 1) * 16, g8, m, xq);
      if constexpr (C::PROBE) {
        probe ^= wk.x ^ wk.y ^ wk.z ^ wk.w;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) probe ^= xc[nt][0] ^ xc[nt][1];
      } else {
        group_step<T, NT>(wk, xc, zl, zh, accg);
      }
      if (++rem == gk) {
        rem = 0;
        ++grp;
      }
    }
    group_flush<NT>(acc, accg, sf);
    if constexpr (!C::PROBE) flat_segment_out<T, NT>(p, acc, nb, a, e, U, W, w);
  }
  griddep_launch_dependents();
  if constexpr (C::PROBE) {
    if (probe == 0x9e3779b9u && m < 0) reinterpret_cast<T*>(p.c)[threadIdx.x] = O::one(0.f);  // never true
  }
}
