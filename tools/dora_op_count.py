"""Top-level torch ops of one fused DoRA layer's forward + backward (torch profiler, CPU, Triton interpreter).
The interpreter runs a Triton launch as tensor copies (aten::empty/new_empty/set_/copy_): those are left out.

A diagnostic of the fused DoRA layer's op count. Run from the repository root:

    TRITON_INTERPRET=1 python tools/dora_op_count.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

import lora_lab
import lora_lab.kernels.lora.dora as dora
from lora_lab.kernels import patch_model

INTERPRETER = {"aten::empty", "aten::new_empty", "aten::set_", "aten::copy_"}


def ops(norm_fn):
    dora.dora_row_norm = norm_fn
    h = torch.nn.Sequential()
    h.add_module("proj", torch.nn.Linear(64, 96))
    lora_lab.add_lora(h, r=8, alpha=16, targets=("proj",), use_dora=True)
    patch_model(h)
    x = torch.randn(5, 64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        h(x).sum().backward()
    return [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None
            and e.name not in INTERPRETER]


kernel = dora.dora_row_norm
for label, fn in (("norm in torch ops (dora_row_norm_reference)", dora.dora_row_norm_reference),
                  ("norm in one Triton launch (dora_row_norm)", kernel)):
    names = ops(fn)
    print(f"{label}: {len(names)} top-level torch ops besides the Triton launches")
    print("   ", " ".join(n.removeprefix("aten::") for n in names))
