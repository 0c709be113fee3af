"""Benchmark: full-depth training steps — lora_lab's recipe beside PEFT, PEFT + Liger, axolotl and unsloth.

Models (random weights, bf16, sdpa, built by ``bench_whole_step.model_config``): ``llama3_8b`` (32 layers, d 4096,
vocab 128,256) and ``qwen3_30b_a3b`` (48 layers, 128 experts of 768, vocab 151,936); ``--layers`` overrides the
depth for every implementation alike. LoRA r=16 (alpha 32) on every linear projection (the MoE: on attention and, by
PEFT ``target_parameters``, the experts), AdamW, ``--batch`` × ``--seq`` tokens (default 4 × 4,096), gradient
checkpointing off and on (``--checkpointing``; non-reentrant).

Implementations (rows' ``impl``):
  peft        PEFT (``bench_whole_step`` variant ``peft``)
  peft_liger  PEFT + Liger-Kernel as its users apply it (variant ``peft_liger``)
  ours        lora_lab's recipe (variant ``whole_step.RECIPE``: Liger + PEFT + ``patch_model``)
  ours_cublas_base  the recipe with the LoRA linear's big GEMMs by cuBLAS (``KernelConfig(base_gemm="cublas")``):
              the recipe's step with and without that route
  ours_quack  the recipe with the LoRA linear's big GEMMs on QuACK, the rank-r term in their epilogue
              (``KernelConfig(base_gemm="quack")``): the single LoRA linears (o_proj, down_proj); the shared-input
              groups (q/k/v, gate/up) keep their default, having no QuACK route. A ``skipped`` row naming why where
              QuACK cannot run (its op would take the Triton route, never timed under this name)
  ours_pure_cublas  the recipe with every product of the LoRA linear a cuBLAS call (``base_gemm="cublas"``,
              ``rank_ops="torch"``)
  axolotl     PEFT + Liger, then axolotl's LoRA-kernel monkeypatch
              (``axolotl.monkeypatch.lora_kernels.apply_lora_kernel_patches``, QKV / O / MLP kernels on), as axolotl
              users run it
  unsloth     ``unsloth.FastLanguageModel.from_pretrained`` of a random-init checkpoint of the shape written to
              ``--checkpoint-dir`` (with a word-level tokenizer of the vocabulary's size, offline), then its
              ``get_peft_model`` (its gradient checkpointing when on)
A peer that cannot load is a ``skipped`` row with its error and what was tried (``peers.load``); one that loads but
fails is an ``error`` / ``oom`` row. Timing as in ``bench_whole_step``: every implementation built once, then
``--repetitions`` rotated loops of ``--steps`` whole steps (``measure.loop_ms``); peak memory of one step
(``measure.peak_bytes``) right after the untimed first step.

Writes into --out: peers_step.csv (one row per model, checkpointing, implementation and repetition), the rows
``peer_comparison.step_metrics`` reads, and peers_step_floor.csv (one row per model and checkpointing: the step's
matrix-product FLOPs by part, ``lora_lab.experiments.step_floor``, and its floor at the dense bf16 rate of an
8192³ product timed in the same process; ``peer_comparison.floor_table`` sets each step beside it).

    python benchmarks/bench_peers_step.py --out DIR                           # both models, checkpointing off, on
    python benchmarks/bench_peers_step.py --out DIR --models llama3_8b --checkpointing off
    TRITON_INTERPRET=1 python benchmarks/bench_peers_step.py --out DIR --smoke    # CPU: tiny configs, peers skip
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

import bench_whole_step as whole
import peers as peer_loader
import torch
from bench_common import check_device, device_line, error_text, is_oom, without_options

from lora_lab.experiments import peer_comparison, step_floor
from lora_lab.experiments.whole_step import RECIPE
from lora_lab.lab import measure

CSV = "peers_step.csv"
FLOOR_CSV = peer_comparison.FLOOR_CSV
MODELS = {"llama3_8b": ("llama", 32), "qwen3_30b_a3b": ("qwen3_moe", 48)}
IMPLS = ("peft", "peft_liger", "ours", "ours_cublas_base", "ours_pure_cublas", "ours_quack", "axolotl", "unsloth")
WHOLE_STEP_VARIANT = {"peft": "peft", "peft_liger": "peft_liger", "ours": RECIPE,
                      "ours_cublas_base": "peft_liger_patch_cublas_base",
                      "ours_pure_cublas": "peft_liger_patch_pure_cublas", "ours_quack": "peft_liger_patch_quack",
                      "axolotl": "peft_liger"}


class PeerModel(whole.Variant):
    """One implementation of one model, built fresh; ``step`` is one whole optimizer step."""

    def __init__(self, model_name: str, impl: str, args, device, dtype, peer=None):
        family, _ = MODELS[model_name]
        if impl == "unsloth":
            self._unsloth(family, args, device, dtype, peer)
        else:
            super().__init__(family, WHOLE_STEP_VARIANT[impl], args, device, dtype)
            if args.checkpointing_now == "on":
                self.model.get_base_model().gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            if impl == "axolotl":
                self.model = peer.fn(self.model)

    def _unsloth(self, family, args, device, dtype, peer):
        from lora_lab.layer import fill_lora_B

        cfg = whole.model_config(family, args.layers, args.smoke)
        path = write_checkpoint(cfg, Path(args.checkpoint_dir) / f"{family}_{args.layers}", dtype, device)
        self.model = peer.fn(path, r=16, max_seq_length=args.seq, dtype=dtype,
                             gradient_checkpointing=args.checkpointing_now == "on").train()
        fill_lora_B(self.model, 0.02)
        self.liger, self.summary, self.smoke = None, {"loss": "unsloth"}, args.smoke
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)
        g = torch.Generator(device="cpu").manual_seed(2)
        self.ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
        self.losses, self.head = [], (cfg.hidden_size, cfg.vocab_size)


def write_checkpoint(cfg, path: Path, dtype, device=None) -> Path:
    """A random-init checkpoint of ``cfg`` (seed 0, drawn on ``device``: an 8B model's init takes minutes on a CPU)
    and a word-level tokenizer of its vocabulary, written once."""
    if (path / "config.json").is_file():
        return path
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(path)
    del model
    whole.free_memory()
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                                        unk_token="t0", pad_token="t1", eos_token="t2", bos_token="t3")
    tokenizer.save_pretrained(path)
    return path


def quack_problem(impl: str, device, dtype) -> str | None:
    """Why ``impl`` (a recipe on QuACK's route) cannot run here, else None (and None for every other impl). The
    models' projections are multiples of 8 wide and r = 16: only QuACK itself, the GPU and the dtype can stop it."""
    if whole.VARIANT_CONFIGS.get(WHOLE_STEP_VARIANT.get(impl), {}).get("base_gemm") != "quack":
        return None
    from lora_lab.kernels.lora import quack_gemm

    return quack_gemm.unavailable_reason(8, 8, 8, 16, dtype, torch.device(device or "cpu"))


def run_model(model_name, args, device, dtype, done=()) -> list[dict]:
    """Rows of one model at one checkpointing setting: build each implementation, then the rotated loops; with
    ``args.sequential`` each implementation is built, timed and freed before the next (full-depth models: five
    copies of an 8B model's weights, each with its activations, do not fit one GPU at once). ``done``: the rows
    of earlier models, written with these after every implementation."""
    base = dict(model=model_name, checkpointing=args.checkpointing_now, layers=args.layers, batch=args.batch,
                seq=args.seq, dtype=str(dtype).removeprefix("torch."), smoke=args.smoke,
                order="sequential" if args.sequential else "rotated")
    built, once, rows = {}, {}, []
    tokens = args.batch * args.seq

    def time_loops(impls, rep_range):
        for rep in rep_range:
            for impl in measure.rotation(impls, rep):
                times = measure.loop_ms(built[impl].step, calls=args.steps, warmup=1)
                ms = statistics.median(times)
                rows.append(dict(base, impl=impl, rep=rep, status="ok", step_ms=ms, tokens_per_s=tokens / ms * 1e3,
                                 step_ms_each=" ".join(f"{t:.3f}" for t in times), timing="loop",
                                 loss_last=float(built[impl].losses[-1]), **once[impl]))

    for impl in args.impls:
        peer = None
        reason = quack_problem(impl, device, dtype)
        if reason:
            rows.append(dict(base, impl=impl, rep=0, tokens_per_s=None, status="skipped", error=reason))
            print(f"   {model_name}: {impl} skipped: {reason}", flush=True)
            continue
        if impl in ("axolotl", "unsloth"):
            peer = peer_loader.load(impl, "model", device)
            if isinstance(peer, peer_loader.PeerSkip):
                rows.append(dict(base, **peer.row(), rep=0, tokens_per_s=None))
                print(f"   {model_name}: {impl} skipped: {peer.error[:200]}", flush=True)
                continue
        try:
            model = PeerModel(model_name, impl, args, device, dtype, peer)
            model.step()  # optimizer state, compile, tuning: untimed
            peak = measure.peak_bytes(model.step)[0] if device.type == "cuda" else None
            built[impl] = model
            once[impl] = dict(peak_bytes=peak, source=peer.source if peer else "", version=peer.version if peer else "")
            print(f"   {model_name}: {impl} built, peak {peak / 2**30 if peak else 0:.1f} GiB", flush=True)
        except Exception as err:  # a peer that loads but cannot train this model is a recorded row
            model = None
            if impl == "ours" and not args.sequential:
                raise
            rows.append(dict(base, impl=impl, rep=0, tokens_per_s=None, status="oom" if is_oom(err) else "error",
                             error=error_text(err)))
            print(f"   {model_name}: {impl} failed: {rows[-1]['error'][:200]}", flush=True)
            whole.free_memory()
            continue
        if args.sequential:
            time_loops([impl], range(args.repetitions))
            del model
            built.clear()
            whole.free_memory()
            measure.write_csv([*done, *rows], Path(args.out) / CSV)  # after every implementation
    if not args.sequential:
        time_loops(list(built), range(args.repetitions))
    built.clear()
    whole.free_memory()
    return rows


def matmul_tflops(device, dtype, size: int = 8192, calls: int = 20) -> float | None:
    """TFLOP/s of one ``size``³ product on random data in the user's loop (CUDA; None elsewhere): the rate a step's
    products could reach at best on this GPU, the floor's denominator."""
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = statistics.median(measure.loop_ms(lambda: torch.mm(a, b), calls=calls, warmup=5))
    return 2 * size**3 / (ms * 1e-3) / 1e12


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers for every implementation (default: "
                                                              "the model's own, 32 / 48)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5, help="timed whole steps per implementation and repetition")
    ap.add_argument("--repetitions", type=int, default=measure.MIN_REPETITIONS)
    ap.add_argument("--sessions", type=int, default=1, help="separate processes (this script again, one after "
                                                           "another), their CSVs pooled: speed ratios are graded "
                                                           f"on >= {measure.MIN_SESSIONS}")
    ap.add_argument("--sequential", action="store_true", help="build, time and free one implementation after "
                                                                 "another (default: all built, loops rotated)")
    ap.add_argument("--checkpoint-dir", default=None, help="where unsloth's random-init checkpoints go "
                                                           "(default: OUT/checkpoints)")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny configs, fp32, 1 layer")
    args = ap.parse_args(argv)
    args.checkpoint_dir = str(Path(args.checkpoint_dir or Path(args.out) / "checkpoints").resolve())
    if args.sessions > 1:  # the sessions share the checkpoints: written once
        raw = without_options(sys.argv[1:] if argv is None else list(argv), ("--out", "--sessions", "--checkpoint-dir"))
        measure.run_script_sessions(Path(__file__), [*raw, "--checkpoint-dir", args.checkpoint_dir], args.out,
                                    [CSV, FLOOR_CSV], sessions=args.sessions)
        return
    if args.repetitions < 1 or args.steps < 1:
        ap.error("--repetitions and --steps must be >= 1")
    if args.smoke:
        args.batch, args.seq, args.steps = 2, 16, min(args.steps, 2)
    if "ours" not in args.impls:
        args.impls = ["ours", *args.impls]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checkpoints are local; the GPU machine has no network
    device = check_device(args.smoke)
    dtype = torch.float32 if device.type != "cuda" else torch.bfloat16
    print(device_line(device, dtype, args.repetitions), flush=True)
    tflops = matmul_tflops(device, dtype)
    if tflops:
        print(f"dense bf16 rate (8192³, the floor's denominator): {tflops:.0f} TFLOP/s", flush=True)
    rows, floors = [], []
    for model_name in args.models:
        for ckpt in args.checkpointing:
            run = copy.copy(args)
            run.checkpointing_now = ckpt
            run.layers = 1 if args.smoke else (args.layers or MODELS[model_name][1])
            print(f"{model_name}, {run.layers} layers, checkpointing {ckpt}", flush=True)
            family = MODELS[model_name][0]
            floors.append(step_floor.floor_rows(model_name, whole.model_config(family, run.layers, args.smoke),
                                                args.batch, args.seq, ckpt, tflops,
                                                lora_experts=family == "qwen3_moe"))
            rows += run_model(model_name, run, device, dtype, rows)
            measure.write_csv(rows, Path(args.out) / CSV)  # after every model and setting
            measure.write_csv(floors, Path(args.out) / FLOOR_CSV)
    for line in peer_comparison.floor_table(rows, floors):
        share = f"{line['floor_share']:.2f} of it at the floor ({line['floor_ms']:.0f} ms)" if line["floor_share"] \
            else "no floor without a measured rate"
        print(f"   {line['model']} ckpt {line['checkpointing']}: {line['impl']} {line['step_ms']:.1f} ms, {share}",
              flush=True)
    print(f"wrote {Path(args.out) / CSV}: {len(rows)} rows, and {Path(args.out) / FLOOR_CSV}", flush=True)


if __name__ == "__main__":
    main()
