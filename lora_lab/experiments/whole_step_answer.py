"""Notebook 10's findings and answer, written from the figures its run recorded (:func:`lora_lab.lab.figures`).

Every number and every judgement word (faster, above a target, the smallest peak) comes from the run's metrics
(:func:`lora_lab.experiments.whole_step.benchmark_metrics` and section 1's); a run without the benchmark (the cpu
profile) gets what it did measure and a sentence saying where the speed figures come from.
"""
from __future__ import annotations

from lora_lab.experiments.whole_step import MODELS, RECIPE, RECIPE_LORA_LAB_LOSS
from lora_lab.lab.answers import Figures

__all__ = ["LABELS", "TARGETS", "recipe_variant", "findings_markdown", "answer_markdown"]

LABELS = {"llama": "Llama-3-8B-like", "qwen2": "Qwen2-7B-like", "qwen3_moe": "Qwen3-30B-A3B-like"}
VARIANT_LABELS = {"peft": "PEFT", "peft_liger": "PEFT + Liger", "peft_patch": "PEFT + `patch_model`",
                  "peft_patch_fused_loss": "PEFT + `patch_model(fused_loss=True)`",
                  RECIPE: "the recipe with Liger's loss", RECIPE_LORA_LAB_LOSS: "the recipe with lora_lab's loss"}
# the benchmark models' LM heads (hidden, vocabulary): LOSS_TABLE's key for whose loss patch_model picks
HEADS = {"llama": (4096, 128256), "qwen2": (3584, 151936), "qwen3_moe": (2048, 151936)}
# the targets registered before the first run: the recipe's step >= 1.5x PEFT's speed and >= 1.25x PEFT + Liger's
TARGETS = {"peft": 1.5, "peft_liger": 1.25}
SAME_PEAK = 1e-3  # relative: two peaks this close are the same peak


def recipe_variant(model: str) -> str:
    """The variant ``patch_model(fused_loss=True)`` runs after Liger at ``model``'s head: lora_lab's loss where
    ``LOSS_TABLE`` names it, else Liger's."""
    from lora_lab.kernels.liger import LOSS_TABLE

    return RECIPE_LORA_LAB_LOSS if LOSS_TABLE.get(HEADS[model], ("liger",))[0] == "lora_lab" else RECIPE


def _models(fig: Figures) -> list[str]:
    return [m for m in MODELS if fig.has(f"{m}_peft_step_ms")]


def _key(model: str, what: str) -> str:
    """``{model}_recipe_*`` for the recipe's variant at that model (``recipe_lora_lab_loss`` or ``recipe``)."""
    prefix = "recipe_lora_lab_loss" if recipe_variant(model) == RECIPE_LORA_LAB_LOSS else "recipe"
    return f"{model}_{prefix}_{what}"


def _names(models: list[str], every: int) -> str:
    if len(models) == every:
        return {1: "the model", 2: "both models", 3: "all three models"}.get(every, f"all {every} models")
    names = [LABELS[m] for m in models]
    return "the " + (names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]) + \
        (" model" if len(names) == 1 else " models")


def _grouped(fig: Figures, keys: dict[str, str], phrase) -> str:
    """'faster on all three models' or 'faster on the A model, slower on the B model': ``phrase(fig, key)`` per
    model, models with the same phrase together."""
    groups: dict[str, list[str]] = {}
    for model, key in keys.items():
        groups.setdefault(phrase(fig, key), []).append(model)
    return "; ".join(f"{w} on {_names(ms, len(keys))}" for w, ms in groups.items())


def _faster(fig: Figures, key: str) -> str:
    """A speed ratio (the other's time over this one's) against 1, by its interval."""
    return {"above": "faster", "below": "slower", "level with": "no faster or slower (interval across 1)"}[
        fig.above(key, 1.0)]


def _faster_time(fig: Figures, key: str) -> str:
    """A time ratio (this one's time over the other's) against 1, by its interval."""
    return {"below": "faster", "above": "slower", "level with": "no faster or slower (interval across 1)"}[
        fig.above(key, 1.0)]


def _against(target: float):
    """A phrase for a speed ratio's interval against ``target``."""
    where = {"above": "above it", "below": "below it", "level with": "across it"}
    return lambda fig, key: where[fig.above(key, target)]


def _span(fig: Figures, keys: list[str]) -> str:
    values = sorted(fig[k] for k in keys)
    return f"{values[0]:.3f}×" if len(values) == 1 or values[0] == values[-1] else \
        f"{values[0]:.3f}–{values[-1]:.3f}×"


def _cell(fig: Figures, key: str, kind: str = "x") -> str:
    if not fig.has(key):
        return "–"
    if kind == "x":
        return f"{fig.x(key)} {fig.interval(key)}"
    if kind == "ratio":
        return f"{fig.num(key)} {fig.interval(key)}".strip()
    if kind == "sci":
        return fig.sci(key)
    return fig.num(key, 1)


def _section1(fig: Figures) -> str:
    tracks = fig.sci("recipe_losses_max_rel_diff_vs_peft")
    fused = "every" if fig["recipe_all_lora_fused"] else "not every"
    return (f"On the small model of section 1 the recipe's first losses differ from PEFT's by at most {tracks} "
            f"(relative), and {fused} LoRA projection runs on the fused kernels.")


def findings_markdown(fig: Figures) -> str:
    """'What this run found', from ``fig``: the table of the benchmark's ratios per model and what they say."""
    models = _models(fig)
    if not models:
        return (_section1(fig) + " The whole-step times and peaks come from section 2's benchmark, which runs on "
                "the gpu profile; this run did not run it.")
    ratios = [fig.raw(_key(m, "speedup_vs_peft")) for m in models if fig.has(_key(m, "speedup_vs_peft"))]
    n, sessions = (int(ratios[0]["n"]), int(ratios[0]["sessions"])) if ratios else (0, 0)
    rows = [
        ("recipe vs PEFT (speed)", lambda m: _cell(fig, _key(m, "speedup_vs_peft"))),
        ("recipe vs PEFT + Liger (speed)", lambda m: _cell(fig, _key(m, "speedup_vs_peft_liger"))),
        ("recipe's peak / PEFT + Liger's", lambda m: _cell(fig, _key(m, "peak_vs_peft_liger"), "ratio")),
        ("recipe with Liger's loss vs PEFT / vs PEFT + Liger (speed)", lambda m: " / ".join(
            _cell(fig, f"{m}_recipe_speedup_vs_{base}") for base in TARGETS)),
        ("step ms: PEFT / PEFT + Liger / recipe", lambda m: " / ".join(
            _cell(fig, f"{m}_{v}_step_ms", "ms") for v in ("peft", "peft_liger", recipe_variant(m)))),
        ("step time, lora_lab's loss / Liger's (in the recipe)",
         lambda m: _cell(fig, f"{m}_lora_lab_loss_time_vs_liger_loss", "ratio")),
        ("`fused_loss=True` vs the standard loss, no Liger (speed)",
         lambda m: _cell(fig, f"{m}_fused_loss_speedup_vs_patch")),
        ("first losses: largest relative difference from PEFT's",
         lambda m: _cell(fig, f"{m}_losses_max_rel_diff_vs_peft", "sci")),
    ]
    counts = (f"{sessions} separate processes of {n // max(sessions, 1)} repetitions each, {n} repetitions per "
              "ratio" if ratios else "no ratio of the recipe to PEFT recorded")
    lines = [f"{len(models)} two-layer models; {counts}: median [95% interval]. A speed ratio is the other "
             "combination's step time over the recipe's, taken repetition by repetition.", "",
             "| | " + " | ".join(LABELS[m] for m in models) + " |", "|---" * (len(models) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cell(m) for m in models) + " |" for label, cell in rows]
    lines.append("")
    for base, target in TARGETS.items():
        keys = {m: _key(m, f"speedup_vs_{base}") for m in models if fig.has(_key(m, f"speedup_vs_{base}"))}
        if keys:
            lines.append(f"* **Against {VARIANT_LABELS[base]}** (target {target}×, registered before the run) the "
                         f"recipe's interval lies {_grouped(fig, keys, _against(target))}.")
    peaks = {m: _key(m, "peak_vs_peft_liger") for m in models if fig.has(_key(m, "peak_vs_peft_liger"))}
    if peaks:
        word = _grouped(fig, peaks, lambda f, k: "below PEFT + Liger's" if f[k] < 1 else
                        "above PEFT + Liger's" if f[k] > 1 else "equal to PEFT + Liger's")
        lines.append(f"* **Its peak** is {word}.")
    loss = {m: f"{m}_lora_lab_loss_time_vs_liger_loss" for m in models
            if fig.has(f"{m}_lora_lab_loss_time_vs_liger_loss")}
    if loss:
        same = [m for m in loss if fig.has(f"{m}_{RECIPE}_peak_gib", f"{m}_{RECIPE_LORA_LAB_LOSS}_peak_gib") and
                abs(fig[f"{m}_{RECIPE}_peak_gib"] / fig[f"{m}_{RECIPE_LORA_LAB_LOSS}_peak_gib"] - 1) <= SAME_PEAK]
        word = _grouped(fig, loss, lambda f, k: _faster_time(f, k) + " than with Liger's")
        lines.append(f"* **Inside the recipe, lora_lab's loss** makes the step {word} (time ratio "
                     f"{_span(fig, list(loss.values())).rstrip('×')}), with the same peak on "
                     f"{_names(same, len(loss)) if same else 'no model'}.")
    fused = {m: f"{m}_fused_loss_speedup_vs_patch" for m in models if fig.has(f"{m}_fused_loss_speedup_vs_patch")}
    if fused:
        word = _grouped(fig, fused, lambda f, k: _faster(f, k) + " than with the standard loss")
        lines.append(f"* **Without Liger**, `patch_model(fused_loss=True)` makes the step {word}.")
    return "\n".join(lines)


def answer_markdown(fig: Figures, device: str | None = None) -> str:
    """'The answer', from ``fig``: the cheapest combination per model, by how much, and the answer's limits."""
    limit = ("**The limit: these are two-layer models.** Two decoder layers overweight the LM head and the loss, "
             "where the fused losses save the most, so a full-depth model's step gains less than a two-layer one's; "
             "notebook 05 measures a full-depth, 24-layer Qwen2.5-0.5B-shaped step.")
    models = _models(fig)
    if not models:
        return (_section1(fig) + " Which combination makes the whole step cheapest, and by how much, is measured on "
                "the gpu profile, on two-layer models.\n\n" + limit)
    fastest = {m: min((v for v in VARIANT_LABELS if fig.has(f"{m}_{v}_step_ms")),
                      key=lambda v: fig[f"{m}_{v}_step_ms"]) for m in models}
    wins = [m for m in models if fastest[m] == recipe_variant(m)]
    vs_peft = [_key(m, "speedup_vs_peft") for m in models if fig.has(_key(m, "speedup_vs_peft"))]
    vs_liger = [_key(m, "speedup_vs_peft_liger") for m in models if fig.has(_key(m, "speedup_vs_peft_liger"))]
    loss_word = ("lora_lab's loss" if all(recipe_variant(m) == RECIPE_LORA_LAB_LOSS for m in models) else
                 "the loss `LOSS_TABLE` names")
    head = (f"**The cheapest step on {_names(wins, len(models))} is the recipe**" if wins else
            "**The recipe is not the cheapest step on any model here**")
    text = (f"{head}: Liger, PEFT and `patch_model(fused_loss=True)` together, which at these heads runs "
            f"{loss_word}.")
    if vs_peft:
        spans = [f"{_span(fig, vs_peft)} PEFT's"] + ([f"{_span(fig, vs_liger)} PEFT + Liger's"] if vs_liger else [])
        if {_faster(fig, k) for k in vs_peft + vs_liger} == {"faster"}:
            text += " Its step ran " + " and ".join(s.replace("× ", "× faster than ", 1) for s in spans) + "."
        else:
            text += " Its step ran at " + " and ".join(s.replace("× ", "× the speed of ", 1) for s in spans) + \
                " (not faster than both on every model)."
    others = [m for m in models if m not in wins]
    if others:
        text += " " + "; ".join(f"On the {LABELS[m]} model {VARIANT_LABELS[fastest[m]]} was faster" for m in others)
        text += "."
    peaks = {m: [fig[f"{m}_{v}_peak_gib"] for v in VARIANT_LABELS if fig.has(f"{m}_{v}_peak_gib")] for m in models}
    measured = [m for m in models if fig.has(f"{m}_{recipe_variant(m)}_peak_gib")]
    smallest = [m for m in measured if fig[f"{m}_{recipe_variant(m)}_peak_gib"] <= (1 + SAME_PEAK) * min(peaks[m])]
    if smallest:
        text += f" Its peak is the smallest of the six combinations on {_names(smallest, len(models))}."
    elif measured:
        text += f" Another combination holds a smaller peak on {_names(measured, len(models))}."
    text += (" It composes because Liger replaces forwards while `patch_model` replaces the LoRA layers inside them; "
             + _section1(fig)[0].lower() + _section1(fig)[1:])
    where = f"one GPU ({device})" if device else "one GPU"
    return (text + "\n\n" + limit + f" Measured on {where}, `2 × 4,096` tokens a step, LoRA r = 16 on every "
            "projection.")
