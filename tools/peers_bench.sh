#!/usr/bin/env bash
# lora_lab beside the peers on a GPU host, with the peers installed from carried wheels.
#
#   bash tools/peers_bench.sh install            peers' wheels (.whl/*.whl, --no-deps) into /tmp/site
#   bash tools/peers_bench.sh load               what each peer's op loads to, or its exact error -> $RES/peers_load.txt
#   bash tools/peers_bench.sh ops  [ARGS ...]    benchmarks/bench_peers.py into $RES/ops (unsloth: $RES/ops_unsloth)
#   bash tools/peers_bench.sh step [ARGS ...]    benchmarks/bench_peers_step.py --sequential, one process per
#                                                checkpointing setting, into $RES/step_ckpt_{off,on}
#
# RES (default $OUT) receives the results; PY (default python3) runs them, with PYTHONPATH=$PWD:/tmp/site.
# Fetch the wheels where an index is reachable (python 3.12, --no-deps: the peers' torch pins disagree with the GPU
# image's torch), e.g. axolotl==0.21.0 unsloth==2026.10.9 unsloth-zoo==2026.10.9 llamafactory==0.9.5 veomni==0.1.12
# liger-kernel plus what their modules import and the image lacks (for axolotl's LoRA-kernel patch: trl, datasets,
# evaluate, dill, multiprocess, pydantic, pydantic-core, addict, annotated-types, typing-inspection; for both:
# bitsandbytes). tools/slim_wheel.py cuts bitsandbytes and unsloth to fit a size-limited transfer.
#
# unsloth patches transformers and PEFT when it is imported, for the whole process. So it never shares a process
# with an implementation timed after its import: the ops run it in a process of its own (beside ours and PEFT,
# timed in that process too), and each step process imports it last (--impls order: unsloth at the end, every other
# implementation built, timed and freed before it).
set -u
PART=${1:?part: install, load, ops or step}
shift
RES=${RES:-${OUT:?set RES or OUT to the folder that receives the results}}
PY=${PY:-python3}
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MPLBACKEND=Agg \
  HF_HUB_OFFLINE=1
mkdir -p "$RES"
case "$PART" in
  install)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      > "$RES/peers_install.log" 2>&1
    echo "install exit $?" | tee -a "$RES/peers_install.log" ;;
  load)
    $PY - > "$RES/peers_load.txt" 2>&1 <<'EOF'
import sys

import torch

sys.path.insert(0, "benchmarks")
import peers  # noqa: E402

device = torch.device("cuda")
print("torch", torch.__version__, "CUDA", torch.version.cuda, "Python", sys.version.split()[0])
for op, names in peers.PEER_OPS.items():
    for name in sorted(names, key=lambda n: n == "unsloth"):  # unsloth's import patches the process: last
        got = peers.load(name, op, device)
        if isinstance(got, peers.PeerOp):
            print(f"{op:12s} {name:13s} ok      {got.source} {got.version} {got.note}")
        else:
            print(f"{op:12s} {name:13s} SKIPPED {got.error}\n{'':27s} tried: {'; '.join(got.tried)}")
EOF
    cat "$RES/peers_load.txt" ;;
  ops)
    others=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import peers
print(' '.join(p for p in peers.PEERS if p != 'unsloth'))")
    $PY benchmarks/bench_peers.py --out "$RES/ops" --peers $others "$@" 2>&1 | tail -40
    $PY benchmarks/bench_peers.py --out "$RES/ops_unsloth" --peers peft unsloth \
      "$@" --ops lora_linear lora_qkv lora_mlp 2>&1 | tail -20 ;;
  step)
    for ckpt in off on; do
      $PY benchmarks/bench_peers_step.py --out "$RES/step_ckpt_$ckpt" --sequential --checkpointing $ckpt \
        --checkpoint-dir /tmp/peer-checkpoints "$@" 2>&1 | tail -30
    done ;;
  *) echo "unknown part $PART (install, load, ops or step)"; exit 2 ;;
esac
