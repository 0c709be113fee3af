#!/usr/bin/env bash
# The GPU side of lora_lab in one script, for a CUDA machine with torch/triton/transformers/peft already
# installed (the H200 this project publishes from). Usage: bash benchmarks/gpu_job.sh STAGE [STAGE...]
#   kernels-lora   focused bf16 GPU tests of the fused LoRA kernels + their benchmarks -> outputs/gpu/
#   kernels-moe    focused bf16 GPU tests of the fused MoE kernels (notebook 06 benchmarks them)
#   notebooks:LIST lora-lab run --profile gpu --only LIST, then grade              -> outputs/gpu/
# Wheels for papermill/nbval/ipykernel, when carried in .whl/, are installed into /tmp/site first.
# If $OUT is set, a tarball of outputs/gpu lands there, refreshed after every stage.
# Measured on the H200: kernels-lora ~4.2 min, notebook 04 ~3.3 min, notebook 05 ~3.2 min; notebook 06 > 1.5 min.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
OUTDIR=${OUT:-$PWD/build/gpu-job}; mkdir -p "$OUTDIR" outputs/gpu
if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && python3 -m ipykernel install --sys-prefix --name python3 >/dev/null && touch /tmp/site/.done
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
for stage in "$@"; do
  echo "=== stage $stage ($(date +%T))"
  case "$stage" in
    kernels-lora)
      # focused bf16 GPU tests, then the three benchmarks (CSV + PNG into outputs/gpu), then notebook 05 reads them
      LORA_LAB_AUTOTUNE=0 timeout 150 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu \
        -k "bfloat16 or bf16 or qkv_bias_odd or float32-777" \
        tests/test_kernel_lora_linear.py tests/test_kernel_lora_shared_input.py tests/test_patching.py 2>&1 | tail -30
      timeout 220 python3 benchmarks/bench_lora_linear.py --out outputs/gpu --rep 20 --warmup 5 \
        --variants peft_nocast chained fused fused_triton fused_overlap fused_qdb_overlap fused_cublas_base \
        fused_cublas_base_overlap --components target 2>&1 | tail -130
      timeout 100 python3 benchmarks/bench_gated_deltanet.py --out outputs/gpu --rep 20 --warmup 5 \
        --variants peft_nocast chained fused fused_triton_base fused_triton_base_overlap fused_cublas_base \
        fused_cublas_base_overlap --check-seq 1024 2>&1 | grep -v "falling back" | tail -14
      timeout 110 python3 benchmarks/bench_lora_train_step.py --out outputs/gpu --steps 3 --warmup 1 \
        --variants fused fused_bf16 fused_triton_base 2>&1 | tail -14
      ;;
    kernels-moe)
      # focused bf16 GPU tests of the MoE kernels; notebook 06 runs the benchmarks itself
      LORA_LAB_MOE_AUTOTUNE=0 timeout 240 python3 -m pytest -q --tb=short -p no:cacheprovider \
        "tests/test_moe_kernels.py::test_fused_bf16_gpu_against_fp32_reference[1000-264-136-16-4-16]" \
        "tests/test_moe_kernels.py::test_fused_bf16_gpu_against_fp32_reference[257-128-96-8-8-0]" \
        "tests/test_moe_kernels.py::test_fused_bf16_gpu_against_fp32_reference[1-64-32-4-2-16]" \
        tests/test_moe_kernels.py::test_fused_bf16_gpu_against_grouped_mm_and_eager \
        tests/test_moe_kernels.py::test_unspecialized_twins_cover_every_size_and_stride \
        tests/test_moe_patch.py::test_patched_peft_model_bf16_gpu_close_to_fp32_eager 2>&1 | tail -20
      ;;
    notebooks:*)
      LORA_LAB_AUTOTUNE=${LORA_LAB_AUTOTUNE:-0} python3 -m lora_lab run --profile gpu --only "${stage#notebooks:}"
      python3 -m lora_lab grade --profile gpu | tail -80
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  # pack after every stage, so a call cut at its time limit still returns what earlier stages wrote
  tar czf "$OUTDIR/outputs_gpu.tgz.tmp" outputs/gpu && mv "$OUTDIR/outputs_gpu.tgz.tmp" "$OUTDIR/outputs_gpu.tgz"
done
echo "=== done ($(date +%T))"
