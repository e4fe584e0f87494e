#!/usr/bin/env bash
# The H200 measurements of docs/benchmarks/pending.md's Pending 47, in one device call of at most ~9.5 minutes. Each part
# has its own time limit and is skipped when too little is left, so the first ones always run:
#   tune (H200 only, ~1 min): `sdquant tune-kernels --resume` over the table of 2026-12-07
#      (bench/results/crossover_h200_tune_20261207.json), which measures its missing shape, 4096x6144
#   cr (~3 min): variant 63's cluster sum from 65 rows (shipped 2026-12-07 on H100 evidence) against the rule before
#      (from 97 rows) at M = 65-128, every shape, on the H200:
#      int4_wgmma --schedule auto,cr97
#   sw (~3 min): the split counts at M = 48-256 on 4096x4096 and 4096x6144, where the layer is below bf16:
#      int4_wgmma --splits 0,2,3,4,6,8
#   g (the rest): the INT4 layer against the op it calls at M = 4096 (gemm run 29 had them 5-22% apart)
# Here:   bash bench/h200_ab_call.sh <full commit hash of the tree sent>   (H200_AB_LIMIT_S=<s>: a shorter call)
# Output under $OUT: t.json, tune.log, cr/int4_wgmma.json, cr.log, sw/int4_wgmma.json, sw.log, g/gemm.json, g.log.
set -u
CALL_NAME=h200_ab_call.sh CALL_COMMIT="${1:-}" CALL_LIMIT="${H200_AB_LIMIT_S:-560}"
. "$(dirname "$0")/call_lib.sh"

if echo "$G" | grep -q H200; then
  cp bench/results/crossover_h200_tune_20261207.json "$OUT/t.json"
  timeout 100 python -m sdquant.cli tune-kernels --output "$OUT/t.json" --resume > "$OUT/tune.log" 2>&1
  echo "tune rc=$? t=$((SECONDS - T0))"
  tail -3 "$OUT/tune.log" | cut -c1-300
else
  echo "tune: skipped (not an H200)"
fi
part cr 200 100 python bench/int4_wgmma.py --configs 63 --schedule auto,cr97 --ms 65,80,96,128 \
  --skip triton,tinygemm,dequant --rounds 3 --budget-s 140
part sw 170 100 python bench/int4_wgmma.py --configs 63 --shapes 4096x4096,4096x6144 --ms 48,64,128,256 \
  --splits 0,2,3,4,6,8 --skip triton,tinygemm,dequant --rounds 3 --budget-s 110
L=$(left)
part g "$L" 60 python bench/gemm.py --shapes 4096x28672,14336x4096 --ms 4096 --kernels bf16,sdq_cuda,sdq_int4_layer \
  --rounds 5
ls -la "$OUT"
