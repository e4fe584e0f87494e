#!/usr/bin/env bash
# One device call: bench/e2e.py once a setting, each in a process of its own, a setting being environment assignments
# and e2e options (the baseline variants run beside the measured one in every process).
#   E2E_VARIANTS=bf16-compiled,int4all-compiled-pdl-early bash bench/env_sweep.sh \
#       "" "SDQ_CARVEOUT=100" "--group-size -1" "SDQ_CARVEOUT=100 --group-size -1"    # "": the defaults
# Outputs: $OUT/e2e_sweep.tgz (e2e_<n>/e2e.json, whose commit field names the setting, and e2e.log; summary.txt).
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-.}"
W=$(mktemp -d)  # the runs' files, packed into one archive under $OUT at the end (a device call returns 8 files)
VARIANTS="${E2E_VARIANTS:-bf16-compiled,int4all-compiled-pdl-early}"
BATCHES="${E2E_BATCHES:-1,8}"
rc=0; i=0; summary=""
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
echo "$summary" | tee "$W/summary.txt"
tar -czf "$OUT/e2e_sweep.tgz" -C "$W" . && rm -rf "$W"
echo "env sweep rc=$rc"
exit $rc
