#!/usr/bin/env bash
# Session 10, one device call (the machine's own python3: torch 2.11, Triton 3.6; nothing installed): where the
# MoE layer's time goes now, kernel by kernel, and the LoRA passes piece by piece. Diagnostics; no notebook reads
# them. Writes under $OUT (or the first argument).
set -u
O=${1:-$OUT}; mkdir -p "$O"
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MPLBACKEND=Agg
T0=$(date +%s)
log() { echo "=== $* $(date +%H:%M:%S) (+$(( $(date +%s) - T0 )) s)" | tee -a "$O/diag.log"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv >> "$O/diag.log" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$O/diag.log" 2>&1
git log -1 --format='tree of %H (device metadata may be stale)' >> "$O/diag.log" 2>&1
log lora passes
timeout -k 5 150 python3 tools/moe_lora_pass_bench.py --shapes qwen3_30b_a3b deepseek_v2_lite \
  > "$O/lora_passes.txt" 2>&1; echo "exit $?" >> "$O/diag.log"
for cell in "qwen3_30b_a3b 32768 moe_full moe_lora" "qwen3_30b_a3b 8192 moe_full" \
            "deepseek_v2_lite 32768 moe_lora" "qwen1_5_moe_a2_7b 32768 moe_lora"; do
  set -- $cell; shape=$1; tokens=$2; shift 2
  log profile $shape $tokens "$@"
  timeout -k 5 120 python3 benchmarks/profile_kernels.py --out "$O/prof_${shape}_${tokens}" --cases "$@" \
    --moe-shape $shape --moe-tokens $tokens --repetitions 5 > "$O/prof_${shape}_${tokens}.log" 2>&1
  echo "exit $?" >> "$O/diag.log"
done
log done
