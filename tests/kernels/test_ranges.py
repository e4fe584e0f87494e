"""The stream-K partition of the warp-specialized wgmma kernel (csrc/w4a16_ranges.h), compiled with the host C++
compiler and run on the CPU: the ranges cover every (tile, stage) unit once, cta_of inverts start, and the protocol the
kernel follows (w4a16_wgmma.cuh, ws_sk_consumer) holds: a cut tile's owner meets it as its range's last segment (so its
wait comes after all its other work), each peer as its range's first, every CTA writes at most one partial, and the
owner reads exactly the slots its peers wrote."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "sdquant" / "kernels" / "csrc"

# The kernel's consumer loop, step for step, with the global writes and reads recorded instead of made. Exits 1 and
# prints the case on the first violation.
PROGRAM = r"""
#include "w4a16_ranges.h"
#include <cstdio>
#include <vector>
static int fail(const char* what, int tiles, int nst, int grid, int a, int b) {
  std::printf("%s: tiles %d nst %d grid %d (%d, %d)\n", what, tiles, nst, grid, a, b);
  return 1;
}
static int check(int tiles, int nst, int grid) {
  const SdqSkRange rg = sdq_sk_range(tiles, nst, grid);
  if (rg.start(0) != 0 || rg.start(grid) != rg.units) return fail("ends", tiles, nst, grid, 0, 0);
  std::vector<int> owner(rg.units, -1);
  for (int g = 0; g < grid; ++g) {
    if ((long long)rg.start(g) != (long long)rg.units * g / grid) return fail("start", tiles, nst, grid, g, 0);
    for (int u = rg.start(g); u < rg.start(g + 1); ++u) {
      if (owner[u] != -1) return fail("unit twice", tiles, nst, grid, u, g);
      owner[u] = g;
    }
  }
  for (int u = 0; u < rg.units; ++u) {
    if (owner[u] == -1) return fail("unit missed", tiles, nst, grid, u, 0);
    if (rg.cta_of(u) != owner[u]) return fail("cta_of", tiles, nst, grid, u, rg.cta_of(u));
  }
  // the consumer loop as the kernel runs it: per CTA its segments in order; a peer's partial goes to slot g (one a CTA)
  // and it counts in; the owner's segment must be its range's last (it waits there), a peer's its range's first
  std::vector<int> slot_tile(grid, -1), whole(tiles, 0), counted(tiles, 0), owned(tiles, 0), covered(tiles, 0);
  std::vector<int> lock_tile(grid, -1);  // the cut tile whose count lives on CTA g's lock (its owner's)
  for (int g = 0; g < grid; ++g)
    for (int u = rg.start(g), end = rg.start(g + 1); u < end;) {
      int t, sa, sb;
      rg.segment(g, u, t, sa, sb);
      if (sa != u - t * nst || sb <= sa || sb > nst) return fail("segment", tiles, nst, grid, g, u);
      covered[t] += sb - sa;
      const bool first = u == rg.start(g);
      u = (t + 1) * nst;
      const bool last = u >= end;
      if (sa == 0 && sb == nst) {
        ++whole[t];
        if (rg.peers(t) != 0) return fail("whole tile with peers", tiles, nst, grid, t, rg.peers(t));
        continue;
      }
      if (g == rg.owner(t)) {
        if (!last) return fail("owner waits mid-range", tiles, nst, grid, t, g);
        if (lock_tile[g] != -1) return fail("two cut tiles on one lock", tiles, nst, grid, g, t);
        lock_tile[g] = t;
        ++owned[t];
        continue;
      }
      if (!first) return fail("peer part not first", tiles, nst, grid, t, g);
      if (g <= rg.owner(t) || g > rg.owner(t) + rg.peers(t)) return fail("peer outside", tiles, nst, grid, t, g);
      if (slot_tile[g] != -1) return fail("slot written twice", tiles, nst, grid, g, t);
      slot_tile[g] = t;
      ++counted[t];
    }
  // each cut tile: one owner, and exactly its peers' slots written for it
  for (int t = 0; t < tiles; ++t) {
    if (covered[t] != nst) return fail("tile coverage", tiles, nst, grid, t, covered[t]);
    if (whole[t]) {
      if (whole[t] != 1 || counted[t] || owned[t]) return fail("whole tile also cut", tiles, nst, grid, t, counted[t]);
      continue;
    }
    if (owned[t] != 1 || counted[t] != rg.peers(t) || rg.peers(t) < 1)
      return fail("count", tiles, nst, grid, t, counted[t]);
    for (int q = rg.owner(t) + 1; q <= rg.owner(t) + rg.peers(t); ++q)
      if (slot_tile[q] != t) return fail("read slot", tiles, nst, grid, t, q);
  }
  return 0;
}
// the hybrid partition: dp rounds of whole tiles (round i: tile i G + g covers tiles 0 .. dp G - 1 once), then the
// stream-K range over the rest, which holds between one and two waves' worth of tiles where dp > 0
static int check_dp(int tiles, int nst, int grid) {
  const SdqSkRange rg = sdq_sk_range_dp(tiles, nst, grid);
  const int want = tiles / grid >= 2 ? tiles / grid - 1 : 0;
  if (rg.dp != want) return fail("dp rounds", tiles, nst, grid, rg.dp, want);
  const int rest = tiles - rg.dp * grid;
  if (rg.units != rest * nst || rg.grid != grid || rg.nst != nst) return fail("dp rest", tiles, nst, grid, rg.units, rest);
  if (rg.dp > 0 && (rest < grid || rest >= 2 * grid)) return fail("dp rest size", tiles, nst, grid, rest, rg.dp);
  const SdqSkRange sk = sdq_sk_range(rest, nst, grid);
  for (int g = 0; g <= grid; ++g)
    if (sk.start(g) != rg.start(g)) return fail("dp start", tiles, nst, grid, g, rg.start(g));
  return 2 * grid <= rest * nst ? check(rest, nst, grid) : 0;  // (launches keep >= 4 units a CTA)
}
int main() {
  // the Llama shapes at the 128-token tile (M = 128 / 256, 128-K and 64-K stages) on 132 and 114 SMs, then a sweep
  // and above 256 rows (every row in one launch): 8192x28672 at M = 1024, 28672x8192 at 4096 and 384, 4096x4096 at 2100
  const int shapes[][2] = {{112, 64}, {224, 64}, {32, 224}, {64, 224}, {40, 64}, {80, 64}, {16, 112}, {16, 32},
                           {32, 32}, {24, 32}, {48, 32}, {112, 128}, {140, 8}, {5, 12},
                           {896, 64}, {1024, 224}, {96, 224}, {272, 32}};
  for (const auto& s : shapes)
    for (int grid : {132, 114, 264})
      if (grid * 2 <= s[0] * s[1] && check(s[0], s[1], grid)) return 1;
  for (int tiles = 1; tiles <= 40; ++tiles)
    for (int nst = 2; nst <= 24; nst += 3)
      for (int grid = 1; 2 * grid <= tiles * nst; grid += 1 + grid / 8)
        if (check(tiles, nst, grid)) return 1;
  for (const auto& s : shapes)
    for (int grid : {132, 114})
      if (check_dp(s[0], s[1], grid)) return 1;
  for (int tiles = 1; tiles <= 300; tiles += 7)
    for (int grid : {5, 16, 33})
      if (check_dp(tiles, 3, grid)) return 1;
  std::puts("ok");
  return 0;
}
"""


def _run_program(tmp_path, name: str, program: str) -> str:
    """Build `program` against csrc/ with the host C++ compiler (warnings are errors) and run it; its stdout, after
    asserting that both steps succeeded."""
    src = tmp_path / f"{name}.cpp"
    src.write_text(program)
    exe = tmp_path / name
    build = subprocess.run(["c++", "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{CSRC}", str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]
    return run.stdout


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler")
def test_stream_k_partition_and_slots(tmp_path):
    out = _run_program(tmp_path, "ranges", PROGRAM)
    assert out.strip() == "ok", out[-2000:]


# The wgmma kernel's group cursor (csrc/w4a16_ranges.h, SdqStageGroups) against the divisions it replaces: every stage
# of every tile range [st0, st1) at 64- and 128-K stages, for the group sizes the kernels take (gk even; a multiple of 4
# at 128-K stages), per-channel ones (gk = K / 16) included. Exits 1 and prints the case on the first difference.
GROUPS_PROGRAM = r"""
#include "w4a16_ranges.h"
#include <cstdio>
int main() {
  int cases = 0;
  for (int ks = 4; ks <= 8; ks += 4)
    for (int gk = 2; gk <= 1024; gk += 2) {
      if (ks == 8 && gk % 4) continue;
      if (gk > 64 && gk % 32 && gk != 96 * 7 && gk != 896 && gk != 1022) continue;  // (long groups: a sample)
      const int nst = (4 * gk + 64) / ks + 3;  // several group ends past the first
      for (int st0 = 0; st0 < 2 * (gk / 2 + 3); ++st0) {
        SdqStageGroups grp(st0 * ks, ks, gk);
        for (int s = st0; s < st0 + nst; ++s) {
          const int ks0 = s * ks, ga = ks0 / gk, gb = (ks0 + ks - 1) / gk;
          if (grp.first() != ga || grp.last() != gb || gb - ga > 1) {
            std::printf("ks %d gk %d st0 %d stage %d: %d %d, expected %d %d\n", ks, gk, st0, s, grp.first(),
                        grp.last(), ga, gb);
            return 1;
          }
          grp.next();
          ++cases;
        }
      }
    }
  std::printf("ok %d\n", cases);
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler")
def test_stage_group_cursor(tmp_path):
    out = _run_program(tmp_path, "groups", GROUPS_PROGRAM)
    assert out.startswith("ok "), out[-2000:]
    assert int(out.split()[1]) > 100_000  # the loops ran
