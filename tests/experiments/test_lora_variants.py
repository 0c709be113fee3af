"""Notebook 09's experiments: interop with PEFT, the digit-code task and its stopping rule (an accuracy target),
swallowed updates and the step-cost session."""
import pytest
import torch

import lora_lab
from lora_lab.experiments import lora_variants as lv


@pytest.mark.parametrize("variant", ["dora", "vera"])
def test_interop_helper_reports_exact_round_trips(variant, tmp_path):
    row = lv.interop_max_abs_diff(variant, "random:tiny-qwen2", tmp_path, r=4)
    assert row == {"variant": variant, "to_peft": 0.0, "from_peft": 0.0}


@pytest.mark.parametrize("variant", list(lv.VARIANTS))
def test_every_variant_trains_on_the_digit_code_and_leaves_the_base(variant, tiny_fp32):
    tok = lora_lab.load_tokenizer("random:tiny-qwen2")
    task = lv.digit_code_task(tok, 2, {"train": 20, "validation": 5, "test": 5}, seed=0)
    before = tiny_fp32.get_submodule("model.layers.0.self_attn.v_proj").weight.clone()
    res = lv.finetune_variant(tiny_fp32, variant, task, 0, r=4, alpha=8, lr=1e-3, targets=("q_proj", "v_proj"),
                              vera_r=8, batch_size=4, max_steps=4, eval_every=2, target_accuracy=1.0)
    assert res["steps"] == 4 and res["trainable_params"] > 0 and len(res["curve"]) == 2
    assert not res["reached"] and res["steps_to_target"] is None
    assert res["variant"] == variant and 0.0 <= res["test_accuracy"] <= 1.0
    # the base is untouched (PiSSA rewrites the copy's weights, never the base's)
    assert torch.equal(tiny_fp32.get_submodule("model.layers.0.self_attn.v_proj").weight, before)


# ---------------------------------------------------------------------------------------------------------------
# The digit-code task, the stopping rule, swallowed updates, the step-cost session
# ---------------------------------------------------------------------------------------------------------------
def _tiny_task(sizes=None):
    tok = lora_lab.load_tokenizer("random:tiny-qwen2")
    return tok, lv.digit_code_task(tok, 3, sizes or {"train": 40, "validation": 10, "test": 20}, seed=1)


def test_digit_code_splits_are_disjoint_and_score_only_the_answer_digits():
    tok, task = _tiny_task()
    seen = {}
    for split, part in task.items():
        strings = {tok.decode(row) for row in part["input_ids"].tolist()}
        assert len(strings) == len(part["input_ids"])
        for other, theirs in seen.items():
            assert not strings & theirs, f"{split} and {other} share codes"
        seen[split] = strings
        assert (part["answer_mask"].sum(1) == 3).all()  # three answer digits, not the spaces between them
        assert torch.equal(part["labels"] != -100, part["answer_mask"])
    text = tok.decode(task["test"]["input_ids"][0].tolist())
    digits = [int(c) for c in text.split("=>")[0].replace("Code:", "").split()]
    answer = [int(c) for c in text.split("=>")[1].split()]
    assert answer == lv.code_answer(digits) == [(d + 1) % 10 for d in digits[::-1]]
    with pytest.raises(ValueError, match="at most 10\\*\\*2"):
        lv.digit_code_task(tok, 2, {"train": 90, "test": 20})


def test_evaluate_scores_a_model_that_knows_the_answer_as_perfect():
    _, task = _tiny_task()
    split = task["test"]

    class Oracle(torch.nn.Module):  # logits that put all mass on the next token of each row
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids):
            rows = {tuple(r.tolist()[:-3]): r for r in split["input_ids"]}
            logits = torch.full((*input_ids.shape, 300), -30.0)
            for i, row in enumerate(input_ids):
                full = rows[tuple(row.tolist()[:-3])]
                logits[i, torch.arange(len(row) - 1), full[1:]] = 30.0
            return type("Out", (), {"logits": logits})

    res = lv.evaluate(Oracle(), split)
    assert res["accuracy"] == 1.0 and res["loss"] < 1e-6


def test_training_stops_at_the_accuracy_target_or_the_limit_and_scores_the_test_split(monkeypatch):
    _, task = _tiny_task()
    base = lora_lab.load_model("random:tiny-qwen2", attn_implementation="sdpa")
    kw = dict(r=4, alpha=8, targets=("q_proj", "v_proj"), vera_r=8, batch_size=4, eval_every=5)
    # the random model gets no answer digit right: a target of 0.5 is never reached, the limit stops the run
    res = lv.finetune_variant(base, "lora", task, 0, lr=3e-3, max_steps=10, target_accuracy=0.5, **kw)
    assert not res["reached"] and res["steps"] == 10 and res["steps_to_target"] is None
    assert [p["step"] for p in res["curve"]] == [5, 10] and 0 <= res["test_accuracy"] <= 1
    assert lv.censored_steps(res, max_steps=10, eval_every=5) == 15
    # an absolute loss floor above the random model's loss fires at the first check
    res = lv.finetune_variant(base, "lora", task, 0, lr=0.0, max_steps=50, target_accuracy=1.0, loss_floor=1e6, **kw)
    assert res["reached"] and res["steps"] == res["steps_to_target"] == 5 and len(res["curve"]) == 1
    assert lv.censored_steps(res, max_steps=50, eval_every=5) == 5
    # the accuracy target: scripted validation accuracies 0.5, 0.9, 0.96 stop the run at the third check (step 15)
    real = lv.evaluate
    script = iter([0.5, 0.9, 0.96, 1.0])

    def scripted(model, split, batch_size=256):
        out = real(model, split, batch_size)
        return {**out, "accuracy": next(script)} if split is task["validation"] else out

    monkeypatch.setattr(lv, "evaluate", scripted)
    res = lv.finetune_variant(base, "lora", task, 0, lr=0.0, max_steps=50, target_accuracy=0.95, **kw)
    assert res["reached"] and res["steps_to_target"] == 15 and [p["val_accuracy"] for p in res["curve"]] == [
        0.5, 0.9, 0.96]
    with pytest.raises(ValueError, match="eval_every"):
        lv.train_to_target(base, None, task, 4, max_steps=3, eval_every=5, target_accuracy=0.9)
    with pytest.raises(ValueError, match="target_accuracy"):
        lv.train_to_target(base, None, task, 4, max_steps=10, eval_every=5, target_accuracy=1.5)
    with pytest.raises(ValueError, match="loss_floor"):
        lv.train_to_target(base, None, task, 4, max_steps=10, eval_every=5, target_accuracy=0.9, loss_floor=0.0)
    with pytest.raises(ValueError, match="unknown variant"):
        lv.attach_variant(base, "qlora", r=4, alpha=8, lr=1e-3, targets=("q_proj",), vera_r=8)


def test_swallowed_shares_see_bf16_rounding_and_not_fp32():
    _, task = _tiny_task()
    batches = [(task["train"]["input_ids"][:4], task["train"]["labels"][:4])] * 2
    shares = {}
    for stored in ("bf16", "fp32"):
        model = lora_lab.load_model("random:tiny-qwen2", dtype="bf16", attn_implementation="sdpa")
        torch.manual_seed(0)
        lora_lab.add_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"), use_dora=True, adapter_dtype=stored)
        shares[stored] = lv.swallowed_update_shares(model, batches, lr=1e-4)
    assert shares["bf16"]["magnitude"] > 0.9 and shares["bf16"]["magnitude_dtype"] == "torch.bfloat16"
    assert shares["fp32"]["magnitude"] == 0.0 and shares["fp32"]["lora_A_dtype"] == "torch.float32"
    with pytest.raises(ValueError, match="add an adapter"):
        lv.swallowed_update_shares(lora_lab.load_model("random:tiny-qwen2"), batches)


def test_step_cost_session_times_each_combination_and_pairs_ratios():
    once = lv.step_cost_session("random:tiny-qwen2", [["lora_lab", "lora"], ["lora_lab", "lora", "copy"],
                                                      ["peft", "dora"]],
                                batch=1, seq=8, calls=1, dtype="fp32", r=2,
                                ratios={"same": [["lora_lab", "lora", "copy"], ["lora_lab", "lora"]]})
    out = once()
    assert set(out) == {"ms|lora_lab|lora", "ms|lora_lab|lora|copy", "ms|peft|dora", "same"}
    assert out["same"] == out["ms|lora_lab|lora|copy"] / out["ms|lora_lab|lora"]
    bf16 = lv._build_cost_model(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), "lora_lab_bf16", "dora", 2, 8)
    assert {p.dtype for p in bf16.parameters() if p.requires_grad} == {torch.bfloat16}
    default = lv._build_cost_model(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), "lora_lab", "vera", 2, 8)
    assert {p.dtype for p in default.parameters() if p.requires_grad} == {torch.float32}
    with pytest.raises(ValueError, match="unknown family"):
        lv.step_cost_session("random:tiny-qwen2", [["nope", "lora"]], batch=1, seq=8, calls=1, dtype="fp32")


def test_step_cost_session_warms_up_fully_once_then_one_round(monkeypatch):
    from lora_lab.lab import measure

    seen = []

    def fake_loop(fns, calls, warmup):
        seen.append(warmup)
        return {key: [1.0] * calls for key in fns}

    monkeypatch.setattr(measure, "interleaved_loop_ms", fake_loop)
    once = lv.step_cost_session("random:tiny-qwen2", [["lora_lab", "lora"]], batch=1, seq=8, calls=2, dtype="fp32",
                                r=2)
    for _ in range(3):
        once()
    assert seen == [2, 1, 1]


def test_runs_spread_over_worker_processes_give_the_in_process_results():
    _, task = _tiny_task()
    base = lora_lab.load_model("random:tiny-qwen2", dtype="fp32", attn_implementation="sdpa")
    kw = dict(r=4, alpha=8, lr=3e-3, targets=("q_proj", "v_proj"), vera_r=8, batch_size=4, max_steps=4, eval_every=2,
              target_accuracy=1.0)
    runs = [("lora", 0), ("vera", 1)]
    here = lv.finetune_runs(base, runs, task, workers=1, **kw)
    spread = lv.finetune_runs(base, runs, task, workers=2, spec="random:tiny-qwen2", dtype="fp32", **kw)
    assert list(spread) == runs == list(here)
    for run in runs:
        assert spread[run]["steps"] == here[run]["steps"] == 4
        assert spread[run]["trainable_params"] == here[run]["trainable_params"]
        assert spread[run]["test_loss"] == pytest.approx(here[run]["test_loss"], rel=1e-4)
        assert [p["val_loss"] for p in spread[run]["curve"]] == pytest.approx(
            [p["val_loss"] for p in here[run]["curve"]], rel=1e-4)
    with pytest.raises(ValueError, match="workers"):
        lv.finetune_runs(base, runs, task, workers=0, **kw)
    with pytest.raises(ValueError, match="needs spec"):
        lv.finetune_runs(base, runs, task, workers=2, **kw)


def test_runs_fall_back_to_this_process_with_a_warning_when_the_workers_fail(monkeypatch):
    import concurrent.futures

    class Broken:
        def __init__(self, *args, **kwargs):
            raise OSError("no processes here")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Broken)
    _, task = _tiny_task()
    base = lora_lab.load_model("random:tiny-qwen2", dtype="fp32", attn_implementation="sdpa")
    kw = dict(r=4, alpha=8, lr=3e-3, targets=("q_proj", "v_proj"), vera_r=8, batch_size=4, max_steps=2, eval_every=2,
              target_accuracy=1.0)
    with pytest.warns(RuntimeWarning, match="no processes here"):
        out = lv.finetune_runs(base, [("lora", 0), ("dora", 0)], task, workers=2, spec="random:tiny-qwen2", **kw)
    assert list(out) == [("lora", 0), ("dora", 0)] and all(res["steps"] == 2 for res in out.values())


def test_step_cost_is_skipped_by_metric_name_under_a_cap_it_does_not_fit():
    from lora_lab.lab.rules import skipped_cell_of
    from lora_lab.memory import budget

    cost = {"spec": "random:qwen2.5-0.5b", "batch": 4, "seq": 1024, "dtype": "bf16", "r": 16}
    need = lv.step_cost_bytes("random:qwen2.5-0.5b", 4, 1024, "bf16", 16, n_models=7)
    assert 20 * budget.GIB < need < 30 * budget.GIB  # seven 0.5B models in bf16 and one step's activations
    assert lv.step_cost_bytes("random:qwen2.5-0.5b", 4, 1024, "bf16", 16, n_models=1) < need
    names = ["peft_dora_over_lora_step", "identical_config_step_time_ratio"]
    budget.clear_skipped()
    try:
        assert not lv.step_cost_decision(cost, 7, names, capacity=140 * budget.GIB).skipped
        assert budget.skipped_cells() == {}
        decision = lv.step_cost_decision(cost, 7, names, capacity=22 * budget.GIB)
        assert decision.skipped and "skipped" in decision.reason
        skipped = budget.skipped_cells()
        assert set(skipped) == {"step_cost", *names}
        for name in names:
            assert skipped_cell_of(name, {"skipped_cells": skipped}) == (name, decision.reason)
    finally:
        budget.clear_skipped()
    with pytest.raises(ValueError, match="n_models"):
        lv.step_cost_bytes("random:qwen2.5-0.5b", 4, 1024, n_models=0)


def test_worker_processes_get_their_share_of_the_memory_cap(monkeypatch):
    import concurrent.futures

    from lora_lab.memory.budget import MEMORY_CAP_ENV

    seen = []

    class Recording:  # what the worker processes would start with, then no processes (the runs fall back)
        def __init__(self, processes, *args, initargs=(), **kwargs):
            seen.append((processes, initargs[-1]))
            raise OSError("recorded")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Recording)
    monkeypatch.setenv(MEMORY_CAP_ENV, "22")
    _, task = _tiny_task()
    base = lora_lab.load_model("random:tiny-qwen2", dtype="fp32", attn_implementation="sdpa")
    kw = dict(r=4, alpha=8, lr=3e-3, targets=("q_proj", "v_proj"), vera_r=8, batch_size=4, max_steps=2, eval_every=2,
              target_accuracy=1.0)
    with pytest.warns(RuntimeWarning, match="recorded"):
        lv.finetune_runs(base, [("lora", 0), ("dora", 0), ("vera", 0)], task, workers=4, spec="random:tiny-qwen2", **kw)
    assert seen == [(3, pytest.approx(22 / 3))]  # three runs: three processes sharing 22 GiB (none held here)
    monkeypatch.delenv(MEMORY_CAP_ENV)
    with pytest.warns(RuntimeWarning, match="recorded"):
        lv.finetune_runs(base, [("lora", 0), ("dora", 0)], task, workers=2, spec="random:tiny-qwen2", **kw)
    assert seen[-1] == (2, None)  # no cap: none to share
