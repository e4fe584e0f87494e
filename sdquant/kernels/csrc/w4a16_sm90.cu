// sdquant W4A16 decode GEMM for sm_90: the C interface (w4a16.h). The kernels and the design notes are in
// w4a16_kernel.cuh; the w4a16_part_*.cu files instantiate them per (dtype, token tiles).
#include "w4a16_wgmma.cuh"  // (includes w4a16_kernel.cuh)

#include <utility>  // std::exchange (the process settings)

#define SDQ_DECL(NAME) extern "C" int sdq_w4a16_part_##NAME(int, int, const SdqW4A16Params*, cudaStream_t);
SDQ_DECL(f16_nt1)
SDQ_DECL(f16_nt2)
SDQ_DECL(f16_nt4)
SDQ_DECL(bf16_nt1)
SDQ_DECL(bf16_nt2)
SDQ_DECL(bf16_nt4)
SDQ_DECL(wgmma_bf16)
SDQ_DECL(wgmma_f16)
#undef SDQ_DECL
extern "C" int sdq_w4a16_part_fused_bf16(int, const SdqW4A16FusedParams*, cudaStream_t);
extern "C" int sdq_w4a16_part_fused_f16(int, const SdqW4A16FusedParams*, cudaStream_t);

namespace {

using sdq_w4a16::N_VARIANTS;
using sdq_w4a16::cp_async16;
using sdq_w4a16::cp_async_commit;
using sdq_w4a16::cp_async_wait;
using sdq_w4a16::evict_first_policy;

int dispatch_raw(int v, int op, const SdqW4A16Params& p, cudaStream_t stream) {
  if (v == 62 || v == 63)  // the wgmma kernel: M <= 256 a launch
    return p.is_bf16 ? sdq_w4a16_part_wgmma_bf16(v, op, &p, stream) : sdq_w4a16_part_wgmma_f16(v, op, &p, stream);
  if (p.is_bf16) {
    if (p.m <= 8) return sdq_w4a16_part_bf16_nt1(v, op, &p, stream);
    if (p.m <= 16) return sdq_w4a16_part_bf16_nt2(v, op, &p, stream);
    if (p.m <= 32) return sdq_w4a16_part_bf16_nt4(v, op, &p, stream);
  } else {
    if (p.m <= 8) return sdq_w4a16_part_f16_nt1(v, op, &p, stream);
    if (p.m <= 16) return sdq_w4a16_part_f16_nt2(v, op, &p, stream);
    if (p.m <= 32) return sdq_w4a16_part_f16_nt4(v, op, &p, stream);
  }
  return -2;
}

int dispatch_m(int op, const SdqW4A16Params& p, cudaStream_t stream) {
  return dispatch_raw((p.variant >= 0 && p.variant < N_VARIANTS) ? p.variant : 0, op, p, stream);
}

int sm_count() {
  int dev = 0, sms = 132;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}

__global__ void probe_kernel(const uint4* src, uint4* dst) {
  __shared__ __align__(16) uint4 buf[32];
  const uint64_t pol = evict_first_policy();
  cp_async16<true>(&buf[threadIdx.x], src + threadIdx.x, pol);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  dst[threadIdx.x] = buf[threadIdx.x];
}

}  // namespace

extern "C" int sdq_w4a16_launch(const SdqW4A16Params* p, cudaStream_t stream) {
  if (p->m < 1 || p->n % 64 || p->k % 32 || p->group_k16 < 2 || p->group_k16 % 2 || p->splits < 1 ||
      p->k % (p->group_k16 * 16) || (p->group_k16 % 4 && p->k % 32) || (p->group_k16 % 4 == 0 && p->k % 64))
    return -1;
  return dispatch_m(0, *p, stream);
}

extern "C" int sdq_w4a16_launch_fused(const SdqW4A16FusedParams* p, cudaStream_t stream) {
  const int v = p->variant;
  const bool tight = v == 38 || v == 39 || v == 40 || v == 41 || v == 43 || v == 44;
  if (!tight || p->m < 1 || p->m > 8 || p->n % 128 || p->group_k16 % 4 || p->k % 64 || p->k % (p->group_k16 * 16) ||
      p->splits < 1 || p->evict_first || (p->gamma == nullptr) != (p->c2 == nullptr) ||
      (p->rms_ss != nullptr && (p->rms_t < 1 || p->rms_t > 256)))
    return -1;
  if (p->kv != nullptr && (p->pos == nullptr || p->cos == nullptr || p->sin == nullptr || p->silu || p->resid ||
                           p->gamma || p->rope_q % 128 || p->rope_kv % 128 || p->rope_kv < 128 ||
                           p->rope_q + 2 * p->rope_kv != p->n))
    return -1;
  return p->is_bf16 ? sdq_w4a16_part_fused_bf16(v, p, stream) : sdq_w4a16_part_fused_f16(v, p, stream);
}

extern "C" int sdq_w4a16_auto_splits(int m, int n, int k, int group_k16, int is_bf16, int variant, int target2) {
  const int sms = sm_count();
  const int ks = group_k16 % 4 == 0 ? 4 : 2;
  const int stages = k / 16 / ks;
  const int nt = m <= 8 ? 1 : (m <= 16 ? 2 : 4);
  if (variant < 0 || variant >= N_VARIANTS ||
      (nt > 2 && variant != 2 && variant != 5 && variant != 37 && variant != 42 && variant != 62 && variant != 63))
    variant = 0;
  if (variant == 0 && target2 <= 0) {
    // The run-3 rule, kept bit for bit so variant 0 times as it did. CTAs per SM: shared memory, and registers
    // (ptxas: ~96 / ~148 / ~216 per thread for 1 / 2 / 4 token tiles).
    const int tiles = (n / 64 + 3) / 4;
    const int stage_bytes = 4 * ks * 512 + 4 * 256 + nt * 8 * (ks * 16 + 8) * 2;
    const int reg_cap = nt == 1 ? 5 : (nt == 2 ? 3 : 2);
    int per_sm = (227 * 1024) / (5 * stage_bytes + 1024);
    per_sm = per_sm < 1 ? 1 : (per_sm > reg_cap ? reg_cap : per_sm);
    const int slots = sms * per_sm;
    // Measured on the H200 (bench/gpu_check.py --sweep-splits): about 2.5 CTAs per SM is best; fewer leave
    // the memory system idle, CTAs beyond what fits at once form a second wave, and splits shorter than ~4
    // stages spend their time in the pipeline prologue.
    int splits = (5 * sms + tiles) / (2 * tiles);
    if (splits > slots / tiles) splits = slots / tiles;
    if (splits > stages / 4) splits = stages / 4;
    if (splits < 1) splits = 1;
    // short splits: prefer a divisor of the stage count (one split a stage longer than the rest sets the time)
    if (stages / splits < 16)
      for (int s = splits; 2 * s >= splits; --s)
        if (stages % s == 0) return s;
    return splits;
  }
  // Other variants (and explicit targets): aim at target2 / 2 CTAs per SM (0 = every resident slot, read from
  // the occupancy calculator), never more than fit at once, at least 4 stages a split.
  SdqW4A16Params q{};
  q.m = m;
  q.n = n;
  q.k = k;
  q.group_k16 = group_k16;
  q.is_bf16 = is_bf16;
  q.variant = variant;
  q.splits = 1;
  const int per_sm = dispatch_m(1, q, nullptr);
  const int wnn = dispatch_m(2, q, nullptr);
  const int kind = dispatch_m(4, q, nullptr);
  if (kind == 4) {
    // wgmma kernel: tiles of 256 features x NTOK tokens; the splits that fill the resident slots once (or
    // target2 / 2 CTAs per SM), at least 4 stages of 64 K a split
    const int ntok = sdq_wg_ntok(m);
    const int tiles = (n / 256) * ((m + ntok - 1) / ntok);
    const int slots = sms * (per_sm < 1 ? 1 : per_sm);
    const int want = target2 > 0 ? (target2 * sms + 1) / 2 : slots;
    if (dispatch_m(6, q, nullptr) == 1) {  // stream-K at this token tile: the grid, at least 4 stages a CTA
      const long long units = static_cast<long long>(tiles) * (k / 64);
      long long g = want < slots ? want : slots;
      if (g > units / 4) g = units / 4;
      return g < 1 ? 1 : static_cast<int>(g);
    }
    if (target2 <= 0 && sdq_w4a16_wg_schedule() == 0) {  // the warp-specialized split-K in clusters (wg_cluster_fit_splits)
      const int cs = dispatch_m(11, q, nullptr);
      if (cs >= 2) return cs;
      if (m > 256 && sdq_w4a16_wg_wave_splits() && dispatch_m(8, q, nullptr) == m) {  // one launch: two splits
        q.splits = 2;                                                                  // where the waves gain
        return sdq_wg_wave_splits(m, n, k, group_k16, slots, dispatch_m(10, q, nullptr), sdq_w4a16_wg_wave_cost());
      }
    }
    return sdq_wg_splits(tiles, want < slots ? want : slots, k, target2 > 0 ? 0 : 2 * sms);
  }
  if (kind == 2) {
    // lean kernel: the CTAs that fit at once (or target2 / 2 per SM), floor(CTAs / tiles) splits (a second partial
    // wave would cost more than idle slots), at least 16 K steps a split; no divisor rounding (its warps split K
    // steps, not stages)
    const int tiles = (n / 64 + wnn - 1) / wnn;
    const int slots = sms * (per_sm < 1 ? 1 : per_sm);
    const int want = target2 > 0 ? (target2 * sms + 1) / 2 : slots;
    int splits = (want < slots ? want : slots) / tiles;
    if (splits > k / 16 / 16) splits = k / 16 / 16;
    return splits < 1 ? 1 : splits;
  }
  if (kind == 3) {
    // flat lean kernel: the grid G is every resident slot (or target2 / 2 per SM), every warp at least one K step
    const long long units = sdq_w4a16::lean_units(n, k);
    const int warps = dispatch_m(5, q, nullptr);
    const int g = target2 > 0 ? (target2 * sms + 1) / 2 : sms * (per_sm < 1 ? 1 : per_sm);
    return sdq_w4a16::lean_flat_grid(g, units, warps < 1 ? 1 : warps);
  }
  if (kind == 5) {
    // feed kernel: one CTA a resident slot (or target2 / 2 per SM), at most one a stage
    const int stages = dispatch_m(7, q, nullptr);
    const int g = target2 > 0 ? (target2 * sms + 1) / 2 : sms * (per_sm < 1 ? 1 : per_sm);
    return g < stages ? g : (stages < 1 ? 1 : stages);
  }
  if (kind == 1) {
    // stream-K: the grid size G. Every resident slot (or target2 / 2 per SM), at least 2 stages (4 K steps) a CTA.
    const long long units = sdq_w4a16::sk_space(n, k, wnn).U;
    long long g = target2 > 0 ? (static_cast<long long>(target2) * sms + 1) / 2
                              : static_cast<long long>(sms) * (per_sm < 1 ? 1 : per_sm);
    if (g > units / 2) g = units / 2;
    return g < 1 ? 1 : static_cast<int>(g);
  }
  const int tiles = (n / 64 + wnn - 1) / wnn;
  const int slots = sms * (per_sm < 1 ? 1 : per_sm);
  const int want = target2 > 0 ? (target2 * sms + 1) / 2 : slots;
  int splits = (want < slots ? want : slots) / tiles;
  if (splits > stages / 4) splits = stages / 4;
  if (splits < 1) splits = 1;
  if (stages / splits < 16)
    for (int s = splits; 2 * s >= splits; --s)
      if (stages % s == 0) return s;
  return splits;
}

extern "C" long long sdq_w4a16_scratch_floats(const SdqW4A16Params* p) {
  if (p->variant == 62 || p->variant == 63) return dispatch_m(3, *p, nullptr);
  if (p->evict_first || p->m > 32) return p->splits > 1 ? static_cast<long long>(p->splits) * p->m * p->n : 0;
  return dispatch_m(3, *p, nullptr);
}

extern "C" int sdq_w4a16_probe(const SdqW4A16Params* p, int kind, int ctas, cudaStream_t stream) {
  if (kind == 0) {  // linear read of the fragments (p->b), grid-stride, 256 threads
    const size_t n16 = static_cast<size_t>(p->n / 64) * (p->k / 16) * 32;
    const int grid = ctas > 0 ? ctas : sm_count() * 8;
    sdq_w4a16::linear_read_probe_kernel<4><<<grid, 256, 0, stream>>>(reinterpret_cast<const uint4*>(p->b), n16,
                                                                     reinterpret_cast<unsigned*>(p->c));
    return cudaGetLastError();
  }
  if (kind < 1 || kind > 8 || p->m > 16) return -1;
  SdqW4A16Params q = *p;
  q.variant = sdq_w4a16::PROBE_BASE + kind;
  q.evict_first = 0;
  q.splits = ctas > 0 ? ctas : sm_count() * dispatch_raw(q.variant, 1, q, nullptr);
  if (kind == 7)  // a tiled grid (tiles x splits): variant 50's automatic split-K, whatever ctas says
    q.splits = sdq_w4a16_auto_splits(p->m, p->n, p->k, p->group_k16, p->is_bf16, 50, 0);
  return dispatch_raw(q.variant, 0, q, stream);
}

namespace {
int g_wg_schedule = 0;
int g_wg_rows = 0;
int g_wg_one_k = SDQ_WG_ONE_LAUNCH_K_DEFAULT;
int g_wg_cluster = 1;
int g_wg_cluster_rows = SDQ_WG_CLUSTER_ROWS_DEFAULT;
int g_wg_wave = 1;
int g_wg_wave_cost = SDQ_WG_WAVE_COST_DEFAULT;
int g_wg_sk_big = 1;
int g_wg_two = 1;
void* g_ws_trace = nullptr;  // the warp-specialized kernel's trace buffer (-DSDQ_WS_TRACE=1 builds)
}
extern "C" int sdq_w4a16_set_wg_schedule(int mode) {
  return std::exchange(g_wg_schedule, mode >= 0 && mode <= 4 ? mode : 0);
}
extern "C" int sdq_w4a16_wg_schedule(void) { return g_wg_schedule; }
extern "C" int sdq_w4a16_set_wg_rows(int rows) {
  return std::exchange(g_wg_rows, rows == 256 ? 256 : 0);
}
extern "C" int sdq_w4a16_wg_rows(void) { return g_wg_rows; }
extern "C" int sdq_w4a16_set_wg_one_launch_k(int k_max) {
  return std::exchange(g_wg_one_k, k_max > 0 ? k_max : 0);
}
extern "C" int sdq_w4a16_wg_one_launch_k(void) { return g_wg_one_k; }
extern "C" int sdq_w4a16_set_wg_cluster(int on) {
  return std::exchange(g_wg_cluster, on ? 1 : 0);
}
extern "C" int sdq_w4a16_wg_cluster(void) { return g_wg_cluster; }
extern "C" int sdq_w4a16_set_wg_cluster_rows(int min_rows) {
  return std::exchange(g_wg_cluster_rows, min_rows < 65 ? 65 : min_rows > 257 ? 257 : min_rows);
}
extern "C" int sdq_w4a16_wg_cluster_rows(void) { return g_wg_cluster_rows; }
extern "C" int sdq_w4a16_set_wg_wave_splits(int on) {
  return std::exchange(g_wg_wave, on ? 1 : 0);
}
extern "C" int sdq_w4a16_wg_wave_splits(void) { return g_wg_wave; }
extern "C" int sdq_w4a16_set_wg_wave_cost(int stages) {
  return std::exchange(g_wg_wave_cost, stages > 0 ? stages : 0);
}
extern "C" int sdq_w4a16_wg_wave_cost(void) { return g_wg_wave_cost; }
extern "C" int sdq_w4a16_set_wg_sk_big(int on) {
  return std::exchange(g_wg_sk_big, on ? 1 : 0);
}
extern "C" int sdq_w4a16_wg_sk_big(void) { return g_wg_sk_big; }
extern "C" int sdq_w4a16_set_wg_two(int mode) {
  return std::exchange(g_wg_two, mode >= 0 && mode <= 2 ? mode : 1);
}
extern "C" int sdq_w4a16_wg_two(void) { return g_wg_two; }
extern "C" void* sdq_w4a16_set_ws_trace(void* trace) {
  return std::exchange(g_ws_trace, trace);
}
extern "C" void* sdq_w4a16_ws_trace(void) { return g_ws_trace; }
extern "C" int sdq_w4a16_ws_trace_built(void) { return SDQ_WS_TRACE; }

extern "C" int sdq_w4a16_wg_path(const SdqW4A16Params* p) {
  if (p->variant != 62 && p->variant != 63) return -1;
  return dispatch_raw(p->variant, 9, *p, nullptr);
}
extern "C" int sdq_w4a16_wg_max_clusters(int size, int is_bf16) {
  SdqW4A16Params q{};
  q.m = 128;
  q.splits = size;
  q.is_bf16 = is_bf16;
  q.variant = 63;
  return dispatch_raw(63, 10, q, nullptr);
}

extern "C" int sdq_w4a16_launch_rows(const SdqW4A16Params* p) {
  if (p->variant == 62 || p->variant == 63) {
    const int r = dispatch_raw(p->variant, 8, *p, nullptr);
    return r < 256 ? 256 : r;
  }
  return 32;
}

extern "C" int sdq_w4a16_occupancy(int m, int group_k16, int is_bf16, int variant) {
  SdqW4A16Params q{};
  q.m = m;
  q.group_k16 = group_k16;
  q.is_bf16 = is_bf16;
  q.variant = variant;
  return dispatch_m(1, q, nullptr);
}

extern "C" int sdq_probe_evict_first(cudaStream_t stream) {
  uint4 *src = nullptr, *dst = nullptr;
  if (cudaMalloc(&src, 32 * sizeof(uint4)) != cudaSuccess) return -1;
  if (cudaMalloc(&dst, 32 * sizeof(uint4)) != cudaSuccess) return -1;
  cudaMemsetAsync(src, 0x5a, 32 * sizeof(uint4), stream);
  probe_kernel<<<1, 32, 0, stream>>>(src, dst);
  cudaError_t e = cudaStreamSynchronize(stream);
  uint4 host[32];
  if (e == cudaSuccess) e = cudaMemcpy(host, dst, sizeof(host), cudaMemcpyDeviceToHost);
  cudaFree(src);
  cudaFree(dst);
  if (e != cudaSuccess) return e;
  for (int i = 0; i < 32; ++i)
    if (host[i].x != 0x5a5a5a5au || host[i].w != 0x5a5a5a5au) return -3;
  return 0;
}
