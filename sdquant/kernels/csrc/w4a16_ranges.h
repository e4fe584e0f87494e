// The stream-K partition of the warp-specialized wgmma kernel (w4a16_wgmma.cuh, w4a16_wgmma_tma_sk_kernel): plain C++
// for host and device, so that tests/kernels/test_ranges.py compiles it with the host compiler and checks the partition
// and the partial-slot protocol on the CPU.
//
// U units (tile, stage) in tile order are cut into G equal ranges, CTA g taking [U g / G, U (g + 1) / G). A CTA's range
// is a sequence of segments, one a tile it touches; a segment that is the whole tile writes y, the others leave an fp32
// partial in one of the CTA's two slots (2 g: the range's first segment, 2 g + 1: its last), and the last CTA of a tile
// to arrive sums the tile's partials in CTA order. 32-bit arithmetic throughout (a 64-bit division is a subroutine call
// on the GPU); callers keep U * (G + 1) below 2^31.
#pragma once

#if defined(__CUDACC__)
#define SDQ_HD __host__ __device__ __forceinline__
#else
#define SDQ_HD inline
#endif

struct SdqSkRange {
  int nst;    // stages a tile
  int grid;   // G
  int units;  // U = tiles x nst
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
  // the partial slot that CTA g writes (or that the summing CTA reads) for tile t: 2 g where tile t holds the start
  // of g's range (its first segment), else 2 g + 1 (its last)
  SDQ_HD int slot(int g, int t) const { return 2 * g + (start(g) >= t * nst ? 0 : 1); }
};
SDQ_HD SdqSkRange sdq_sk_range(int tiles, int nst, int grid) {
  SdqSkRange r;
  r.nst = nst;
  r.grid = grid;
  r.units = tiles * nst;
  r.q = r.units / grid;
  r.rem = r.units - r.q * grid;
  return r;
}
