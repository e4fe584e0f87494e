#!/usr/bin/env bash
# Issue 4's measurements in one device call of at most ~9.5 minutes, whichever Hopper GPU comes:
#   H200: `sdquant tune-kernels` (the crossover table as the op is now; Pending 31), then bench/gemm.py's whole issue
#         table with its dispatched-layer columns planned from that table, then the M > 256 schedule A/B in the time
#         left: int4_wgmma --schedule auto,nosk+k0+wc0 (the schedule of 2026-12-07 09:47 UTC against the one before
#         that day's changes: one launch at K <= 4096, the wave splits' cost rule, stream-K where the last wave is
#         part-empty; all measured on H100s only, int4_wgmma runs 50-60), 3 rounds.
#   H100: gemm.py at the table's buckets, planned from the shipped H100 table (measured 2026-12-07, so the layers'
#         plans are this tree's, e.g. the one-layout choice on 4096x4096), then the same A/B.
#   gemm.py times each point's kernels round robin (--rounds: 2 on the H200's whole table, 3 on the H100's buckets):
#   the H100's SM clock fell to 1455-1650 MHz under its power cap at M >= 1024 in gemm run 21.
# Here:   bash bench/issue4_call.sh <full commit hash of the tree sent>   (ISSUE4_LIMIT_S=<s>: a shorter call;
#         under 480 s the H200 skips the tuning and plans from the shipped table)
# Output under $OUT: t.json and tune.log (H200), gemm/gemm.json, gemm.log, int4_wgmma.json, wave.log.
set -u
CALL_NAME=issue4_call.sh CALL_COMMIT="${1:-}" CALL_LIMIT="${ISSUE4_LIMIT_S:-560}"
. "$(dirname "$0")/call_lib.sh"
mkdir -p "$OUT/gemm"

wave() {  # $1: seconds it may take; the rest: int4_wgmma.py's arguments. M > 256 on every shape: the automatic
  # schedule against the one before 2026-12-07's changes (k0: no one-launch grant at K <= 4096, wc0: the wave splits'
  # fill rule alone, nosk: no stream-K above 256 rows), the fastest round and the median of 3 kept
  local t=$1
  shift
  [ "$t" -gt 90 ] || { echo "wave: skipped (${t}s left)"; return; }
  timeout "$t" python bench/int4_wgmma.py --configs 63 --schedule auto,nosk+k0+wc0 --ms 384,520,640,777,1040,1536,2100 \
    --skip triton,dequant --rounds 3 --budget-s $((t - 60)) --out "$OUT" "$@" > "$OUT/wave.log" 2>&1
  echo "wave rc=$? t=$((SECONDS - T0))"
  tail -52 "$OUT/wave.log" | cut -c1-300
}

tune() {  # $1: seconds it may take
  timeout "$1" python -m sdquant.cli tune-kernels --output "$OUT/t.json" --budget-s $(($1 - 40)) > "$OUT/tune.log" 2>&1
  echo "tune rc=$? t=$((SECONDS - T0))"
  tail -3 "$OUT/tune.log" | cut -c1-300
}

gemm() {  # $1: seconds it may take; the rest: gemm.py's arguments
  local t=$1
  shift
  local tb=""
  [ -s "$OUT/t.json" ] && tb="$OUT/t.json"
  SDQUANT_KERNEL_TABLE=$tb timeout "$t" python bench/gemm.py --out "$OUT/gemm" "$@" > "$OUT/gemm.log" 2>&1
  echo "gemm rc=$? t=$((SECONDS - T0)) table=${tb:-shipped}"
  grep -E "^\|" "$OUT/gemm.log" | cut -c1-400
}

if echo "$G" | grep -q H200; then
  if [ "$LIMIT" -ge 480 ]; then tune 200; else echo "tune: skipped (ISSUE4_LIMIT_S=$LIMIT); the shipped table plans"; fi
  L=$(left)
  if [ "$LIMIT" -ge 480 ]; then gemm $((L < 330 ? L : 330)) --rounds 2; else  # short: the targets' columns only
    gemm "$L" --kernels bf16,fp8_tensorwise,fp8_rowwise,sdq_triton,sdq_cuda,sdq_int4_layer,sdq_fp8_layer,sdq_fp8_tensor_layer; fi
  wave "$(left)"
else  # H100: the layers from the shipped H100 table, then the A/B
  gemm $((LIMIT * 2 / 5)) --ms 1,16,64,128,256,1024,4096 --kernels bf16,fp8_tensorwise,sdq_cuda,sdq_int4_layer,sdq_fp8_layer,sdq_fp8_tensor_layer \
    --rounds 3
  wave "$(left)"
fi
ls -la "$OUT" "$OUT/gemm"
