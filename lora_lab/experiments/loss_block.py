"""The measurements notebook 07 reports about the loss block, as plain functions.

* :func:`logits_bytes`        — bytes of the standard loss's [tokens x vocab] buffers vs the gradient floor
* :func:`option_errors`       — the fused op vs the plain-torch reference over every option (fp32: exact)
* :func:`real_head_errors`    — the fused op in 16-bit at real heads against the fp32 reference
* :func:`model_loss_check`    — a causal LM's loss and LoRA gradients: standard vs causal_lm_loss(fused=True) vs
                                patch_model(fused_loss=True)
* :func:`benchmark_metrics`   — the graded ratios of ``benchmarks/bench_loss.py`` and ``bench_loss_train_step.py``
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from lora_lab.kernels.loss import linear_cross_entropy, linear_cross_entropy_reference
from lora_lab.lab import measure
from lora_lab.memory import budget
from lora_lab.numerics import rel_l2

__all__ = ["GIB", "OPTIONS", "loss_inputs", "logits_bytes", "option_errors", "real_head_errors", "model_loss_check",
           "benchmark_metrics", "BASELINES"]

GIB = 2**30
# every option of the op once, and all of them together
OPTIONS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-3},
    {"softcap": 4.0},
    {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 8.0, "reduction": "sum"},
]
BASELINES = ("torch_fp32", "torch_bf16", "chunked", "liger", "cce")


def logits_bytes(tokens: int, vocab: int, hidden: int, trainable: bool = False) -> dict:
    """Bytes (GiB) of what the standard path builds for ``F.cross_entropy((H Wᵀ).float(), y)`` in bf16, next to
    the gradient floor: the bf16 logits, their fp32 copy, the fp32 log-softmax saved for backward, and the
    gradient buffers the call must return (dH, plus dW for a trainable head)."""
    logits = tokens * vocab * 2
    floor = tokens * hidden * 2 + (vocab * hidden * 2 if trainable else 0)
    return {"tokens": tokens, "vocab": vocab, "logits_bf16_gib": logits / GIB, "fp32_copy_gib": 2 * logits / GIB,
            "fp32_log_softmax_gib": 2 * logits / GIB, "standard_total_gib": 5 * logits / GIB,
            "grad_floor_gib": floor / GIB}


def loss_inputs(n, d, vocab, dtype, device, seed=0, weight_scale=0.3, ignored=(3,)):
    """Seeded (hidden [n, d] ~ N(0, 1), weight [vocab, d] ~ N(0, weight_scale²), labels [n] with the rows in
    ``ignored`` set to -100), cast to ``dtype`` on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen)
    w = torch.randn(vocab, d, generator=gen) * weight_scale
    y = torch.randint(0, vocab, (n,), generator=gen)
    for i in ignored:
        if i < n:
            y[i] = -100
    return h.to(device, dtype), w.to(device, dtype), y.to(device)


def _errors(h, w, y, trainable, reference_dtype=torch.float64, seed=1, **options) -> dict:
    """Loss, dH, dW of the op against the reference evaluated in ``reference_dtype`` on the same input values."""
    hk, wk = h.clone().requires_grad_(), w.clone().requires_grad_(trainable)
    hr = h.detach().to(reference_dtype).requires_grad_()
    wr = w.detach().to(reference_dtype).requires_grad_(trainable)
    loss = linear_cross_entropy(hk, wk, y, **options)
    ref = linear_cross_entropy_reference(hr, wr, y, **options)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.to(ref.device, reference_dtype)
    (loss.to(reference_dtype) * g).sum().backward()
    (ref * g).sum().backward()
    out = {"loss": rel_l2(loss, ref), "dh": rel_l2(hk.grad, hr.grad)}
    if trainable:
        out["dw"] = rel_l2(wk.grad, wr.grad)
    return out


def option_errors(device, n=37, d=40, vocab=203, dtype=torch.float32, seed=0) -> dict:
    """Worst relative errors of loss, dH and dW over :data:`OPTIONS` x {frozen, trainable} head (fp64 reference)."""
    h, w, y = loss_inputs(n, d, vocab, dtype, device, seed, 0.3)
    worst = {"loss": 0.0, "dh": 0.0, "dw": 0.0}
    for options in OPTIONS:
        for trainable in (False, True):
            for key, value in _errors(h, w, y, trainable, **options).items():
                worst[key] = max(worst[key], value)
    return worst


def real_head_errors(cases, dtype, device, seed=0) -> list[dict]:
    """The op in ``dtype`` at each ``(tokens, hidden, vocab)`` case, head frozen and trainable, against the fp32
    reference (TF32 off) on the same values; W ~ N(0, 0.02²) and H ~ N(0, 1) as in the benchmarks."""
    rows = []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for n, d, vocab in cases:
            # a few ignored rows, except when the one row is all there is
            h, w, y = loss_inputs(n, d, vocab, dtype, device, seed, 0.02, ignored=(0, 5, 77) if n > 1 else ())
            for trainable in (False, True):
                err = _errors(h, w, y, trainable, reference_dtype=torch.float32)
                rows.append({"tokens": n, "hidden": d, "vocab": vocab, "head": "trainable" if trainable else "frozen",
                             **err})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return rows


def model_loss_check(model, ids, labels) -> dict:
    """Loss and trainable gradients of ``model`` three ways: transformers' standard loss (all logits),
    ``causal_lm_loss(fused=True)`` and ``model(..., labels=...)`` after ``patch_model(fused_loss=True)``.
    Returns the relative differences from the standard path (loss, and the worst relative L2 over the gradients)."""
    from lora_lab.kernels import patch_model, unpatch_model
    from lora_lab.loss import causal_lm_loss

    def run(m, fn):
        m.zero_grad(set_to_none=True)
        loss = fn(m)
        loss.backward()
        return loss.detach().double(), {n: p.grad.detach().clone() for n, p in m.named_parameters()
                                        if p.grad is not None}

    standard = run(model, lambda m: causal_lm_loss(m, ids, labels, chunked=False))
    fused = run(model, lambda m: causal_lm_loss(m, ids, labels, fused=True))
    patched_model = copy.deepcopy(model)
    summary = patch_model(patched_model, fused_loss=True)
    no_logits = patched_model(input_ids=ids, labels=labels).logits is None
    patched = run(patched_model, lambda m: m(input_ids=ids, labels=labels).loss)
    unpatch_model(patched_model)

    def worst(grads):
        return max(rel_l2(grads[n], standard[1][n]) for n in standard[1])

    return {"standard_loss": float(standard[0]), "fused_loss_rel_diff": rel_l2(fused[0], standard[0]),
            "fused_grad_max_rel_l2": worst(fused[1]), "patched_loss_rel_diff": rel_l2(patched[0], standard[0]),
            "patched_grad_max_rel_l2": worst(patched[1]), "patched_builds_no_logits": no_logits,
            "patched_lora_layers": summary["lora_layers"], "trainable_tensors": len(standard[1])}


def _max_ratio_over_cells(rows, cells, method, others) -> dict | None:
    """Per repetition, the largest over ``cells`` of (``method``'s ms / the smallest ms among ``others`` measured in
    that repetition), summarized (median, 95% interval, samples). None if nothing to compare."""
    per_rep: dict[int, float] = {}
    for cell in cells:
        mine = [r for r in rows if (r["shape"], r["tokens"], r["head"]) == cell and r["status"] == "ok"]
        ours = measure.by_repetition(mine, "ms", method=method)
        rivals = {o: measure.by_repetition(mine, "ms", method=o) for o in others}
        rivals = {o: v for o, v in rivals.items() if v}
        if not ours or not rivals:
            continue
        for rep, ms in ours.items():
            best = min(v[rep] for v in rivals.values() if rep in v)
            per_rep[rep] = max(per_rep.get(rep, 0.0), ms / best)
    if not per_rep:
        return None
    return measure.summarize((per_rep[k] for k in sorted(per_rep)), sessions=measure.sessions_in(rows))


def _cell_name(cell) -> str:
    shape, tokens, head = cell
    return f"{shape}_{tokens}_{head}"


def void_capped_metrics(out: dict, rows: list[dict], scope: dict[str, tuple[list, tuple]]) -> dict[str, str]:
    """Under a GPU memory cap (:mod:`lora_lab.memory.budget`): each cell where a method ran out of memory (or was
    predicted to) is kept as a skipped cell (``<shape>_<tokens>_<head>``, the suffix of the per-cell metrics), and
    each metric of ``scope`` ({key: (its cells, the methods it compares)}) that one of those touches is taken out of
    ``out`` and kept as skipped under its own key, with the method and cell: over fewer cells it would answer another
    question. Returns {key: reason} of the metrics taken out; without a cap nothing changes (an OOM on the whole
    card is the measurement's own result)."""
    cap = budget.memory_cap_gib()
    if cap is None:
        return {}
    oom = {((r["shape"], int(r["tokens"]), r["head"]), r["method"]) for r in rows if r["status"] == "oom"}
    for cell, method in sorted(oom):
        budget.note_out_of_memory(_cell_name(cell), method)
    voided = {}
    for key, (cells, methods) in scope.items():
        hit = sorted(f"{method} in {_cell_name(cell)}" for cell, method in oom if cell in cells and method in methods)
        if hit:
            out.pop(key, None)
            voided[key] = f"ran out of memory under the {cap:g} GiB memory cap (${budget.MEMORY_CAP_ENV}): " \
                          + ", ".join(hit)
            budget.note_skipped(key, voided[key])
    return voided


def note_unrun_comparisons(out: dict, rows: list[dict], ratios: dict[str, tuple[list, tuple]]) -> dict[str, str]:
    """Each ratio of ``ratios`` ({key: (its cells, the methods it compares lora_lab with)}) left out of ``out``
    because a method it compares never ran (every row of it skipped, not run or failed: a peer not installed, a
    kernel needing CUDA) is kept as a skipped cell under its own key, with the method and the reason its rows give,
    so the grade says why the metric is missing instead of leaving a reader to guess. With or without a memory cap;
    a metric already kept as skipped (:func:`void_capped_metrics`) is left as it is. Returns {key: reason}."""
    noted = {}
    already = budget.skipped_cells()
    for key, (_cells, others) in ratios.items():
        if key in out or key in already:
            continue
        reasons = []
        for method in others:
            mine = [r for r in rows if r["method"] == method]
            if mine and all(r["status"] in ("skipped", "not_run", "error") for r in mine):
                why = dict.fromkeys(str(r.get("note") or r["status"]).strip() for r in mine)
                reasons.append(f"{method} {mine[0]['status']}: " + "; ".join(why))
        if reasons:
            noted[key] = "; ".join(reasons)
            budget.note_skipped(key, noted[key])
    return noted


def benchmark_metrics(bench_dir: Path | str, min_tokens: int = 16384) -> dict:
    """The graded numbers of notebook 07 from the benchmark CSVs this run wrote (refused if written by other code).

    Loss block (``07_loss_block.csv``), over the cells with at least ``min_tokens`` tokens: time ratios as the
    largest over cells per repetition (median and interval over repetitions), peak / gradient floor as the largest
    over cells (measured once per cell). Whole step (``07_train_step.csv``): tokens/s ratios per repetition, peaks.
    Under a GPU memory cap, a metric over cells where one of its methods ran out of memory is left out, with the
    reason kept (:func:`void_capped_metrics`).
    """
    bench_dir = Path(bench_dir)
    rows = measure.read_csv(bench_dir / "07_loss_block.csv")
    for r in rows:
        r["tokens"] = int(r["tokens"])
    big = sorted({(r["shape"], r["tokens"], r["head"]) for r in rows if r["tokens"] >= min_tokens})
    frozen = [c for c in big if c[2] == "frozen"]
    out: dict = {}
    ratios = {
        "time_vs_fastest_baseline_max": (big, BASELINES),
        "time_vs_own_gemm_floor_max": (big, ("gemm_floor_recompute",)),
        "time_vs_three_gemm_floor_max": (big, ("gemm_floor",)),
        "time_vs_chunked_max": (big, ("chunked",)),
        "time_vs_liger_frozen_max": (frozen, ("liger",)),
        "time_vs_liger_max": (big, ("liger",)),
        "time_vs_cce_max": (big, ("cce",)),
        "time_vs_cce_exact_max": (big, ("cce_exact",)),
        "time_vs_torch_bf16_max": (big, ("torch_bf16",)),
    }
    for key, (cells, others) in ratios.items():
        value = _max_ratio_over_cells(rows, cells, "lora_lab", others)
        if value is not None:
            out[key] = value

    def peak_ratio(method, head):
        values = [float(r["peak_vs_floor"]) for r in rows if r["method"] == method and r["head"] == head
                  and r["tokens"] >= min_tokens and r["status"] == "ok" and r.get("peak_vs_floor") is not None
                  and int(r["rep"]) == 0]
        return max(values) if values else None

    for key, method, head in (("frozen_peak_over_floor_max", "lora_lab", "frozen"),
                              ("trainable_one_pass_peak_over_floor_max", "lora_lab", "trainable"),
                              ("trainable_two_pass_peak_over_floor_max", "lora_lab_two_pass", "trainable")):
        value = peak_ratio(method, head)
        if value is not None:
            out[key] = value
    for r in rows:
        if (r["method"], r["shape"], r["tokens"], r["head"], int(r["rep"])) == (
                "torch_fp32", "qwen2.5-0.5b", 16384, "trainable", 0) and r["status"] == "ok" \
                and r.get("peak_extra_gib") is not None:
            out["torch_fp32_peak_gib_qwen_16k_trainable"] = float(r["peak_extra_gib"])
    for shape, tokens, head in big:  # lora_lab's time per cell (the target cell: llama3-8b, 16k, trainable)
        mine = [r for r in rows if (r["shape"], r["tokens"], r["head"], r["method"], r["status"]) ==
                (shape, tokens, head, "lora_lab", "ok") and r.get("ms") is not None]
        if mine:
            out[f"lora_lab_ms_{shape}_{tokens}_{head}"] = measure.summarize(
                (float(r["ms"]) for r in mine), sessions=measure.sessions_in(mine))
    peak_ratios = []  # lora_lab's extra peak over Liger's, per cell (first repetition of each)
    for cell in big:
        peaks = {}
        for r in rows:
            if (r["shape"], r["tokens"], r["head"]) == cell and r["status"] == "ok" and r["method"] in (
                    "lora_lab", "liger") and r.get("peak_extra_gib") is not None:
                peaks.setdefault(r["method"], float(r["peak_extra_gib"]))
        if len(peaks) == 2 and peaks["liger"] > 0:
            peak_ratios.append(peaks["lora_lab"] / peaks["liger"])
    if peak_ratios:
        out["peak_vs_liger_max"] = max(peak_ratios)
    scope = {key: (cells, ("lora_lab",) if key == "time_vs_fastest_baseline_max" else ("lora_lab", *others))
             for key, (cells, others) in ratios.items()}  # the fastest baseline: of those that fit, as uncapped
    scope.update({"frozen_peak_over_floor_max": (frozen, ("lora_lab",)),
                  "trainable_one_pass_peak_over_floor_max": ([c for c in big if c[2] == "trainable"], ("lora_lab",)),
                  "trainable_two_pass_peak_over_floor_max": ([c for c in big if c[2] == "trainable"],
                                                             ("lora_lab_two_pass",)),
                  "peak_vs_liger_max": (big, ("lora_lab", "liger")),
                  "torch_fp32_peak_gib_qwen_16k_trainable": ([("qwen2.5-0.5b", 16384, "trainable")], ("torch_fp32",))})
    void_capped_metrics(out, rows, scope)
    note_unrun_comparisons(out, rows, ratios)
    errors = [float(r["loss_rel_err"]) for r in rows if r["method"] == "lora_lab" and r.get("loss_rel_err")
              is not None]
    if errors:
        out["bench_loss_max_rel_err"] = max(errors)

    step_path = bench_dir / "07_train_step.csv"
    if step_path.exists():
        steps = measure.read_csv(step_path)
        ok = [r for r in steps if r["status"] == "ok"]
        variants = {r["variant"] for r in ok}
        if {"fused", "chunked"} <= variants:
            out["step_speedup_vs_chunked"] = measure.ratio_summary(
                ok, "tokens_per_s", {"variant": "fused"}, {"variant": "chunked"})
        if {"fused", "peft_liger"} <= variants:
            out["step_speedup_vs_peft_liger"] = measure.ratio_summary(
                ok, "tokens_per_s", {"variant": "fused"}, {"variant": "peft_liger"})
        peaks = {r["variant"]: float(r["peak_gib"]) for r in ok if int(r["rep"]) == 0 and r.get("peak_gib")
                 is not None}
        if "fused" in peaks:
            out["step_peak_gib_fused"] = peaks["fused"]
            if "peft_liger" in peaks:
                out["step_peak_vs_peft_liger"] = peaks["fused"] / peaks["peft_liger"]
        out["step_peaks_gib"] = peaks
    return out
