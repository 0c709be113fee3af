#!/usr/bin/env bash
# Session 10, one device call on the machine's own python3 (nothing installed): the GPU tests of the scatter GEMMs and
# the grouped-GEMM dW1, then bench_moe on the full cells of three fine-grained layers (ours, ours_scatter_triton,
# ours_dw_grouped_mm, grouped_mm). Writes under $OUT.
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MPLBACKEND=Agg TRITON_CACHE_AUTOTUNING=1
timeout -k 5 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/moe/test_moe_scatter.py tests/kernels/moe/test_moe_grouped_mm_weight_grad.py "tests/kernels/moe/test_moe_kernels.py::test_fused_bf16_gpu_against_grouped_mm_and_eager" -rA > $OUT/gpu-tests.log 2>&1; echo "tests exit $?"; tail -2 $OUT/gpu-tests.log
timeout -k 5 170 python3 benchmarks/bench_moe.py --out $OUT/bench --no-e2e --modes full --shapes qwen3_30b_a3b qwen1_5_moe_a2_7b deepseek_v2_lite --tokens 8192 32768 --repetitions 3 --budget-s 120 --variants ours_scatter_triton ours_dw_grouped_mm ours_gmm_engine > $OUT/bench.log 2>&1; echo "bench exit $?"; grep "_full:" $OUT/bench.log; rm -f $OUT/bench/*.png
