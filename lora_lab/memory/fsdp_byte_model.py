"""The byte model of :mod:`.byte_model` on N GPUs under FSDP2 (``lora_lab.distributed.shard_model``): what one GPU
holds.

FSDP2 shards every parameter on dim 0: a rank keeps ``ceil(rows / N)`` rows of each (the last ranks' blocks padded
to that size), so weights, gradients and AdamW states shrink to about 1/N. A unit's parameters are all-gathered
(padded to ``N * ceil(rows / N)`` rows) just before its forward and its backward:

* the root unit (embeddings, final norm, an untied lm_head) is not resharded after the forward: it stays gathered
  through the whole step;
* a decoder layer's gathered parameters live through its forward (and its backward); FSDP prefetches the next
  layer's all-gather while one computes, so two layers are gathered at a time. With
  ``reshard_after_forward=False`` every layer stays gathered from its forward until its backward;
* after a layer's backward its trainable gradients (unsharded) are copied into a reduce-scatter buffer of the same
  size and reduced into the rank's shard: about two unsharded copies of one layer's trainable gradients, briefly.

Activations are those of the rank's rows of the global batch (``ceil(batch / N)``), from :func:`analytic_memory`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .accounting import GIB, dtype_of
from .byte_model import AnalyticMemory, ModelShape, PhasePeaks, TrainingSetup, analytic_memory

__all__ = ["FsdpMemory", "fsdp_memory", "unit_parameter_shapes"]


def unit_parameter_shapes(shape: ModelShape, setup: TrainingSetup) -> dict[str, list[tuple[tuple[int, ...], bool]]]:
    """``{"root": [...], "layer": [...]}``: the (shape, trainable) of every parameter of the root unit and of one
    decoder layer unit, in the order FSDP sees them."""
    d, V = shape.hidden_size, shape.vocab_size
    full = setup.method == "full"
    lora = set() if full else set(setup.lora_targets)
    layer: list[tuple[tuple[int, ...], bool]] = []
    for name, (i, o, bias) in shape.linear_shapes().items():
        layer.append(((o, i), full))
        if bias:
            layer.append(((o,), full))
        if name in lora:
            layer += [((setup.lora_r, i), True), ((o, setup.lora_r), True)]
    layer += [((d,), full), ((d,), full)]  # input and post-attention RMSNorm
    root = [((V, d), full), ((d,), full)]  # embeddings (and the tied lm_head), final norm
    if not shape.tied_embeddings:
        root.append(((V, d), full))
    return {"root": root, "layer": layer}


def _local(shape: tuple[int, ...], world: int) -> int:
    """Elements a rank keeps: ceil(rows / N) rows."""
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def _gathered(shape: tuple[int, ...], world: int) -> int:
    """Elements of the all-gathered (padded) parameter: N * ceil(rows / N) rows."""
    return world * _local(shape, world)


@dataclass
class FsdpMemory(PhasePeaks):
    """What :func:`fsdp_memory` predicts for one GPU (bytes)."""

    world_size: int
    weights: int  # this rank's shards of every parameter
    gradients: int  # its shards of the trainable ones
    optimizer_states: int  # AdamW's two states of those shards
    root_gathered: int  # the root unit, all-gathered for the whole step
    layer_gathered: int  # one decoder layer unit, all-gathered
    layers_gathered: int  # decoder layers gathered at once (2 with resharding, all of them without)
    reduce_scatter: int  # one layer's unsharded trainable gradients and the reduce-scatter buffer
    activations: AnalyticMemory  # the single-GPU model on this rank's rows of the batch
    phases: dict[str, int]

    def bars(self) -> dict[str, float]:
        gathered = self.root_gathered + self.layers_gathered * self.layer_gathered
        return {"shards": self.fixed / GIB, "gathered": gathered / GIB,
                "activations": (self.peak - self.fixed - gathered) / GIB}


def fsdp_memory(shape: ModelShape, setup: TrainingSetup, world_size: int,
                reshard_after_forward: bool = True) -> FsdpMemory:
    """Predict one GPU's memory for a training step sharded over ``world_size`` GPUs with FSDP2 (every decoder
    layer a unit, the rest the root). ``setup.batch`` is the global batch; parameters, gradients and states are
    in ``setup.dtype`` (no mixed-precision policy). ``world_size=1`` is the unsharded step plus FSDP's gathered
    copies, which one GPU would not need: compare with :func:`analytic_memory` for that."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    N, L = world_size, shape.num_layers
    s = dtype_of(setup.dtype).itemsize
    units = unit_parameter_shapes(shape, setup)
    local_trainable = (sum(_local(p, N) for p, t in units["root"] if t)
                       + L * sum(_local(p, N) for p, t in units["layer"] if t))
    # trainable parameters (LoRA factors) in the adapter dtype (fp32 on a bf16 model by default), frozen in s
    a = s if setup.method == "full" else setup.adapter_itemsize

    def nbytes(p, t, count):
        return count(p, N) * (a if t else s)

    weights = sum(nbytes(p, t, _local) for p, t in units["root"]) + L * sum(nbytes(p, t, _local)
                                                                         for p, t in units["layer"])
    gradients, states = local_trainable * a, 2 * local_trainable * a
    root_gathered = sum(nbytes(p, t, _gathered) for p, t in units["root"])
    layer_gathered = sum(nbytes(p, t, _gathered) for p, t in units["layer"])
    layers_gathered = min(2, L) if reshard_after_forward else L
    layer_grads = sum(_gathered(p, N) for p, t in units["layer"] if t) * a
    reduce_scatter = 2 * layer_grads

    local_batch = math.ceil(setup.batch / N)
    single = analytic_memory(shape, replace(setup, batch=local_batch))
    single_fixed = single.weights + single.optimizer_states
    gathered = root_gathered + layers_gathered * layer_gathered
    fixed = weights + states
    phases = {}
    for phase in ("forward", "loss_backward"):
        phases[phase] = single.phases[phase] - single_fixed + fixed + gathered
    phases["layers_backward"] = single.phases["layers_backward"] - single_fixed + fixed + gathered + reduce_scatter
    foreach_tmp = local_trainable * a if setup.optimizer_foreach else 0
    phases["optimizer"] = weights + gradients + states + foreach_tmp  # every unit resharded again
    return FsdpMemory(world_size=N, weights=weights, gradients=gradients, optimizer_states=states,
                      root_gathered=root_gathered, layer_gathered=layer_gathered, layers_gathered=layers_gathered,
                      reduce_scatter=reduce_scatter, activations=single, phases=phases)
