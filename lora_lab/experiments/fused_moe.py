"""Notebook 06's code: correctness checks of the fused MoE experts, the layer shapes it benchmarks, and the metrics.

Checks (shared with the tests):

* ``make_moe_problem``: a random MoE experts problem (X, routing, weights, optional LoRA factors);
* ``fused_vs_reference``: output and every gradient of ``fused_moe_experts`` vs ``moe_experts_reference``;
* ``EDGE_CASES``: odd sizes, T = 1, one expert receiving every token (others none), top-k = E, many tiles;
* ``patched_model_check``: a tiny Qwen3-MoE, eager vs patched, full fine-tuning and PEFT expert LoRA;
* ``peft_roundtrip_check``: train one step through the fused path, PEFT ``save_pretrained`` /
  ``from_pretrained``, logits of the reloaded model (PEFT's forward and the fused one).

Real layer shapes (shared with ``benchmarks/bench_moe.py``, which times them):

* ``LAYER_SHAPES`` / ``MoeLayerShape``: the Qwen3-30B-A3B-like and Qwen1.5-MoE-like experts layers, built as
  transformers' own experts modules; ``random_routing``, ``add_expert_lora``, ``set_implementation``
  (transformers eager / grouped_mm, ours, or Liger-Kernel's fused MoE — full fine-tuning only, when
  ``liger-kernel`` is installed: ``implementations(mode)`` lists what a cell can run);
* ``layer_numerics``: bf16 output and gradients of each implementation against an fp32 reference;
* ``saved_bytes_by_implementation``: bytes autograd keeps for backward, per implementation;
* ``benchmark_metrics``: the speed and memory ratios notebook 06 records, from the benchmark's CSVs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import importlib.util
import tempfile

import torch
from torch import nn

from lora_lab.experiments.fused_moe_metrics import (
    E2E_CSV,
    GRADED_CELLS,
    GRADED_PEAKS,
    GRADED_SPEEDUPS,
    LAYER_CSV,
    NOTEBOOK_CELLS,
    PANEL_CELLS,
    PANEL_TOKENS,
    PERSISTENT_CELLS,
    TFLOPS_CELLS,
    VARIANT_CELLS,
    benchmark_metrics,
    layer_table,
)
from lora_lab.experiments.fused_moe_panel import (
    COARSE_SHAPES,
    H200_DENSE_BF16_TFLOPS,
    IMPLEMENTATIONS,
    LAYER_SHAPES,
    LIGER,
    OURS_ENGINES,
    OURS_KGROUPED,
    OURS_PERSISTENT,
    OURS_SCATTER,
    OURS_UNTUNED,
    OURS_VARIANTS,
    MoeLayerShape,
)
from lora_lab.kernels import (
    ExpertLoRA,
    KernelConfig,
    fused_moe_experts,
    moe_experts_reference,
    patch_moe_experts,
    unpatch_moe_experts,
)
from lora_lab.layer import SingleChild, fill_lora_B
from lora_lab.memory import saved_bytes_excluding
from lora_lab.numerics import error_stats

__all__ = [
    "EDGE_CASES", "TENSOR_NAMES", "make_moe_problem", "outputs_and_grads", "fused_vs_reference",
    "edge_case_table", "tiny_qwen3_moe", "add_expert_lora", "patched_model_check", "peft_roundtrip_check",
    "H200_DENSE_BF16_TFLOPS", "IMPLEMENTATIONS", "OURS_KGROUPED", "OURS_PERSISTENT", "OURS_UNTUNED", "OURS_VARIANTS",
    "OURS_ENGINES", "OURS_SCATTER",
    "COARSE_SHAPES", "ours_config", "MoeLayerShape",
    "LAYER_SHAPES", "random_routing",
    "LIGER", "liger_available", "implementations", "register_liger", "layer_holder", "set_implementation",
    "expert_gemm_flops", "layer_numerics", "saved_bytes_by_implementation",
    # the benchmark's metrics (lora_lab.experiments.fused_moe_metrics)
    "LAYER_CSV", "E2E_CSV", "GRADED_SPEEDUPS", "TFLOPS_CELLS", "GRADED_PEAKS", "PERSISTENT_CELLS", "PANEL_TOKENS",
    "PANEL_CELLS", "GRADED_CELLS", "NOTEBOOK_CELLS", "VARIANT_CELLS", "benchmark_metrics", "layer_table",
]

TENSOR_NAMES = ["out", "d_x", "d_weights", "d_gate_up_proj", "d_down_proj",
                "d_gate_up_A", "d_gate_up_B", "d_down_A", "d_down_B"]

EDGE_CASES = [
    dict(case="odd sizes (H=37, I=19)", T=9, H=37, I=19, E=5, K=2, routing="random"),
    dict(case="T = 1", T=1, H=24, I=16, E=4, K=2, routing="random"),
    dict(case="all tokens to one expert", T=12, H=32, I=16, E=6, K=1, routing="one_expert"),
    dict(case="top-k = number of experts", T=7, H=20, I=12, E=4, K=4, routing="random"),
    dict(case="several row tiles per expert", T=40, H=48, I=24, E=3, K=2, routing="random"),
]


def make_moe_problem(T, H, I, E, K, *, rank=0, seed=0, dtype=torch.float32, device="cpu", routing="random"):
    """(X, top_k_index, top_k_weights, W1, W2, ExpertLoRA | None) with weights scaled like a trained layer."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    x = rnd(T, H)
    if routing == "random":
        logits = torch.randn(T, E, generator=gen)
        weights, index = torch.topk(logits.softmax(-1), K, dim=-1)
    elif routing == "one_expert":  # every token's choices are experts 1..K: expert 0 (and K+1..) get nothing
        index = torch.stack([(torch.arange(K) + 1) % E for _ in range(T)])
        weights = torch.rand(T, K, generator=gen)
    else:
        raise ValueError(f"unknown routing {routing!r}")
    w1 = rnd(E, 2 * I, H, scale=H ** -0.5)
    w2 = rnd(E, H, I, scale=I ** -0.5)
    lora = None
    if rank:
        lora = ExpertLoRA(
            rnd(E, rank, H, scale=H ** -0.5), rnd(E, 2 * I, rank, scale=0.3), 1.7,
            rnd(E, rank, I, scale=I ** -0.5), rnd(E, H, rank, scale=0.3), 0.6,
        )
    return x, index.to(device), weights.to(device=device, dtype=dtype), w1, w2, lora


def fixed_tiles() -> KernelConfig:
    """Correctness checks over many small shapes: fixed tile configs (a tuning sweep per shape proves nothing
    about correctness and costs minutes on a GPU); other settings as configured."""
    return KernelConfig.from_env(moe_autotune=False)


def _lora_list(lora):
    return [] if lora is None else [lora.gate_up_A, lora.gate_up_B, lora.down_A, lora.down_B]


def outputs_and_grads(fn, x, index, weights, w1, w2, lora, grad_seed=1, config=None):
    """[out, dX, dweights, dW1, dW2, (dA1, dB1, dA2, dB2)] of one implementation, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, w1, w2, *_lora_list(lora))]
    lo = None
    if lora is not None:
        lo = ExpertLoRA(leaves[4], leaves[5], lora.gate_up_scale, leaves[6], leaves[7], lora.down_scale)
    if fn is fused_moe_experts:
        out = fn(leaves[0], index, leaves[1], leaves[2], leaves[3], lora=lo, config=config or fixed_tiles())
    else:
        out = fn(leaves[0], index, leaves[1], leaves[2], leaves[3], lo)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)
    grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
    return [out.detach(), *grads]


def fused_vs_reference(problem) -> list[dict]:
    """Per-tensor errors of the fused kernels against the plain-torch reference (same dtype)."""
    got = outputs_and_grads(fused_moe_experts, *problem)
    ref = outputs_and_grads(moe_experts_reference, *problem)
    rows = []
    for name, a, b in zip(TENSOR_NAMES, got, ref):
        if a is None or b is None:
            raise AssertionError(f"{name}: missing gradient (fused {a is None}, reference {b is None})")
        rows.append(dict(tensor=name, **error_stats(a, b)))
    return rows


def edge_case_table(device="cpu", dtype=torch.float32, ranks=(0, 3)) -> list[dict]:
    """Every EDGE_CASES entry, without and with LoRA, fused vs reference."""
    rows = []
    for spec in EDGE_CASES:
        shape = {k: v for k, v in spec.items() if k not in ("case", "routing")}
        for rank in ranks:
            problem = make_moe_problem(**shape, rank=rank, routing=spec["routing"], device=device, dtype=dtype)
            for row in fused_vs_reference(problem):
                rows.append(dict(case=spec["case"], lora_rank=rank, **row))
    return rows


def tiny_qwen3_moe(seed: int = 0, hidden: int = 32, experts: int = 6, top_k: int = 2):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=experts,
        num_experts_per_tok=top_k, experts_implementation="eager",
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def add_expert_lora(model, rank=4, alpha=8, seed=0, b_std=0.1, inject=False):
    """PEFT LoRA on experts.gate_up_proj / down_proj with B ~ N(0, b_std) (B = 0 would test nothing).

    Returns the PeftModel, or with ``inject`` the same ``model`` with the adapters injected in place (a bare
    experts layer in a ``SingleChild`` holder keeps its call signature)."""
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=[],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = inject_adapter_in_model(config, model) if inject else get_peft_model(model, config)
    fill_lora_B(model, b_std, generator=torch.Generator().manual_seed(seed))
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def patched_model_check(device="cpu", seed=0) -> dict:
    """Largest relative error (loss and every gradient) of patched vs eager, full FT and PEFT expert LoRA."""
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    result = {}
    for mode in ("full", "lora"):
        model = tiny_qwen3_moe(seed).to(device)
        if mode == "lora":
            model = add_expert_lora(model, seed=seed)
        loss_ref, grads_ref = _loss_and_grads(model, ids)
        patched = patch_moe_experts(model, config=fixed_tiles())
        loss, grads = _loss_and_grads(model, ids)
        errors = [abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())]
        same_keys = grads.keys() == grads_ref.keys()
        errors += [error_stats(grads[n], grads_ref[n])["rel_l2"] for n in grads_ref if n in grads]
        result[mode] = dict(patched_modules=patched, max_rel_err=max(errors), same_gradient_set=same_keys,
                            trainable=len(grads_ref), loss=loss.item(), loss_eager=loss_ref.item())
    return result


def peft_roundtrip_check(device="cpu", seed=0) -> dict:
    """One SGD step through the fused path, then PEFT save → load: do PEFT and fused logits agree?"""
    from peft import PeftModel
    from safetensors.torch import load_file

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    base = tiny_qwen3_moe(seed).to(device)
    model = add_expert_lora(copy.deepcopy(base), seed=seed)
    patch_moe_experts(model, config=fixed_tiles())
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        keys = sorted(load_file(f"{tmp}/adapter_model.safetensors"))
        reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp).to(device)
    with torch.no_grad():
        peft_logits = reloaded(input_ids=ids).logits
        patch_moe_experts(reloaded, config=fixed_tiles())
        fused_logits = reloaded(input_ids=ids).logits
    return dict(
        adapter_keys=keys,
        peft_reload_max_abs=(peft_logits - trained).abs().max().item(),
        fused_reload_max_abs=(fused_logits - trained).abs().max().item(),
        logit_scale=trained.abs().max().item(),
    )



# ----------------------------------------------------------------------------------------------
# The real layer shapes (lora_lab.experiments.fused_moe_panel): numerics here, timing in benchmarks/bench_moe.py.
# ----------------------------------------------------------------------------------------------
def ours_config(impl: str, config: KernelConfig | None) -> KernelConfig | None:
    """The kernel settings of one of our implementations: ``ours`` as given, the variants (persistent form,
    untuned, K-grouped weight gradient) with their fields replaced."""
    if impl not in OURS_VARIANTS:
        return config
    return (config if config is not None else KernelConfig.from_env()).replace(**OURS_VARIANTS[impl])


def ours_engine(shape: MoeLayerShape, num_tokens: int, mode: str, device, dtype, config: KernelConfig | None = None,
                rank: int = 16) -> str:
    """The engine the rule (:func:`lora_lab.kernels.moe.engine.choose_engine`) gives ``ours`` at a layer cell, on
    ``device``'s GPU class as :mod:`lora_lab.gpu_arch` reports it (``$LORA_LAB_ARCH`` included): 'grouped_mm' or
    'triton'. ``mode`` 'lora' puts rank-``rank`` LoRA on the experts, as :func:`layer_holder` does."""
    from lora_lab import gpu_arch
    from lora_lab.kernels.moe.engine import choose_engine, grouped_mm_available

    return choose_engine(num_experts=shape.num_experts, num_assignments=num_tokens * shape.top_k, hidden=shape.hidden,
                         intermediate=shape.intermediate, dtype=dtype, capability=gpu_arch.capability(device),
                         requested=(config or KernelConfig.from_env()).moe_engine, available=grouped_mm_available(),
                         ranks=(rank, rank) if mode == "lora" else ())


def random_routing(num_tokens: int, shape: MoeLayerShape, device, dtype, seed: int = 0):
    """Softmax router over random logits → (top_k_index, top_k_weights leaf with grad)."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    logits = torch.randn(num_tokens, shape.num_experts, generator=gen).to(device)
    probs = logits.float().softmax(-1)
    weights, index = torch.topk(probs, shape.top_k, dim=-1)
    if shape.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return index, weights.to(dtype).requires_grad_(True)


def layer_holder(shape: MoeLayerShape, mode: str, device, dtype, seed: int = 0, rank: int = 16):
    """(holder, experts, trainable parameters): the experts layer in a ``SingleChild`` named ``experts`` (PEFT's
    ``target_parameters`` name); ``mode`` 'full' trains both expert weights, 'lora' freezes them and adds PEFT
    LoRA (r = ``rank``, alpha 2r, B ~ N(0, 0.01)) on both."""
    experts = shape.build_experts(device, dtype, seed)
    holder = SingleChild(experts, "experts")
    if mode == "full":
        return holder, experts, [experts.gate_up_proj, experts.down_proj]
    if mode != "lora":
        raise ValueError(f"mode must be 'full' or 'lora', got {mode!r}")
    experts.requires_grad_(False)
    add_expert_lora(holder, rank=rank, alpha=2 * rank, seed=seed, b_std=0.01, inject=True)
    return holder, experts, [p for p in holder.parameters() if p.requires_grad]


def liger_available() -> bool:
    """True when ``liger_kernel`` can be imported (PyPI ``liger-kernel``)."""
    return importlib.util.find_spec("liger_kernel") is not None


def implementations(mode: str) -> tuple[str, ...]:
    """What a benchmark cell of ``mode`` can run here: eager, grouped_mm and ours, plus Liger for full fine-tuning
    when it is installed."""
    if mode not in ("full", "lora"):
        raise ValueError(f"mode must be 'full' or 'lora', got {mode!r}")
    return IMPLEMENTATIONS + ((LIGER,) if mode == "full" and liger_available() else ())


def _liger_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    # transformers' experts signature -> Liger's autograd Function (routing indices as int32, as it expects)
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    return LigerFusedMoEFunction.apply(hidden_states, self.gate_up_proj, self.down_proj,
                                       top_k_index.to(torch.int32), top_k_weights)


@functools.cache
def register_liger() -> None:
    """Register Liger's fused MoE as transformers' experts implementation ``"liger"`` (once). In Triton's
    interpreter each of its autotuned kernels keeps its first config: the interpreter cannot time candidates."""
    if not liger_available():
        raise ImportError("the 'liger' implementation needs Liger-Kernel: pip install liger-kernel")
    from transformers.integrations.moe import ExpertsInterface

    from lora_lab.kernels.triton_helpers import running_in_interpreter

    if running_in_interpreter():
        import liger_kernel.ops.fused_moe_kernels as liger_kernels
        from triton.runtime.autotuner import Autotuner

        for name in dir(liger_kernels):
            kernel = getattr(liger_kernels, name)
            if isinstance(kernel, Autotuner):
                kernel.configs = kernel.configs[:1]
    ExpertsInterface.register(LIGER, _liger_experts_forward)


@contextlib.contextmanager
def liger_single_config():
    """Liger's autotuned MoE kernels each keep their first config inside the block (restored after it).

    For the cells that check numerics or count saved bytes, not speed: Liger's kernels otherwise tune at every new
    shape on their first call (102 s at a Mixtral-like layer on an H200; notebook 06's bf16 and saved-bytes cells
    took 302 s and 104 s with it). The tile config changes neither what is saved nor more than the summation order.
    """
    try:
        import liger_kernel.ops.fused_moe_kernels as liger_kernels
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # Liger not installed, or a release that keeps its MoE kernels elsewhere: nothing to pin
        yield
        return

    saved = {}
    for name in dir(liger_kernels):
        kernel = getattr(liger_kernels, name)
        if isinstance(kernel, Autotuner) and len(kernel.configs) > 1:
            saved[name] = kernel.configs
            kernel.configs = kernel.configs[:1]
    try:
        yield
    finally:
        for name, configs in saved.items():
            getattr(liger_kernels, name).configs = configs


def set_implementation(holder: nn.Module, experts: nn.Module, impl: str, config: KernelConfig | None = None) -> None:
    """eager / grouped_mm through transformers' switch; ours through ``patch_moe_experts(config=config)``; Liger's
    fused MoE registered as a transformers experts implementation (full fine-tuning only)."""
    unpatch_moe_experts(holder)
    if impl == "ours" or impl in OURS_VARIANTS:
        experts.config._experts_implementation = "eager"
        if patch_moe_experts(holder, config=ours_config(impl, config)) != 1:
            raise RuntimeError("expected exactly one patched experts module")
    elif impl in ("eager", "grouped_mm"):
        experts.config._experts_implementation = impl
    elif impl == LIGER:
        if any(hasattr(m, "base_layer") for m in holder.modules()):
            raise ValueError("Liger's fused MoE computes plain experts: it has no LoRA on experts (PEFT's "
                             "target_parameters wrapper found); use it for full fine-tuning only")
        register_liger()
        experts.config._experts_implementation = LIGER
    else:
        raise ValueError(f"unknown implementation {impl!r}")


def expert_gemm_flops(num_tokens: int, shape: MoeLayerShape, mode: str) -> float:
    """Dense expert-GEMM FLOPs of forward + backward, S = T·K assignments (LoRA rank terms not counted): forward
    6·S·H·I (gate_up 2·S·H·2I, down 2·S·I·H), backward 12·S·H·I (dX and dW) or 6·S·H·I (LoRA: no dW)."""
    s, h, i = num_tokens * shape.top_k, shape.hidden, shape.intermediate
    forward = 6.0 * s * h * i
    return forward + (2 * forward if mode == "full" else forward)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def saved_bytes_by_implementation(shape: MoeLayerShape, num_tokens: int, mode: str, *, device: str = "cuda",
                                  dtype=torch.bfloat16, seed: int = 0, config: KernelConfig | None = None) -> dict:
    """Bytes autograd saves for backward in one forward (deduplicated by storage, inputs and parameters
    excluded), for each of ``implementations(mode)`` on one shared layer."""
    holder, experts, _ = layer_holder(shape, mode, torch.device(device), dtype, seed)
    gen = torch.Generator(device="cpu").manual_seed(seed + 3)
    x = torch.randn(num_tokens, shape.hidden, generator=gen).to(device, dtype).requires_grad_(True)
    index, weights = random_routing(num_tokens, shape, torch.device(device), dtype, seed)
    exclude = (x, index, weights, *holder.parameters())
    result = {}
    with liger_single_config():  # bytes, not speed: no tuning sweep (:func:`liger_single_config`)
        for impl in implementations(mode):
            set_implementation(holder, experts, impl, config)
            result[impl] = saved_bytes_excluding(functools.partial(holder, x, index, weights), exclude)
    unpatch_moe_experts(holder)
    del experts, holder, exclude
    _free_memory()
    return result


def _bare_experts(holder: nn.Module) -> nn.Module:
    module = holder.experts
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def layer_numerics(shape: MoeLayerShape, num_tokens: int, mode: str, seed: int = 0, device: str = "cuda",
                   dtype: torch.dtype = torch.bfloat16, config: KernelConfig | None = None) -> list[dict]:
    """Low-precision forward + every gradient of each of ``implementations(mode)`` against an fp32 eager reference.

    The reference runs on the *same* rounded weights and inputs, upcast to fp32 (TF32 off), so the errors
    measure the arithmetic of each implementation, not the rounding of the weights.
    """
    device = torch.device(device)
    holder, _, _ = layer_holder(shape, mode, device, dtype, seed)
    if mode == "lora":
        for p in holder.parameters():  # PEFT may keep adapters in fp32: round them like the weights
            if p.requires_grad:
                p.data = p.data.to(dtype).to(p.dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed + 3)
    x = torch.randn(num_tokens, shape.hidden, generator=gen).to(device, dtype)
    index, weights = random_routing(num_tokens, shape, device, dtype, seed)
    grad_out = torch.randn(num_tokens, shape.hidden, generator=gen).to(device, dtype)
    reference_holder = copy.deepcopy(holder).float()
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {}
    single = liger_single_config()  # numerics, not speed: no tuning sweep
    single.__enter__()
    try:
        for impl in ("reference", *implementations(mode)):
            is_ref = impl == "reference"
            h = reference_holder if is_ref else holder
            cast = (lambda t: t.float()) if is_ref else (lambda t: t)
            xi = cast(x).detach().requires_grad_(True)
            wi = cast(weights).detach().requires_grad_(True)
            params = [p for p in h.parameters() if p.requires_grad]
            set_implementation(h, _bare_experts(h), "eager" if is_ref else impl, config)
            out = h(xi, index, wi)
            grads = torch.autograd.grad(out, [xi, wi, *params], cast(grad_out))
            results[impl] = [t.detach() for t in (out, *grads)]  # as computed: error_stats upcasts a slice at a time
            unpatch_moe_experts(h)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
        single.__exit__(None, None, None)
    if mode == "full":
        names = ["out", "d_x", "d_weights"] + [f"d_{n.split('.')[-1]}" for n, p in holder.named_parameters()
                                               if p.requires_grad]
    else:  # PEFT's names: experts.base_layer.lora_A.default.weight (gate_up), experts.lora_A... (down)
        renames = ((".default.weight", ""), ("experts.base_layer.", "gate_up."), ("experts.", "down."))
        names = ["out", "d_x", "d_weights"]
        for n, p in holder.named_parameters():
            if p.requires_grad:
                for old, new in renames:
                    n = n.replace(old, new)
                names.append("d_" + n)
    rows = []
    for impl in implementations(mode):
        for name, got, ref in zip(names, results[impl], results["reference"]):
            rows.append(dict(shape=shape.name, tokens=num_tokens, mode=mode, impl=impl, tensor=name,
                             **error_stats(got, ref)))
    del holder, reference_holder
    _free_memory()
    return rows
