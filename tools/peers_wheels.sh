#!/usr/bin/env bash
# Fetch the wheels of the LoRA and MoE peers (axolotl, unsloth, LlamaFactory, VeOmni, Liger, CCE) and of what their
# kernel modules import that the GPU image lacks, into one folder that a single device call carries (under 20 MiB).
#
#   bash tools/peers_wheels.sh [DIR]        (default .whl-peers; add its name to .git/info/exclude)
#   bash tools/peers_wheels.sh quack [DIR] [CALLS]     QuACK's group (default DIR build/parts-quack), see below
#   bash tools/peers_wheels.sh sonicmoe [DIR] [CALLS]  SonicMoE's group (default DIR build/parts-sonicmoe): sonic-moe
#                                                      0.1.2.post1, quack-kernels 0.4.1 and the CUTLASS DSL 4.4.2
#                                                      (libs-base) it pins, with the same common wheels as QuACK's,
#                                                      cut and carried as below; `sites` installs it into
#                                                      $SITE-sonicmoe
#
# On the GPU host: WHEELS=DIR bash tools/peers_bench.sh install (pip --no-deps into /tmp/site), then load/ops/step.
#
# Python 3.12 wheels, --no-deps: the peers' pins (torch >= 2.13 for axolotl, transformers <= 5.6 for LlamaFactory,
# datasets <= 2.21 for VeOmni) disagree with the image (torch 2.11, transformers 5.17, peft 0.21), so only what
# their modules import at import time is added, in versions that satisfy the checks the peers make when imported:
#   trl 1.14.1          unsloth asks for >= 0.18.2, <= 1.15.0 (it reads trl.__version__); axolotl pins 1.14.1
#   datasets 4.8.5      unsloth asks for < 5 and refuses 4.4-4.5; trl 1.14 asks for >= 4.7 (with dill, multiprocess)
#   pydantic 2.13.5     axolotl's pin (its config schemas), with pydantic-core 2.46.5, annotated-types,
#                       typing-inspection and typing-extensions 4.15.0 (pydantic 2.13 asks for >= 4.14.1)
#   evaluate, addict, colorama      imported by axolotl's callbacks, dict and logging modules
#   bitsandbytes 0.50.2 axolotl's pin, imported by axolotl.kernels.lora; slimmed to its CUDA 13.0 library (the
#                       image's torch is cu130; bitsandbytes picks the library by torch.version.cuda)
#   unsloth             slimmed: its web UI (studio/, unsloth_cli/) is 26 of its 28 MB and nothing under unsloth/
#                       imports it
# Not carried, and why: wandb (axolotl's callbacks import it for logging; benchmarks/peers.py puts an empty module
# with a spec in its place), xformers and torchao (unsloth imports them only when present), tyro, diffusers,
# json5, structlog (listed in unsloth's metadata, imported by none of the modules timed).
# Found by reading the import chains and importing on a CPU host (unsloth takes a CPU path there): what breaks on
# the GPU is what the `load` part of tools/peers_bench.sh records.
#
# `quack`: quack-kernels 0.6.5 with the CUTLASS DSL 4.7.1 it asks for (libs-base, libs-core, libs-cu12 and
# nvidia-cuda-nvdisasm), cuda-python 12.9.10 (cuda-bindings, cuda-pathfinder), apache-tvm-ffi, torch-c-dlpack-ext
# and einops. Deflated, the DSL's CUDA library wheel alone is larger than what one call takes beside the
# repository; each wheel is therefore stored LZMA-compressed (tools/slim_wheel.py --lzma; pip installs it as
# usual), about 77 MiB in all, and the group cut into call folders DIR/1 ... DIR/CALLS (`quack [DIR] [CALLS]`,
# default build/parts-quack and 3: a call takes 64 MiB with the repository, about 28 MiB now). Each travels in one
# call, carried with no other wheels, to one host that stays up between them; carrying each under one folder name
# (copied into .whl/, say) keeps the calls' carry lists alike:
#   bash tools/remote_gpu_run.sh COMMIT --no-install --site-parts DIR/1 command -- ...     (carry DIR/1)
#   ... DIR/2 likewise, then the last:
#   bash tools/remote_gpu_run.sh COMMIT --no-install --site-parts DIR/3 command -- \
#       bash -c 'bash tools/peers_bench.sh sites; PYTHONPATH=$(bash tools/peers_bench.sh path quack) python3 ...'
# (carry DIR/3; gathered and assembled into build/assembled-sites/; `sites` installs the group into $SITE-quack, default
# /tmp/site-quack, for notebook 05's base_gemm="quack" route and QuACK's loss as a peer).
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$tmp" "$@"
}
if [ "${1:-}" = quack ] || [ "${1:-}" = sonicmoe ]; then
  group=$1 dest=${2:-build/parts-$1} calls=${3:-3}
  [[ "$calls" =~ ^[1-9][0-9]*$ ]] || { echo "peers_wheels.sh: CALLS is a whole number of calls, not '$calls'" >&2; exit 2; }
  common=(apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2 cuda-python==12.9.10
          cuda-bindings==12.9.10 cuda-pathfinder==1.9.1)
  if [ "$group" = quack ]; then
    fetch quack-kernels==0.6.5 nvidia-cutlass-dsl==4.7.1 nvidia-cutlass-dsl-libs-base==4.7.1 \
      nvidia-cutlass-dsl-libs-core==4.7.1 nvidia-cutlass-dsl-libs-cu12==4.7.1 nvidia-cuda-nvdisasm==13.5.37 \
      "${common[@]}"
  else
    fetch sonic-moe==0.1.2.post1 quack-kernels==0.4.1 nvidia-cutlass-dsl==4.4.2 nvidia-cutlass-dsl-libs-base==4.4.2 \
      "${common[@]}"
  fi
  for wheel in "$tmp"/*.whl; do
    python3 tools/slim_wheel.py "$wheel" "$tmp/lzma" --lzma
  done
  rm -rf "$dest"
  python3 tools/parts.py split "$tmp"/lzma/*.whl --out "$dest" --part-mib 10 --calls "$calls" > /dev/null
  du -sh "$dest"/*
  exit 0
fi
dest=${1:-.whl-peers}
mkdir -p "$dest"
fetch axolotl==0.21.0 unsloth==2026.10.9 unsloth-zoo==2026.10.9 llamafactory==0.9.5 veomni==0.1.12 \
  liger-kernel==0.8.5 cut-cross-entropy==25.1.1 trl==1.14.1 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 \
  evaluate==0.4.6 pydantic==2.13.5 pydantic-core==2.46.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.15.0 addict==2.4.0 colorama==0.4.6 bitsandbytes==0.50.2
python3 tools/slim_wheel.py "$tmp"/unsloth-2026.10.9-*.whl "$tmp/slim" --drop 'studio/*' --drop 'unsloth_cli/*'
python3 tools/slim_wheel.py "$tmp"/bitsandbytes-0.50.2-*.whl "$tmp/slim" \
  --drop 'bitsandbytes/libbitsandbytes_*' --keep 'bitsandbytes/libbitsandbytes_cuda130*'
rm "$tmp"/unsloth-2026.10.9-*.whl "$tmp"/bitsandbytes-0.50.2-*.whl
mv "$tmp"/*.whl "$tmp"/slim/*.whl "$dest"/
du -sh "$dest"
