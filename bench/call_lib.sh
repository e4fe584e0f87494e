# Sourced by the one-call device scripts (bench/issue4_call.sh, bench/h200_ab_call.sh, bench/tight_pdl_call.sh): the
# environment every part runs with, the GPU's name, the seconds left of the call's limit, and `part`. Before sourcing,
# set CALL_NAME (the script's name, for the usage line) and CALL_LIMIT (seconds the whole call may take); pass the
# commit as the script's $1. CALL_PARTS (comma-separated names) runs only those parts.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" SDQUANT_CACHE_DIR="${SDQUANT_CACHE_DIR:-/tmp/sdq_ext}"
export SDQUANT_COMMIT="${CALL_COMMIT:?usage: bash bench/$CALL_NAME <full commit hash of the tree sent>}" PYTHONUNBUFFERED=1
OUT="${OUT:?OUT must name the output folder}"
LIMIT="$CALL_LIMIT"
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU=$G commit=$SDQUANT_COMMIT"
T0=$SECONDS
left() { echo $((LIMIT - SECONDS + T0)); }

part() {  # $1: name, $2: seconds it may take, $3: the least worth starting, the rest: the command (+ --out $OUT/name)
  local name=$1 t=$2 least=$3
  shift 3
  if [ -n "${CALL_PARTS:-}" ] && [[ ",$CALL_PARTS," != *",$name,"* ]]; then echo "$name: not asked for"; return; fi
  local l
  l=$(left)
  [ "$t" -le "$l" ] || t=$l
  if [ "$t" -lt "$least" ]; then echo "$name: skipped (${t}s left)"; return; fi
  mkdir -p "$OUT/$name"
  timeout "$t" "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? t=$((SECONDS - T0))"
  grep -E "checks:|pass|^\|" "$OUT/$name.log" | cut -c1-300 | tail -60
}
