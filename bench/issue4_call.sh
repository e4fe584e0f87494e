#!/usr/bin/env bash
# Issue 4's measurements in one device call of at most ~9.5 minutes, whichever Hopper GPU comes:
#   H200: `sdquant tune-kernels` (the crossover table as the op is now; Pending 31), then bench/gemm.py's whole issue
#         table with its dispatched-layer columns planned from that table, then the M > 256 wave rule's A/B
#         (int4_wgmma --schedule auto,rem0; Pending 40) in the time left.
#   H100: the wave rule's A/B first, then tune-kernels (the H100 table) and gemm.py at the table's buckets.
# Here:   bash bench/issue4_call.sh <full commit hash of the tree sent>   (ISSUE4_LIMIT_S=<s>: a shorter call;
#         under 480 s either branch skips the tuning and plans from the shipped table)
# Output under $OUT: t.json, tune.log, gemm/gemm.json, gemm.log, int4_wgmma.json, wave.log (6 files); a short H100
# call also ab/ab_build.json and ab.log (ab_build's times beside the wave A/B's at M = 256, GPU clocks logged).
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" SDQUANT_CACHE_DIR="${SDQUANT_CACHE_DIR:-/tmp/sdq_ext}"
export SDQUANT_COMMIT="${1:?usage: bash bench/issue4_call.sh <commit>}" PYTHONUNBUFFERED=1
OUT="${OUT:?OUT must name the output folder}"
LIMIT="${ISSUE4_LIMIT_S:-560}"
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU=$G commit=$SDQUANT_COMMIT"
mkdir -p "$OUT/gemm"
T0=$SECONDS
left() { echo $((LIMIT - SECONDS + T0)); }

wave() {  # $1: seconds it may take; the rest: int4_wgmma.py's arguments. The M > 256 remainder rule against none
  local t=$1
  shift
  [ "$t" -gt 90 ] || { echo "wave: skipped (${t}s left)"; return; }
  timeout "$t" python bench/int4_wgmma.py --configs 63 --schedule auto,rem0 --ms 256,520,777,1040,1088,2100 \
    --budget-s $((t - 60)) --out "$OUT" "$@" > "$OUT/wave.log" 2>&1
  echo "wave rc=$? t=$((SECONDS - T0))"
  tail -24 "$OUT/wave.log" | cut -c1-300
}

abcheck() {  # $1: seconds it may take. ab_build's own build of this tree at M = 256 (config 63), beside the wave
  # A/B's v63 there, both with the GPU clocks logged: do ab_build's 5-13% slower times on the large shapes (H100,
  # e.g. 8192x10240 81.7 against 69.7 us) come from the machine state or from the code path?
  [ "$(left)" -gt $(($1 + 120)) ] || { echo "abcheck: skipped ($(left)s left)"; return; }
  mkdir -p "$OUT/ab"
  timeout "$1" python bench/ab_build.py --old none --configs 63 --ms 256 --out "$OUT/ab" > "$OUT/ab.log" 2>&1
  echo "abcheck rc=$? t=$((SECONDS - T0))"
  grep -E "^\|" "$OUT/ab.log" | cut -c1-300
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
  if [ "$LIMIT" -ge 480 ]; then gemm $((L < 330 ? L : 330)); else  # short: the targets' columns only
    gemm "$L" --kernels bf16,fp8_tensorwise,fp8_rowwise,sdq_triton,sdq_cuda,sdq_int4_layer,sdq_fp8_layer; fi
  wave "$(left)"
elif [ "$LIMIT" -ge 480 ]; then
  wave 200
  tune 150
  gemm "$(left)" --ms 1,16,64,128,256,1024,4096 --kernels bf16,fp8_tensorwise,sdq_cuda,sdq_int4_layer,sdq_fp8_layer
else  # a short call: the A/B, then the layers planned from the shipped table
  wave $((LIMIT * 2 / 5)) --shapes 4096x4096,14336x4096,28672x8192,8192x28672  # where run 45's splits paid
  abcheck 100
  gemm "$(left)" --ms 1,16,64,128,256,1024,4096 --kernels bf16,fp8_tensorwise,sdq_cuda,sdq_int4_layer,sdq_fp8_layer
fi
ls -la "$OUT" "$OUT/gemm"
