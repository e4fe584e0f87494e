// sdquant W4A16 decode kernel for sm_90: the launcher's C interface (no torch headers, so the kernel file
// compiles alone with nvcc; the torch binding includes only this header).
#pragma once
#include <cuda_runtime.h>

// Locks a layout holds at least (int4_layout.repack_cuda: max(N/64, this)): the warp-specialized stream-K counts a cut
// tile's peers in on its owner CTA's lock, one a CTA of its grid (at most one CTA a SM)
#define SDQ_LOCKS_MIN 1024

struct SdqW4A16Params {
  const void* a;       // [m, k] fp16/bf16, row-major, rows 16-byte aligned (k % 8 == 0), m <= 32 (256: 62-63)
  const void* b;       // [n/64, k/16, 32 lanes, 4] int32 fragments (int4_layout.repack_cuda)
  const void* s;       // [g, n/64, 8, 8] scales, fp16 (applied in fp32 to the group sums)
  const void* zs;      // [g, n/64, 8, 8] integer zero points stored in the activation dtype
  void* c;             // [m, n] output, activation dtype
  float* partial;      // fp32 scratch: [splits, m, n] (read only when splits > 1); stream-K: [G, 2, m, 64 * WNN]
  int* locks;          // >= max(n/64, SDQ_LOCKS_MIN) ints, zero on entry and left zero on exit
  int m, n, k;
  int group_k16;       // group size / 16 (k / 16 for per-channel)
  int splits;          // split-K factor (>= 1), or the grid size G of a stream-K variant; sdq_w4a16_auto_splits picks it
  int is_bf16;
  int evict_first;     // 1: weights copied with an L2 evict-first policy (variant 0 only)
  int variant;         // kernel variant id (w4a16_kernel.cuh's list; 0 = the run-3 kernel; 62-63 w4a16_wgmma.cuh)
  int xs;              // 1: the direct kernel (variants 8-12) copies its CTA's activation range to shared memory once
                       // and reads the MMA fragments there, instead of through L1 every K step (int4_cuda.set_x_smem)
  int pdl;             // 1, 2: launch with programmatic dependent launch (variants 0-12, 38-44, 50-61, else ignored): the
                       // kernel may start while the previous kernel of the stream finishes; it reads weights
                       // first (direct kernel; the cp.async kernel waits at its start) and waits
                       // (griddepcontrol.wait) before it touches activations or the output. It
                       // lets the next kernel launch after its main loop (1), right after its wait (2), or
                       // (tight kernel; the others as 2) before its prologue (3, SDQUANT_GEMM_TRIGGER=first)
};

// The fused decode-block prologue / epilogue: the tight kernel (variants 38-41 and 43-44, group % 64 == 0, m <= 8) in a
// build of its own (w4a16_part_fused_*.cu; the plain kernels' parameter block is unchanged). Null / zero = off;
// applied in this order:
struct SdqW4A16FusedParams : SdqW4A16Params {
  const float* rms_ss;  // [m, rms_t] fp32 partial sums of squares of the RMSNorm's input rows (a producer's ss_out):
  int rms_t;            //   output row r scaled by rsqrt(sum(rms_ss[r]) / k + rms_eps) (the norm's weight is already
  float rms_eps;        //   multiplied into a); rms_t <= 256
  int silu;             // 1: the weight's 64-feature blocks alternate gate, up; c gets [m, n/2] = silu(gate) * up
  const void* resid;    // [m, n_out]: c = round(round(y) + resid) (the residual add)
  const void* gamma;    // [n_out] with c2: c2 = round(c * gamma) (the next RMSNorm's weight)
  void* c2;             // [m, n_out] second output, activation dtype
  float* ss_out;        // [m, n_out / 64] fp32 or null: the sums of squares of c's 64-column blocks (the next rms_ss)
  // A decode step's RoPE and KV-cache write (the qkv projection, 128-feature heads; not with silu, resid or gamma), on
  // when kv is set: columns [0, rope_q) are query heads, the next rope_kv key heads, the last rope_kv value heads. c
  // gets [rope(q), rope(k), v], each head rotated in fp32 from its rounded value and rounded once (HF's rotate_half
  // layout), and the keys and values also go to slot *pos of kv [2, B >= m, nkv, T, 128] (strides in elements).
  void* kv;
  const long long* pos;  // int64 [1]
  const void* cos;       // [128] activation dtype: this position's RoPE row (halves duplicated)
  const void* sin;
  int rope_q, rope_kv;
  long long kv_sk, kv_sb, kv_sh, kv_st;
};

// The wgmma kernel (variants 62-63): its token tile for m rows. The 128-token tile runs two warpgroups a CTA (each
// 128 of the 256 features); the others one.
static inline int sdq_wg_ntok(int m) { return m <= 16 ? 16 : (m <= 32 ? 32 : (m <= 64 ? 64 : 128)); }
// Its split-K factor for `tiles` tiles on `ctas` CTAs (the resident slots, or a target): the splits that fill them
// once, at least 8 stages of 64 K a split; automatic (two_per_sm: twice the SM count, else 0) at most two CTAs per SM
// where the splits would be shorter than 16 stages and that still leaves 3 or more. bench/int4_wgmma.py run 17
// (forced splits 2-16 at M = 16-64): filling 3 CTAs per SM with short splits cost 4-11% on the N = 4096 / 6144
// shapes (4096x4096 M = 64: 16 splits 17.0 us, 8 splits 15.1; 14336x4096 M = 32: 24 splits 22.8, 16 splits 21.5),
// while the wide shapes' 2-3 splits and 28672x8192's 12 were best.
static inline int sdq_wg_splits(int tiles, int ctas, int k, int two_per_sm) {
  const int t = tiles < 1 ? 1 : tiles;
  int splits = ctas / t;
  const int two = two_per_sm / t;
  if (two_per_sm > 0 && two >= 3 && two < splits && k / 64 < 16 * splits) splits = two;
  if (splits > k / 64 / 8) splits = k / 64 / 8;
  return splits < 1 ? 1 : splits;
}
// Whether the 32- or 64-token tile runs two warpgroups of 128 features a CTA instead of one of 256 (slots1: the
// one-warpgroup kernel's resident CTAs): where that kernel's automatic split-K grid holds at most one CTA a SM, so each
// SM would run one warp a scheduler. The splits are capped at 8 stages of 64 K each, so this is where K is short and
// the tiles few (4096x4096 at M <= 64 among the Llama shapes: 16 tiles x 8 splits = 128 CTAs). ncu (int4_wgmma run 66,
// H100, 4096x4096 M = 64): one warp a scheduler, 3.5 cycles an issued instruction, mostly fixed-latency waits. ab_build
// run 27 (H100, both forms everywhere at M = 24-64, 3 rounds, us): 4096x4096 v63 10.8 / 11.1 / 13.8 / 14.6 -> 10.3 /
// 10.7 / 12.6 / 13.8, bit-identical; level (within 2%) on 4096x6144, 14336x4096 and 8192x10240, whose grids hold more
// CTAs than SMs; 4-10% slower on the N = 28672 shapes and 28672x8192 (8192x28672 M = 64 79.2 -> 86.5).
static inline int sdq_wg_two_wg(int m, int n, int k, int ntok, int slots1, int sms) {
  if (ntok != 32 && ntok != 64) return 0;
  const int tiles = (m + ntok - 1) / ntok * (n / 256);
  return tiles * sdq_wg_splits(tiles, slots1, k, 2 * sms) <= sms;
}
// Whether that automatic split-K grid of the ntok-token tile fills at least num / den of `slots` resident CTAs over its
// waves (sms: the SM count)
static inline int sdq_wg_split_fills(int m, int n, int k, int ntok, int slots, int sms, int num, int den) {
  const int tiles = (m + ntok - 1) / ntok * (n / 256);
  const int ctas = tiles * sdq_wg_splits(tiles, slots, k, 2 * sms);
  const int waves = (ctas + slots - 1) / slots;
  return den * ctas >= num * waves * slots;
}
// The automatic choice of variant 63's warp-specialized split-K at the 128-token tile (w4a16_wgmma.cuh wg_ws; slots:
// its resident CTAs, one a SM). Groups a multiple of 128 and K of 128 only. From bench/ab_build.py runs 4-5 (same
// process, against the single-role kernel):
// * one token tile (M = 65-128): where K x N >= 2^25. It was 3-25% faster there (8192x28672 M = 128 125.0 -> 94.9 us,
//   28672x8192 119.6 -> 95.2, 14336x4096 35.6 -> 34.6) and 7-10% slower on 4096x4096 and 4096x6144;
// * two (M = 129-256): where K x N > 2^24 (4096x4096: 3% slower at M = 192, level at 256), unless its split-K grid
//   would fill less than 70% of the slots over its waves; there stream-K is better (8192x10240 M = 256: 80 tiles on
//   132 slots, 86.0 stream-K, 94.7 warp-specialized). Elsewhere it beat stream-K (8192x28672 M = 256 234.3 -> 202.7,
//   4096x6144 38.1 -> 34.9) and split-K (28672x8192 218.2 -> 171.1).
// * more (M > 256, every row in one launch since 2026-12-06: wgmma_rows in w4a16_wgmma.cuh): the same fill bound, any
//   K x N. int4_wgmma run 30 (H100, same process, us): 4096x4096 M = 512 / 1024 / 4096 37.3 / 56.0 / 223.1 against
//   53.6 / 109.6 / 436.0 for 256-row launches of the single-role kernel; 8192x10240 M = 512 (160 tiles, 61% of the
//   slots) stays on stream-K: 182.2 against 203.5.
static inline int sdq_wg_ws_auto(int m, int n, int k, int group_k16, int slots, int sms) {
  if (group_k16 % 8 || k % 128) return 0;
  const long long kn = (long long)k * n;
  if (m <= 128) return kn >= (1LL << 25);
  if (m <= 256 && kn <= (1LL << 24)) return 0;
  return sdq_wg_split_fills(m, n, k, 128, slots, sms, 7, 10);
}

// M = 65-256 where the split-K grid's splits are short (<= 16 stages of 128 K): variant 63's warp-specialized kernel with
// its splits summed inside thread-block clusters, at the largest split count <= the grid's whose clusters all fit at once
// (max_clusters[s]: clusters of s CTAs resident at once, s = 2..8) and that still fills 70% of the slots; 0 where there is
// none. int4_wgmma run 35 (H100, same process, us, the single-role split-K kernel against this): 4096x4096 M = 128 /
// 192 / 256 20.1 / 24.2 / 26.6 against 18.5 (5 splits) / 22.9 / 22.7; 4096x6144 M = 128 24.0 against 20.0 (run 36: 23.9
// against 19.8). Not with longer splits (8192x10240 M = 128: 2 splits in clusters 52.4 against 3 by a second kernel
// 47.7; 28672x8192 M = 128: 3 in clusters 111.5 against 4 99.3). At M = 65-96 (a part-filled 128-token tile, the same
// clusters as M = 128) only where sdq_wg_ws_auto leaves the shape to the single-role split-K (K N < 2^25): int4_wgmma
// run 76 (H100, same process, us, M = 65 / 80 / 96, that kernel against this) 4096x6144 20.6 / 20.7 / 21.3 against
// 19.5 / 18.9 / 18.4, 4096x4096 16.0 / 16.7 / 17.8 against 17.1 / 17.0 / 16.6 (run 35 had M = 96 17.3 against 18.7);
// where the warp-specialized split-K runs it with a second-kernel sum, clusters were slower (14336x4096 29.5 / 30.0 /
// 31.5 against 34.0 / 35.1 / 35.1). On the H200 (run 73) the clusters at M = 128 took 15.97 / 18.15 us on 4096x4096 /
// 4096x6144, against the single-role kernel's 16.5-16.9 / 20.9-21.8 at M = 80-96.
// min_rows: the fewest rows it takes (SDQ_WG_CLUSTER_ROWS_DEFAULT; sdq_w4a16_set_wg_cluster_rows, for A/B runs: 97 is
// the rule before 2026-12-07 19:45 UTC).
#define SDQ_WG_CLUSTER_ROWS_DEFAULT 65
static inline int sdq_wg_cluster_fit_splits(int m, int n, int k, int group_k16, int slots, int sms,
                                            const int* max_clusters, int min_rows = SDQ_WG_CLUSTER_ROWS_DEFAULT) {
  if (m < min_rows || m <= 64 || m > 256 || group_k16 % 8 || k % 128) return 0;
  if (m <= 96 && (long long)k * n >= (1LL << 25)) return 0;  // sdq_wg_ws_auto's warp-specialized split-K takes it
  const int tiles = (m + 127) / 128 * (n / 256);
  const int s0 = sdq_wg_splits(tiles, slots, k, 2 * sms);
  if (s0 < 2 || k / 128 > 16 * s0) return 0;
  for (int sp = s0 < 8 ? s0 : 8; sp >= 2 && 10 * tiles * sp >= 7 * slots; --sp)
    if (tiles <= max_clusters[sp]) return sp;
  return 0;
}

// M = 129-256: variant 63's stream-K over the warp-specialized pipeline (w4a16_wgmma.cuh wg_ws_sk) where the automatic
// schedule would otherwise run the single-role stream-K: neither the warp-specialized split-K (sdq_wg_ws_auto) nor its
// cluster sum (sdq_wg_cluster_fit_splits >= 2) takes M, and the single-role kernel's split-K grid fills less than 90%
// of its slots over its waves (wg_stream_k). Groups a multiple of 128, K of 128, fewer than 2^31 / 1025 (tile, stage)
// units (the kernel's 32-bit range arithmetic). ws_slots / wg_slots: the resident CTAs of the warp-specialized and of the
// single-role 128-token kernels; max_clusters as for sdq_wg_cluster_fit_splits (all 0 where the cluster sum is off).
// int4_wgmma runs 43-44 (H100, same process, us): 8192x10240 M = 144 / 192 / 256 86.5 / 86.4 / 88.5 -> 66.8 / 68.4 /
// 69.7, 3584x18944 78.0 / 80.0 / 84.3 -> 57.3 / 56.8 / 57.5; where the warp-specialized split-K or its cluster sum runs
// it was 1% faster to 43% slower (4096x4096 M = 128 17.0 -> 24.3), so not there.
// What that kernel takes at all (forced or automatic): groups a multiple of 128, K of 128, and fewer than 2^31 / 1025
// (tile, stage) units; any M since its locks are counted per owner CTA (SDQ_LOCKS_MIN); automatically at M = 129-256
// (sdq_wg_ws_sk_auto) and above 256 rows where sdq_wg_ws_sk_big says.
static inline int sdq_wg_ws_sk_fits(int m, int n, int k, int group_k16) {
  return group_k16 % 8 == 0 && k % 128 == 0 &&
         (long long)((m + 127) / 128) * (n / 256) * (k / 128) * 1025 < (1LL << 31);
}
static inline int sdq_wg_ws_sk_auto(int m, int n, int k, int group_k16, int ws_slots, int wg_slots, int sms,
                                    const int* max_clusters, int cluster_min_rows = SDQ_WG_CLUSTER_ROWS_DEFAULT) {
  if (m <= 128 || m > 256 || !sdq_wg_ws_sk_fits(m, n, k, group_k16)) return 0;  // (M > 256: sdq_wg_ws_sk_big)
  if (sdq_wg_ws_auto(m, n, k, group_k16, ws_slots, sms) ||
      sdq_wg_cluster_fit_splits(m, n, k, group_k16, ws_slots, sms, max_clusters, cluster_min_rows) >= 2)
    return 0;
  return !sdq_wg_split_fills(m, n, k, 128, wg_slots, sms, 9, 10);
}

// M > 256 where variant 63 runs every row in one launch without wave splits (wave_splits 1): stream-K over the
// warp-specialized pipeline instead (w4a16_wgmma.cuh wg_ws_sk, a grid of the `slots`) where its time, the units spread
// evenly plus its measured overhead (10% a unit and 4 stages, as stream-K over every tile cost: run 52), is
// below the one launch's waves of whole tiles: 1.1 tiles S / slots + 4 < w1 S (S = K / 128 stages a tile). H100
// int4_wgmma run 52 (same process, fastest of 3 rounds, stream-K against the one launch): 0.77-0.95 at the one-launch
// points with a part-empty last wave (28672x8192 M = 384 278 against 359 us, 8192x10240 M = 640 166 against 206,
// 4096x6144 M = 2100 166 against 192, 14336x4096 M = 384 76 against 85) and 1.06-1.16 where the waves are full (every
// shape at M = 4096, 4096x28672 M = 777 / 1040), where the rule keeps the one launch; 19 points take it, geometric
// mean 0.90. Where the one launch splits in two (sdq_wg_wave_splits) stream-K was 0.81-1.08, not kept. Fitted on
// stream-K over every tile; the kernel now runs data-parallel rounds first (w4a16_wgmma.cuh), which brought the full
// waves to 0.97-1.05 and kept the rule's points at 0.76-0.96 (int4_wgmma run 59).
static inline int sdq_wg_ws_sk_big(int m, int n, int k, int group_k16, int slots, int wave_splits) {
  if (m <= 256 || wave_splits != 1 || slots <= 0 || !sdq_wg_ws_sk_fits(m, n, k, group_k16)) return 0;
  const long long tiles = (long long)((m + 127) / 128) * (n / 256), s = k / 128, w1 = (tiles + slots - 1) / slots;
  return 11 * tiles * s + 40LL * slots < 10 * w1 * s * slots;
}

// M > 256: variant 63's one launch granted at K <= k_max whatever sdq_wg_ws_auto's fill test says (k_max 4096 by
// default; 0 turns it off: sdq_w4a16_set_wg_one_launch_k). On the K = 4096 shapes the fill test chose 256-row launches
// where one launch was faster: H100 int4_wgmma runs 48-50 (same process, us): 4096x4096 M = 520 / 640 47 against 53-62,
// 4096x6144 M = 777 89-94 against 102-106, M = 384 46.5-46.9 against 48.6-49.2; it was never slower there. At longer K it
// is not granted: one launch forced was 2-43% slower on 14336x4096 and 28672x8192 (runs 48-49).
#define SDQ_WG_ONE_LAUNCH_K_DEFAULT 4096  // k_max by default (sdq_w4a16_set_wg_one_launch_k)
static inline int sdq_wg_one_launch_short_k(int m, int k, int group_k16, int k_max) {
  return m > 256 && k_max > 0 && k <= k_max && group_k16 % 8 == 0 && k % 128 == 0;
}

// M > 256 (one launch): two splits summed in clusters of 2 where the tiles alone leave the last wave part-empty, so that
// twice the CTAs at half the work each take at most 90% of the waves' time (the fill rule), and the waves of half the
// work plus the cluster sum's cost take less time than the waves of whole tiles (the cost rule): w2 (S / 2 + cost) < w1 S
// for w1 / w2 waves unsplit / split, S = K / 128 stages a tile and `cost` in stages (4 by default,
// sdq_w4a16_set_wg_wave_cost; 0 leaves the fill rule alone, the rule from 2026-12-06 to 2026-12-07). Only where pairs
// pack the device (pair_clusters: clusters of 2 resident at once, x 2 >= 90% of the slots) and each split keeps >= 8
// stages of 128 K. Returns 2 or 1.
// * The fill rule: H100 int4_wgmma runs 38-39 (4096x6144 M = 1024 -14%, 8192x10240 M = 1024 -9..-15%, 8192x28672
//   M = 512 -5..-8%; docs/benchmarks/int4-wgmma.md "Two splits for the one-launch path's last wave").
// * The cost rule: at K = 4096 (S = 32) the fill rule's splits were slower where they add many half waves: H100 runs
//   48-50, one launch without the splits against with them (us): 4096x28672 M = 520 / 640 (5 -> 9 waves) 233 / 246
//   against 268 / 277, 4096x6144 M = 1536 / 2100 (3 -> 5, 4 -> 7) 146 / 193 against 156 / 222, 4096x4096 M = 2100
//   115 against 121; they were faster where they add few: 4096x4096 M = 1536 (2 -> 3) 90 against 97, 4096x6144 M = 777
//   89 against 94. A cost of 4 stages (about 6 us at 1.5 us a stage: the cluster barrier and the DSMEM sum, 6-8 us in
//   bench/ws_trace.py) fits all of these and keeps every split of runs 38-39.
#define SDQ_WG_WAVE_COST_DEFAULT 4  // cost by default (sdq_w4a16_set_wg_wave_cost)
static inline int sdq_wg_wave_splits(int m, int n, int k, int group_k16, int slots, int pair_clusters, int cost) {
  if (m <= 256 || group_k16 % 8 || k % 128 || k / 128 < 16 || 20 * pair_clusters < 9 * slots) return 1;
  const long long tiles = (long long)((m + 127) / 128) * (n / 256), s = k / 128, c = cost > 0 ? cost : 0;
  const long long w1 = (tiles + slots - 1) / slots, w2 = (2 * tiles + slots - 1) / slots;
  // fill: w2 / 2 <= 0.9 w1; cost: w2 (s / 2 + c) < w1 s (with c = 0 the fill rule implies it)
  return 10 * w2 <= 18 * w1 && w2 * (s + 2 * c) < 2 * w1 * s ? 2 : 1;
}

#ifdef __cplusplus
extern "C" {
#endif
// Returns 0 or a cudaError_t / negative code for bad parameters (-1: shape, -2: m too large).
int sdq_w4a16_launch(const SdqW4A16Params* p, cudaStream_t stream);
// The same with the fused prologue / epilogue (SdqW4A16FusedParams); -1 for a variant, group, m or n it cannot run
// (splits, partial and locks as for the plain launch of the same variant).
int sdq_w4a16_launch_fused(const SdqW4A16FusedParams* p, cudaStream_t stream);
// Split-K factor for this shape and variant: target2 / 2 CTAs per SM (0 = the variant's default: 2.5 per SM for
// variant 0, every resident slot for the others); reads the SM count and the occupancy calculator.
int sdq_w4a16_auto_splits(int m, int n, int k, int group_k16, int is_bf16, int variant, int target2);
// fp32 scratch (p->partial) that the launch of *p (splits already chosen) needs, in floats (0: none).
long long sdq_w4a16_scratch_floats(const SdqW4A16Params* p);
// Read-bandwidth probes over p->b (not GEMMs; p->c gets nothing): kind 0 = the whole fragment buffer read in order
// by a grid-stride kernel (ctas CTAs of 256 threads, 0 = 8 per SM); 1-3 = the stream-K kernel's loads (P1-P3 in
// w4a16_kernel.cuh) without the arithmetic, on ctas CTAs (0 = every resident slot of the probe kernel); 7 = the
// bulk-copy kernel's copies and shared-memory reads (variant 50's grid; ctas ignored); 8 = the same for the flat
// bulk-copy kernel (variant 58, on ctas CTAs or its resident slots).
int sdq_w4a16_probe(const SdqW4A16Params* p, int kind, int ctas, cudaStream_t stream);
// Resident CTAs per SM of the kernel the launcher would pick for (m, group, dtype, variant).
int sdq_w4a16_occupancy(int m, int group_k16, int is_bf16, int variant);
// Runs a tiny kernel that copies through cp.async with an L2::evict_first cache policy; 0 = it worked.
int sdq_probe_evict_first(cudaStream_t stream);
// The schedule of the wgmma kernel's 128-token tile, for the launches and split/grid queries from now on in this
// process: 0 automatic (w4a16_wgmma.cuh: wg_ws, then wg_stream_k), 1 split-K, 2 stream-K, 3 variant 63's
// warp-specialized split-K, 4 variant 63's stream-K over the warp-specialized pipeline (M <= 256). Returns the previous
// setting.
int sdq_w4a16_set_wg_schedule(int mode);
int sdq_w4a16_wg_schedule(void);
// Rows a launch of the wgmma kernel (variants 62-63) takes from now on in this process: 0 automatic (every row in one
// launch where variant 63's warp-specialized kernel runs that M, else 256), 256 (always 256-row launches, the rule
// before). Returns the previous setting.
int sdq_w4a16_set_wg_rows(int rows);
int sdq_w4a16_wg_rows(void);
// K up to which variant 63 runs every row of M > 256 in one launch whatever its fill test says (sdq_wg_one_launch_short_k;
// 4096 by default, 0: off). Returns the previous setting.
int sdq_w4a16_set_wg_one_launch_k(int k_max);
int sdq_w4a16_wg_one_launch_k(void);
// Whether variant 63's warp-specialized split-K sums its 2-8 splits inside a thread-block cluster (1, the default) or
// through [splits, m, n] fp32 partials and a second kernel (0). Returns the previous setting.
int sdq_w4a16_set_wg_cluster(int on);
int sdq_w4a16_wg_cluster(void);
// The fewest rows variant 63's cluster sum takes at the 128-token tile (sdq_wg_cluster_fit_splits' min_rows; 65 by
// default, 97 the rule before; values clamped to 65-257, 257: never). Returns the previous setting.
int sdq_w4a16_set_wg_cluster_rows(int min_rows);
int sdq_w4a16_wg_cluster_rows(void);
// Whether the one-launch path at M > 256 uses sdq_wg_wave_splits (1, the default) or not (0).
int sdq_w4a16_set_wg_wave_splits(int on);
int sdq_w4a16_wg_wave_splits(void);
// sdq_wg_wave_splits' cost of the cluster sum, in 128-K stages (4 by default; 0: its fill rule alone). Returns the
// previous setting.
int sdq_w4a16_set_wg_wave_cost(int stages);
int sdq_w4a16_wg_wave_cost(void);
// Whether variant 63 runs M > 256 as stream-K where sdq_wg_ws_sk_big says (1, the default) or never (0). Returns the
// previous setting.
int sdq_w4a16_set_wg_sk_big(int on);
int sdq_w4a16_wg_sk_big(void);
// Two warpgroups at the 32- and 64-token tiles: 1 where sdq_wg_two_wg says (the default), 0 never, 2 always. Returns the
// previous setting.
int sdq_w4a16_set_wg_two(int mode);
int sdq_w4a16_wg_two(void);
// The warp-specialized kernel's phase trace (bench/ws_trace.py): in a -DSDQ_WS_TRACE=1 build its launches from now on
// write 16 u64 a CTA to trace (device memory, 16 x its CTAs; null = off). Returns the previous buffer.
// sdq_w4a16_ws_trace_built() is 1 in such a build, else 0 (and the buffer is never written).
void* sdq_w4a16_set_ws_trace(void* trace);
void* sdq_w4a16_ws_trace(void);
int sdq_w4a16_ws_trace_built(void);
// The rows a launch of *p's variant takes (p->m, n, k, group_k16, is_bf16, variant set): 32 for variants 0-61; 256
// or, where the setting above allows, p->m for 62-63. Callers split larger M into launches of that many rows.
int sdq_w4a16_launch_rows(const SdqW4A16Params* p);
// The path a launch of *p (variant 62-63, splits set) takes: 0 split-K, 1 stream-K, 2 the warp-specialized split-K with
// its splits summed by a second kernel, 3 summed inside a cluster; -1 other variants.
int sdq_w4a16_wg_path(const SdqW4A16Params* p);
// Clusters of `size` (2-8) CTAs of the warp-specialized kernel's cluster form that fit the device at once (0: none).
int sdq_w4a16_wg_max_clusters(int size, int is_bf16);
#ifdef __cplusplus
}
#endif
