#!/usr/bin/env bash
# GPU checks before the notebooks (time-boxed; session 6 plan): the bf16 GPU tests of what session 5 landed without a
# GPU run: the MoE kernels (per-tile default, [g|u] freed early, grouped_mm engine with LoRA) and the loss's frozen
# chunk bound. Compile-heavy: session 5's 110 s box ran out after 5 tests of tests/kernels/moe.
O=$1
timeout 240 .venv-gpu/bin/python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/moe/test_moe_engine.py \
  tests/kernels/moe/test_moe_grouped_mm_weight_grad.py -rA --durations=8 > $O/moe-gpu-tests.log 2>&1
echo "moe gpu tests exit $?"
timeout 90 .venv-gpu/bin/python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/loss/test_fwdgrad.py -rA \
  > $O/loss-gpu-tests.log 2>&1
echo "loss gpu tests exit $?"
