#!/usr/bin/env bash
# The measurements of docs/benchmarks/pending.md's Pending 48, 49, 51 and 52, in one device call of at most ~9.5 minutes
# (any H100 or H200). Items 48-49 ran on an H100 on 2026-12-07 (ab_build run 29, gemm run 30); on the H200 they give
# issue 4's µs targets under PDL and item 48's A/B there. Each part has its own time limit and is skipped when too
# little is left, so the first ones always run:
#   pdl (~2.5 min): the CUDA op launched as the decode runtime launches it (programmatic dependent launch with the
#      early trigger) and with PDL but no early trigger, beside its default launch and cuBLAS bf16, at M = 1-16 on the
#      four shapes with µs targets (Pending 49; at M = 9-16 the two PDL columns differ by the wgmma path's early
#      triggers, Pending 52)
#   late (~1.5 min): the two PDL columns on all seven shapes at M = 16-64: at M = 16 the wgmma path's early triggers
#      against none; above it both columns run the same code (a control)
#   trig (~2 min with its build): Pending 52's check under PDL with the early trigger: the shipped build (the wgmma
#      kernels and variant 63's split-K sum let the next kernel launch right after their wait at M <= 16) against the
#      form before (-DSDQ_WG_EARLY_TRIGGER_MAX_M=0) and the triggers at every M (=256):
#      ab_build --old none --new-defines=-DSDQ_WG_EARLY_TRIGGER_MAX_M=0 --new-defines=-DSDQ_WG_EARLY_TRIGGER_MAX_M=256
#      --configs 62,63 --ms 12,16,32,64 --pdl 2
#   ab (~2 min with its two builds): the shipped tight kernel (the next group's scale / zero offset in a register)
#      against the build before it, M = 1-8, outputs compared bit for bit (Pending 48):
#      ab_build --old none --new-defines=-DSDQ_TIGHT_SZO=0 --configs 38,39,40 --ms 1,4,8
# Here:   bash bench/tight_pdl_call.sh <full commit hash of the tree sent>   (TIGHT_PDL_LIMIT_S=<s>: a shorter call)
# Output under $OUT: pdl/gemm.json, pdl.log, late/gemm.json, late.log, trig/ab_build.json, trig.log, ab/ab_build.json,
# ab.log.
set -u
CALL_NAME=tight_pdl_call.sh CALL_COMMIT="${1:-}" CALL_LIMIT="${TIGHT_PDL_LIMIT_S:-560}"
. "$(dirname "$0")/call_lib.sh"

part pdl 200 60 python bench/gemm.py --shapes 8192x28672,4096x28672,14336x4096,4096x4096 --ms 1,2,4,8,16 \
  --kernels bf16,sdq_cuda,sdq_cuda_pdl,sdq_cuda_pdl_late --rounds 3
part late 220 90 python bench/gemm.py --shapes 4096x4096,4096x6144,14336x4096,8192x10240,4096x28672,8192x28672,28672x8192 \
  --ms 16,32,64 --kernels bf16,sdq_cuda_pdl,sdq_cuda_pdl_late --rounds 3 --pdl-max-m 64
part trig 240 120 python bench/ab_build.py --old none --new-defines=-DSDQ_WG_EARLY_TRIGGER_MAX_M=0 \
  --new-defines=-DSDQ_WG_EARLY_TRIGGER_MAX_M=256 --configs 62,63 --ms 12,16,32,64 --pdl 2 --rounds 3
part ab "$(left)" 150 python bench/ab_build.py --old none --new-defines=-DSDQ_TIGHT_SZO=0 --configs 38,39,40 --ms 1,4,8 \
  --rounds 3
ls -la "$OUT"
