#!/usr/bin/env bash
# One foreground device call (carry .whl), no notebook: issue #24's K-widened LoRA go/no-go, then issue #23's 64k loss
# cells on the final code with the two suspects of the 64k gap (session 18 README, "Next session's route"):
# (CCE left out: 1.2-1.9 s a call at 64k in session 15, the budget buys more cells without it)
#   bash tools/device/loss64k_kaug.sh [loss_budget_s]
# Writes $OUT/kaug/ and $OUT/loss64k/ (each with its log). Session 18 lost a call to `pip` not being the venv's
# (Liger skipped) and another to a missing PYTHONPATH: both are set here.
set -u
LOSS_BUDGET=${1:-380}
export PYTHONPATH=$PWD:$PWD/benchmarks TQDM_DISABLE=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-index .whl/liger_kernel-*.whl .whl/cut_cross_entropy-*.whl > $OUT/pip.log 2>&1
python3 -c "import liger_kernel, cut_cross_entropy; print('liger and cce import')" >> $OUT/pip.log 2>&1
mkdir -p $OUT/kaug $OUT/loss64k
timeout -k 5 150 python3 tools/moe_lora_kaug_bench.py --out $OUT/kaug > $OUT/kaug/kaug.log 2>&1
echo "kaug exit $?" | tee -a $OUT/run.log
timeout -k 5 $(( LOSS_BUDGET + 60 )) python3 benchmarks/bench_loss.py --out $OUT/loss64k \
  --methods lora_lab lora_lab_fwdgrad_lowmem lora_lab_fwdgrad_r4096 liger gemm_floor torch_bf16 \
  --shapes llama3-8b qwen2.5-14b gemma2-2b qwen2.5-0.5b --tokens 65536 --repetitions 3 \
  --time-budget-s "$LOSS_BUDGET" > $OUT/loss64k/bench.log 2>&1
echo "loss64k exit $?" | tee -a $OUT/run.log
python3 benchmarks/loss_panel_table.py $OUT/loss64k > $OUT/loss64k/panel_table.md 2>&1
tail -n 3 $OUT/kaug/kaug.log $OUT/loss64k/bench.log
