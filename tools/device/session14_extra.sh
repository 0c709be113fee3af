#!/usr/bin/env bash
# Session 14: the loss suite's bf16 GPU tests before the notebooks (the first GPU run of 3efd401, the label check
# finished behind the first GEMM, of 4cc2561, dW scaled and narrowed by scale_cast_kernel, and of b258bb8's move of
# the checks). The MoE kernels are unchanged since d5a54f7, whose 30 MoE GPU tests passed in session 13
# (outputs/gpu/session_logs/session13/moe-gpu-tests.log), so they are not rerun. Exit status gates the notebooks
# (EXTRA_GATES=1). Copied into .devcarry/extra.sh, where tools/device/steps.sh looks for it.
O=$1
timeout -k 10 200 .venv-gpu/bin/python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/loss -rA \
  --durations=8 > $O/loss-gpu-tests.log 2>&1
loss=$?; echo "loss gpu tests exit $loss"
[ $loss = 0 ]
