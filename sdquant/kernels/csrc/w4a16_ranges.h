// The stream-K partition of the warp-specialized wgmma kernel (w4a16_wgmma.cuh, w4a16_wgmma_tma_sk_kernel): plain C++
// for host and device, so that tests/kernels/test_ranges.py compiles it with the host compiler and checks the partition
// and the partial-slot protocol on the CPU.
//
// U units (tile, stage) in tile order are cut into G equal ranges, CTA g taking [U g / G, U (g + 1) / G). A CTA's range
// is a sequence of segments, one a tile it touches. A segment that is the whole tile writes y. A tile cut between CTAs
// is owned by the CTA holding its first unit: for that CTA it is the range's last segment, for the others (its peers,
// the next CTAs) their range's first, so the peers finish their parts first, each leaves an fp32 partial in its one
// scratch slot and counts in on the tile's lock, and the owner, at the end of its range, waits for the count, adds the
// peers' partials to its own accumulators in CTA order and writes y (deterministic; the owner writes no partial). The
// wait cannot deadlock: peers never wait, and a grid is at most the resident CTAs. 32-bit arithmetic throughout (a
// 64-bit division is a subroutine call on the GPU); callers keep U * (G + 1) below 2^31.
#pragma once

#if defined(__CUDACC__)
#define SDQ_HD __host__ __device__ __forceinline__
#else
#define SDQ_HD inline
#endif

struct SdqSkRange {
  int nst;    // stages a tile
  int grid;   // G
  int units;  // U = tiles x nst (of the stream-K part)
  int dp;     // whole tiles a CTA runs first, data-parallel: tile i G + g in round i (sdq_sk_range_dp; 0: none)
  int q, rem;  // U = q G + rem
  SDQ_HD int start(int g) const { return q * g + rem * g / grid; }  // floor(U g / G), g <= G
  // the CTA whose range holds unit u (the last g with start(g) <= u): floor((u + 1) G / U) is that or one above it
  SDQ_HD int cta_of(int u) const {
    int g = (u + 1) * grid / units;
    if (g >= grid || start(g) > u) --g;
    return g;
  }
  // the segment of CTA g's range that starts at unit u: its tile t and stages [sa, sb) of that tile
  SDQ_HD void segment(int g, int u, int& t, int& sa, int& sb) const {
    const int end = start(g + 1);
    t = u / nst;
    sa = u - t * nst;
    sb = end - t * nst < nst ? end - t * nst : nst;
  }
  // a cut tile t: its owner (the CTA holding its first unit) and its peers' count (the CTAs after it that hold its
  // other units); peers == 0 where one CTA's range holds the whole tile
  SDQ_HD int owner(int t) const { return cta_of(t * nst); }
  SDQ_HD int peers(int t) const { return cta_of(t * nst + nst - 1) - owner(t); }
};
SDQ_HD SdqSkRange sdq_sk_range(int tiles, int nst, int grid) {
  SdqSkRange r;
  r.nst = nst;
  r.grid = grid;
  r.dp = 0;
  r.units = tiles * nst;
  r.q = r.units / grid;
  r.rem = r.units - r.q * grid;
  return r;
}
// The hybrid partition: where the tiles make two or more waves of the grid, every CTA first runs dp = tiles / G - 1
// rounds of whole tiles data-parallel (round i: tile i G + g, so the CTAs of a round share weight and activation tiles
// in L2 as one launch's neighbouring CTAs do), then the stream-K range over the last tiles - dp G tiles (between one and
// two waves' worth), whose tile t (as owner / peers / segment number it) is tile dp G + t of the launch.
SDQ_HD SdqSkRange sdq_sk_range_dp(int tiles, int nst, int grid) {
  const int dp = tiles / grid >= 2 ? tiles / grid - 1 : 0;
  SdqSkRange r = sdq_sk_range(tiles - dp * grid, nst, grid);
  r.dp = dp;
  return r;
}

// The groups of a tile's stages in load order (w4a16_wgmma.cuh, wg_load_stage's first and last group of a stage): one
// division a tile instead of two a stage. A stage is ks = 4 or 8 K steps from a multiple of ks, a group gk K steps with
// gk even and, for ks = 8, a multiple of 4 (the kernels' launch conditions), so a stage touches at most two groups
// and moving on a stage crosses at most two group ends. tests/kernels/test_ranges.py checks it against the divisions.
struct SdqStageGroups {
  int g, rem;  // the next stage's first group, and its first K step's offset in that group
  int ks, gk;
  SDQ_HD SdqStageGroups(int ks0, int ks_, int gk_) : g(ks0 / gk_), rem(ks0 - (ks0 / gk_) * gk_), ks(ks_), gk(gk_) {}
  SDQ_HD int first() const { return g; }
  SDQ_HD int last() const { return g + (rem + ks - 1 >= gk ? 1 : 0); }
  SDQ_HD void next() {
    rem += ks;
    if (rem >= gk) rem -= gk, ++g;
    if (rem >= gk) rem -= gk, ++g;
  }
};
