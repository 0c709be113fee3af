#!/usr/bin/env bash
# One GPU notebook run in one foreground device call (carry .whl), publishable here afterwards:
#   bash tools/device/run_notebook.sh <commit> <ONLY> [timeout_s]
# installs, declares <commit> (tools/device/declare_commit.sh), runs `make run PROFILE=gpu ONLY=<ONLY>` and packs
# build/runs/gpu into $OUT/results.tgz. Here: `tar xzf <files_at>/results.tgz -C .` then
# `make publish PROFILE=gpu ONLY=<ONLY>` (publishes, then grades outputs/gpu: commit the scoreboard with the run;
# `lora-lab publish` alone leaves it stale, which tests/lab/test_committed_scoreboards.py refuses). Notebook 07 took
# 350-420 s. Notebook 10 took 150-215 s until session 17. In session 18 its first session took about 285 s on a fresh
# machine; in session 19 the first session's qwen3_moe model alone took 278 s (52 s in the second session of the same
# run): a first-use cost on a fresh machine, most likely Liger's MoE kernels autotuning, as notebook 06 found them
# doing for minutes at each new shape (not profiled). Session 19's run took 505 s, session 20's 403 s (notebook 07:
# 400 s): give notebook 10 560.
set -u
COMMIT=$1 ONLY=$2 LIMIT=${3:-450}
source tools/device/declare_commit.sh "$COMMIT" > $OUT/declared.log 2>&1 || exit 2
T0=$(date +%s)
source tools/device/gpu_install.sh ""  # an argument, or the sourced file sees this script's own
echo "install $INSTALL_S s" | tee $OUT/run.log
timeout -k 5 "$LIMIT" make run PROFILE=gpu ONLY="$ONLY" > $OUT/notebooks.log 2>&1
echo "make run exit $? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/run.log
tar czf $OUT/results.tgz --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' build/runs/gpu
