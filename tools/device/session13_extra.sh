#!/usr/bin/env bash
# Session 13 (for the next GPU run): the bf16 GPU tests before the notebooks, the MoE and the loss suites side by side
# (two processes on one GPU; correctness only, so sharing it changes no verdict). Loss: the first GPU run of 3efd401
# (the label check finished behind the first GEMM; a bad label must leave the device usable) and 4cc2561 (dW scaled
# and narrowed by scale_cast_kernel, bit-exact with torch.mul in bf16). Its exit status gates the notebooks
# (EXTRA_GATES=1). Copied into .devcarry/extra.sh, where tools/device/steps.sh looks for it.
O=$1
timeout -k 10 330 .venv-gpu/bin/python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/moe -rA \
  --durations=12 > $O/moe-gpu-tests.log 2>&1 &
MOE=$!
timeout -k 10 200 .venv-gpu/bin/python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/loss -rA \
  --durations=8 > $O/loss-gpu-tests.log 2>&1
loss=$?; echo "loss gpu tests exit $loss"
wait $MOE; moe=$?; echo "moe gpu tests exit $moe"
[ $moe = 0 ] && [ $loss = 0 ]
