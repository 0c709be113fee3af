"""Two processes with gloo on random:tiny-qwen2 in fp32 (notebook 08's CPU check): FSDP2-sharded LoRA training gives
the one-process losses (same global batch) within 1e-6, and the adapter saved from the two processes reloads on one
process, in lora_lab and in PEFT, with the two-process model's logits bit for bit."""
import pytest
import torch

import lora_lab
from lora_lab.distributed import launch
from lora_lab.distributed.jobs import train_lora

JOB = "lora_lab.distributed.jobs:train_lora"
TOLERANCE = 1e-6


def _losses(results):
    per_rank = [r["metrics"]["losses"] for r in results]
    assert all(losses == per_rank[0] for losses in per_rank)  # every rank reports the global loss
    return per_rank[0]


def _close(got, want):
    assert len(got) == len(want)
    assert max(abs(g - w) for g, w in zip(got, want)) <= TOLERANCE, (got, want)


SGD = {"optimizer": "sgd", "lr": 1.0}  # plain SGD: a gradient scaled wrong (a bad average over ranks) shows


@pytest.fixture(scope="module")
def reference():
    """The one-process runs of the same job (no process group): AdamW with lora_lab's layer, SGD with both."""
    return {"adamw": train_lora({"shard": False})["losses"],
            "sgd": train_lora({"shard": False, **SGD})["losses"],
            "sgd-peft": train_lora({"shard": False, "peft": True, **SGD})["losses"]}


def test_two_processes_meta_built_give_the_one_process_losses_and_a_reloadable_adapter(reference, tmp_path):
    adapter, logits_file = tmp_path / "adapter", tmp_path / "logits.pt"
    results = launch(JOB, {"meta_init": True, "save_adapter": str(adapter), "save_logits": str(logits_file)},
                     nproc=2, out_dir=tmp_path / "run", timeout=300)
    assert [r["world_size"] for r in results] == [2, 2]
    _close(_losses(results), reference["adamw"])
    sharded_logits = torch.load(logits_file)
    batch = lora_lab.text_batch(lora_lab.load_tokenizer("random:tiny-qwen2"))
    ours = lora_lab.load_adapter(lora_lab.load_model("random:tiny-qwen2"), adapter)
    assert torch.equal(lora_lab.model_logits(ours, batch), sharded_logits)
    from peft import PeftModel

    theirs = PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(adapter))
    assert torch.equal(lora_lab.model_logits(theirs, batch), sharded_logits)


def test_two_processes_peft_checkpointed_kept_unsharded_standard_loss(reference, tmp_path):
    results = launch(JOB, {"peft": True, "activation_checkpointing": True, "reshard_after_forward": False,
                           "loss": "standard", **SGD}, nproc=2, out_dir=tmp_path, timeout=300)
    _close(_losses(results), reference["sgd-peft"])


def test_two_processes_with_the_fused_lora_kernels_and_fused_loss(reference, tmp_path):
    """The fused LoRA Function reads the weights inside its FSDP unit's forward, the fused loss reads the lm_head
    inside the root's loss method (Triton's interpreter on CPU)."""
    results = launch(JOB, {"patch_kernels": True, "loss": "fused", **SGD}, nproc=2, out_dir=tmp_path, timeout=300,
                     env={"TRITON_INTERPRET": "1"})
    assert results[0]["metrics"]["patched"]["lora_layers"] == 4
    _close(_losses(results), reference["sgd"])


def test_two_processes_bf16_compute_fp32_reduce(reference, tmp_path):
    """FSDP's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) runs on gloo: close to fp32, not equal."""
    results = launch(JOB, {"param_dtype": "bf16"}, nproc=2, out_dir=tmp_path, timeout=300)
    losses = _losses(results)
    assert losses != reference["adamw"]
    assert max(abs(g - w) for g, w in zip(losses, reference["adamw"])) < 1e-2


def test_step_throughput_job_on_two_processes(tmp_path):
    from lora_lab.distributed.jobs import step_throughput

    variants = {"plain": {"patch_kernels": False, "loss": "standard"},
                "chunked": {"patch_kernels": False, "loss": "chunked"}}
    results = launch("lora_lab.distributed.jobs:step_throughput",
                     {"steps": 1, "seq": 32, "variants": variants, "rounds": 2}, nproc=2,
                     out_dir=tmp_path / "run", timeout=300)
    metrics = [r["metrics"] for r in results]
    for name in variants:
        mine = [m["variants"][name] for m in metrics]
        assert mine[0]["losses"] == mine[1]["losses"] and len(mine[0]["losses"]) == 4  # 2 rounds x (1 + 1)
        assert len(mine[0]["round_ms"]) == 2 and min(mine[0]["tokens_per_s"]) > 0
    assert metrics[0]["tokens_per_step"] == 2 * 32 and metrics[0]["world_size"] == 2
    one = step_throughput({"shard": False, "steps": 1, "seq": 32, "activation_checkpointing": False})
    assert one["world_size"] == 1 and one["trainable_parameters"] == metrics[0]["trainable_parameters"]
    with pytest.raises(ValueError, match="unknown config key"):
        step_throughput({"sequence": 32})
    with pytest.raises(ValueError, match="exactly patch_kernels and loss"):
        step_throughput({"variants": {"x": {"loss": "fused"}}})
