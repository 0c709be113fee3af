#!/usr/bin/env bash
# Session 15 (for the next GPU run), after notebook 06: issue #23's loss diagnostics and panel, none of which grades
# a prediction. Copied into .devcarry/post.sh, where tools/device/steps.sh looks for it; runs in the fresh clone.
#  1. profile_kernels.py at the Llama-3-8B head (16,384 tokens, trainable and frozen; ours, Liger, the GEMM floor):
#     the first GPU run of the idle-gap report (profile_kernels_gaps.csv): where the about 3 ms between our kernels'
#     sum and the user's loop (session 14) go;
#  2. bench_loss.py over issue #23's panel (four heads x 4k / 16k / 64k tokens x trainable / frozen), the heads that
#     notebook 07 does not time first, with a time budget: cells it cannot start get 'not_run' rows;
# (The 0.5B-head profile was dropped: with 30 min of device time, notebook 06 and these two fit, a third does not.)
O=$1
mkdir -p $O/prof $O/panel
PY=.venv-gpu/bin/python
timeout -k 10 150 $PY benchmarks/profile_kernels.py --cases loss_trainable loss_frozen --variants ours ours_r4096 liger gemm_floor \
  --repetitions 3 --loss-shape llama3-8b --out $O/prof/llama3-8b > $O/prof/prof_llama3-8b.log 2>&1
echo "profile llama3-8b exit $?"
timeout -k 10 320 $PY benchmarks/bench_loss.py --out $O/panel --methods lora_lab liger cce torch_bf16 gemm_floor \
  --shapes qwen2.5-14b gemma2-2b llama3-8b qwen2.5-0.5b --repetitions 3 --time-budget-s 250 > $O/panel/panel.log 2>&1
echo "panel exit $?"
