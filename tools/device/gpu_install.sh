# Sourced by the device scripts (nb06_split.sh, run_notebook.sh) on the GPU machine, in the carried working tree:
# the environment a notebook run wants, then `make install PROFILE=gpu` from the carried wheels (.whl) and
# cut-cross-entropy (no dependencies: the machine's torch stays). Writes $OUT/install$1.log (give $1, "" included:
# sourced without arguments it would see the caller's); sets INSTALL_S (seconds).
# Source it (not in a pipeline: the exports must stay in the caller's shell).
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MPLBACKEND=Agg
INSTALL_T0=$(date +%s)
{ time make install PROFILE=gpu WHEELS=.whl ; } > "$OUT/install${1:-}.log" 2>&1
.venv-gpu/bin/python -m pip install -q --no-index --no-deps --find-links .whl cut-cross-entropy >> "$OUT/install${1:-}.log" 2>&1
INSTALL_S=$(( $(date +%s) - INSTALL_T0 ))
