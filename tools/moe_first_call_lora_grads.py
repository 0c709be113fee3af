"""First-call check of the fused MoE path with PEFT LoRA on the experts: the tiny two-layer Qwen3-MoE of
``tests/kernels/moe/test_moe_patch.py`` (rank 4), patched, against the same model eager in fp32, twice in one process
(round 0: the first call at this shape, where the kernels autotune; round 1: tuned). Prints which LoRA parameters got
an all-zero gradient and, per MoE layer, the experts' output error and output-gradient norm. Found session 8's bug: the
autotuner zeroed the routing weights, which stood in for down_backward's unused router-gradient buffer.

    LORA_LAB_MOE_TUNING_CACHE=0 PYTHONPATH=. python tools/moe_first_call_lora_grads.py fp32|bf16 [untuned]

Run from the repository root. On a CPU it runs fp32 in Triton's interpreter (TRITON_INTERPRET=1), which never
autotunes: a smoke test of the script only. A diagnostic; no notebook reads it.
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests/kernels/moe")
from peft import LoraConfig, get_peft_model  # noqa: E402
from test_moe_patch import EXPERT_TARGETS, fill_lora_B, ids, tiny_qwen3_moe  # noqa: E402

from lora_lab.kernels.config import KernelConfig  # noqa: E402
from lora_lab.kernels.moe.patch import patch_moe_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build(dtype):
    model = get_peft_model(tiny_qwen3_moe(), LoraConfig(r=4, lora_alpha=8, target_modules=[],
                                                        target_parameters=EXPERT_TARGETS))
    torch.manual_seed(5)
    fill_lora_B(model, 0.1)
    return model.to(DEVICE, dtype)


def record_experts(model, tag: str, outs: dict) -> None:
    """Keep each MoE layer's experts output (``<tag><layer>``) and, in backward, its gradient (``..._grad``)."""
    def hook(name):
        def keep(module, inputs, out):
            out = out[0] if isinstance(out, tuple) else out
            outs[name] = out.detach().float().clone()
            if out.requires_grad:
                out.register_hook(lambda g: outs.__setitem__(name + "_grad", g.detach().float().clone()))
        return keep

    for i in (0, 1):
        model.base_model.model.model.layers[i].mlp.experts.register_forward_hook(hook(f"{tag}{i}"))


def norm(t):
    return None if t is None else f"{float(t.norm()):.2e}"


def one_round(dtype, untuned: bool, x) -> str:
    ref, fused = build(torch.float32), build(dtype)
    with torch.no_grad():  # the fp32 model takes the low-precision model's rounded weights
        for (_, p), (_, q) in zip(ref.named_parameters(), fused.named_parameters()):
            p.copy_(q.float())
    outs = {}
    record_experts(ref, "ref", outs)
    record_experts(fused, "fused", outs)
    ref(input_ids=x).logits.float().square().mean().backward()
    patch_moe_experts(fused, KernelConfig(moe_autotune=False) if untuned else None)
    fused(input_ids=x).logits.float().square().mean().backward()
    layers = []
    for i in (0, 1):
        a, b = outs[f"fused{i}"], outs[f"ref{i}"]
        layers.append(f"L{i} out |d|/|ref| {float((a - b).norm() / b.norm()):.2e} "
                      f"outgrad {norm(outs.get(f'fused{i}_grad'))} ref {norm(outs.get(f'ref{i}_grad'))}")
    zero = [n.split("layers.")[1][:40] for n, p in fused.named_parameters()
            if "lora" in n and p.grad is not None and float(p.grad.abs().max()) == 0]
    return f"zero-grad lora params: {zero} | " + " ; ".join(layers)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[argv[0]]
    x = ids(shape=(4, 64)).to(DEVICE)
    for rnd in range(2):
        print(argv, "round", rnd, "|", one_round(dtype, "untuned" in argv, x), flush=True)


if __name__ == "__main__":
    main()
