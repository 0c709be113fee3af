"""First-call check of the fused MoE path with PEFT LoRA on the experts: the tiny two-layer Qwen3-MoE of
``tests/kernels/moe/test_moe_patch.py`` (rank 4), patched, against the same model eager in fp32, twice in one process
(round 0: the first call at this shape, where the kernels autotune; round 1: tuned). Prints which LoRA parameters got
an all-zero gradient and, per MoE layer, the experts' output error and output-gradient norm. Found session 8's bug: the
autotuner zeroed the routing weights, which stood in for down_backward's unused router-gradient buffer.

    LORA_LAB_MOE_TUNING_CACHE=0 PYTHONPATH=. python tools/moe_first_call_lora_grads.py fp32|bf16 [untuned]

Needs CUDA. A diagnostic; no notebook reads it.
"""
import sys, torch
sys.path.insert(0, "tests/kernels/moe")
from test_moe_patch import tiny_qwen3_moe, ids, EXPERT_TARGETS, fill_lora_B
from peft import LoraConfig, get_peft_model
from lora_lab.kernels.moe.patch import patch_moe_experts
from lora_lab.kernels.config import KernelConfig
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
untuned = "untuned" in sys.argv
rounds = 2
def build(dt):
    m = get_peft_model(tiny_qwen3_moe(), LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERT_TARGETS))
    torch.manual_seed(5); fill_lora_B(m, 0.1); return m.to("cuda", dt)
x = ids(shape=(4, 64)).cuda()
for rnd in range(rounds):
    ref = build(torch.float32); fused = build(dtype)
    with torch.no_grad():
        for (_, p), (_, q) in zip(ref.named_parameters(), fused.named_parameters()): p.copy_(q.float())
    outs = {}
    def hook(name):
        def h(mod, inp, out):
            o = out[0] if isinstance(out, tuple) else out
            outs[name] = o.detach().float().clone()
            if o.requires_grad:
                o.register_hook(lambda g: outs.__setitem__(name + "_grad", g.detach().float().clone()))
        return h
    for tag, m in (("ref", ref), ("fused", fused)):
        for i in (0, 1):
            m.base_model.model.model.layers[i].mlp.experts.register_forward_hook(hook(f"{tag}{i}"))
    ref(input_ids=x).logits.float().square().mean().backward()
    patch_moe_experts(fused, KernelConfig(moe_autotune=False) if untuned else None)
    fused(input_ids=x).logits.float().square().mean().backward()
    res = []
    for i in (0, 1):
        a, b = outs[f"fused{i}"], outs[f"ref{i}"]
        ga, gb = outs.get(f"fused{i}_grad"), outs.get(f"ref{i}_grad")
        res.append(f"L{i} out |d|/|ref| {float((a-b).norm()/b.norm()):.2e} outgrad {None if ga is None else f'{float(ga.norm()):.2e}'} ref {None if gb is None else f'{float(gb.norm()):.2e}'}")
    z = [n.split('layers.')[1][:40] for n, p in fused.named_parameters() if "lora" in n and p.grad is not None and float(p.grad.abs().max()) == 0]
    print(sys.argv[1:], "round", rnd, "| zero-grad lora params:", z, "|", " ; ".join(res), flush=True)
