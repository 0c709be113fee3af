"""Data-parallel LoRA training steps that give the one-process numbers: the global batch is split by rows, and the
loss is the mean over the labelled tokens of the *global* batch.

Each rank computes the sum of its token losses, ``S_r = mean_r * n_r``, and backpropagates
``S_r * world / N`` (``N = sum_r n_r``); FSDP averages the gradients over the ranks (divides their sum by
``world``), so every rank ends with the gradient of ``sum_r S_r / N``, the one-process loss. Without
torch.distributed (or with one rank) the same function is the plain one-process loop.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from lora_lab.distributed.process_group import rank_and_world
from lora_lab.distributed.sharding import LOSS_METHOD, is_sharded, unwrap_peft
from lora_lab.loss import causal_lm_loss, shift_labels

__all__ = ["LOSS_KINDS", "rank_and_world", "local_rows", "local_loss_sum", "train_step", "sharded_train_steps"]

LOSS_KINDS = ("standard", "chunked", "fused")


def local_rows(batch: Mapping[str, torch.Tensor], rank: int | None = None, world: int | None = None) -> dict:
    """This rank's rows of a global batch: contiguous blocks (``torch.tensor_split``), rank 0 first."""
    if rank is None or world is None:
        rank, world = rank_and_world()
    rows = batch["input_ids"].shape[0]
    if rows < world:
        raise ValueError(f"a global batch of {rows} row(s) cannot be split over {world} ranks")
    return {k: torch.tensor_split(v, world)[rank] for k, v in batch.items()}


def _loss_fn(model: nn.Module):
    return getattr(model, LOSS_METHOD) if is_sharded(model) else (
        lambda *a, **k: causal_lm_loss(unwrap_peft(model), *a, **k))


def local_loss_sum(model: nn.Module, batch: Mapping[str, torch.Tensor], loss: str = "chunked",
                   ignore_index: int = -100) -> tuple[torch.Tensor, int]:
    """(sum of this batch's next-token losses, number of labelled tokens), through the root's loss method on a
    sharded model (so FSDP unshards the head for it)."""
    if loss not in LOSS_KINDS:
        raise ValueError(f"loss must be one of {LOSS_KINDS}, got {loss!r}")
    labels = batch.get("labels", batch["input_ids"])
    count = int((shift_labels(labels, ignore_index) != ignore_index).sum())
    if count == 0:
        raise ValueError("this rank's rows carry no labelled token; the mean over the global batch needs some "
                         "on every rank (give each rank at least one row with two or more labelled tokens)")
    mean = _loss_fn(model)(batch["input_ids"], labels, batch.get("attention_mask"),
                           chunked=loss == "chunked", fused=loss == "fused", ignore_index=ignore_index)
    return mean * count, count


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, torch.Tensor],
               loss: str = "chunked") -> float:
    """One optimizer step on the global ``batch`` (every rank passes the same one); returns the global mean loss
    before the step."""
    rank, world = rank_and_world()
    mine = local_rows(batch, rank, world)
    total, count = local_loss_sum(model, mine, loss)
    # on the loss's device: NCCL reduces CUDA tensors only (gloo takes CPU ones)
    counts = torch.tensor([float(total.detach()), float(count)], dtype=torch.float64, device=total.device)
    if world > 1:
        dist.all_reduce(counts)
    n_global = counts[1].item()
    # world / N: FSDP divides the summed gradients by world (see the module docstring)
    (total * (world / n_global)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return counts[0].item() / n_global


OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def sharded_train_steps(model: nn.Module, batch: Mapping[str, torch.Tensor], steps: int = 5, lr: float = 1e-3,
                        loss: str = "chunked", optimizer: str = "adamw") -> list[float]:
    """``steps`` optimizer steps (AdamW, or plain SGD; torch defaults besides ``lr``) on the global ``batch``, as
    :func:`lora_lab.train_steps` does on one process; returns the global loss before each step. Works on a sharded
    model (every rank calls it with the same batch) and on a plain one. The model is left in eval mode.

    SGD is there for checks: AdamW's update hardly depends on the gradient's scale, so only SGD shows a gradient
    that is off by a constant factor (a wrong average over the ranks, say)."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameter (add LoRA first)")
    optimizer = OPTIMIZERS[optimizer](params, lr=lr)
    model.train()
    losses = [train_step(model, optimizer, batch, loss) for _ in range(steps)]
    model.eval()
    return losses
