"""Two processes with gloo on random:tiny-qwen2 in fp32 (notebook 08's CPU check): FSDP2-sharded LoRA training gives
the one-process losses (same global batch) within 1e-6, and the adapter saved from the two processes reloads on one
process, in lora_lab and in PEFT, with the two-process model's logits bit for bit."""
import os
from pathlib import Path

import pytest
import torch

import lora_lab
from lora_lab.distributed import launch
from lora_lab.distributed.jobs import train_lora

JOB = "lora_lab.distributed.jobs:train_lora"
TOLERANCE = 1e-6
ROOT = Path(__file__).resolve().parents[2]


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


THROUGHPUT_VARIANTS = {"plain": {"patch_kernels": False, "loss": "standard"},
                       "chunked": {"patch_kernels": False, "loss": "chunked"}}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every two-process job of this file, run one after another in one launch (tests/distributed/jobs_in_order.py:
    one torchrun start and one import per rank for all of them); ``two_ranks(label)`` is that job's result per rank,
    rank 0 first (its error, when it raised, fails the test that asks for it). Triton's interpreter is on for every
    job (the fused kernels' job needs it on a CPU; the others run no Triton kernel)."""
    folder = tmp_path_factory.mktemp("two_ranks")
    jobs = [["meta", JOB, {"meta_init": True, "save_adapter": str(folder / "adapter"),
                           "save_logits": str(folder / "logits.pt")}],
            ["peft", JOB, {"peft": True, "activation_checkpointing": True, "reshard_after_forward": False,
                           "loss": "standard", **SGD}],
            ["bf16", JOB, {"param_dtype": "bf16"}],
            ["throughput", "lora_lab.distributed.jobs:step_throughput",
             {"steps": 1, "seq": 32, "variants": THROUGHPUT_VARIANTS, "rounds": 2}],
            ["fused", JOB, {"patch_kernels": True, "loss": "fused", **SGD}]]
    path = os.pathsep.join(p for p in (str(ROOT), str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    results = launch("jobs_in_order:run_in_order", {"jobs": jobs}, nproc=2, out_dir=folder / "run", timeout=600,
                     env={"TRITON_INTERPRET": "1", "PYTHONPATH": path})
    assert [r["world_size"] for r in results] == [2, 2]

    def job(label):
        per_rank = [{"world_size": r["world_size"], "metrics": r["metrics"][label]} for r in results]
        for r in per_rank:
            assert "error" not in r["metrics"], f"the {label} job failed:\n{r['metrics']['error']}"
        return per_rank

    job.folder = folder
    return job


def test_two_processes_meta_built_give_the_one_process_losses_and_a_reloadable_adapter(reference, two_ranks):
    adapter, logits_file = two_ranks.folder / "adapter", two_ranks.folder / "logits.pt"
    results = two_ranks("meta")
    assert [r["world_size"] for r in results] == [2, 2]
    _close(_losses(results), reference["adamw"])
    sharded_logits = torch.load(logits_file)
    batch = lora_lab.text_batch(lora_lab.load_tokenizer("random:tiny-qwen2"))
    ours = lora_lab.load_adapter(lora_lab.load_model("random:tiny-qwen2"), adapter)
    assert torch.equal(lora_lab.model_logits(ours, batch), sharded_logits)
    from peft import PeftModel

    theirs = PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(adapter))
    assert torch.equal(lora_lab.model_logits(theirs, batch), sharded_logits)


def test_two_processes_peft_checkpointed_kept_unsharded_standard_loss(reference, two_ranks):
    results = two_ranks("peft")
    _close(_losses(results), reference["sgd-peft"])


def test_two_processes_with_the_fused_lora_kernels_and_fused_loss(reference, two_ranks):
    """The fused LoRA Function reads the weights inside its FSDP unit's forward, the fused loss reads the lm_head
    inside the root's loss method (Triton's interpreter on CPU)."""
    results = two_ranks("fused")
    assert results[0]["metrics"]["patched"]["lora_layers"] == 4
    _close(_losses(results), reference["sgd"])


def test_two_processes_bf16_compute_fp32_reduce(reference, two_ranks):
    """FSDP's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) runs on gloo: close to fp32, not equal."""
    results = two_ranks("bf16")
    losses = _losses(results)
    assert losses != reference["adamw"]
    assert max(abs(g - w) for g, w in zip(losses, reference["adamw"])) < 1e-2


def test_step_throughput_job_on_two_processes(two_ranks):
    from lora_lab.distributed.jobs import step_throughput

    variants = THROUGHPUT_VARIANTS
    results = two_ranks("throughput")
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
