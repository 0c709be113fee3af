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
    left = torch.linalg.svd(delta.double(), full_matrices=False).U[:, :k]
    return torch.linalg.svdvals(u.double().T @ left).clamp(max=1.0)


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
