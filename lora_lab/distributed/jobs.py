"""Jobs for :func:`lora_lab.distributed.launch`: functions of one config dict that return each rank's metrics.

:func:`train_lora` builds a model with LoRA (lora_lab's layer or PEFT's), shards it with FSDP2 (or not: the
one-process reference), trains a few steps on the sample sentences and returns the losses; optionally it saves
the adapter and rank 0's logits after training. Every setting is a key of :data:`TRAIN_LORA_DEFAULTS`.

:func:`step_throughput` times training steps on random token batches (tokens/s, step times, peak memory per rank):
the measurement of a sharded LoRA step at a real shape. Its settings are :data:`STEP_THROUGHPUT_DEFAULTS`.
"""
from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["TRAIN_LORA_DEFAULTS", "STEP_THROUGHPUT_DEFAULTS", "build_lora_model", "train_lora", "step_throughput"]

TRAIN_LORA_DEFAULTS: dict[str, Any] = {
    "model": "random:tiny-qwen2",   # lora_lab.load_model spec
    "seed": 0,                      # the base model's init (load_model's seed)
    "lora_seed": 1,                 # torch.manual_seed before LoRA is added (its A factors)
    "peft": False,                  # True: peft.get_peft_model instead of lora_lab.add_lora
    "r": 4,
    "alpha": 8,
    "targets": ["q_proj", "v_proj"],
    "texts": None,                  # the global batch; None: lora_lab.SAMPLE_SENTENCES
    "steps": 3,
    "lr": 1e-3,
    "optimizer": "adamw",           # adamw | sgd (plain SGD shows a gradient scaled wrong; AdamW hardly does)
    "loss": "chunked",              # standard | chunked | fused
    "shard": True,                  # False: plain model on one process (the reference)
    "meta_init": False,             # build on meta, materialise shard by shard (random: models)
    "init": "replay",               # meta_init: "replay" the CPU build's values, or "random" fill on the device
    "param_dtype": None,            # FSDP MixedPrecisionPolicy compute dtype (None: the parameters', fp32)
    "reshard_after_forward": True,
    "activation_checkpointing": False,
    "patch_kernels": False,         # lora_lab.kernels.patch_model on the sharded model (fuse_shared_inputs off)
    "save_adapter": None,           # directory to save the trained adapter into (rank 0 writes)
    "save_logits": None,            # file for rank 0's fp32 logits on the batch after training (torch.save)
}


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _add_lora(model, cfg):
    import lora_lab

    torch.manual_seed(cfg["lora_seed"])
    if cfg["peft"]:
        return lora_lab.peft_lora_model(model, r=cfg["r"], alpha=cfg["alpha"], targets=tuple(cfg["targets"]))
    return lora_lab.add_lora(model, r=cfg["r"], alpha=cfg["alpha"], targets=tuple(cfg["targets"]))


def build_lora_model(cfg: dict[str, Any]):
    """(model with LoRA, init plan or None): built normally on the CPU, or on meta with a plan to fill it — the
    CPU build's exact values (``init="replay"``) or a seeded fill on the device (``init="random"``: seconds
    instead of minutes at 72B, for throughput)."""
    import lora_lab

    dtype = lora_lab.models._as_dtype(cfg.get("dtype") or torch.float32)  # the parameters' storage dtype
    if not cfg["meta_init"]:
        return _add_lora(lora_lab.load_model(cfg["model"], seed=cfg["seed"], dtype=dtype), cfg), None
    from transformers import AutoModelForCausalLM

    from lora_lab.distributed.meta_init import MetaInit, RandomFill
    from lora_lab.models import RANDOM_PREFIX, model_config

    if not cfg["model"].startswith(RANDOM_PREFIX):
        raise ValueError(f"meta_init builds random: models only, got {cfg['model']!r}")
    init = cfg.get("init", "replay")
    if init not in ("replay", "random"):
        raise ValueError(f"init must be 'replay' or 'random', got {init!r}")
    with MetaInit(record=init == "replay") as meta:
        # the same calls as lora_lab.load_model(spec, seed=...) makes, then the LoRA init
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg["seed"])
            model = AutoModelForCausalLM.from_config(model_config(cfg["model"]), dtype=dtype,
                                                     attn_implementation=cfg.get("attn_implementation", "eager"))
        model = _add_lora(model.eval(), cfg)
    if init == "random":
        return model, RandomFill(seed=cfg["seed"], std=model_config(cfg["model"]).initializer_range)
    return model, meta.plan(model)


def _job_config(config: dict[str, Any], defaults: dict[str, Any], job: str) -> dict[str, Any]:
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError(f"{job}: unknown config key(s) {unknown}; known: {sorted(defaults)}")
    return {**defaults, **config}


def _placed_model(cfg: dict[str, Any], world: int, device: torch.device):
    """The job's LoRA model on ``device``: sharded with FSDP2 (``cfg["shard"]``; a meta build materialised shard by
    shard) or, on one process only, whole; non-reentrant activation checkpointing when ``cfg`` asks for it."""
    import lora_lab
    from lora_lab.distributed.sharding import shard_model, unwrap_peft

    model, plan = build_lora_model(cfg)
    if not cfg["shard"]:
        if world > 1:
            raise ValueError("shard=False is the one-process reference: launch it with nproc=1")
        if plan is not None:
            plan.materialize(model, device)
        model = model.to(device)
        if cfg["activation_checkpointing"]:
            unwrap_peft(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = lora_lab.models._as_dtype(cfg["param_dtype"]) if cfg["param_dtype"] else None
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    if plan is None:
        model = model.to(device)
    shard_model(model, mp_policy=policy, reshard_after_forward=cfg["reshard_after_forward"],
                activation_checkpointing=cfg["activation_checkpointing"])
    if plan is not None:
        plan.materialize(model, device)
    return model


def train_lora(config: dict[str, Any]) -> dict[str, Any]:
    """Train LoRA on the sample sentences, sharded over the job's ranks (or not); returns the metrics."""
    import lora_lab
    from lora_lab.distributed.adapters import save_sharded_adapter
    from lora_lab.distributed.process_group import rank_and_world
    from lora_lab.distributed.training import sharded_train_steps

    cfg = _job_config(config, TRAIN_LORA_DEFAULTS, "train_lora")
    rank, world = rank_and_world()
    device = _device()
    started = time.monotonic()
    model = _placed_model(cfg, world, device)
    patched = None
    if cfg["patch_kernels"]:
        from lora_lab.kernels import patch_model

        patched = patch_model(model, fuse_shared_inputs=False)
    built = time.monotonic() - started
    batch = lora_lab.text_batch(lora_lab.load_tokenizer(cfg["model"]), texts=cfg["texts"] or lora_lab.SAMPLE_SENTENCES,
                                device=device)
    losses = sharded_train_steps(model, batch, steps=cfg["steps"], lr=cfg["lr"], loss=cfg["loss"],
                                 optimizer=cfg["optimizer"])
    if cfg["save_adapter"]:
        save_sharded_adapter(model, cfg["save_adapter"], overwrite=True)
    if cfg["save_logits"]:
        logits = lora_lab.model_logits(model, batch)
        if rank == 0:
            torch.save(logits.cpu(), cfg["save_logits"])
    return {"rank": rank, "world_size": world, "losses": losses, "build_seconds": round(built, 3),
            "seconds": round(time.monotonic() - started, 3), "device": str(device), "patched": patched,
            "trainable_parameters": lora_lab.count_parameters(model).trainable}


STEP_THROUGHPUT_DEFAULTS: dict[str, Any] = {
    "model": "random:tiny-qwen2",
    "seed": 0,
    "lora_seed": 1,
    "peft": False,                  # PEFT's LoRA (its default fp32 adapters) instead of lora_lab's
    "r": 16,
    "alpha": 32,
    "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "dtype": "float32",             # storage dtype of the built model ("bfloat16" on GPUs)
    "param_dtype": None,            # FSDP MixedPrecisionPolicy compute dtype (reduce in fp32 when set)
    "attn_implementation": "sdpa",
    "meta_init": True,
    "init": "random",               # "random": seeded fill on the device (seconds); "replay": the CPU build's values
    "shard": True,
    "reshard_after_forward": True,
    "activation_checkpointing": True,
    # what is timed on the one built model, side by side: name -> {"patch_kernels": bool, "loss": str};
    # patch_kernels: lora_lab.kernels.patch_model (fuse_shared_inputs off), undone for the variants without it
    "variants": {"plain": {"patch_kernels": False, "loss": "standard"}},
    "rounds": 1,                    # side-by-side rounds (variant order rotated); each: warmup + steps
    "seq": 64,
    "batch_per_rank": 1,
    "warmup": 1,
    "steps": 3,
    "lr": 1e-4,
}


def step_throughput(config: dict[str, Any]) -> dict[str, Any]:
    """Time LoRA training steps (AdamW) on random token batches, sharded over the job's ranks (or one process with
    ``shard=False``), for each of ``variants`` on the same model, ``rounds`` times side by side. Returns per rank
    and variant: the median step (ms) of each round, global tokens/s per round, the peak memory (CUDA) over its
    rounds and the losses; plus the memory after the build and the trainable parameter count."""
    import lora_lab
    from lora_lab.distributed.process_group import rank_and_world
    from lora_lab.distributed.sharding import unwrap_peft
    from lora_lab.distributed.training import train_step
    from lora_lab.kernels import patch_model, unpatch_model

    cfg = _job_config(config, STEP_THROUGHPUT_DEFAULTS, "step_throughput")
    for name, spec in cfg["variants"].items():
        if set(spec) != {"patch_kernels", "loss"}:
            raise ValueError(f"variant {name!r} must give exactly patch_kernels and loss, got {sorted(spec)}")
    rank, world = rank_and_world()
    device = _device()
    cuda = device.type == "cuda"
    started = time.monotonic()
    model = _placed_model(cfg, world, device)
    built = time.monotonic() - started
    if cuda:
        torch.cuda.synchronize(device)
    after_build = torch.cuda.memory_allocated(device) if cuda else None
    vocab = unwrap_peft(model).config.vocab_size
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    ids = torch.randint(0, vocab, (world * cfg["batch_per_rank"], cfg["seq"]), generator=gen).to(device)
    batch = {"input_ids": ids}  # every rank draws the same global batch and trains on its rows
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg["lr"])
    model.train()
    names = list(cfg["variants"])
    out = {name: {"round_ms": [], "tokens_per_s": [], "losses": [], "peak_bytes": 0} for name in names}
    for rnd in range(cfg["rounds"]):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            spec = cfg["variants"][name]
            unpatch_model(model)
            if spec["patch_kernels"]:
                patch_model(model, fuse_shared_inputs=False)
            times = []
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            for i in range(cfg["warmup"] + cfg["steps"]):
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                out[name]["losses"].append(train_step(model, optimizer, batch, spec["loss"]))
                if cuda:
                    torch.cuda.synchronize(device)
                if i >= cfg["warmup"]:
                    times.append((time.perf_counter() - t0) * 1e3)
            median = sorted(times)[len(times) // 2]
            out[name]["round_ms"].append(median)
            out[name]["tokens_per_s"].append(ids.numel() / (median / 1e3))
            if cuda:
                out[name]["peak_bytes"] = max(out[name]["peak_bytes"], torch.cuda.max_memory_allocated(device))
    unpatch_model(model)
    return {"rank": rank, "world_size": world, "variants": out, "tokens_per_step": ids.numel(),
            "after_build_bytes": after_build, "build_seconds": round(built, 3),
            "trainable_parameters": lora_lab.count_parameters(model).trainable, "device": str(device)}
