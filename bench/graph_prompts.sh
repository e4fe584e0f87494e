#!/usr/bin/env bash
# Pending 30 in one device call: bench/graph_prompts.py in every mode, each in a process of its own (a broken state
# must not leak into the next mode). Outputs: $OUT/graph_prompts_sweep.tgz (gp_<n>/graph_prompts.json and .log;
# summary.txt).
set -u
. "$(dirname "$0")/sweep_lib.sh"
for setting in "--mode none" "--mode capture" "--mode replay" "--mode sidestream" "--mode replay --pdl off"; do
  d="$W/gp_$i"; mkdir -p "$d"; i=$((i + 1))
  # shellcheck disable=SC2086
  python bench/graph_prompts.py $setting --out "$d/graph_prompts.json" > "$d/graph_prompts.log" 2>&1 || rc=1
  summary+="== [$setting]"$'\n'"$(grep -E 'PASS|FAIL' "$d/graph_prompts.log" | cut -c1-200)"$'\n'
done
sweep_end graph_prompts
