"""Side-by-side GPU benchmarks of MoE experts: transformers eager, transformers grouped_mm, ours.

Layer benchmark: one experts module of a real MoE shape, forward + backward (``torch.autograd.grad``
of a fixed upstream gradient, so nothing accumulates), bf16, routing from a random softmax
router. Modes:

* ``full``: gradients for X, the routing weights and both expert weights (full fine-tuning);
* ``lora``: frozen experts with PEFT ``target_parameters`` LoRA on gate_up_proj and down_proj;
  baselines run PEFT's own ParamWrapper forward, ours patches that wrapper (same parameters).

Every implementation runs on the same module, weights and routing, in one process, alternating,
timed with CUDA events (median of many), peak memory = ``max_memory_allocated`` above what was
allocated before the step. TFLOP/s counts the dense expert GEMMs only:
forward 6·S·H·I, backward 12·S·H·I (full) or 6·S·H·I (LoRA: no weight gradient), S = T·K.

End to end: a small Qwen3-MoE-shaped causal LM (random init), full training steps (forward,
backward, AdamW step, zero_grad) per implementation, samples/s.
"""

from __future__ import annotations

import copy
import csv
import gc
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lora_lab.kernels.moe_patch import patch_moe_experts, unpatch_moe_experts
from lora_lab.layer import SingleChild, fill_lora_B
from lora_lab.kernels.moe_numerics import error_stats

# NVIDIA H200 SXM: 1,979 TFLOP/s bf16 Tensor Core *with* 2:4 sparsity → 989.5 dense.
H200_DENSE_BF16_TFLOPS = 989.5

IMPLEMENTATIONS = ("eager", "grouped_mm", "ours")


@dataclass(frozen=True)
class MoeLayerShape:
    name: str
    hidden: int
    num_experts: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool
    family: str  # transformers model family whose experts class is used

    def build_experts(self, device, dtype, seed: int = 0) -> nn.Module:
        """The transformers experts module of this shape, weights ~ N(0, 0.02)."""
        if self.family == "qwen3_moe":
            from transformers import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls
            config = Qwen3MoeConfig(
                hidden_size=self.hidden, moe_intermediate_size=self.intermediate,
                num_experts=self.num_experts, num_experts_per_tok=self.top_k,
            )
        elif self.family == "qwen2_moe":
            from transformers import Qwen2MoeConfig
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts as cls
            config = Qwen2MoeConfig(
                hidden_size=self.hidden, moe_intermediate_size=self.intermediate,
                num_experts=self.num_experts, num_experts_per_tok=self.top_k,
            )
        else:
            raise ValueError(f"unknown family {self.family}")
        config._experts_implementation = "eager"
        # weights drawn on the target device: a CPU draw of the 30B-like layer's 600M values plus the
        # host->device copy took seconds per benchmark configuration
        device = torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.device(device):
            experts = cls(config)
        with torch.no_grad():
            for p in (experts.gate_up_proj, experts.down_proj):
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
        return experts.to(device=device, dtype=dtype)


LAYER_SHAPES = {
    "qwen3_30b_a3b": MoeLayerShape("qwen3_30b_a3b", 2048, 128, 8, 768, True, "qwen3_moe"),
    "qwen1_5_moe_a2_7b": MoeLayerShape("qwen1_5_moe_a2_7b", 2048, 60, 4, 1408, False, "qwen2_moe"),
}


def random_routing(num_tokens: int, shape: MoeLayerShape, device, dtype, seed: int = 0):
    """Softmax router over random logits → (top_k_index, top_k_weights leaf with grad)."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    logits = torch.randn(num_tokens, shape.num_experts, generator=gen).to(device)
    probs = logits.float().softmax(-1)
    weights, index = torch.topk(probs, shape.top_k, dim=-1)
    if shape.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return index, weights.to(dtype).requires_grad_(True)


def add_peft_expert_lora(holder: nn.Module, rank: int, alpha: int, seed: int = 0) -> list[nn.Parameter]:
    """PEFT LoRA on experts.gate_up_proj / down_proj (B made non-zero so the path is exercised)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=[],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    inject_adapter_in_model(config, holder)
    fill_lora_B(holder, 0.01, generator=torch.Generator(device="cpu").manual_seed(seed + 2))
    return [p for p in holder.parameters() if p.requires_grad]


def set_implementation(holder: nn.Module, experts: nn.Module, impl: str) -> None:
    """eager / grouped_mm through transformers' switch; ours through ``patch_moe_experts``."""
    unpatch_moe_experts(holder)
    if impl == "ours":
        experts.config._experts_implementation = "eager"
        if patch_moe_experts(holder) != 1:
            raise RuntimeError("expected exactly one patched experts module")
    elif impl in ("eager", "grouped_mm"):
        experts.config._experts_implementation = impl
    else:
        raise ValueError(f"unknown implementation {impl!r}")


def time_cuda(fn, warmup: int = 2, min_reps: int = 5, max_reps: int = 40, target_ms: float = 400.0) -> list[float]:
    """Milliseconds per call (CUDA events), after ``warmup`` calls; rep count adapts to the call time.

    Without CUDA (CPU smoke runs of this code) it times one call with ``perf_counter``.
    """
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return [1e3 * (time.perf_counter() - t0)]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    reps = int(min(max_reps, max(min_reps, math.ceil(target_ms / estimate))))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def peak_extra_bytes(fn) -> int:
    """Peak allocated bytes above the pre-call level during one call (NaN without CUDA)."""
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def saved_activation_bytes(holder: nn.Module, x, index, weights) -> int:
    """Bytes of tensors autograd saves for backward in one forward, deduplicated by storage,
    excluding the inputs and the module's parameters (they exist anyway)."""
    from ..memory import saved_bytes_excluding

    return saved_bytes_excluding(lambda: holder(x, index, weights), (x, index, weights, *holder.parameters()))


def saved_bytes_by_implementation(
    shape: MoeLayerShape, num_tokens: int, mode: str, *, device: str = "cuda", dtype=torch.bfloat16, seed: int = 0,
) -> dict:
    """saved_activation_bytes for eager / grouped_mm / ours on one shared layer."""
    experts = shape.build_experts(torch.device(device), dtype, seed)
    holder = SingleChild(experts, "experts")  # PEFT's target_parameters name "experts.…"
    if mode == "lora":
        experts.requires_grad_(False)
        add_peft_expert_lora(holder, 16, 32, seed)
    gen = torch.Generator(device="cpu").manual_seed(seed + 3)
    x = torch.randn(num_tokens, shape.hidden, generator=gen).to(device, dtype).requires_grad_(True)
    index, weights = random_routing(num_tokens, shape, torch.device(device), dtype, seed)
    result = {}
    for impl in IMPLEMENTATIONS:
        set_implementation(holder, experts, impl)
        result[impl] = saved_activation_bytes(holder, x, index, weights)
    unpatch_moe_experts(holder)
    del experts, holder
    _free_memory()
    return result


def expert_gemm_flops(num_tokens: int, shape: MoeLayerShape, mode: str) -> float:
    """Dense expert GEMM FLOPs of forward + backward (LoRA rank terms not counted)."""
    s, h, i = num_tokens * shape.top_k, shape.hidden, shape.intermediate
    forward = 6.0 * s * h * i  # 2·S·H·2I (gate_up) + 2·S·I·H (down)
    backward = 2 * forward if mode == "full" else forward  # dX (+ dW for full fine-tuning)
    return forward + backward


def bench_layer(
    shape: MoeLayerShape, num_tokens: int, mode: str, *, impls=IMPLEMENTATIONS, lora_rank: int = 16,
    lora_alpha: int = 32, seed: int = 0, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """Time + peak memory of forward+backward for each implementation on one shared layer."""
    device = torch.device(device)
    experts = shape.build_experts(device, dtype, seed)
    holder = SingleChild(experts, "experts")
    if mode == "full":
        params = [experts.gate_up_proj, experts.down_proj]
    elif mode == "lora":
        experts.requires_grad_(False)
        params = add_peft_expert_lora(holder, lora_rank, lora_alpha, seed)
    else:
        raise ValueError(mode)
    gen = torch.Generator(device=device).manual_seed(seed + 3)  # drawn on the device (T=32768: 67M values)
    x = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype).requires_grad_(True)
    index, weights = random_routing(num_tokens, shape, device, dtype, seed)
    grad_out = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype)
    inputs = [x, weights, *params]

    def step():
        out = holder(x, index, weights)
        return torch.autograd.grad(out, inputs, grad_out)

    rows = []
    flops = expert_gemm_flops(num_tokens, shape, mode)
    for impl in impls:
        set_implementation(holder, experts, impl)
        row = dict(shape=shape.name, tokens=num_tokens, mode=mode, impl=impl, status="ok")
        try:
            # the eager loop takes ~0.25 s per call on the H200: one warm-up and 3 timed calls suffice
            times = time_cuda(step, warmup=1, min_reps=3) if impl == "eager" else time_cuda(step)
            row["peak_extra_gib"] = peak_extra_bytes(step) / 2**30
            row["ms_median"] = statistics.median(times)
            row["ms_min"] = min(times)
            row["reps"] = len(times)
            row["tflops"] = flops / (row["ms_median"] * 1e-3) / 1e12
            row["fraction_of_peak"] = row["tflops"] / H200_DENSE_BF16_TFLOPS
        except torch.OutOfMemoryError:
            row["status"] = "oom"
        rows.append(row)
        _free_memory()
    unpatch_moe_experts(holder)
    del experts, holder, x, weights, grad_out, params, inputs
    _free_memory()
    return rows


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _trainable(holder: nn.Module, mode: str) -> list[torch.Tensor]:
    if mode == "full":
        return [holder.experts.gate_up_proj, holder.experts.down_proj]
    return [p for p in holder.parameters() if p.requires_grad]


def _experts_of(holder: nn.Module) -> nn.Module:
    module = holder.experts
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def layer_numerics(
    shape: MoeLayerShape, num_tokens: int, mode: str, seed: int = 0, device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """bf16 forward + every gradient of eager / grouped_mm / ours against an fp32 eager reference.

    The reference runs on the *same* bf16-rounded weights and inputs, upcast to fp32 (TF32 off),
    so the errors measure the bf16 arithmetic of each implementation, not the weight rounding.
    """
    device = torch.device(device)
    experts = shape.build_experts(device, dtype, seed)
    holder = SingleChild(experts, "experts")
    if mode == "lora":
        experts.requires_grad_(False)
        torch.manual_seed(seed)
        add_peft_expert_lora(holder, 16, 32, seed)
        for p in holder.parameters():  # PEFT may keep adapters in fp32: round them like the weights
            if p.requires_grad:
                p.data = p.data.to(dtype).to(p.dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed + 3)
    x = torch.randn(num_tokens, shape.hidden, generator=gen).to(device, dtype)
    index, weights = random_routing(num_tokens, shape, device, dtype, seed)
    grad_out = torch.randn(num_tokens, shape.hidden, generator=gen).to(device, dtype)
    reference_holder = copy.deepcopy(holder).float()

    results = {}
    for impl in ("reference", *IMPLEMENTATIONS):
        is_ref = impl == "reference"
        h = reference_holder if is_ref else holder
        cast = (lambda t: t.float()) if is_ref else (lambda t: t)
        xi = cast(x).detach().requires_grad_(True)
        wi = cast(weights).detach().requires_grad_(True)
        params = _trainable(h, mode)
        with _no_tf32():
            set_implementation(h, _experts_of(h), "eager" if is_ref else impl)
            out = h(xi, index, wi)
            grads = torch.autograd.grad(out, [xi, wi, *params], cast(grad_out))
        results[impl] = [t.detach().float() for t in (out, *grads)]
        unpatch_moe_experts(h)
    if mode == "full":
        names = ["out", "d_x", "d_weights", "d_gate_up_proj", "d_down_proj"]
    else:
        names = ["out", "d_x", "d_weights"] + [
            "d_" + n.replace(".default.weight", "").replace("experts.base_layer.", "gate_up.").replace("experts.", "down.")
            for n, p in holder.named_parameters() if p.requires_grad
        ]
    rows = []
    for impl in IMPLEMENTATIONS:
        for name, got, ref in zip(names, results[impl], results["reference"]):
            rows.append(dict(shape=shape.name, tokens=num_tokens, mode=mode, impl=impl, tensor=name, **error_stats(got, ref)))
    del experts, holder, reference_holder
    _free_memory()
    return rows


class _no_tf32:
    """fp32 reference without TF32 matmuls."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        return self

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def small_qwen3_moe_config(num_layers: int = 4, vocab_size: int = 151936):
    """Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top-8, expert I 768), few layers."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=num_layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
        tie_word_embeddings=False, output_router_logits=False,
    )


def bench_end_to_end(
    mode: str, *, batch: int = 4, seq_len: int = 2048, num_layers: int = 4, steps: int = 5, warmup: int = 2,
    seed: int = 0, impls=IMPLEMENTATIONS, config=None, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """Training steps/s of a small random Qwen3-MoE-shaped model per experts implementation."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = config if config is not None else small_qwen3_moe_config(num_layers)
    config._attn_implementation = "sdpa"
    with torch.device(device):  # random init on the device: ~3B parameters, slow on the host
        model = Qwen3MoeForCausalLM(config)
    model = model.to(device=device, dtype=dtype)
    model.train()
    root = model
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        root = get_peft_model(model, LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ))
    gen = torch.Generator(device="cpu").manual_seed(seed + 5)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen).to(device)
    rows = []
    for impl in impls:
        unpatch_moe_experts(root)
        if impl == "ours":
            model.set_experts_implementation("eager")
            patch_moe_experts(root)
        else:
            model.set_experts_implementation(impl)
        optimizer = torch.optim.AdamW([p for p in root.parameters() if p.requires_grad], lr=1e-5, foreach=True)

        def train_step():
            loss = root(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        row = dict(mode=mode, impl=impl, batch=batch, seq_len=seq_len, layers=config.num_hidden_layers, status="ok")
        try:
            for _ in range(warmup):
                train_step()
            _synchronize()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                loss = train_step()
                _synchronize()
                times.append(time.perf_counter() - t0)
            row["step_s_median"] = statistics.median(times)
            row["samples_per_s"] = batch / row["step_s_median"]
            row["tokens_per_s"] = batch * seq_len / row["step_s_median"]
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
            row["final_loss"] = loss.item()
        except torch.OutOfMemoryError:
            row["status"] = "oom"
        rows.append(row)
        del optimizer
        _free_memory()
    unpatch_moe_experts(root)
    del model, root
    _free_memory()
    return rows


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def write_csv(rows: list[dict], path: Path) -> None:
    keys = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def lookup(rows: list[dict], **match) -> dict | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def ratio_summary(layer_rows: list[dict], e2e_rows: list[dict]) -> dict:
    """Speed-up / memory ratios vs grouped_mm and eager, keyed for ``lora_lab.record``."""
    summary = {}
    for row in layer_rows:
        if row["impl"] != "ours" or row["status"] != "ok":
            continue
        tag = f"{row['shape']}_t{row['tokens']}_{row['mode']}"
        summary[f"{tag}_ours_ms"] = row["ms_median"]
        summary[f"{tag}_ours_tflops"] = row["tflops"]
        summary[f"{tag}_ours_fraction_of_peak"] = row["fraction_of_peak"]
        for base in ("grouped_mm", "eager"):
            other = lookup(layer_rows, shape=row["shape"], tokens=row["tokens"], mode=row["mode"], impl=base)
            if other and other["status"] == "ok":
                summary[f"{tag}_{base}_ms"] = other["ms_median"]
                summary[f"{tag}_speedup_vs_{base}"] = other["ms_median"] / row["ms_median"]
                summary[f"{tag}_peak_ratio_vs_{base}"] = row["peak_extra_gib"] / other["peak_extra_gib"]
    for mode in ("full", "lora"):
        ours = lookup(e2e_rows, mode=mode, impl="ours")
        if not ours or ours["status"] != "ok":
            continue
        summary[f"e2e_{mode}_ours_samples_per_s"] = ours["samples_per_s"]
        for base in ("grouped_mm", "eager"):
            other = lookup(e2e_rows, mode=mode, impl=base)
            if other and other["status"] == "ok":
                summary[f"e2e_{mode}_{base}_samples_per_s"] = other["samples_per_s"]
                summary[f"e2e_{mode}_speedup_vs_{base}"] = ours["samples_per_s"] / other["samples_per_s"]
    return summary


def plot_layer(rows: list[dict], path: Path | None = None):
    """Forward+backward time vs T, one panel per (shape, mode); saved to ``path`` if given; returns the figure."""
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows})
    modes = ["full", "lora"]
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 4 * len(shapes)), squeeze=False)
    for i, shape in enumerate(shapes):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            for impl in IMPLEMENTATIONS:
                pts = sorted(
                    (r["tokens"], r["ms_median"]) for r in rows
                    if r["shape"] == shape and r["mode"] == mode and r["impl"] == impl and r["status"] == "ok"
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens T")
            ax.set_ylabel("forward+backward ms (median)")
            ax.set_title(f"{shape} — {'full fine-tuning' if mode == 'full' else 'LoRA on experts (PEFT)'}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_memory(rows: list[dict], path: Path | None = None):
    """Peak memory above resident per configuration and implementation; returns the figure."""
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    labels = sorted({(r["shape"], r["tokens"], r["mode"]) for r in ok})
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4.5))
    width = 0.27
    for k, impl in enumerate(IMPLEMENTATIONS):
        vals = []
        for shape, tokens, mode in labels:
            row = lookup(ok, shape=shape, tokens=tokens, mode=mode, impl=impl)
            vals.append(row["peak_extra_gib"] if row else float("nan"))  # eager is not run at every T
        ax.bar([x + (k - 1) * width for x in range(len(labels))], vals, width, label=impl)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([f"{s.split('_')[0]}\nT={t}\n{m}" for s, t, m in labels], fontsize=7)
    ax.set_ylabel("peak GiB above resident (fwd+bwd)")
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def run_moe_benchmarks(
    out_dir, *, tokens=(4096, 8192, 32768), shapes=tuple(LAYER_SHAPES), modes=("full", "lora"),
    e2e: bool = True, numerics: bool = True, numerics_tokens: int = 4096, eager_tokens=(8192,),
    e2e_steps: int = 3, e2e_warmup: int = 1, e2e_layers: int = 4, e2e_eager_modes=("lora",), log=print,
) -> dict:
    """All GPU benchmarks; writes CSVs + PNGs into ``out_dir``; returns rows and the ratio summary.

    The eager per-expert loop (~0.25 s per forward+backward, ~30x the others) is timed only at the
    token counts in ``eager_tokens`` (``None``: at every T), and end to end only in ``e2e_eager_modes``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    import matplotlib.pyplot as plt

    numerics_rows, layer_rows, e2e_rows = [], [], []
    if numerics:
        for shape_name in shapes:
            for mode in modes:
                numerics_rows.extend(layer_numerics(LAYER_SHAPES[shape_name], numerics_tokens, mode))
        write_csv(numerics_rows, out_dir / "moe_numerics.csv")
    for shape_name in shapes:
        for num_tokens in tokens:
            for mode in modes:
                t0 = time.perf_counter()
                with_eager = eager_tokens is None or num_tokens in eager_tokens
                impls = IMPLEMENTATIONS if with_eager else tuple(i for i in IMPLEMENTATIONS if i != "eager")
                rows = bench_layer(LAYER_SHAPES[shape_name], num_tokens, mode, impls=impls)
                layer_rows.extend(rows)
                log(f"[moe-bench] {shape_name} T={num_tokens} {mode}: " + ", ".join(
                    f"{r['impl']} {r.get('ms_median', float('nan')):.2f} ms {r.get('peak_extra_gib', float('nan')):.2f} GiB"
                    for r in rows) + f"  ({time.perf_counter() - t0:.0f}s)")
                write_csv(layer_rows, out_dir / "moe_layer_bench.csv")
    plt.close(plot_layer(layer_rows, out_dir / "moe_layer_speed.png"))
    plt.close(plot_memory(layer_rows, out_dir / "moe_layer_memory.png"))
    if e2e:
        for mode in modes:
            t0 = time.perf_counter()
            impls = IMPLEMENTATIONS if mode in e2e_eager_modes else tuple(i for i in IMPLEMENTATIONS if i != "eager")
            rows = bench_end_to_end(mode, steps=e2e_steps, warmup=e2e_warmup, num_layers=e2e_layers, impls=impls)
            e2e_rows.extend(rows)
            log(f"[moe-bench] e2e {mode}: " + ", ".join(
                f"{r['impl']} {r.get('samples_per_s', float('nan')):.2f} samples/s" for r in rows)
                + f"  ({time.perf_counter() - t0:.0f}s)")
        write_csv(e2e_rows, out_dir / "moe_e2e_bench.csv")
    summary = ratio_summary(layer_rows, e2e_rows)
    return dict(numerics=numerics_rows, layer=layer_rows, e2e=e2e_rows, summary=summary)
