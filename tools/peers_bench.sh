#!/usr/bin/env bash
# lora_lab beside the peers on a GPU host, one part per call, run through tools/remote_gpu_run.sh (which installs
# lora_lab into .venv-gpu first and sets $OUT):
#
#   bash tools/remote_gpu_run.sh COMMIT command -- bash tools/peers_bench.sh ops  [bench_peers.py arguments]
#        e.g. --ops lora_linear lora_qkv lora_mlp
#   bash tools/remote_gpu_run.sh COMMIT command -- bash tools/peers_bench.sh step [bench_peers_step.py arguments]
#        e.g. --models llama3_8b --checkpointing off
#
# Carry .whl: lora_lab's wheels plus the peers' wheels and whatever their kernel modules import, downloaded where
# an index is reachable (the GPU host may have none), e.g. for the pins of pyproject's peers-* extras:
#   pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl axolotl==0.21.0 ...
# The peers install one by one with --no-deps (their torch pins disagree with the machine's torch), each logged;
# then every peer's load result (peers.load: the op, or the exact error and what was tried) goes to
# $OUT/peers_load.txt, and the benchmark runs with 2 sessions into $OUT/<part>/.
set -u
PART=$1
shift
: "${OUT:?set OUT to the folder that receives the results}"
PY=.venv-gpu/bin/python
[ -x "$PY" ] || { echo "no $PY: install lora_lab first (make install PROFILE=gpu WHEELS=.whl)"; exit 2; }
PINS=$($PY -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']
print(' '.join(r for k, v in d.items() if k.startswith('peers-') for r in v))")
for pin in $PINS; do
  if $PY -m pip install -q --no-index --no-deps --find-links .whl "$pin" >> "$OUT/peers_install.log" 2>&1; then
    echo "installed $pin" | tee -a "$OUT/peers_install.log"
  else
    echo "NOT installed $pin (see peers_install.log)" | tee -a "$OUT/peers_install.log"
  fi
done
$PY - > "$OUT/peers_load.txt" 2>&1 <<'EOF'
import sys

import torch

sys.path.insert(0, "benchmarks")
import peers  # noqa: E402

device = torch.device("cuda")
for op, names in peers.PEER_OPS.items():
    for name in names:
        got = peers.load(name, op, device)
        if isinstance(got, peers.PeerOp):
            print(f"{op:12s} {name:13s} ok      {got.source} {got.version} {got.note}")
        else:
            print(f"{op:12s} {name:13s} SKIPPED {got.error}\n{'':27s} tried: {'; '.join(got.tried)}")
EOF
cat "$OUT/peers_load.txt"
case "$PART" in
  ops)  SCRIPT=benchmarks/bench_peers.py ;;
  step) SCRIPT="benchmarks/bench_peers_step.py --checkpoint-dir build/peer-checkpoints" ;;  # not under $OUT: GBs
  *)    echo "unknown part $PART (ops or step)"; exit 2 ;;
esac
$PY $SCRIPT --out "$OUT/$PART" --sessions 2 "$@" 2>&1 | tail -60
