"""The FSDP2 byte model's arithmetic: shard sizes with dim-0 padding, gathered units, reduce-scatter buffers."""
import math

import pytest

from lora_lab.memory import ModelShape, TrainingSetup, analytic_memory, fsdp_memory, unit_parameter_shapes
from lora_lab.models import model_config

SMALL = ModelShape(hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2,
                   vocab_size=10, tied_embeddings=True, attention_bias=True)
LORA = TrainingSetup(batch=3, seq_len=5, dtype="bf16", method="lora", lora_r=2, lora_targets=("q_proj", "v_proj"),
                     attention="eager")


def test_units_hold_every_parameter_once():
    for setup in (LORA, TrainingSetup(batch=1, seq_len=4, method="full")):
        units = unit_parameter_shapes(SMALL, setup)
        def numel(shapes):
            return sum(math.prod(p) for p, _ in shapes)

        lora = SMALL.lora_parameter_count(setup.lora_r, setup.lora_targets) if setup.method == "lora" else 0
        assert numel(units["root"]) + SMALL.num_layers * numel(units["layer"]) == SMALL.parameter_count() + lora


@pytest.mark.parametrize("adapter_dtype, a", [(None, 4), ("bf16", 2)])
def test_shards_gathered_units_and_buffers_by_hand(adapter_dtype, a):
    """N = 3 ranks, bf16 (2 bytes): each parameter keeps ceil(rows / 3) rows on a rank. The LoRA factors, their
    gradients and states take ``a`` bytes: fp32 by default on a bf16 model (add_lora's default), or bf16."""
    setup = TrainingSetup(**{**LORA.__dict__, "adapter_dtype": adapter_dtype})
    m = fsdp_memory(SMALL, setup, world_size=3)
    # one layer, local elements: q 2x4 + bias 2, k 1x4 + 1, v 1x4 + 1, o 2x4, gate 2x4, up 2x4, down 2x6,
    # two norms 2 + 2 = 60; LoRA q: A 1x4, B 2x2; v: A 1x4, B 1x2 = 14
    layer_frozen, layer_lora = 60, 14
    layer_bytes = layer_frozen * 2 + layer_lora * a
    root_local = 4 * 4 + 2  # embeddings ceil(10/3) = 4 rows of 4, final norm 2
    assert m.weights == root_local * 2 + 2 * layer_bytes
    assert m.gradients == 2 * layer_lora * a
    assert m.optimizer_states == 2 * m.gradients
    assert m.layer_gathered == 3 * layer_bytes  # padded to 3 * ceil(rows / 3) rows
    assert m.root_gathered == 3 * root_local * 2
    assert m.reduce_scatter == 2 * 3 * layer_lora * a
    assert m.layers_gathered == 2
    assert m.activations.phases == analytic_memory(SMALL, TrainingSetup(**{**setup.__dict__, "batch": 1})).phases
    assert m.phases["optimizer"] == m.weights + m.gradients + m.optimizer_states + m.gradients  # foreach temporary
    assert m.peak == max(m.phases.values())


def test_one_rank_holds_what_one_gpu_holds():
    single = analytic_memory(SMALL, LORA)
    m = fsdp_memory(SMALL, LORA, world_size=1)
    assert (m.weights, m.gradients, m.optimizer_states) == (single.weights, single.gradients, single.optimizer_states)
    assert m.phases["optimizer"] == single.phases["optimizer"]


def test_two_gpus_halve_the_shards_of_the_real_shape():
    shape = ModelShape.from_config(model_config("random:qwen2.5-0.5b"))
    setup = TrainingSetup(batch=8, seq_len=512, dtype="bf16", method="lora")
    one, two = fsdp_memory(shape, setup, 1), fsdp_memory(shape, setup, 2)
    assert two.weights == pytest.approx(one.weights / 2, rel=1e-3)
    # all but the rotary tables (shared, one per sequence position) scale with the rows
    assert two.activations.body_held == pytest.approx(one.activations.body_held / 2, rel=1e-4)
    kept = fsdp_memory(shape, setup, 2, reshard_after_forward=False)
    assert kept.layers_gathered == shape.num_layers and kept.peak > two.peak


def test_world_size_is_checked():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="world_size"):
            fsdp_memory(SMALL, LORA, bad)
