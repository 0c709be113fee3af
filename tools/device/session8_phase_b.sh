#!/usr/bin/env bash
# Session 8, phase B (background, setsid): a fresh clone of the carried bundle at $1 (branch moe-lora-column with the
# Triton routing), installed from the wheels in /tmp/lab/carry/.whl; then the rank check of the Triton MoE path
# (tools/moe_lora_rank_check.py), the host profile again (30B-A3B-like, 8k, full and LoRA; Liger left out: its first
# call autotunes for 210 s), the MoE bf16 GPU tests (6 workers, boxed at 300 s).
set -u
COMMIT=$1
L=/tmp/lab; O=$L/out; mkdir -p $O $L/carry
cp -r $PWD/.devcarry $L/carry/; CARRY=$L/carry
T0=$(date +%s)
log() { echo "=== $* $(date +%H:%M:%S) (+$(( $(date +%s) - T0 )) s)" | tee -a $O/session.log; }
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MPLBACKEND=Agg TRITON_CACHE_AUTOTUNING=1
log start
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >> $O/session.log
git clone -q $CARRY/.devcarry/repo.bundle $L/fresh && cd $L/fresh && git checkout -q $COMMIT && git log --oneline -1 >> $O/session.log
log install
{ time make install PROFILE=gpu WHEELS=$CARRY/.whl ; } >> $O/session.log 2>&1
.venv-gpu/bin/python -m pip install -q --no-index --no-deps --find-links $CARRY/.whl pytest-xdist execnet >> $O/session.log 2>&1
.venv-gpu/bin/python -c "import torch, triton, lora_lab; print('torch', torch.__version__, 'triton', triton.__version__)" >> $O/session.log 2>&1
log rank check
timeout -k 5 150 .venv-gpu/bin/python tools/moe_lora_rank_check.py > $O/rank_check.txt 2>&1; echo "exit $?" >> $O/session.log
log host profile full
timeout -k 5 150 .venv-gpu/bin/python tools/moe_host_profile.py --out $O/host_full --shape qwen3_30b_a3b \
  --tokens 8192 --mode full --repetitions 2 --impls ours grouped_mm > $O/host_full.log 2>&1; echo "exit $?" >> $O/session.log
log host profile lora
timeout -k 5 150 .venv-gpu/bin/python tools/moe_host_profile.py --out $O/host_lora --shape qwen3_30b_a3b \
  --tokens 8192 --mode lora --repetitions 2 --impls ours grouped_mm ours_triton > $O/host_lora.log 2>&1; echo "exit $?" >> $O/session.log
log moe gpu tests
timeout -k 5 300 .venv-gpu/bin/python -m pytest -q -m gpu -p no:cacheprovider -n 6 tests/kernels/moe -rA --durations=12 \
  > $O/moe-gpu-tests.log 2>&1; echo "tests exit $?" >> $O/session.log
tail -3 $O/moe-gpu-tests.log >> $O/session.log
log done
touch $O/DONE
