"""A task with a known answer for comparing LoRA variants on random weights: the **planted adapter**.

The teacher is the base model plus a known low-rank update on chosen projections,

    W_teacher = W + U diag(σ) Vᵀ          U [out x k], V [in x k] orthonormal columns, σ a chosen spectrum,

and a student (the base with some adapter) learns it from the teacher's outputs on random token batches. Because
the answer is known, three things are measurable for any variant: how fast the student's loss falls, where it ends,
and whether the learned update ``ΔW = s·B A`` spans the planted subspace (principal angles between the column
spaces of ``U`` and of ΔW's top-k left singular vectors).

* :func:`orthonormal`      — a seeded [n x k] matrix with orthonormal columns
* :func:`plant_adapter`    — the teacher: a copy of the base with the planted updates added to its weights
* :func:`subspace_cosines` — cosines of the principal angles between the planted and the learned subspaces
* :func:`distill`          — train a student on the teacher's final hidden states (MSE), recording the loss curve
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["orthonormal", "plant_adapter", "subspace_cosines", "distill", "steps_to_threshold"]


def orthonormal(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """[n x k] with orthonormal columns (QR of a seeded Gaussian), fp32 on the CPU."""
    if not 0 < k <= n:
        raise ValueError(f"need 0 < k <= n, got k={k}, n={n}")
    q, r = torch.linalg.qr(torch.randn(n, k, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()  # fixed signs: the same seed gives the same matrix


Planted = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def plant_adapter(base: nn.Module, targets: Sequence[str], rank: int, spectrum: Sequence[float], seed: int = 0,
                  relative: bool = True) -> tuple[nn.Module, Planted]:
    """A copy of ``base`` with ``U diag(σ) Vᵀ`` added to every ``nn.Linear`` whose name ends in one of ``targets``.

    ``spectrum`` gives σ (``rank`` values); with ``relative`` each σ_i is multiplied by the module's weight RMS
    times sqrt(in·out) / rank, so that the update's size is a fixed fraction of the weight's whatever the shape.
    Returns the teacher and ``{module name: (U, σ, V)}`` (fp32, CPU)."""
    if len(spectrum) != rank:
        raise ValueError(f"spectrum has {len(spectrum)} values for rank {rank}")
    gen = torch.Generator().manual_seed(seed)
    teacher = copy.deepcopy(base)
    planted = {}
    names = [n for n, m in teacher.named_modules() if isinstance(m, nn.Linear)
             and any(n == t or n.endswith("." + t) for t in targets)]
    if not names:
        raise ValueError(f"no nn.Linear named like {list(targets)} in {type(base).__name__}")
    for name in names:
        module = teacher.get_submodule(name)
        out_f, in_f = module.weight.shape
        u, v = orthonormal(out_f, rank, gen), orthonormal(in_f, rank, gen)
        sigma = torch.tensor([float(s) for s in spectrum])
        if relative:
            rms = module.weight.detach().float().pow(2).mean().sqrt().item()
            sigma = sigma * rms * (in_f * out_f) ** 0.5 / rank
        with torch.no_grad():
            delta = (u * sigma) @ v.T
            module.weight.add_(delta.to(module.weight.device, module.weight.dtype))
        planted[name] = (u, sigma, v)
    return teacher, planted


def subspace_cosines(delta: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Cosines of the principal angles between span(U) and the span of ``delta``'s top-k left singular vectors
    (k = U's columns), largest first: all 1 means the learned update lies in the planted subspace."""
    k = u.shape[1]
    # on the CPU in fp64 (the planted U lives there; the learned update may come from a GPU)
    left = torch.linalg.svd(delta.detach().double().cpu(), full_matrices=False).U[:, :k]
    return torch.linalg.svdvals(u.double().cpu().T @ left).clamp(max=1.0)


def steps_to_threshold(losses: Sequence[float], threshold: float) -> int | None:
    """The first step (1-based) whose loss is at or below ``threshold``; None if never."""
    for i, value in enumerate(losses):
        if value <= threshold:
            return i + 1
    return None


@torch.no_grad()
def _targets_of(teacher: nn.Module, batches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [teacher(input_ids=ids, output_hidden_states=True).hidden_states[-1] for ids in batches]


def distill(student: nn.Module, teacher: nn.Module, batches: Sequence[torch.Tensor],
            optimizer: torch.optim.Optimizer, steps: int,
            on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train ``student`` to reproduce ``teacher``'s final hidden states on ``batches`` (cycled), MSE loss
    normalised by the targets' mean square; returns the loss of every step (before its update)."""
    targets = _targets_of(teacher, batches)
    scales = [t.float().pow(2).mean() for t in targets]
    losses = []
    student.train()
    for step in range(steps):
        i = step % len(batches)
        optimizer.zero_grad(set_to_none=True)
        out = student(input_ids=batches[i], output_hidden_states=True).hidden_states[-1]
        loss = (out.float() - targets[i].float()).pow(2).mean() / scales[i]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


# ----------------------------------------------------------------------------------------------------------------
# The variants on the planted task
# ----------------------------------------------------------------------------------------------------------------
# name: (add_lora keyword arguments, optimizer: "adamw" or "loraplus")
VARIANTS = {
    "lora": ({}, "adamw"),
    "rslora": ({"use_rslora": True}, "adamw"),
    "dora": ({"use_dora": True}, "adamw"),
    "lora_fa": ({"lora_fa": True}, "adamw"),
    "loraplus": ({}, "loraplus"),
    "pissa": ({"init_lora_weights": "pissa"}, "adamw"),
    "vera": ({}, "vera"),  # lora_lab.vera.add_vera: shared frozen random A, B; trainable vectors d, b
}
VERA_LR_FACTOR = 10.0  # VeRA trains scaling vectors: the VeRA paper uses a learning rate ~10x LoRA's


def effective_updates(student: nn.Module, base: nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``W_merged - W_base`` (fp32) of each named layer: what the adapter adds to the original weight, whatever the
    variant (DoRA's rescaling and PiSSA's residual base included)."""
    from lora_lab.layer import merge_lora

    merged = merge_lora(copy.deepcopy(student))
    return {n: merged.get_submodule(n).weight.detach().float() - base.get_submodule(n).weight.detach().float()
            for n in names}


def train_variant(variant: str, base: nn.Module, teacher: nn.Module, planted: Planted, batches, steps: int,
                  r: int, alpha: float, lr: float, targets: Sequence[str], loraplus_ratio: float = 16.0,
                  seed: int = 0) -> dict:
    """Train one variant on the planted task from ``base`` (copied) and report its loss curve, its trainable
    parameters and how well its effective update spans the planted subspace (mean over layers of the smallest
    principal cosine)."""
    from lora_lab.layer import add_lora, count_parameters

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    kwargs, optimizer = VARIANTS[variant]
    student = copy.deepcopy(base)
    torch.manual_seed(seed)
    if optimizer == "vera":
        from lora_lab.vera import add_vera

        add_vera(student, r=r, targets=tuple(targets))
        lr = lr * VERA_LR_FACTOR
    else:
        add_lora(student, r=r, alpha=alpha, targets=tuple(targets), **kwargs)
    if optimizer == "loraplus":
        from lora_lab.variants import loraplus_optimizer

        opt = loraplus_optimizer(student, lr=lr, ratio=loraplus_ratio)
    else:
        opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=lr)
    losses = distill(student, teacher, batches, opt, steps)
    last = losses[-len(batches):]  # one pass over the batches: the final loss without the batch-to-batch noise
    updates = effective_updates(student, base, list(planted))
    cosines = [subspace_cosines(updates[n], planted[n][0]) for n in planted]
    return {"variant": variant, "r": r, "alpha": alpha, "lr": lr, "losses": losses, "final_loss": sum(last) / len(last),
            "trainable_params": count_parameters(student).trainable,
            "subspace_min_cos": float(torch.stack([c.min() for c in cosines]).mean()),
            "subspace_mean_cos": float(torch.stack([c.mean() for c in cosines]).mean())}


def loss_at(losses: Sequence[float], fraction: float, window: int) -> float:
    """Mean loss over ``window`` steps ending at ``fraction`` of the run (early-convergence comparisons)."""
    end = max(window, int(round(fraction * len(losses))))
    part = losses[end - window:end]
    return sum(part) / len(part)


def step_cost(model: nn.Module, ids: torch.Tensor, steps: int, lr: float = 1e-4) -> dict:
    """Median ms of ``steps`` training steps (standard causal-LM loss, AdamW; :func:`measure.training_step_ms`)
    and the peak bytes of one untimed step (CUDA only)."""
    from lora_lab.lab import measure

    times, _, peak = measure.training_step_ms(model, lambda m: m(input_ids=ids, labels=ids).loss, steps, lr=lr,
                                              measure_peak=ids.is_cuda)
    return {"ms": sorted(times)[len(times) // 2], "peak_bytes": peak}


INTEROP_TARGETS = ("q_proj", "v_proj")


def _peft_config(variant: str, r: int):
    import peft

    if variant == "vera":
        return peft.VeraConfig(r=r, target_modules=list(INTEROP_TARGETS))
    flags = {"rslora": {"use_rslora": True}, "dora": {"use_dora": True},
             "pissa": {"init_lora_weights": "pissa"}, "lora": {}}[variant]
    return peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(INTEROP_TARGETS), **flags)


def _add_ours(model: nn.Module, variant: str, r: int) -> None:
    if variant == "vera":
        from lora_lab.vera import add_vera

        add_vera(model, r=r, targets=INTEROP_TARGETS)
        return
    from lora_lab.layer import add_lora

    add_lora(model, r=r, alpha=2 * r, targets=INTEROP_TARGETS, **VARIANTS[variant][0])


@torch.no_grad()
def _perturb(model: nn.Module, seed: int) -> None:
    # every trainable tensor moved off its initial value, so that the files carry more than an initialisation
    gen = torch.Generator().manual_seed(seed)
    for _, p in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
        p.add_(0.02 * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))


def interop_max_abs_diff(variant: str, spec: str, folder, r: int = 8, seed: int = 0) -> dict:
    """fp32 logits of an adapter moved both ways between lora_lab and PEFT: lora_lab saves, PEFT's
    ``PeftModel.from_pretrained`` reloads; PEFT saves, ``lora_lab.load_adapter`` reloads. Max |Δ| each way."""
    from pathlib import Path

    import peft

    from lora_lab.adapters import load_adapter, save_adapter
    from lora_lab.models import load_model

    folder = Path(folder)
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(seed))
    ours = load_model(spec)
    _add_ours(ours, variant, r)
    _perturb(ours, seed)
    save_adapter(ours, folder / f"{variant}_ours", overwrite=True)
    theirs = peft.PeftModel.from_pretrained(load_model(spec), str(folder / f"{variant}_ours"))
    with torch.no_grad():
        to_peft = (ours(input_ids=ids).logits - theirs(input_ids=ids).logits).abs().max().item()
    made = peft.get_peft_model(load_model(spec), _peft_config(variant, r))
    _perturb(made, seed + 1)
    made.save_pretrained(str(folder / f"{variant}_peft"))
    back = load_adapter(load_model(spec), folder / f"{variant}_peft")
    with torch.no_grad():
        from_peft = (made(input_ids=ids).logits - back(input_ids=ids).logits).abs().max().item()
    return {"variant": variant, "to_peft": to_peft, "from_peft": from_peft}
