#!/usr/bin/env bash
# quick GPU check of branch loss-dw-first-chunk (leftover budget): its bf16 GPU loss tests, then the softmax pass
# variants and the whole op at the Llama-3-8B head (tune_loss --fwdgrad, one shape, 1 repetition)
set -u
O=$OUT; D=/tmp/lossq; rm -rf $D; git clone -q $PWD/.devcarry/loss.bundle $D && git -C $D checkout -q loss-dw-first-chunk && git -C $D log --oneline -1 | cut -c1-100 > $O/loss_quick.log
cd $D
export PYTHONPATH=$D TQDM_DISABLE=1
timeout -k 5 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/loss/test_fwdgrad.py -rA 2>&1 | tail -25 >> $O/loss_quick.log
sed -i 's/^FWDGRAD_SHAPES = {\*\*SHAPES, "gemma2-2b": (2304, 256_000), "qwen2.5-14b": (5120, 152_064)}/FWDGRAD_SHAPES = {"llama3-8b": (4096, 128_256)}/' benchmarks/tune_loss.py
timeout -k 5 80 python3 benchmarks/tune_loss.py --out $O/tune --fwdgrad --repetitions 1 >> $O/loss_quick.log 2>&1
echo "tune exit $?" >> $O/loss_quick.log
