#!/usr/bin/env bash
# Session 16 (GPU), after notebook 06: issue #23's checks of the loss op with free_bytes' estimate (no
# cudaMemGetInfo in a loop's steady state), none of which grades a prediction. Copied into .devcarry/post.sh, where
# tools/device/steps.sh looks for it; runs in the fresh clone.
#  1. the loss op's GPU tests (bf16 against the fp32 reference, every option): a failure skips the rest;
#  2. bench_loss.py over issue #23's panel at 4k and 16k tokens (four heads x trainable / frozen), where a fixed
#     per-call cost weighs most, with a time budget: cells it cannot start get 'not_run' rows;
#  3. profile_kernels.py at the Llama-3-8B head (16,384 tokens; ours and the GEMM floor): the idle-gap report
#     again, to see whether the 548 us gap behind cudaMemGetInfo (session 15) is gone.
O=$1
mkdir -p $O/prof $O/panel
PY=.venv-gpu/bin/python
timeout -k 10 200 $PY -m pytest -q -p no:cacheprovider -m gpu tests/kernels/loss > $O/loss-gpu-tests.log 2>&1
rc=$?; echo "loss gpu tests exit $rc"
[ $rc = 0 ] || exit 1
timeout -k 10 300 $PY benchmarks/bench_loss.py --out $O/panel --methods lora_lab liger cce torch_bf16 gemm_floor \
  --shapes llama3-8b qwen2.5-0.5b gemma2-2b qwen2.5-14b --tokens 4096 16384 --repetitions 3 --time-budget-s 230 \
  > $O/panel/panel.log 2>&1
echo "panel exit $?"
timeout -k 10 120 $PY benchmarks/profile_kernels.py --cases loss_trainable loss_frozen --variants ours gemm_floor \
  --repetitions 3 --loss-shape llama3-8b --out $O/prof/llama3-8b > $O/prof/prof_llama3-8b.log 2>&1
echo "profile llama3-8b exit $?"
