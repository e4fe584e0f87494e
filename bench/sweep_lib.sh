# Sourced by bench/define_sweep.sh and bench/env_sweep.sh: a device call returns at most 8 files, so a sweep writes its
# runs under a temporary directory and packs them into one archive under $OUT at the end.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-.}"
W=$(mktemp -d)
rc=0; i=0; summary=""

# sweep_end NAME: print the summary (also kept as summary.txt), write $OUT/NAME_sweep.tgz, exit with the sweep's status
sweep_end() {
  echo "$summary" | tee "$W/summary.txt"
  tar -czf "$OUT/$1_sweep.tgz" -C "$W" . && rm -rf "$W"
  echo "$1 sweep rc=$rc"
  exit "$rc"
}
