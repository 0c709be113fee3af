#!/usr/bin/env bash
# Session 7 diagnostic, after the notebooks (waits for /tmp/lab/out/DONE): branch moe-lora-column, logs only, nothing
# published. Uses the notebooks' venv (/tmp/lab/fresh/.venv-gpu) with PYTHONPATH at the branch's clone.
#  1. GPU bf16 tests of tests/kernels/moe on the branch (the LoRA column, LoRA on the grouped_mm engine by rule)
#  2. bench_moe, LoRA cells at 8k (ours = the new rules; ours_untuned = the LoRA column; ours_gmm_engine on
#     fine-grained layers), then full cells of the 30B-A3B- and OLMoE-like layers at 8k and 32k (auto weight gradients
#     vs per_tile and grouped_mm, with the profiler's kernel time); each bench boxed at $2 s (default 160)
set -u
BRANCH=${1:-moe-lora-column}; BOX=${2:-160}
D=/tmp/diag; O=$D/out; mkdir -p $O; touch $D/started
T0=$(date +%s)
log() { echo "=== $* $(date +%H:%M:%S) (+$(( $(date +%s) - T0 )) s)" | tee -a $O/diag.log; }
cp $PWD/.devcarry/repo.bundle $D/repo.bundle
log waiting for the notebooks
for i in $(seq 1 400); do [ -f /tmp/lab/out/DONE ] && break; sleep 5; done
PY=/tmp/lab/fresh/.venv-gpu/bin/python
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MPLBACKEND=Agg TRITON_CACHE_AUTOTUNING=1
git clone -q $D/repo.bundle $D/moe && git -C $D/moe checkout -q $BRANCH && git -C $D/moe log --oneline -1 >> $O/diag.log
log moe tests
(cd $D/moe && PYTHONPATH=$D/moe timeout -k 5 120 $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels/moe -rA \
   --durations=8) > $O/moe-gpu-tests.log 2>&1; echo "moe gpu tests exit $?" >> $O/diag.log
tail -3 $O/moe-gpu-tests.log >> $O/diag.log
log bench_moe lora
(cd $D/moe && PYTHONPATH=$D/moe timeout -k 5 $BOX $PY benchmarks/bench_moe.py --out $O/moe_lora \
   --shapes qwen3_30b_a3b mixtral_8x7b qwen1_5_moe_a2_7b --tokens 8192 --modes lora --no-e2e \
   --repetitions 2 --variants ours_untuned ours_gmm_engine --budget-s $((BOX - 20))) > $O/bench_moe_lora.log 2>&1
echo "bench_moe lora exit $?" >> $O/diag.log
# the whole-layer puzzle of the grouped_mm weight gradients: faster in isolation (1.43x / 2.08x), slower in the layer
# at 8k tokens; the profiler's kernel time beside the user's loop says whether the GPU or the host pays
log bench_moe full
(cd $D/moe && PYTHONPATH=$D/moe timeout -k 5 $BOX $PY benchmarks/bench_moe.py --out $O/moe_full \
   --shapes qwen3_30b_a3b olmoe_1b_7b --tokens 8192 32768 --modes full --no-e2e --secondary kernel \
   --repetitions 2 --variants ours_per_tile ours_dw_grouped_mm --budget-s $((BOX - 20))) > $O/bench_moe_full.log 2>&1
echo "bench_moe full exit $?" >> $O/diag.log
log diag done
touch $O/DONE
