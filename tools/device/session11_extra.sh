#!/usr/bin/env bash
# The MoE bf16 GPU tests before the notebooks (session 11: the first GPU run of e6d6500, c8c4fc9 and 87f8c31;
# next: zero_empty_experts_, the down backward on CUTLASS by default, keep_sorted_x). Its exit status gates the notebooks
# (EXTRA_GATES=1). Copied into .devcarry/extra.sh, where tools/device/steps.sh looks for it.
O=$1
timeout -k 10 330 .venv-gpu/bin/python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/moe -rA \
  --durations=12 > $O/moe-gpu-tests.log 2>&1
rc=$?; echo "moe gpu tests exit $rc"; exit $rc
