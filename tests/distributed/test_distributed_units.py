"""lora_lab.distributed in this process: the meta-device build, the batch split, adapter keys, the launcher's
argument checks, and sharding on a one-rank gloo group (the two-process runs are in test_distributed_fsdp.py)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import lora_lab
from lora_lab.distributed import MetaInit, local_rows, shard_model, sharded_train_steps
from lora_lab.distributed.adapters import adapter_key, load_sharded_adapter, save_sharded_adapter
from lora_lab.distributed.jobs import TRAIN_LORA_DEFAULTS, build_lora_model
from lora_lab.distributed.launch import LaunchError, launch


def _normal_build(peft: bool):
    return build_lora_model({**TRAIN_LORA_DEFAULTS, "peft": peft, "seed": 3, "lora_seed": 5,
                             "targets": ["q_proj", "v_proj", "down_proj"]})[0]


@pytest.mark.parametrize("peft", [False, True], ids=["lora_lab", "peft"])
def test_meta_build_materialises_to_the_normal_build(peft):
    ref = _normal_build(peft)
    state_after_ref = torch.random.get_rng_state()
    model, plan = build_lora_model({**TRAIN_LORA_DEFAULTS, "peft": peft, "seed": 3, "lora_seed": 5,
                                    "targets": ["q_proj", "v_proj", "down_proj"], "meta_init": True})
    # the build drew from the global generator exactly as the normal one did
    assert torch.equal(torch.random.get_rng_state(), state_after_ref)
    assert all(p.device.type == "meta" for p in model.parameters())
    plan.materialize(model, "cpu")
    want, got = ref.state_dict(), model.state_dict()
    assert set(want) == set(got)
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different
    inner = model.get_base_model() if peft else model
    assert inner.lm_head.weight is inner.model.embed_tokens.weight  # tied again after to_empty
    assert [n for n, p in model.named_parameters() if p.requires_grad] == \
        [n for n, p in ref.named_parameters() if p.requires_grad]


def test_meta_init_refuses_writes_it_cannot_replay():
    with pytest.raises(NotImplementedError, match="not a parameter"):
        with MetaInit():
            layer = nn.Linear(4, 3)
            layer.weight.data.normal_()
    with MetaInit() as meta:
        holder = nn.Module()
        holder.p = nn.Parameter(torch.zeros(3, device="meta"))  # a factory's value: invisible
    with pytest.raises(ValueError, match="no recorded write"):
        meta.plan(holder)
    with pytest.raises(NotImplementedError, match="generator"):
        with MetaInit():
            layer = nn.Linear(4, 3)
            nn.init.normal_(layer.weight, generator=torch.Generator())
    # the patch of register_parameter is undone
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_local_rows_splits_the_global_batch_in_rank_order():
    batch = {"input_ids": torch.arange(10).view(5, 2), "labels": torch.arange(10).view(5, 2)}
    parts = [local_rows(batch, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    assert [p["labels"].shape[0] for p in parts] == [3, 2]
    with pytest.raises(ValueError, match="cannot be split over 8 ranks"):
        local_rows(batch, 0, 8)


def test_adapter_keys_of_lora_lab_and_peft_parameters():
    assert adapter_key("model.layers.0.self_attn.q_proj.lora_A") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert adapter_key("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert adapter_key("model.layers.0.self_attn.q_proj.base.weight") is None


def test_launch_checks_its_arguments_and_reports_a_failing_rank(tmp_path):
    with pytest.raises(ValueError, match="module:function"):
        launch("lora_lab.distributed.jobs.train_lora")
    with pytest.raises(ValueError, match="nproc"):
        launch("lora_lab.distributed.jobs:train_lora", nproc=0)
    with pytest.raises(LaunchError, match="unknown config key"):
        launch("lora_lab.distributed.jobs:train_lora", {"bogus": 1}, nproc=1, out_dir=tmp_path, timeout=120)
    assert (tmp_path / "rank0.json").is_file()


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank in this process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tiny_with_lora():
    model = lora_lab.load_model("random:tiny-qwen2")
    torch.manual_seed(1)
    return lora_lab.add_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"))


def test_sharded_steps_on_one_rank_equal_the_plain_steps(one_rank_group, tmp_path):
    batch = lora_lab.text_batch(lora_lab.load_tokenizer("random:tiny-qwen2"))
    plain = sharded_train_steps(_tiny_with_lora(), batch, steps=2)
    model = shard_model(_tiny_with_lora(), activation_checkpointing=True)
    assert sharded_train_steps(model, batch, steps=2) == plain
    with pytest.raises(ValueError, match="already sharded"):
        shard_model(model)
    # adapters: saved from the sharded model, refused over an existing one, loaded back exactly
    save_sharded_adapter(model, tmp_path / "adapter")
    with pytest.raises(lora_lab.AdapterExistsError):
        save_sharded_adapter(model, tmp_path / "adapter")
    reloaded = lora_lab.load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path / "adapter")
    assert torch.equal(lora_lab.model_logits(reloaded, batch), lora_lab.model_logits(model, batch))
    fresh = shard_model(_tiny_with_lora())
    load_sharded_adapter(fresh, tmp_path / "adapter")
    assert torch.equal(lora_lab.model_logits(fresh, batch), lora_lab.model_logits(model, batch))


def test_shard_model_refuses_what_fsdp_cannot_shard_right(one_rank_group):
    from lora_lab.kernels import UnsupportedLoRAError, patch_model, unpatch_model

    with pytest.raises(ValueError, match="no trainable LoRA factor"):
        shard_model(lora_lab.load_model("random:tiny-qwen2"))
    model = _tiny_with_lora()
    patch_model(model)  # q/k/v and gate/up in shared-input groups
    with pytest.raises(ValueError, match="shared-input group"):
        shard_model(model)
    unpatch_model(model)
    shard_model(model)
    with pytest.raises(UnsupportedLoRAError, match="fuse_shared_inputs=False"):
        patch_model(model)
    assert patch_model(model, fuse_shared_inputs=False)["lora_layers"] == 4


def test_shard_model_needs_a_process_group():
    with pytest.raises(RuntimeError, match="not initialised"):
        shard_model(_tiny_with_lora())


def test_launch_command_runs_a_job_and_prints_each_ranks_metrics(tmp_path, capsys):
    import json

    from lora_lab.lab.cli import main

    assert main(["launch", "lora_lab.distributed.jobs:train_lora", "--nproc", "1", "--out", str(tmp_path),
                 "--config", '{"shard": false, "steps": 1}']) == 0
    [rank0] = json.loads(capsys.readouterr().out)
    assert rank0["status"] == "completed" and len(rank0["metrics"]["losses"]) == 1
    assert main(["launch", "lora_lab.distributed.jobs:train_lora", "--config", "[1]"]) == 2
    assert "JSON object" in capsys.readouterr().err


def test_launch_stops_every_process_of_a_job_that_runs_too_long(tmp_path):
    (tmp_path / "slow_job.py").write_text("import time\n\ndef run(config):\n    time.sleep(600)\n")
    with pytest.raises(LaunchError, match="timed out"):
        launch("slow_job:run", nproc=2, out_dir=tmp_path / "out", timeout=8,
               env={"PYTHONPATH": f"{tmp_path}:{lora_lab.__path__[0].rsplit('/', 1)[0]}"})


def test_a_sharded_dora_adapter_is_refused_before_anything_is_gathered(tmp_path):
    import lora_lab
    from lora_lab.adapters import AdapterError
    from lora_lab.distributed.adapters import save_sharded_adapter

    model = lora_lab.load_model("random:tiny-qwen2")
    lora_lab.add_lora(model, r=2, alpha=4, targets=("q_proj",), use_dora=True)
    with pytest.raises(AdapterError, match="sharded DoRA adapter is not supported"):
        save_sharded_adapter(model, tmp_path / "a")


def test_random_fill_of_a_meta_build_gives_each_kind_its_values_and_is_seeded():
    from lora_lab.distributed import RandomFill, materialize_random

    cfg = {**TRAIN_LORA_DEFAULTS, "meta_init": True, "init": "random", "targets": ["q_proj", "v_proj"]}
    model, fill = build_lora_model(cfg)
    assert isinstance(fill, RandomFill) and all(p.device.type == "meta" for p in model.parameters())
    fill.materialize(model, "cpu")
    again = fill.materialize(build_lora_model(cfg)[0], "cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    named = dict(model.named_parameters())
    q = model.model.layers[0].self_attn.q_proj
    assert torch.count_nonzero(q.lora_B) == 0
    bound = 1 / q.in_features ** 0.5
    assert q.lora_A.abs().max() <= bound and q.lora_A.std() > bound / 3
    assert torch.all(named["model.norm.weight"] == 1) and torch.all(q.base.bias == 0)
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025  # initializer_range 0.02
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    with pytest.raises(ValueError, match="real parameters"):
        materialize_random(model, "cpu")
    with pytest.raises(ValueError, match="init must be"):
        build_lora_model({**cfg, "init": "zeros"})
    with pytest.raises(ValueError, match="materialize_random"):
        with MetaInit(record=False) as meta:
            layer = nn.Linear(2, 2)
        meta.plan(layer)


def test_the_distributed_modules_import_each_other_without_a_circle():
    """adapters -> training -> sharding -> adapters was a circle (closed by an import inside shard_model); every
    import between lora_lab.distributed's modules, at module level or inside a function, now runs one way."""
    import ast
    from pathlib import Path

    import lora_lab.distributed

    package = Path(lora_lab.distributed.__file__).parent
    graph = {}
    for path in package.glob("*.py"):
        if path.stem == "__init__":
            continue
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lora_lab.distributed."):
                imported.add(node.module.rsplit(".", 1)[-1])
        graph[path.stem] = imported

    def circle_from(start, path=()):
        if start in path:
            return path[path.index(start):] + (start,)
        for nxt in sorted(graph.get(start, ())):
            found = circle_from(nxt, path + (start,))
            if found:
                return found
        return None

    circles = [c for c in (circle_from(m) for m in sorted(graph)) if c]
    assert not circles, " -> ".join(circles[0])


def test_load_sharded_adapter_restores_lora_fa(tmp_path):
    """One process, no process group: the loader's LoRA-FA step (A frozen, as save_adapter recorded it)."""
    import lora_lab

    saved = lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2"), r=2, alpha=4, lora_fa=True)
    lora_lab.save_adapter(saved, tmp_path)
    model = lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2"), r=2, alpha=4)
    assert all(layer.lora_A.requires_grad for _, layer in lora_lab.lora_layers(model))
    load_sharded_adapter(model, tmp_path)
    assert all(not layer.lora_A.requires_grad and layer.lora_B.requires_grad and layer.lora_fa
               for _, layer in lora_lab.lora_layers(model))
