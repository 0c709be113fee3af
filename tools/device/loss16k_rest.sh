#!/usr/bin/env bash
# One foreground device call (carry .whl): the four 16k cells of issue #23's panel that have not run on the final loss
# code (gemma2-2b and qwen2.5-14b heads, 16,384 tokens, trainable and frozen; session 19 README, "Known and left"),
# with every column of the panel (ours, Liger, CCE, torch bf16, GEMM floor), 3 repetitions in one process:
#   bash tools/device/loss16k_rest.sh [budget_s]      (about 3 minutes)
# Writes $OUT/loss16k/ (the raw and summary CSVs, the log and panel_table.md; the plots are left out: a call
# returns at most 8 files).
set -u
BUDGET=${1:-300}
export PYTHONPATH=$PWD:$PWD/benchmarks TQDM_DISABLE=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-index .whl/liger_kernel-*.whl .whl/cut_cross_entropy-*.whl > $OUT/pip.log 2>&1
mkdir -p $OUT/loss16k
timeout -k 5 $(( BUDGET + 60 )) python3 benchmarks/bench_loss.py --out $OUT/loss16k \
  --methods lora_lab liger cce gemm_floor torch_bf16 --shapes gemma2-2b qwen2.5-14b --tokens 16384 \
  --repetitions 3 --time-budget-s "$BUDGET" > $OUT/loss16k/bench.log 2>&1
echo "loss16k exit $?" | tee -a $OUT/run.log
rm -f $OUT/loss16k/*.png
python3 benchmarks/loss_panel_table.py $OUT/loss16k > $OUT/loss16k/panel_table.md 2>&1
tail -n 12 $OUT/loss16k/panel_table.md
