#!/usr/bin/env bash
# The measurements of docs/benchmarks/pending.md's Pending 48 and 49, in one device call of at most ~9.5 minutes
# (any H100 or H200). Ran on an H100 on 2026-12-07 (ab_build run 29, gemm run 30); on the H200 it gives item 48's A/B
# there and issue 4's µs targets under PDL. Each part has its own time limit and is skipped when too little is left:
#   ab (~2 min with its two builds): the shipped tight kernel (the next group's scale / zero offset in a register)
#      against the build before it, M = 1-8, outputs compared bit for bit (Pending 48):
#      ab_build --old none --new-defines=-DSDQ_TIGHT_SZO=0 --configs 38,39,40 --ms 1,4,8
#   pdl (~2 min): the CUDA op launched as the decode runtime launches it (programmatic dependent launch) beside its
#      default launch and cuBLAS bf16, at M = 1-16 on the four shapes with µs targets (Pending 49)
# Here:   bash bench/tight_pdl_call.sh <full commit hash of the tree sent>   (TIGHT_PDL_LIMIT_S=<s>: a shorter call)
# Output under $OUT: ab/ab_build.json, ab.log, pdl/gemm.json, pdl.log.
set -u
CALL_NAME=tight_pdl_call.sh CALL_COMMIT="${1:-}" CALL_LIMIT="${TIGHT_PDL_LIMIT_S:-560}"
. "$(dirname "$0")/call_lib.sh"

part ab 360 150 python bench/ab_build.py --old none --new-defines=-DSDQ_TIGHT_SZO=0 --configs 38,39,40 --ms 1,4,8 \
  --rounds 3
part pdl "$(left)" 60 python bench/gemm.py --shapes 8192x28672,4096x28672,14336x4096,4096x4096 --ms 1,2,4,8,16 \
  --kernels bf16,sdq_cuda,sdq_cuda_pdl --rounds 3
ls -la "$OUT"
