#!/usr/bin/env bash
# One device call that re-checks what CPU tests cannot: the CUDA INT4 kernels against the reference (every variant
# the defaults use, PDL on and off; the fused decode-block op, bench/fused_ops.py), sdquant.compile's defaults against
# eager tokens, and the e2e decode numbers of the default path beside bf16. About 5-6 minutes on a fresh H200
# (extension build included).
#   export SDQUANT_COMMIT=$(git rev-parse --short HEAD)   # here, then on the device:  bash bench/device_smoke.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-.}"
rc=0
python bench/gpu_check.py --correctness-only --cuda-only --quick > "$OUT/gpu_check.log" 2>&1 || rc=1
tail -3 "$OUT/gpu_check.log"
python bench/fused_ops.py --out "$OUT" > "$OUT/fused_ops.log" 2>&1 || rc=1
grep -E "^checks:" "$OUT/fused_ops.log" | tail -1
python bench/pdl_check.py --out "$OUT/pdl_check.json" > "$OUT/pdl_check.log" 2>&1 || rc=1
grep -E "^\| |PDL check" "$OUT/pdl_check.log" | tail -14
python bench/compile_smoke.py --out "$OUT/compile_smoke.json" > "$OUT/compile_smoke.log" 2>&1 || rc=1
grep -E "PASS|FAIL|ERROR" "$OUT/compile_smoke.log"
python bench/e2e.py --variants bf16-compiled,int4all-compiled,int4all-compiled-pdl-early --batches 1,8,32 \
  --no-prefill --commit "${SDQUANT_COMMIT:-unknown}" --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1 || rc=1
tail -6 "$OUT/e2e.log"
echo "device smoke rc=$rc"
exit $rc
