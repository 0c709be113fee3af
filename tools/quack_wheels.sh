#!/usr/bin/env bash
# Fetch QuACK's group for a GPU host: quack-kernels 0.6.5 with the CUTLASS DSL 4.7.1 it asks for (libs-base,
# libs-core, libs-cu12 and nvidia-cuda-nvdisasm), cuda-python 12.9.10 (cuda-bindings, cuda-pathfinder),
# apache-tvm-ffi, torch-c-dlpack-ext and einops. Each wheel is stored LZMA-compressed (tools/slim_wheel.py --lzma;
# pip installs it as usual) and the group is cut into two call folders (tools/parts.py split --calls 2):
#
#   bash tools/quack_wheels.sh [DIR]        (default build/parts-quack: DIR/1 and DIR/2)
#
# Deflated, the DSL's CUDA library wheel alone is larger than what one call takes beside the repository; stored
# LZMA-compressed the whole group is about 77 MiB, about 39 MiB a folder. Each folder travels in one call, carried
# with no other wheels, to one host that stays up between the two:
#   bash tools/remote_gpu_run.sh COMMIT --no-install --site-parts DIR/1 command -- ...     (carry DIR/1)
#   bash tools/remote_gpu_run.sh COMMIT --no-install --site-parts DIR/2 command -- \
#       bash -c 'bash tools/peers_bench.sh sites; PYTHONPATH=$PWD:/tmp/site-quack python3 ...'   (carry DIR/2)
# (the two folders gathered and assembled into build/assembled-sites/; `sites` installs the group into
# $SITE-quack, default /tmp/site-quack, for notebook 05's base_gemm="quack" route and QuACK's loss as a peer).
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
dest=${1:-build/parts-quack}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$tmp/raw" \
  quack-kernels==0.6.5 nvidia-cutlass-dsl==4.7.1 nvidia-cutlass-dsl-libs-base==4.7.1 \
  nvidia-cutlass-dsl-libs-core==4.7.1 nvidia-cutlass-dsl-libs-cu12==4.7.1 nvidia-cuda-nvdisasm==13.5.37 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2 cuda-python==12.9.10 \
  cuda-bindings==12.9.10 cuda-pathfinder==1.9.1
for wheel in "$tmp"/raw/*.whl; do
  python3 tools/slim_wheel.py "$wheel" "$tmp/lzma" --lzma
done
rm -rf "$dest"
python3 tools/parts.py split "$tmp"/lzma/*.whl --out "$dest" --part-mib 10 --calls 2 > /dev/null
du -sh "$dest"/1 "$dest"/2
