"""Diagnostic for the whole-step memory target (not a benchmark): what is alive at the peak of one training step.

Notebook 10's H200 run measured the Llama-like step's peak at 6.26 GiB with lora_lab's loss against 5.59 GiB with
Liger's (everything else the same: PEFT LoRA, Liger's kernels, ``patch_model``). By the two losses' own buffers
(a 1,024-row bf16 logits chunk against Liger's 256 rows) the difference should be about 0.18 GiB. This script finds
where the rest is: for each variant of ``bench_whole_step.py`` named, one warm-up step, then a second step under
``torch.cuda.memory._record_memory_history``; from the allocator's trace it rebuilds the live blocks at the moment
of the peak and prints the largest, each with the innermost frames of this project (or the nearest frames) that
allocated it. Run from the repository root on a CUDA machine:

    python benchmarks/whole_step_memory.py --models llama --variants peft_liger_patch peft_liger_patch_lora_lab_loss

One step, one process, no repetitions: its numbers say where memory goes, never whether a target is met.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_whole_step import MODELS, VARIANTS, Variant  # noqa: E402

MIB = 2**20
OWN = ("lora_lab", "liger_kernel", "peft", "transformers", "benchmarks")


def frames_of(entry: dict, keep: int = 3) -> str:
    """The innermost ``keep`` frames from this project, Liger, PEFT or transformers (else the innermost frames)."""
    frames = entry.get("frames") or []
    chosen = [f for f in frames if any(part in f.get("filename", "") for part in OWN)] or frames
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in chosen[:keep])


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """(peak bytes over the trace, the blocks alive at that moment) from one device's allocator trace; bytes
    allocated before recording began are not in the trace and not counted."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for event in trace:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return peak, at_peak


def diagnose(model_name: str, variant: str, args, top: int) -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    built = Variant(model_name, variant, args, device, dtype)
    built.step()  # optimizer state, autotuning
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    built.step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_allocated = torch.cuda.max_memory_allocated()
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    traced_peak, blocks = live_at_peak(trace)
    print(f"{model_name} {variant}: peak {peak_allocated / 2**30:.3f} GiB allocated, {resident / 2**30:.3f} GiB "
          f"resident before the step, {traced_peak / 2**30:.3f} GiB allocated during the step and alive at its "
          f"peak ({len(blocks)} blocks)", flush=True)
    for block in sorted(blocks, key=lambda b: -b["size"])[:top]:
        print(f"  {block['size'] / MIB:10.1f} MiB  {frames_of(block)}", flush=True)
    del built
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama"], choices=MODELS)
    ap.add_argument("--variants", nargs="+", default=["peft_liger_patch", "peft_liger_patch_lora_lab_loss"],
                    choices=list(VARIANTS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--top", type=int, default=15, help="largest live blocks printed per variant")
    args = ap.parse_args()
    args.smoke = False
    if not torch.cuda.is_available():
        raise SystemExit("whole_step_memory.py reads the CUDA allocator's trace and needs a CUDA device")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.batch}x{args.seq} tokens, "
          f"{args.layers} layers", flush=True)
    for model_name in args.models:
        for variant in args.variants:
            diagnose(model_name, variant, args, args.top)


if __name__ == "__main__":
    main()
