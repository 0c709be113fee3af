"""Whose time is ``host_busy_ms``? Calls of known, small host cost, timed both ways.

``measure.host_ms`` times a call started on an idle device; ``measure.host_ms_busy`` times it behind a queued
sleep kernel, so that no launch can wait for the device. Notebook 05's benchmark found the frozen layer's forward +
backward taking the host longer behind a busy device than from an idle one, the opposite of what that measure is
for. This tool times, both ways and in one process, calls whose host cost is known to be small:

* ``noop``: a Python call that launches nothing;
* ``one_launch`` / ``eight_launches``: one and eight in-place adds on a one-element tensor (one kernel each);
* ``frozen_layer``: the frozen layer's forward and ``torch.autograd.grad`` at one of notebook 05's cells, bf16.

If the probes that launch also take longer behind a busy device, the extra time comes from the measurement or the
driver, not from the layer's code; if only the layer does, it comes from what its calls do. CUDA only.

    python tools/host_busy_probe.py [--cell 32768,4096,4096] [--calls 20] [--ledger FILE.csv]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MEASURES = ("host_ms", "host_ms_busy")


def probes(torch, M: int, K: int, N: int, device: str = "cuda") -> dict:
    """{name: call} for the four probes (module docstring); the frozen layer's tensors built once, here."""
    one = torch.zeros(1, device=device)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K ** 0.5
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)

    def eight():
        for _ in range(8):
            one.add_(1)

    def frozen_layer():
        torch.autograd.grad(torch.nn.functional.linear(x, w), (x,), dy)

    return {"noop": lambda: None, "one_launch": lambda: one.add_(1), "eight_launches": eight,
            "frozen_layer": frozen_layer}


def ledger_rows(results: dict, M: int, K: int, N: int) -> list[dict]:
    """Ledger rows of ``results`` ({probe: {measure: [ms, ...]}}): each probe's median and 95% interval under each
    measure (:func:`lora_lab.lab.ledger.summary_figures`)."""
    from lora_lab.lab import measure
    from lora_lab.lab.ledger import summary_figures

    rows = []
    for name, by_measure in results.items():
        cell = f"probe={name}" + (f";M={M};K={K};N={N};dtype=bfloat16" if name == "frozen_layer" else "")
        for measure_name, times in by_measure.items():
            rows += summary_figures(measure.summarize(times), benchmark="host_busy_probe", cell=cell,
                                    method=measure_name, unit="ms", source="tools/host_busy_probe.py")
    return rows


def parse_cell(text: str) -> tuple[int, int, int]:
    try:
        M, K, N = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cell takes M,K,N (e.g. 32768,4096,4096), got {text!r}") from None
    if min(M, K, N) < 1:
        raise argparse.ArgumentTypeError(f"--cell needs positive sizes, got {text!r}")
    return M, K, N


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cell", type=parse_cell, default=(32768, 4096, 4096), help="M,K,N of the frozen layer")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per probe and measure")
    ap.add_argument("--ledger", help="append the medians to this measurement ledger (a CSV file)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("host_busy_probe: needs a CUDA device (host_ms_busy keeps one busy with a sleep kernel)",
              file=sys.stderr)
        return 2
    from lora_lab.lab import measure

    M, K, N = args.cell
    results, waits = {}, {}
    for name, call in probes(torch, M, K, N).items():
        results[name] = {"host_ms": measure.host_ms(call, calls=args.calls)}
        results[name]["host_ms_busy"], waits[name] = measure.host_ms_busy(call, calls=args.calls)
    print(f"{torch.cuda.get_device_name()}: host ms per call, median of {args.calls} (frozen layer {M}x{K}x{N})")
    print(f"{'probe':16s} {'idle device':>12s} {'busy device':>12s}  calls that waited")
    for name, by_measure in results.items():
        print(f"{name:16s} {statistics.median(by_measure['host_ms']):12.4f} "
              f"{statistics.median(by_measure['host_ms_busy']):12.4f}  {waits[name]}")
    if args.ledger:
        from lora_lab.lab.ledger import append_measurements

        print("appended to", append_measurements(ledger_rows(results, M, K, N), ledger=args.ledger))
    return 0


if __name__ == "__main__":
    sys.exit(main())
