#!/usr/bin/env bash
# Pending 24's measurement (docs/BENCHMARKS.md): the tight kernels with SDQ_TIGHT_L2PF=1 (an L2 prefetch of the
# prologue's ring before griddepcontrol.wait, with which ptxas keeps the ring's loads ahead of the wait) against the
# default build, each in its own process (SDQUANT_NVCC_FLAGS builds the flagged extension in a directory of its own).
#   part 1 (about 4 minutes): the GPU checks of the flagged build, then bench/chain.py both ways
#   part 2 (about 7 minutes): bench/e2e.py batch 1 and 8 both ways, bf16 compiled beside each
#   export SDQUANT_COMMIT=$(git rev-parse --short HEAD)   # here, then on the device:  bash bench/l2pf_check.sh 1
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-.}"
FLAG="-DSDQ_TIGHT_L2PF=1"
rc=0
case "${1:-1}" in
  1)
    SDQUANT_NVCC_FLAGS="$FLAG" python bench/gpu_check.py --correctness-only --cuda-only --quick \
      > "$OUT/gpu_check_l2pf.log" 2>&1 || rc=1
    tail -2 "$OUT/gpu_check_l2pf.log"
    SDQUANT_NVCC_FLAGS="$FLAG" python bench/fused_ops.py --out "$OUT/fused_ops_l2pf" > "$OUT/fused_ops_l2pf.log" 2>&1 || rc=1
    grep -E "^checks:" "$OUT/fused_ops_l2pf.log" | tail -1
    for mode in off on; do
      flags=""; [ "$mode" = on ] && flags="$FLAG"
      SDQUANT_NVCC_FLAGS="$flags" python bench/chain.py --modes PPPP,NNNN,FFFF --ms 1,8 --reps 30 \
        --out "$OUT/chain_$mode" > "$OUT/chain_$mode.log" 2>&1 || rc=1
      echo "== chain, SDQ_TIGHT_L2PF $mode"
      grep -A6 "^| M | PDL | qkv" "$OUT/chain_$mode.log" | head -6
    done
    ;;
  2)
    for mode in off on; do
      flags=""; [ "$mode" = on ] && flags="$FLAG"
      SDQUANT_NVCC_FLAGS="$flags" python bench/e2e.py --variants bf16-compiled,int4all-compiled-pdl-early \
        --batches 1,8 --no-prefill --commit "${SDQUANT_COMMIT:-unknown}+l2pf_$mode" --out "$OUT/e2e_l2pf_$mode.json" \
        > "$OUT/e2e_l2pf_$mode.log" 2>&1 || rc=1
      echo "== e2e, SDQ_TIGHT_L2PF $mode"
      grep -E "decode B=" "$OUT/e2e_l2pf_$mode.log"
    done
    ;;
  *) echo "usage: bash bench/l2pf_check.sh 1|2"; exit 2 ;;
esac
echo "l2pf check part ${1:-1} rc=$rc"
exit $rc
