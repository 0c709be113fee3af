#!/usr/bin/env bash
# Session 12: the bf16 GPU tests before the notebooks. MoE: the first GPU run of a1d33c7 (the down backward on CUTLASS
# with write_h=False), keep_sorted_x and the [g | u] early free; loss: the first GPU run of bcfd97c (dW's fp32
# accumulator scaled and rounded once in backward). Its exit status gates the notebooks (EXTRA_GATES=1). Copied into
# .devcarry/extra.sh, where tools/device/steps.sh looks for it.
O=$1
timeout -k 10 330 .venv-gpu/bin/python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/moe -rA \
  --durations=12 > $O/moe-gpu-tests.log 2>&1
moe=$?; echo "moe gpu tests exit $moe"
timeout -k 10 150 .venv-gpu/bin/python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/loss -rA \
  --durations=8 > $O/loss-gpu-tests.log 2>&1
loss=$?; echo "loss gpu tests exit $loss"
[ $moe = 0 ] && [ $loss = 0 ]
