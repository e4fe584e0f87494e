#!/usr/bin/env bash
# One device call: a compile-time switch of the CUDA kernels at several values, each build in a process of its own
# (SDQUANT_NVCC_FLAGS gives each its own module name and build directory), against the default build.
#   bash bench/define_sweep.sh chain "" "-DSDQ_TIGHT_L2PF=0"
#   bash bench/define_sweep.sh e2e   "" "-DSDQ_TIGHT_L2PF=0"        # bf16 compiled beside each, batches 1 and 8
# "" is the default build. Every flagged build first passes bench/fused_ops.py's checks (plain and fused ops against
# the reference); a build that fails them is not timed. Outputs: $OUT/<what>_sweep.tgz (<what>_<n>/ a setting, summary.txt), the summary printed last.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-.}"
W=$(mktemp -d)  # the runs' files, packed into one archive under $OUT at the end (a device call returns 8 files)
what="${1:-}"; shift || true
case "$what" in chain|e2e) ;; *) echo "usage: bash bench/define_sweep.sh chain|e2e FLAGS..."; exit 2 ;; esac
rc=0; i=0; summary=""
for flags in "$@"; do
  d="$W/${what}_$i"; mkdir -p "$d"; i=$((i + 1))
  echo "$flags" > "$d/flags.txt"
  if [ -n "$flags" ]; then
    if ! SDQUANT_NVCC_FLAGS="$flags" python bench/fused_ops.py --out "$d/fused_ops" > "$d/fused_ops.log" 2>&1; then
      echo "== [$flags] fused_ops checks FAILED: not timed"; tail -3 "$d/fused_ops.log"; rc=1; continue
    fi
    echo "== [$flags] $(grep -E '^checks:' "$d/fused_ops.log" | tail -1)"
  fi
  if [ "$what" = chain ]; then
    SDQUANT_NVCC_FLAGS="$flags" python bench/chain.py --modes PPPP,FFFF --ms 1,8 --reps 30 --out "$d" \
      > "$d/chain.log" 2>&1 || rc=1
    summary+="== chain [$flags]"$'\n'"$(grep -A6 '^| M | PDL | qkv' "$d/chain.log" | head -6)"$'\n'
  else
    SDQUANT_NVCC_FLAGS="$flags" python bench/e2e.py --variants bf16-compiled,int4all-compiled-pdl-early \
      --batches 1,8 --no-prefill --commit "${SDQUANT_COMMIT:-unknown}+[$flags]" --out "$d/e2e.json" \
      > "$d/e2e.log" 2>&1 || rc=1
    summary+="== e2e [$flags]"$'\n'"$(grep -E 'decode B=' "$d/e2e.log" | sed -E 's/, .trials_ms.*//')"$'\n'
  fi
done
echo "$summary" | tee "$W/summary.txt"
tar -czf "$OUT/${what}_sweep.tgz" -C "$W" . && rm -rf "$W"
echo "define sweep ($what) rc=$rc"
exit $rc
