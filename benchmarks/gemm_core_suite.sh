#!/usr/bin/env bash
# The GEMM core's GPU measurements in one place: the bf16 GPU tests of every kernel the GEMM core touches, then the
# benchmarks that grade it (the core against cuBLAS, the LoRA linear's persistent / folded variants against the
# frozen layer, the MoE layer's persistent variants against grouped_mm and Liger), then a kernel-by-kernel profile
# of the LoRA linear's target cell and the MoE layer (what limits them). Each step writes into OUT and
# logs to OUT/<step>.log; a failing step is reported and the next one still runs.
#
#     bash benchmarks/gemm_core_suite.sh OUT                      # every step
#     bash benchmarks/gemm_core_suite.sh OUT tests moe            # some of them: tests gemm linear moe profile
#
# Needs a CUDA GPU and the package installed (make install PROFILE=gpu); Liger's cells need liger-kernel.
# SMOKE=1 passes --smoke to the benchmarks (tiny shapes; on a CPU with TRITON_INTERPRET=1: the code path only).
set -u
OUT=${1:?usage: gemm_core_suite.sh OUT [tests] [gemm] [linear] [moe] [profile]}
shift
STEPS=${*:-tests gemm linear moe profile}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
SMOKE_FLAG=""; [ "${SMOKE:-0}" = 1 ] && SMOKE_FLAG=--smoke
mkdir -p "$OUT"
export TQDM_DISABLE=1 PYTHONUNBUFFERED=1
status=0
step() {
  local name=$1; shift
  echo "=== $name ($(date +%T))"
  if "$@" > "$OUT/$name.log" 2>&1; then echo "$name: ok"; else echo "$name: FAILED (exit $?), see $OUT/$name.log"; status=1; fi
  tail -3 "$OUT/$name.log"
}
for s in $STEPS; do
  case $s in
    tests) step tests env LORA_LAB_AUTOTUNE=0 LORA_LAB_MOE_AUTOTUNE=0 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
             -o addopts="-ra" "$HERE/../tests/kernels" ;;
    gemm) step gemm "$PY" "$HERE/bench_gemm_core.py" --out "$OUT" --variants all $SMOKE_FLAG ;;
    linear) step linear "$PY" "$HERE/bench_lora_linear.py" --out "$OUT" --tokens 32768 --ranks 16 \
              --variants fused_persistent fused_fold $SMOKE_FLAG ;;
    moe) step moe "$PY" "$HERE/bench_moe.py" --out "$OUT" --no-e2e \
           --variants ours_persistent liger $SMOKE_FLAG ;;
    profile) step profile "$PY" "$HERE/profile_kernels.py" --out "$OUT" --variants all $SMOKE_FLAG ;;
    *) echo "unknown step $s (tests gemm linear moe profile)"; status=2 ;;
  esac
done
exit $status
