#!/usr/bin/env bash
# Session 11, one device call on the machine's own python3 (torch 2.11, Triton 3.6; nothing installed, so no Liger):
# the GPU tests of the empty-expert zeroing pass and its callers, bench_moe on the 30B-A3B-like full cells (ours,
# ours_per_tile, ours_down_gmm, grouped_mm), the kernel profile and the host timeline at 32k. Diagnostics; no
# notebook reads them. Writes under $OUT.
# (Ran at ae430a2. Since a98a82d the CUTLASS down backward is the default and that variant is gone: the fused kernel
# is timed as ours_down_triton.)
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MPLBACKEND=Agg TRITON_CACHE_AUTOTUNING=1
T0=$(date +%s); log() { echo "=== $* (+$(( $(date +%s) - T0 )) s)" | tee -a $OUT/check.log; }
git log -1 --format='tree of %H (device metadata may be stale)' >> $OUT/check.log 2>&1
log tests
timeout -k 5 130 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/moe/test_moe_zero_empty_experts.py \
  tests/kernels/moe/test_moe_grouped_mm_weight_grad.py tests/kernels/moe/test_moe_scatter.py -rA > $OUT/gpu-tests.log 2>&1
echo "tests exit $?" | tee -a $OUT/check.log; tail -1 $OUT/gpu-tests.log | tee -a $OUT/check.log
log bench
timeout -k 5 170 python3 benchmarks/bench_moe.py --out $OUT/bench --no-e2e --modes full --shapes qwen3_30b_a3b \
  --tokens 8192 32768 --repetitions 3 --budget-s 140 --variants ours_per_tile ours_down_gmm > $OUT/bench.log 2>&1
echo "bench exit $?" | tee -a $OUT/check.log; grep "_full:" $OUT/bench.log | tee -a $OUT/check.log; rm -f $OUT/bench/*.png
log profile
timeout -k 5 60 python3 benchmarks/profile_kernels.py --out $OUT/prof --cases moe_full --moe-shape qwen3_30b_a3b \
  --moe-tokens 32768 --repetitions 5 > $OUT/prof_qwen3_30b_a3b_32768.log 2>&1; echo "profile exit $?" | tee -a $OUT/check.log
rm -f $OUT/prof/*.png
log host
timeout -k 5 60 python3 tools/moe_host_profile.py --out $OUT/host --tokens 32768 --impls ours --calls 10 --traced 3 \
  --repetitions 2 > $OUT/host.log 2>&1; echo "host exit $?" | tee -a $OUT/check.log
python3 tools/moe_trace_timeline.py $OUT/host/ours_trace.json.gz > $OUT/host/ours_timeline.txt 2>&1
log done
cd $OUT && tar czf check.tgz check.log gpu-tests.log bench.log bench prof_*.log prof host.log host && rm -rf bench prof host
