#!/usr/bin/env bash
# Session 6, leftover device time: which tiles the autotuner picks in the LoRA cells (issue #24's untuned trap:
# ours_untuned 1.47-1.60x ours in every LoRA cell of session 5's diagnostic). Logs only.
set -u
COMMIT=$1; BOX=${2:-150}
O=${OUT:-/tmp/out6}; mkdir -p $O; HERE=$PWD
L=/tmp/lab
if [ ! -x $L/fresh/.venv-gpu/bin/python ]; then
  rm -rf $L/fresh; mkdir -p $L
  git clone -q $HERE/.devcarry/repo.bundle $L/fresh && cd $L/fresh && git checkout -q $COMMIT
  { time make install PROFILE=gpu WHEELS=$HERE/.whl ; } > $O/install.log 2>&1
fi
cd $L/fresh && git log --oneline -1 > $O/commit.txt
export TRITON_PRINT_AUTOTUNING=1 TQDM_DISABLE=1 LORA_LAB_MOE_TUNING_CACHE=0 PYTHONUNBUFFERED=1
timeout $BOX .venv-gpu/bin/python benchmarks/bench_moe.py --out $O/bench --repetitions 1 --variants ours_untuned \
  --shapes qwen3_30b_a3b mixtral_8x7b --modes lora --tokens 8192 --no-e2e --calls 5 > $O/autotune.log 2>&1
echo "bench exit $?" >> $O/autotune.log
