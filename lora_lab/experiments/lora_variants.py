"""Notebook 09's experiments: LoRA variants fine-tuning a real model on a task it fails, with a held-out evaluation.

* :func:`digit_code_task`         — the digit code ("Code: 3 8 1 5 =>" answered " 6 2 9 4": reversed, each plus one),
  disjoint train / validation / test codes, loss and accuracy on the answer digits only
* :func:`evaluate`                — teacher-forced answer-digit loss and accuracy of a model on one split
* :func:`train_to_target`         — AdamW until the stopping rule (validation accuracy at a target) or a step limit
* :func:`finetune_variant`        — one variant from one seed, trained and scored on the test codes
* :func:`finetune_runs`           — many (variant, seed) runs, in this process or spread over worker processes
* :func:`swallowed_update_shares` — the share of optimizer updates that round to no change in the adapter's dtype
* :func:`step_cost_session`       — one session (process) of the side-by-side step-cost loop
* :func:`step_cost_decision`      — whether that loop fits the GPU memory cap; a skip is kept by metric name
* :func:`interop_max_abs_diff`    — an adapter moved both ways between lora_lab and PEFT
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["VARIANTS", "digit_code_task", "evaluate", "train_to_target", "censored_steps", "finetune_variant",
           "finetune_runs", "swallowed_update_shares", "step_cost_session", "step_cost_bytes", "step_cost_decision",
           "interop_max_abs_diff"]


# ----------------------------------------------------------------------------------------------------------------
# The variants
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


# ----------------------------------------------------------------------------------------------------------------
# A real fine-tuning task with a held-out evaluation: the digit code
# ----------------------------------------------------------------------------------------------------------------
# "Code: 3 8 1 5 => 6 2 9 4": the answer is the digits reversed, each plus one (mod 10). A pretrained LM has never
# seen the rule, so its answer tokens are near chance; a LoRA learns it from a few hundred examples. Train,
# validation (for the stopping rule) and test (the verdicts) use disjoint digit strings.

def _encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens: a transformers tokenizer or lora_lab's ByteTokenizer."""
    from lora_lab.models import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text, add_bos=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def code_answer(digits: Sequence[int]) -> list[int]:
    """The rule: digits reversed, each plus one modulo 10."""
    return [(d + 1) % 10 for d in reversed(digits)]


def digit_code_task(tokenizer, n_digits: int, sizes: dict[str, int], seed: int = 0) -> dict[str, dict]:
    """``{split: {"input_ids", "labels", "answer_mask"}}`` for each split in ``sizes`` ({"train": 512, ...}):
    distinct digit strings drawn without replacement across splits, so no test string was trained on. Every
    example has the same length (the prompt ``"Code: d d d =>"`` and the answer ``" e e e"``, whose tokens are
    checked to be a suffix); ``answer_mask`` marks the answer's digit tokens (not the spaces between them, which
    any model predicts) and ``labels`` are -100 elsewhere, so loss and accuracy are on the answer digits only."""
    import random

    if n_digits < 1:
        raise ValueError(f"n_digits must be >= 1, got {n_digits}")
    total = sum(sizes.values())
    if any(v < 1 for v in sizes.values()) or total > 10**n_digits:
        raise ValueError(f"need positive split sizes summing to at most 10**{n_digits}, got {sizes}")
    digit_ids = set()
    for d in range(10):
        ids = _encode(tokenizer, str(d))
        if len(ids) != 1:
            raise ValueError(f"the tokenizer splits the digit {d} into {len(ids)} tokens; the task scores one token "
                             "per digit")
        digit_ids.add(ids[0])
    rng = random.Random(seed)
    strings = rng.sample(range(10**n_digits), total)
    out, start = {}, 0
    for split, size in sizes.items():
        rows, masks = [], []
        for value in strings[start:start + size]:
            digits = [int(c) for c in str(value).zfill(n_digits)]
            prompt = _encode(tokenizer, "Code: " + " ".join(map(str, digits)) + " =>")
            full = _encode(tokenizer, "Code: " + " ".join(map(str, digits)) + " =>"
                           + "".join(f" {d}" for d in code_answer(digits)))
            if full[:len(prompt)] != prompt:
                raise ValueError("the tokenizer does not keep the prompt's tokens as a prefix of the example")
            answer = [int(t in digit_ids) for t in full[len(prompt):]]  # the digits, not the spaces between them
            if sum(answer) != n_digits:
                raise ValueError(f"the answer of {digits} does not tokenize to {n_digits} digit tokens")
            rows.append(full)
            masks.append([0] * len(prompt) + answer)
        if len({len(r) for r in rows}) != 1:
            raise ValueError("examples tokenize to different lengths")
        ids = torch.tensor(rows)
        mask = torch.tensor(masks, dtype=torch.bool)
        out[split] = {"input_ids": ids, "labels": ids.masked_fill(~mask, -100), "answer_mask": mask}
        start += size
    return out


@torch.no_grad()
def evaluate(model: nn.Module, split: dict, batch_size: int = 256) -> dict:
    """Teacher-forced answer-token loss (nats per answer token) and accuracy (argmax = the right token) on
    ``split``, on the model's device."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, len(split["input_ids"]), batch_size):
        ids = split["input_ids"][i:i + batch_size].to(device)
        labels = split["labels"][i:i + batch_size].to(device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        target = labels[:, 1:]
        keep = target != -100
        loss_sum += torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum").item()
        correct += (logits.argmax(-1)[keep] == target[keep]).sum().item()
        count += int(keep.sum())
    model.train(was_training)
    return {"loss": loss_sum / count, "accuracy": correct / count}


def train_to_target(model: nn.Module, optimizer: torch.optim.Optimizer, task: dict, batch_size: int,
                    max_steps: int, eval_every: int, target_accuracy: float, loss_floor: float | None = None,
                    seed: int = 0) -> dict:
    """AdamW steps on random training batches until the **stopping rule**: every ``eval_every`` steps the validation
    split is scored (one batched, teacher-forced pass) and the run stops at the first check whose answer accuracy
    is at least ``target_accuracy`` (or whose answer loss is at most ``loss_floor``, if given), else at
    ``max_steps``. Returns the validation curve, the steps run, ``reached`` (the target, not the limit, stopped it),
    ``steps_to_target`` (the step of that check; None if never reached) and the final model's test loss and
    accuracy. A non-finite training loss ends the run unreached."""
    if eval_every < 1 or max_steps < eval_every:
        raise ValueError(f"need 1 <= eval_every <= max_steps, got eval_every={eval_every}, max_steps={max_steps}")
    if not 0.0 < target_accuracy <= 1.0:
        raise ValueError(f"target_accuracy must be in (0, 1], got {target_accuracy}")
    if loss_floor is not None and not loss_floor > 0:
        raise ValueError(f"loss_floor must be positive or None, got {loss_floor}")
    device = next(model.parameters()).device
    train = task["train"]
    gen = torch.Generator().manual_seed(seed)
    curve, reached, step = [], False, 0
    model.train()
    while step < max_steps:
        rows = torch.randint(0, len(train["input_ids"]), (batch_size,), generator=gen)
        ids, labels = train["input_ids"][rows].to(device), train["labels"][rows].to(device)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % eval_every == 0:
            if not torch.isfinite(loss):
                break
            val = evaluate(model, task["validation"])
            curve.append({"step": step, "train_loss": float(loss.detach()), **{f"val_{k}": v for k, v in val.items()}})
            if val["accuracy"] >= target_accuracy or (loss_floor is not None and val["loss"] <= loss_floor):
                reached = True
                break
    test = evaluate(model, task["test"])
    return {"curve": curve, "steps": step, "reached": reached, "steps_to_target": step if reached else None,
            "test_loss": test["loss"], "test_accuracy": test["accuracy"]}


def censored_steps(run: dict, max_steps: int, eval_every: int) -> int:
    """Steps to the target of a run, a run that never reached it counted as ``max_steps + eval_every``: a lower
    bound on its true value, finite so that ratios between runs stay defined."""
    return run["steps_to_target"] if run["reached"] else max_steps + eval_every


def attach_variant(model: nn.Module, variant: str, r: int, alpha: float, lr: float, targets: Sequence[str],
                   vera_r: int, loraplus_ratio: float = 16.0) -> torch.optim.Optimizer:
    """Put ``variant``'s adapter on ``model`` (in place) and return its optimizer (AdamW at ``lr``; LoRA+ with B at
    ``ratio`` times; VeRA at ``VERA_LR_FACTOR`` times, its scaling vectors being all it trains)."""
    from lora_lab.layer import add_lora

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    kwargs, kind = VARIANTS[variant]
    if kind == "vera":
        from lora_lab.vera import add_vera

        add_vera(model, r=vera_r, targets=tuple(targets))
        lr = lr * VERA_LR_FACTOR
    else:
        add_lora(model, r=r, alpha=alpha, targets=tuple(targets), **kwargs)
    if kind == "loraplus":
        from lora_lab.variants import loraplus_optimizer

        return loraplus_optimizer(model, lr=lr, ratio=loraplus_ratio)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def finetune_variant(base: nn.Module, variant: str, task: dict, seed: int, *, r: int, alpha: float, lr: float,
                     targets: Sequence[str], vera_r: int, batch_size: int, max_steps: int, eval_every: int,
                     target_accuracy: float, loss_floor: float | None = None) -> dict:
    """One variant, one seed: a fresh copy of ``base`` with the adapter (initialised from ``seed``), trained by
    :func:`train_to_target` (batches drawn from ``seed`` too). Returns its result with the trainable count."""
    from lora_lab.layer import count_parameters

    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    opt = attach_variant(model, variant, r=r, alpha=alpha, lr=lr, targets=targets, vera_r=vera_r)
    res = train_to_target(model, opt, task, batch_size, max_steps, eval_every, target_accuracy,
                          loss_floor=loss_floor, seed=seed)
    res.update(variant=variant, seed=seed, trainable_params=count_parameters(model).trainable)
    del model, opt
    return res


RUN_COST = {"vera": 3, "lora_fa": 2}  # rough steps to the target relative to LoRA's: the longest runs start first
_worker: dict = {}


def _worker_start(spec: str, dtype: str, device: str, task: dict, cap_gib: float | None = None) -> None:
    from lora_lab.memory.budget import apply_memory_cap
    from lora_lab.models import load_model

    if cap_gib is not None:  # this worker's share of the run's cap, before its first CUDA allocation
        apply_memory_cap(cap_gib)
    torch.set_num_threads(1)
    _worker["task"] = {split: {k: torch.tensor(v[0], dtype=getattr(torch, v[1])) for k, v in part.items()}
                       for split, part in task.items()}
    _worker["base"] = load_model(spec, dtype=dtype, device=device, attn_implementation="sdpa")


def _worker_run(variant: str, seed: int, kwargs: dict) -> dict:
    return finetune_variant(_worker["base"], variant, _worker["task"], seed, **kwargs)


def finetune_runs(base: nn.Module, runs: Sequence[tuple[str, int]], task: dict, *, workers: int = 1,
                  spec: str | None = None, dtype: str = "fp32", **kwargs) -> dict:
    """``{(variant, seed): finetune_variant(...)}`` for every pair of ``runs``. ``workers`` > 1 spreads them over
    that many worker processes (each loads ``spec`` in ``dtype`` on ``base``'s device once; the longest variants
    start first): a run's result does not depend on where it ran, and a small model's step is bound by the host's
    kernel launches, which separate processes issue side by side. Under a memory cap the workers share what this
    process leaves of it (:func:`lora_lab.memory.budget.worker_cap_gib`). If the worker processes fail (out of memory
    under their share, too), a warning says why and the runs are made in this process."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    runs = list(runs)
    if workers == 1 or len(runs) < 2:
        return {(v, s): finetune_variant(base, v, task, s, **kwargs) for v, s in runs}
    if spec is None:
        raise ValueError("finetune_runs with workers > 1 needs spec: the model each worker process loads")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from lora_lab.memory.budget import worker_cap_gib

    device = str(next(base.parameters()).device)
    plain = {split: {k: (t.tolist(), str(t.dtype).removeprefix("torch.")) for k, t in part.items()}
             for split, part in task.items()}
    order = sorted(runs, key=lambda run: -RUN_COST.get(run[0], 1))
    processes = min(workers, len(runs))
    try:
        # under a memory cap (gpu-24g, gpu-40g) the workers share it: together they must fit the card it stands for
        share = worker_cap_gib(processes, device)
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_worker_start, initargs=(spec, dtype, device, plain, share)) as pool:
            futures = {run: pool.submit(_worker_run, run[0], run[1], kwargs) for run in order}
            done = {run: future.result() for run, future in futures.items()}
    except Exception as error:  # the runs do not need the workers: say why, and run them here
        import warnings

        warnings.warn(f"finetune_runs: the {workers} worker processes failed ({type(error).__name__}: {error}); "
                      "running every run in this process", RuntimeWarning, stacklevel=2)
        return finetune_runs(base, runs, task, workers=1, **kwargs)
    return {run: done[run] for run in runs}


# ----------------------------------------------------------------------------------------------------------------
# Swallowed updates: how many optimizer updates round to no change in the adapter's stored dtype
# ----------------------------------------------------------------------------------------------------------------
def _kind(name: str) -> str | None:
    for kind in ("lora_A", "lora_B", "magnitude"):
        if name.endswith(kind):
            return kind
    return None


def swallowed_update_shares(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                            lr: float = 1e-4) -> dict:
    """Train ``model`` (its adapters already added) one AdamW step per ``(input_ids, labels)`` batch and count, per
    tensor kind (``lora_A``, ``lora_B``, ``magnitude``), the elements whose gradient was non-zero but whose stored
    value did not change: the update rounded away in the parameter's dtype. Returns ``{kind: share}`` over all
    steps, plus ``{kind}_dtype`` and the losses."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad and _kind(n)}
    if not params:
        raise ValueError("no trainable lora_A / lora_B / magnitude parameter: add an adapter first")
    opt = torch.optim.AdamW(list(params.values()), lr=lr)
    moved = {k: 0 for k in ("lora_A", "lora_B", "magnitude")}
    stuck = dict(moved)
    losses = []
    model.train()
    for ids, labels in batches:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        before = {n: p.detach().clone() for n, p in params.items()}
        live = {n: p.grad != 0 for n, p in params.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        for n, p in params.items():
            k = _kind(n)
            moved[k] += int(live[n].sum())
            stuck[k] += int((live[n] & (p.detach() == before[n])).sum())
        losses.append(float(loss.detach()))
    out = {k: stuck[k] / moved[k] for k in moved if moved[k]}
    out.update({f"{k}_dtype": str(next(p.dtype for n, p in params.items() if _kind(n) == k))
                for k in moved if moved[k]})
    out["losses"] = losses
    return out


# ----------------------------------------------------------------------------------------------------------------
# Step cost: one session (process) of the side-by-side loop, for measure.repeat_in_processes
# ----------------------------------------------------------------------------------------------------------------
COST_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COST_FAMILIES = ("lora_lab", "lora_lab_bf16", "lora_lab_fused", "peft")


def _build_cost_model(base: nn.Module, family: str, variant: str, r: int, vera_r: int) -> nn.Module:
    """``family``: ``lora_lab`` (add_lora's default adapter dtype), ``lora_lab_bf16`` (``adapter_dtype="bf16"``),
    ``lora_lab_fused`` (the default, then ``patch_model``) or ``peft`` (PEFT's defaults)."""
    import peft

    if family not in COST_FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(COST_FAMILIES)}")
    model = copy.deepcopy(base)
    if family.startswith("lora_lab"):
        dtype = "bf16" if family == "lora_lab_bf16" else None
        if variant == "vera":
            from lora_lab.vera import add_vera

            add_vera(model, r=vera_r, targets=COST_TARGETS, adapter_dtype=dtype)
        else:
            from lora_lab.layer import add_lora

            add_lora(model, r=r, alpha=2 * r, targets=COST_TARGETS, adapter_dtype=dtype, **VARIANTS[variant][0])
        if family == "lora_lab_fused":
            from lora_lab.kernels import patch_model

            patch_model(model, strict=False)  # VeRA layers keep their own forward
        return model.train()
    if variant == "vera":
        return peft.get_peft_model(model, peft.VeraConfig(r=vera_r, target_modules=list(COST_TARGETS))).train()
    flags = {"lora": {}, "rslora": {"use_rslora": True}, "dora": {"use_dora": True},
             "pissa": {"init_lora_weights": "pissa"}, "lora_fa": {}}[variant]
    model = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(COST_TARGETS),
                                                       **flags))
    if variant == "lora_fa":
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.requires_grad_(False)
    return model.train()


def step_cost_session(spec: str, combos: Sequence[Sequence[str]], batch: int, seq: int, calls: int,
                      dtype: str = "bf16", r: int = 16, vera_r: int = 256, seed: int = 0,
                      ratios: dict | None = None, warmup: int = 2) -> Callable[[], dict]:
    """Build every ``(family, variant[, copy])`` of ``combos`` once on ``spec`` (a third element makes a second,
    identical model: the check that identical configurations time alike) and return ``measure_once``: one
    repetition of ``calls`` rounds, each round one whole training step (forward, backward, AdamW, zero_grad;
    synchronised after it) of every combination in turn (``measure.interleaved_loop_ms``; order rotated by
    repetition), after ``warmup`` warm-up rounds in the session's first repetition and one in each later one (the
    models are warm by then); each combination's median. It returns
    ``{"ms|family|variant[|copy]": median ms}`` and, for each ``ratios`` entry ``name: [numerator combo, denominator
    combo]``, ``name``: their ratio within the repetition."""
    from lora_lab.lab import measure
    from lora_lab.models import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = load_model(spec, dtype=dtype, device=device, attn_implementation="sdpa")
    ids = torch.randint(0, base.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    keys = ["|".join(c) for c in combos]
    steps = {}
    for key, combo in zip(keys, combos):
        model = _build_cost_model(base, combo[0], combo[1], r, vera_r)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step(model=model, opt=opt):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[key] = step
    counter = {"rep": 0}

    def measure_once() -> dict:
        order = measure.rotation(keys, counter["rep"])
        times = measure.interleaved_loop_ms({key: steps[key] for key in order}, calls=calls,
                                            warmup=warmup if counter["rep"] == 0 else min(warmup, 1))
        out = {f"ms|{key}": sorted(times[key])[len(times[key]) // 2] for key in keys}
        counter["rep"] += 1
        for name, (num, den) in (ratios or {}).items():
            out[name] = out[f"ms|{'|'.join(num)}"] / out[f"ms|{'|'.join(den)}"]
        return out

    return measure_once


def step_cost_bytes(spec: str, batch: int, seq: int, dtype: str = "bf16", r: int = 16, n_models: int = 1) -> int:
    """About the GPU memory :func:`step_cost_session` needs: the byte model's peak of one LoRA step (``r`` on every
    projection, the standard loss) plus the weights and optimizer states of the ``n_models`` other models it holds
    (the base and every other combination)."""
    from lora_lab.memory.byte_model import ModelShape, TrainingSetup, analytic_memory
    from lora_lab.models import model_config

    if isinstance(n_models, bool) or not isinstance(n_models, int) or n_models < 1:
        raise ValueError(f"n_models must be an integer >= 1, got {n_models!r}")
    one = analytic_memory(ModelShape.from_config(model_config(spec)),
                          TrainingSetup(batch=batch, seq_len=seq, dtype=dtype, method="lora", lora_r=r,
                                        lora_targets=COST_TARGETS))
    return one.peak + n_models * one.fixed


def step_cost_decision(cost: dict, n_models: int, metrics: Sequence[str], capacity: int | None = None):
    """:func:`lora_lab.memory.budget.skip_or_shrink` for the step-cost cell (``cost``: the keyword arguments of
    :func:`step_cost_session` that set its shape) at its one shape: under a cap it cannot fit, the cell is skipped and
    each of ``metrics`` is kept as skipped with the reason, so that grading names it."""
    from lora_lab.memory import budget

    need = step_cost_bytes(cost["spec"], cost["batch"], cost["seq"], cost.get("dtype", "bf16"), cost.get("r", 16),
                           n_models)
    decision = budget.skip_or_shrink("step_cost", [f"{cost['spec']} {cost['batch']}x{cost['seq']}"],
                                     lambda _: need, capacity=capacity)
    if decision.skipped:
        for name in metrics:
            budget.note_skipped(name, decision.reason)
    return decision
