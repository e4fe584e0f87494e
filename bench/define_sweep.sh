#!/usr/bin/env bash
# One device call: a compile-time switch of the CUDA kernels at several values in bench/chain.py (a decode layer's
# four GEMMs chained, M = 1 and 8, PDL off and on), each build in a process of its own (SDQUANT_NVCC_FLAGS gives each its
# own module name and build directory), against the default build.
#   bash bench/define_sweep.sh chain "" "-DSDQ_TIGHT_L2PF=0"          # "": the default build
# Every flagged build first passes bench/fused_ops.py's checks (plain and fused ops against the reference); a build
# that fails them is not timed. End to end, a flagged build runs through bench/env_sweep.sh:
#   bash bench/env_sweep.sh "" "SDQUANT_NVCC_FLAGS=-DSDQ_TIGHT_L2PF=0"
# Outputs: $OUT/chain_sweep.tgz (chain_<n>/ a setting, summary.txt), the summary printed last.
set -u
[ "${1:-}" = chain ] || { echo "usage: bash bench/define_sweep.sh chain FLAGS..."; exit 2; }
shift
. "$(dirname "$0")/sweep_lib.sh"
for flags in "$@"; do
  d="$W/chain_$i"; mkdir -p "$d"; i=$((i + 1))
  echo "$flags" > "$d/flags.txt"
  if [ -n "$flags" ]; then
    if ! SDQUANT_NVCC_FLAGS="$flags" python bench/fused_ops.py --out "$d/fused_ops" > "$d/fused_ops.log" 2>&1; then
      echo "== [$flags] fused_ops checks FAILED: not timed"; tail -3 "$d/fused_ops.log"; rc=1; continue
    fi
    echo "== [$flags] $(grep -E '^checks:' "$d/fused_ops.log" | tail -1)"
  fi
  SDQUANT_NVCC_FLAGS="$flags" python bench/chain.py --modes PPPP,FFFF --ms 1,8 --reps 30 --out "$d" \
    > "$d/chain.log" 2>&1 || rc=1
  summary+="== chain [$flags]"$'\n'"$(grep -A6 '^| M | PDL | qkv' "$d/chain.log" | head -6)"$'\n'
done
sweep_end chain
