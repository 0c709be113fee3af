#!/usr/bin/env bash
# Notebook 06 on the GPU in two foreground calls, each of which returns its own results, so that a machine given
# back between the calls costs a restart, not the run (the background-job route lost notebook 06 in sessions 14,
# 15 and 16: it needs two polls back to back, and the machine goes back after 30 s idle). Notebook 06 takes 930-960 s;
# the benchmark's first session (--budget-s 420) is most of it.
#
#   call A (carry .whl):                          bash tools/device/nb06_split.sh A <commit>
#     installs, runs bench_moe.py's session 0 with the notebook's own arguments into build/runs/gpu/session0 (the
#     folder notebook 06's bench_moe writes into) and packs it, the ledger of first calls, and Triton's autotuning
#     picks into $OUT/sessionA.tgz.
#   here:   tar xzf <files_at>/sessionA.tgz -C .   (build/ is ignored: it travels only as carry)
#   call B (carry .whl, build/runs/gpu, build/triton-cache):    bash tools/device/nb06_split.sh B <commit>
#     installs, runs `make run PROFILE=gpu ONLY=06`: the notebook's bench_moe --sessions 2 keeps session 0 (same
#     code, same arguments: benchmarks/bench_moe.py session_complete) and runs session 1; results in $OUT.
# Both calls must run the same commit (session_complete compares the code hash). Give that commit as the second
# argument (git rev-parse HEAD here): the copy's stale .git is moved aside and the commit declared
# (tools/device/declare_commit.sh), so that `lora-lab publish` accepts the run.
set -u
STEP=$1
if [ -n "${2:-}" ]; then source tools/device/declare_commit.sh "$2"; fi
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=$PWD/build/triton-cache
T0=$(date +%s)
source tools/device/gpu_install.sh "$STEP"
echo "install $INSTALL_S s" | tee $OUT/split$STEP.log
G=build/runs/gpu
if [ "$STEP" = A ]; then
  mkdir -p $G $TRITON_CACHE_DIR
  # notebook 06's bench_moe arguments (its section 6 cell, with its default parameters), less --out and --sessions
  timeout -k 10 540 .venv-gpu/bin/python benchmarks/bench_moe.py --repetitions 5 --budget-s 420 300 --secondary \
    --variants eager liger ours_untuned ours_per_tile ours_down_triton ours_triton \
    --out $G/session0 --session-index 0 --first-call-ledger $G/first_calls.json > $OUT/session0.log 2>&1
  echo "session 0 exit $? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/splitA.log
  find build/triton-cache -name '*.autotune.json' > /tmp/picks.txt
  tar czf $OUT/sessionA.tgz $G/session0 $G/first_calls.json -T /tmp/picks.txt
  echo "$(wc -l < /tmp/picks.txt) autotuning picks packed" | tee -a $OUT/splitA.log
else
  ls $G/session0/session_complete.json >> $OUT/splitB.log 2>&1
  timeout -k 10 550 make run PROFILE=gpu ONLY=06 > $OUT/nb06.log 2>&1
  echo "nb06 exit $? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/splitB.log
  tar czf $OUT/results.tgz --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' $G
fi
