#!/usr/bin/env bash
# The GPU side of lora_lab in one script, for a CUDA machine with torch/triton/transformers/peft already
# installed (the H200 this project publishes from). Usage: bash benchmarks/gpu_job.sh STAGE [STAGE...]
#   kernels-lora   GPU tests (bf16) of the fused LoRA kernels + their benchmarks  -> outputs/gpu/
#   kernels-moe    GPU tests of the fused MoE kernels + the MoE benchmark          -> outputs/gpu/moe_bench/
#   notebooks:LIST lora-lab run --profile gpu --only LIST, then grade              -> outputs/gpu/
# Wheels for papermill/nbval/ipykernel, when carried in .whl/, are installed into /tmp/site first.
# If $OUT is set, logs and a tarball of outputs/gpu land there.
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
      LORA_LAB_AUTOTUNE=0 timeout 150 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu \
        tests/test_kernel_lora_linear.py tests/test_kernel_lora_shared_input.py tests/test_patching.py 2>&1 | tail -40
      timeout 150 python3 benchmarks/bench_lora_linear.py --out outputs/gpu --rep 50 --warmup 10 2>&1 | tail -60
      timeout 60 python3 benchmarks/bench_gated_deltanet.py --out outputs/gpu --rep 50 --warmup 10 2>&1 | tail -20
      timeout 90 python3 benchmarks/bench_lora_train_step.py --out outputs/gpu --steps 5 --warmup 2 2>&1 | tail -20
      ;;
    kernels-moe)
      LORA_LAB_MOE_AUTOTUNE=0 timeout 90 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu \
        tests/test_moe_kernels.py tests/test_moe_patch.py 2>&1 | tail -25
      timeout 200 python3 benchmarks/bench_moe.py --out outputs/gpu/moe_bench 2>&1 | grep -v Warning
      ;;
    notebooks:*)
      python3 -m lora_lab run --profile gpu --only "${stage#notebooks:}"
      python3 -m lora_lab grade --profile gpu | tail -80
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
tar czf "$OUTDIR/outputs_gpu.tgz" outputs/gpu
echo "=== done ($(date +%T))"
