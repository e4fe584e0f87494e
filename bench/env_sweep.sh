#!/usr/bin/env bash
# One device call: bench/e2e.py once a setting, each in a process of its own, a setting being environment assignments
# and e2e options (the baseline variants run beside the measured one in every process).
#   E2E_VARIANTS=bf16-compiled,int4all-compiled-pdl-early bash bench/env_sweep.sh \
#       "" "SDQ_CARVEOUT=100" "--group-size -1" "SDQ_CARVEOUT=100 --group-size -1"    # "": the defaults
#   bash bench/env_sweep.sh "" "SDQUANT_NVCC_FLAGS=-DSDQ_TIGHT_L2PF=0"    # a compile-time switch (one define a setting)
# Outputs: $OUT/e2e_sweep.tgz (e2e_<n>/e2e.json, whose commit field names the setting, and e2e.log; summary.txt).
set -u
. "$(dirname "$0")/sweep_lib.sh"
VARIANTS="${E2E_VARIANTS:-bf16-compiled,int4all-compiled-pdl-early}"
BATCHES="${E2E_BATCHES:-1,8}"
for setting in "$@"; do
  d="$W/e2e_$i"; mkdir -p "$d"; i=$((i + 1))
  envs=(); opts=()
  for w in $setting; do
    if [[ "$w" == *=* && "$w" != -* ]]; then envs+=("$w"); else opts+=("$w"); fi
  done
  env "${envs[@]}" python bench/e2e.py --variants "$VARIANTS" --batches "$BATCHES" --no-prefill \
    --commit "${SDQUANT_COMMIT:-unknown}+[$setting]" --out "$d/e2e.json" "${opts[@]}" > "$d/e2e.log" 2>&1 || rc=1
  summary+="== e2e [$setting]"$'\n'"$(grep -E 'decode B=|check' "$d/e2e.log" | sed -E 's/, .trials_ms.*//' | cut -c1-160)"$'\n'
done
sweep_end e2e
