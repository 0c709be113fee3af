"""The planted-adapter task: the teacher holds exactly the planted update, the angle measure is right on known
cases, and a plain LoRA student learns the update from the teacher's outputs."""
import pytest
import torch

import lora_lab
from lora_lab.experiments import lora_variants as lv


def test_orthonormal_is_orthonormal_and_seeded():
    q = lv.orthonormal(40, 6, torch.Generator().manual_seed(3))
    assert torch.allclose(q.T @ q, torch.eye(6), atol=1e-6)
    assert torch.equal(q, lv.orthonormal(40, 6, torch.Generator().manual_seed(3)))
    with pytest.raises(ValueError, match="0 < k <= n"):
        lv.orthonormal(4, 5, torch.Generator())


def test_teacher_holds_exactly_the_planted_update(tiny_fp32):
    teacher, planted = lv.plant_adapter(tiny_fp32, ["v_proj"], 3, [1.0, 0.5, 0.25], seed=1, relative=False)
    assert len(planted) == tiny_fp32.config.num_hidden_layers
    for name, (u, sigma, v) in planted.items():
        delta = teacher.get_submodule(name).weight - tiny_fp32.get_submodule(name).weight
        torch.testing.assert_close(delta, (u * sigma) @ v.T, rtol=0, atol=1e-6)
    assert torch.equal(teacher.get_submodule("model.layers.0.self_attn.q_proj").weight,
                       tiny_fp32.get_submodule("model.layers.0.self_attn.q_proj").weight)
    with pytest.raises(ValueError, match="no nn.Linear"):
        lv.plant_adapter(tiny_fp32, ["nothing"], 1, [1.0])
    with pytest.raises(ValueError, match="spectrum"):
        lv.plant_adapter(tiny_fp32, ["v_proj"], 2, [1.0])


def test_subspace_cosines_on_known_cases():
    gen = torch.Generator().manual_seed(0)
    u, v = lv.orthonormal(30, 4, gen), lv.orthonormal(20, 4, gen)
    same = lv.subspace_cosines((u * torch.tensor([4.0, 3, 2, 1])) @ v.T, u)
    assert torch.allclose(same, torch.ones(4, dtype=torch.float64), atol=1e-9)
    other = lv.orthonormal(30, 8, torch.Generator().manual_seed(1))
    orth = other - u @ (u.T @ other)  # columns orthogonal to span(U)
    assert lv.subspace_cosines(orth[:, :4] @ v.T, u).max() < 1e-6


def test_plain_lora_learns_the_planted_update(tiny_fp32):
    teacher, planted = lv.plant_adapter(tiny_fp32, ["v_proj"], 2, [1.0, 0.6], seed=0)
    student = lora_lab.load_model("random:tiny-qwen2", attn_implementation="sdpa")
    lora_lab.add_lora(student, r=8, alpha=16, targets=("v_proj",))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, student.config.vocab_size, (2, 24), generator=gen) for _ in range(2)]
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=3e-3)
    losses = lv.distill(student, teacher, batches, opt, 60)
    assert losses[-1] < 0.1 * losses[0]
    assert lv.steps_to_threshold(losses, 0.1 * losses[0]) is not None
    assert lv.steps_to_threshold([3.0, 2.0], 1.0) is None
    name = "model.layers.0.self_attn.v_proj"
    layer = student.get_submodule(name)
    delta = layer.scaling * (layer.lora_B @ layer.lora_A)
    assert lv.subspace_cosines(delta.detach(), planted[name][0]).min() > 0.8


@pytest.mark.parametrize("variant", ["dora", "vera"])
def test_interop_helper_reports_exact_round_trips(variant, tmp_path):
    row = lv.interop_max_abs_diff(variant, "random:tiny-qwen2", tmp_path, r=4)
    assert row == {"variant": variant, "to_peft": 0.0, "from_peft": 0.0}


@pytest.mark.parametrize("variant", list(lv.VARIANTS))
def test_every_variant_trains_on_the_planted_task(variant, tiny_fp32):
    teacher, planted = lv.plant_adapter(tiny_fp32, ["v_proj"], 2, [1.0, 0.6], seed=0)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, tiny_fp32.config.vocab_size, (2, 16), generator=gen)]
    res = lv.train_variant(variant, tiny_fp32, teacher, planted, batches, steps=6, r=4, alpha=8, lr=1e-3,
                           targets=("v_proj",))
    assert len(res["losses"]) == 6 and res["trainable_params"] > 0
    assert 0.0 <= res["subspace_min_cos"] <= res["subspace_mean_cos"] <= 1.0
    # the base is untouched (PiSSA rewrites the copy's weights, never the base's)
    assert torch.equal(tiny_fp32.get_submodule("model.layers.0.self_attn.v_proj").weight,
                       lora_lab.load_model("random:tiny-qwen2").get_submodule("model.layers.0.self_attn.v_proj").weight)
    with pytest.raises(ValueError, match="unknown variant"):
        lv.train_variant("qlora", tiny_fp32, teacher, planted, batches, 1, 4, 8, 1e-3, ("v_proj",))


def test_loss_at_averages_a_window():
    assert lv.loss_at([4.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.1, 0.1, 0.1, 0.1], 0.4, 2) == 1.5  # steps 3 and 4


def test_step_cost_times_real_training_steps(tiny_fp32):
    import copy

    model = copy.deepcopy(tiny_fp32)
    lora_lab.add_lora(model, r=2, alpha=4, targets=("v_proj",))
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    cost = lv.step_cost(model, ids, steps=2, lr=1e-2)
    assert cost["ms"] > 0 and cost["peak_bytes"] is None  # no peak without CUDA
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the optimizer stepped
