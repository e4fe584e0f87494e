#!/usr/bin/env bash
# The H200 A/Bs that the H100 measured and the H200 has not, in one device call of at most ~9.5 minutes (run after
# bench/issue4_call.sh, which takes a whole call for the targets table). Each part has its own time limit and is
# skipped when too little is left, so the first ones always run:
#   45 (~3.5 min): the two-warpgroup rule at 17-64 tokens, two warpgroups everywhere at 9-64 tokens (the raw 16-token
#      kernel's too: Pending 46) and the warp-specialized kernel at 65-128 on every shape:
#      int4_wgmma --schedule auto,1wg,2wg,ws (docs/benchmarks/pending.md, Pendings 45-46)
#   44 (~3 min): the raw 16-token kernel at 3 CTAs a SM, an ab_build of -DSDQ_WG_RAW_OCC=3 against the default (Pending 44)
#   42 (the rest): M > 256, the shipped schedule against the one before 2026-12-07's changes (Pending 42)
# Here:   bash bench/h200_ab_call.sh <full commit hash of the tree sent>   (H200_AB_LIMIT_S=<s>: a shorter call)
# Output under $OUT: p45/int4_wgmma.json, p45.log, p44/ab_build.json, p44.log, p42/int4_wgmma.json, p42.log.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" SDQUANT_CACHE_DIR="${SDQUANT_CACHE_DIR:-/tmp/sdq_ext}"
export SDQUANT_COMMIT="${1:?usage: bash bench/h200_ab_call.sh <commit>}" PYTHONUNBUFFERED=1
OUT="${OUT:?OUT must name the output folder}"
LIMIT="${H200_AB_LIMIT_S:-560}"
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU=$G commit=$SDQUANT_COMMIT"
T0=$SECONDS
left() { echo $((LIMIT - SECONDS + T0)); }

part() {  # $1: name, $2: seconds it may take, $3: the least worth starting, the rest: the command
  local name=$1 t=$2 least=$3
  shift 3
  local l
  l=$(left)
  [ "$t" -le "$l" ] || t=$l
  if [ "$t" -lt "$least" ]; then echo "$name: skipped (${t}s left)"; return; fi
  mkdir -p "$OUT/$name"
  timeout "$t" "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? t=$((SECONDS - T0))"
  grep -E "checks:|pass|^\|" "$OUT/$name.log" | cut -c1-300 | tail -60
}

part p45 220 120 python bench/int4_wgmma.py --configs 63 --schedule auto,1wg,2wg,ws --ms 12,16,24,32,48,64,80,96,128 \
  --skip triton,tinygemm,dequant --rounds 3 --budget-s 140
part p44 200 150 python bench/ab_build.py --old none --new-defines=-DSDQ_WG_RAW_OCC=3 --configs 62,63 --ms 12,16 \
  --rounds 3
L=$(left)
part p42 "$L" 90 python bench/int4_wgmma.py --configs 63 --schedule auto,nosk+k0+wc0 --ms 384,520,640,777,1040,1536,2100 \
  --skip triton,dequant --rounds 3 --budget-s $((L - 60))
ls -la "$OUT"
