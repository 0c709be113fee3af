#!/usr/bin/env bash
# lora_lab beside the peers on a GPU host, with the peers installed from carried wheels.
#
#   bash tools/peers_bench.sh install            peers' wheels ($WHEELS/*.whl, --no-deps) into $SITE; SonicMoE and
#                                                QuACK each with the CUTLASS DSL it pins into $SITE-sonicmoe and
#                                                $SITE-quack (from $WHEELS/, build/assembled/ or
#                                                build/assembled-sites/: tools/parts.py, remote_gpu_run.sh --site-parts)
#   bash tools/peers_bench.sh sites              the two DSL site folders only (e.g. QuACK for notebook 05's
#                                                base_gemm="quack" route)
#   bash tools/peers_bench.sh path quack|sonicmoe  the PYTHONPATH that imports from that site folder: $PWD, the
#                                                folder and what its .pth files add (PYTHONPATH=$(bash
#                                                tools/peers_bench.sh path quack) python3 benchmarks/...)
#   bash tools/peers_bench.sh load               what each peer's op loads to, or its exact error -> $RES/peers_load.txt
#   bash tools/peers_bench.sh ops  [ARGS ...]    benchmarks/bench_peers.py into $RES/ops (unsloth, SonicMoE, QuACK:
#                                                $RES/ops_unsloth, ops_sonicmoe, ops_quack, each its own process)
#   bash tools/peers_bench.sh step [ARGS ...]    benchmarks/bench_peers_step.py --sequential, one process per
#                                                checkpointing setting (CKPT, default "off on"), into
#                                                $RES/step_ckpt_{off,on}
#   bash tools/peers_bench.sh warm [PEER ...]    each CUTLASS-DSL peer (default: sonicmoe quack) that is installed, once
#                                                (bench_peers.py --repetitions 1 into $RES/warm_PEER) under a limit of
#                                                its own (WARM_S, default 500 s), so its GEMMs compile and autotune into
#                                                QuACK's caches before a later call times them; $RES/warm.txt gets
#                                                each one's exit status and seconds
#   bash tools/peers_bench.sh call               one device call's worth (remote_gpu_run.sh --limit 570), the least
#                                                measured first, each part under its own limit so what finished
#                                                comes back: install, load (LOAD_S, default 60 s), the
#                                                Llama-3-8B-shaped step at full depth with checkpointing on (STEP_S,
#                                                270 s, 3 steps per repetition: ours, PEFT + Liger, axolotl, unsloth
#                                                last; PEFT, slower than PEFT + Liger, is left to the step part), the
#                                                Qwen3-30B-A3B-shaped MoE beside Liger, LlamaFactory and VeOmni in a
#                                                process of its own ($RES/ops_moe; MOE_S, 210 s: about three minutes
#                                                on an H100), then the LoRA ops beside PEFT and axolotl (OPS_S, 90 s);
#                                                CALL_PARTS (default "step moe ops") picks some of the three, to
#                                                spread them over calls. unsloth's ops: the ops part
#
# RES (default $OUT) receives the results; PY (default python3) runs them, with PYTHONPATH=$PWD:$SITE (SITE, default
# /tmp/site: where the peers are installed).
# Notebook 10 reads them when RES is its run folder's 10_peers (e.g. RES=build/runs/gpu/10_peers) and the rows were
# written by the code it runs (lora_lab.experiments.peer_comparison.read_results): one folder per process, ops,
# ops_moe, ops_unsloth, ops_sonicmoe, ops_quack, step_ckpt_off and step_ckpt_on.
#
# SonicMoE 0.1.2.post1 pins nvidia-cutlass-dsl 4.4.2 and takes quack-kernels >= 0.3.11 (0.4.1 is the newest that
# accepts 4.4.2); QuACK 0.6.5's linear cross-entropy asks for the DSL >= 4.7 (4.7.1 needs its libs-core, libs-cu12
# and nvidia-cuda-nvdisasm wheels too). Both need cuda-python (cuda-bindings, cuda-pathfinder), apache-tvm-ffi,
# torch-c-dlpack-ext and einops.
# One process holds one DSL version, so each runs in a process of its own with its own site folder.
# QuACK (QuACK's own GEMMs and the quack-kernels 0.4.1 that SonicMoE calls) autotunes a GEMM on its first call at a
# shape, compiling every candidate with the DSL in worker processes: minutes per GEMM. Its caches go to
# QUACK_CACHE_DIR (here /tmp/quack-cache unless set, which outlives a call while the host stays up) and the picks are
# kept there too (QUACK_CACHE_AUTOTUNING=1), so `warm` in one call lets the next call time the tuned kernels.
# Fetch the wheels where an index is reachable: tools/peers_wheels.sh writes the LoRA and MoE peers' set (python 3.12,
# --no-deps: the peers' torch pins disagree with the GPU image's torch; what their modules import and the image
# lacks, in versions the peers' import-time checks accept; unsloth and bitsandbytes slimmed by tools/slim_wheel.py).
#
# unsloth patches transformers and PEFT when it is imported, for the whole process. So it never shares a process
# with an implementation timed after its import: the ops run it in a process of its own (beside ours and PEFT,
# timed in that process too), and each step process imports it last (--impls order: unsloth at the end, every other
# implementation built, timed and freed before it).
set -u
PART=${1:?part: install, sites, path, load, ops, warm, step or call}
shift
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}  # where the peers install (SITE-sonicmoe, SITE-quack: the CUTLASS DSL peers)
WHEELS=${WHEELS:-.whl}   # the folder of the peers' wheels (e.g. .whl-peers, carried beside .whl)
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MPLBACKEND=Agg \
  HF_HUB_OFFLINE=1 QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-/tmp/quack-cache} \
  QUACK_CACHE_AUTOTUNING=${QUACK_CACHE_AUTOTUNING:-1}
if [ "$PART" != path ]; then
  RES=${RES:-${OUT:?set RES or OUT to the folder that receives the results}}
  mkdir -p "$RES"
fi
# A site folder's path entries: the folder and what its .pth files add. `pip install --target` leaves .pth files
# that only a site directory's processing runs, never a PYTHONPATH entry: the CUTLASS DSL's `cutlass` package is
# put on sys.path by one (nvidia_cutlass_dsl_packages.pth), so the folder alone imports quack but not cutlass.
site_path() {
  env -u PYTHONPATH $PY -c 'import os, site, sys
folder = os.path.abspath(sys.argv[1])
before = set(sys.path)
site.addsitedir(folder)
print(":".join([folder] + [p for p in sys.path if p not in before and p != folder]))' "$1"
}
case "$PART" in
  install|sites)
    if [ "$PART" = install ]; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl > "$RES/peers_install.log" 2>&1
      echo "install exit $?" | tee -a "$RES/peers_install.log"
    fi
    group() {  # group SITE PATTERN...: the wheels matching each pattern (from $WHEELS/, build/assembled/ or
      #          build/assembled-sites/) into SITE
      local site=$1 found=() p w; shift
      for p in "$@"; do
        for w in "$WHEELS"/$p build/assembled/$p build/assembled-sites/$p; do
          [ -f "$w" ] && { found+=("$w"); break; }
        done
      done
      [ ${#found[@]} -eq $# ] || { echo "$site: not installed, missing wheels among: $*"; return 0; }
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${found[@]}"
      echo "$site: install exit $?"
    }
    { common=("apache_tvm_ffi-*.whl" "torch_c_dlpack_ext-*.whl" "einops-*.whl" "cuda_python-12.9.*.whl"
              "cuda_bindings-12.9.*.whl" "cuda_pathfinder-*.whl")
      group "$SITE-sonicmoe" "sonic_moe-0.1.2.post1-*.whl" "quack_kernels-0.4.1-*.whl" \
        "nvidia_cutlass_dsl-4.4.2-*.whl" "nvidia_cutlass_dsl_libs_base-4.4.2-*.whl" "${common[@]}"
      group "$SITE-quack" "quack_kernels-0.6.5-*.whl" "nvidia_cutlass_dsl-4.7.1-*.whl" \
        "nvidia_cutlass_dsl_libs_base-4.7.1-*.whl" "nvidia_cutlass_dsl_libs_core-4.7.1-*.whl" \
        "nvidia_cutlass_dsl_libs_cu12-4.7.1-*.whl" "nvidia_cuda_nvdisasm-13.*.whl" "${common[@]}"
    } 2>&1 | tee -a "$RES/peers_install.log" ;;
  load)
    : > "$RES/peers_load.txt"
    for site in "$SITE" "$SITE-sonicmoe" "$SITE-quack"; do
    only=; case $site in *-sonicmoe) only=sonicmoe ;; *-quack) only=quack ;; esac
    [ -z "$only" ] || [ -d "$site" ] || { echo "$only: $site not installed" >> "$RES/peers_load.txt"; continue; }
    PEERS_ONLY=$only PYTHONPATH=$PWD:$(site_path "$site") $PY - >> "$RES/peers_load.txt" 2>&1 <<'EOF'
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
import peers  # noqa: E402

device = torch.device("cuda")
print("torch", torch.__version__, "CUDA", torch.version.cuda, "Python", sys.version.split()[0])
only = os.environ.get("PEERS_ONLY")
for op, names in peers.PEER_OPS.items():
    for name in sorted(names, key=lambda n: n == "unsloth"):  # unsloth's import patches the process: last
        if only and name != only:
            continue
        got = peers.load(name, op, device)
        if isinstance(got, peers.PeerOp):
            print(f"{op:12s} {name:13s} ok      {got.source} {got.version} {got.note}")
        else:
            print(f"{op:12s} {name:13s} SKIPPED {got.error}\n{'':27s} tried: {'; '.join(got.tried)}")
EOF
    done
    cat "$RES/peers_load.txt" ;;
  ops)
    others=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import peers
print(' '.join(p for p in peers.PEERS if p != 'unsloth'))")
    $PY benchmarks/bench_peers.py --out "$RES/ops" --peers $others "$@" 2>&1 | tail -40
    $PY benchmarks/bench_peers.py --out "$RES/ops_unsloth" --peers peft unsloth \
      "$@" --ops lora_linear lora_qkv lora_mlp moe_full 2>&1 | tail -20
    for peer in sonicmoe quack; do  # each in its own process, with the CUTLASS DSL version it pins
      op=moe_full; [ $peer = quack ] && op=loss
      if [ -d "$SITE-$peer" ]; then
        PYTHONPATH=$PWD:$(site_path "$SITE-$peer") $PY benchmarks/bench_peers.py --out "$RES/ops_$peer" "$@" \
          --peers $peer --ops $op 2>&1 | tail -20
      else
        echo "$peer: $SITE-$peer not installed (peers_bench.sh install), its own process skipped"
      fi
    done ;;
  warm)
    for peer in ${*:-sonicmoe quack}; do
      case $peer in sonicmoe) op=moe_full ;; quack) op=loss ;;
        *) echo "warm: unknown peer $peer (sonicmoe, quack)" >&2; exit 2 ;; esac
      if [ ! -d "$SITE-$peer" ]; then
        echo "warm $peer: $SITE-$peer not installed (peers_bench.sh sites)" | tee -a "$RES/warm.txt"; continue
      fi
      extra=(); [ $peer = sonicmoe ] && extra=(--moe-shapes qwen3_30b_a3b)
      started=$(date +%s)
      # QuACK prints each candidate's compile and time (QUACK_PRINT_AUTOTUNING=1) into warm_<peer>.log: where a first
      # call outlasts its limit, the log says whether candidates were still being compiled or timed.
      # QUACK_COMPILE_WORKERS=1 (set it to try) compiles them in this process instead of quack-kernels 0.4.1's pool of
      # worker processes, which waits on each worker without a time limit
      PYTHONPATH=$PWD:$(site_path "$SITE-$peer") QUACK_PRINT_AUTOTUNING=${QUACK_PRINT_AUTOTUNING:-1} \
        timeout "${WARM_S:-500}" $PY -X faulthandler benchmarks/bench_peers.py --out "$RES/warm_$peer" --peers $peer \
        --ops $op "${extra[@]}" --repetitions 1 > "$RES/warm_$peer.log" 2>&1
      status=$?
      tail -20 "$RES/warm_$peer.log"
      echo "warm $peer: exit $status after $(( $(date +%s) - started )) s (limit ${WARM_S:-500} s)" \
        | tee -a "$RES/warm.txt"
    done ;;
  step)  # with QuACK's site on the path where it is installed: the recipe on its route (ours_quack)
    quack=; [ -d "$SITE-quack" ] && quack=:$(site_path "$SITE-quack")
    for ckpt in ${CKPT:-off on}; do
      PYTHONPATH=$PYTHONPATH$quack $PY benchmarks/bench_peers_step.py --out "$RES/step_ckpt_$ckpt" --sequential \
        --checkpointing $ckpt --checkpoint-dir /tmp/peer-checkpoints "$@" 2>&1 | tail -30
    done ;;
  path)
    name=${1:?path quack or path sonicmoe}
    case $name in quack|sonicmoe) ;; *) echo "path: unknown site $name (quack, sonicmoe)" >&2; exit 2 ;; esac
    [ -d "$SITE-$name" ] || { echo "path: $SITE-$name is not installed (peers_bench.sh sites)" >&2; exit 1; }
    echo "$PWD:$(site_path "$SITE-$name")" ;;
  call)
    parts=" ${CALL_PARTS:-step moe ops} "
    for p in $parts; do
      case $p in step|moe|ops) ;; *) echo "CALL_PARTS: unknown part $p (step, moe, ops)"; exit 2 ;; esac
    done
    bash "$0" install
    timeout "${LOAD_S:-60}" bash "$0" load > /dev/null
    cat "$RES/peers_load.txt"
    if [[ $parts == *" step "* ]]; then
      echo "== step, $(date +%T)"
      CKPT=on timeout "${STEP_S:-270}" bash "$0" step --models llama3_8b --impls ours peft_liger axolotl unsloth \
        --steps 3
    fi
    if [[ $parts == *" moe "* ]]; then
      echo "== MoE ops, $(date +%T)"  # a process of their own: the MoE cells come after every LoRA cell in one
      timeout "${MOE_S:-210}" $PY benchmarks/bench_peers.py --out "$RES/ops_moe" --peers liger llamafactory veomni \
        --ops moe_full --moe-shapes qwen3_30b_a3b 2>&1 | tail -20
    fi
    if [[ $parts == *" ops "* ]]; then
      echo "== LoRA ops, $(date +%T)"
      timeout "${OPS_S:-90}" $PY benchmarks/bench_peers.py --out "$RES/ops" --peers peft axolotl \
        --ops lora_mlp lora_qkv lora_linear 2>&1 | tail -30
    fi
    echo "== done, $(date +%T)" ;;
  *) echo "unknown part $PART (install, sites, path, load, ops, warm, step or call)"; exit 2 ;;
esac
