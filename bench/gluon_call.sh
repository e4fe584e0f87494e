#!/usr/bin/env bash
# One device call (any H100 or H200, at most ~9.5 minutes): the Gluon W4A16 prototype first (Pending 53), then the
# decode-launch columns and the early-trigger A/B of bench/tight_pdl_call.sh (Pendings 49 and 52). Each part has its own
# time limit and is skipped when too little is left:
#   gluon (~4-5 min with the CUDA extension's build): bench/triton_gluon.py's diagnose, then M = 2-16 (where the Triton
#      op misses) on the seven shapes, every config checked against x @ W.T, then timed beside cuBLAS bf16, the shipped
#      Triton op and the sdquant CUDA op
#   then, in the time left, tight_pdl_call.sh's parts pdl (~2.5 min: the CUDA op launched as the decode runtime
#   launches it) and trig (~2 min: the wgmma path's early triggers as shipped, none, at every M)
# Here:   bash bench/gluon_call.sh <full commit hash of the tree sent>   (GLUON_CALL_LIMIT_S=<s>: a shorter call)
# Output under $OUT: gluon/triton_gluon.json, gluon.log, pdl/gemm.json, pdl.log, trig/ab_build.json, trig.log.
set -u
CALL_NAME=gluon_call.sh CALL_COMMIT="${1:-}" CALL_LIMIT="${GLUON_CALL_LIMIT_S:-560}"
. "$(dirname "$0")/call_lib.sh"

part gluon 330 120 python bench/triton_gluon.py --ms 2,4,8,16
CALL_PARTS=pdl,trig TIGHT_PDL_LIMIT_S=$(left) bash "$(dirname "$0")/tight_pdl_call.sh" "$CALL_COMMIT"
