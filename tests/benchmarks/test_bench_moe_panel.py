"""bench_moe's MoE panel on the CPU: the time budget, the sessions pooled, the untuned form and the first
calls recorded, and the panel metrics notebook 06 grades (smoke: tiny stand-ins in Triton's interpreter)."""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_lab.experiments import fused_moe
from lora_lab.kernels.config import KernelConfig
from lora_lab.lab import measure

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("bench_moe")


def test_panel_names_six_or_more_public_layers_coarse_and_fine(bench):
    shapes = fused_moe.LAYER_SHAPES
    assert len(shapes) >= 6 and {"qwen3_30b_a3b", "mixtral_8x7b"} <= set(shapes)
    assert shapes["mixtral_8x7b"].hidden == 4096 and shapes["mixtral_8x7b"].intermediate == 14336
    coarse = [s for s in shapes.values() if s.num_experts <= 16]
    fine = [s for s in shapes.values() if s.num_experts >= 64]
    assert {s.name for s in coarse} == set(fused_moe.COARSE_SHAPES) and len(fine) >= 3
    assert set(bench.SMOKE_SHAPES) == set(shapes)
    assert len(fused_moe.PANEL_CELLS) == len(shapes) * 2 * 2


def test_calls_fit_the_budget(bench):
    assert bench.calls_within(None, {"a": 5.0}, 5, 10) == 10
    assert bench.calls_within(10.0, {"a": 100.0, "b": 100.0}, 5, 10) == 10  # 10 s >= 5 reps × 200 ms × 10
    assert bench.calls_within(2.0, {"a": 100.0, "b": 100.0}, 5, 10) == 2
    assert bench.calls_within(0.01, {"a": 100.0}, 5, 10) == 1  # never below one call


def test_graded_cells_run_first(bench):
    args = argparse.Namespace(shapes=["mixtral_8x7b", "qwen3_30b_a3b"], tokens=[8192, 32768], modes=["full", "lora"],
                              graded_only=False)
    cells = [f"{n}_t{t}_{m}" for n, t, m in bench.layer_cells(args)]
    graded = [c for c in cells if c in fused_moe.GRADED_CELLS]
    assert cells[:len(graded)] == graded and len(cells) == 8 and 0 < len(graded) < 8


@pytest.mark.slow
def test_sessions_split_over_two_machines_pool_with_untuned_form_and_first_calls(tmp_path):
    """The first session run alone (one GPU call), then --sessions 2 over its folder (the next call): the first is
    kept, the second runs, and the pooled CSV holds both sessions' rows of ours, grouped_mm and the untuned form,
    each with its first call, which the panel metrics pool over the two sessions."""
    env = {**os.environ, "MPLBACKEND": "Agg", "TQDM_DISABLE": "1"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    common = ["--smoke", "--budget-s", "600", "--repetitions", "2", "--shapes", "mixtral_8x7b", "olmoe_1b_7b",
              "--tokens", "8192", "--modes", "full", "--no-e2e", "--variants", "ours_untuned", "--secondary"]
    script = str(ROOT / "benchmarks" / "bench_moe.py")
    first = subprocess.run([sys.executable, script, *common, "--out", str(measure.process_folder(tmp_path, 0)),
                            "--session-index", "0", "--first-call-ledger", str(tmp_path / "first_calls.json")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    written = (measure.process_folder(tmp_path, 0) / fused_moe.LAYER_CSV).read_text()
    done = subprocess.run([sys.executable, script, *common, "--out", str(tmp_path), "--sessions", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "process 1 of 2 kept" in done.stdout and "process 2 of 2 done" in done.stdout
    assert (measure.process_folder(tmp_path, 0) / fused_moe.LAYER_CSV).read_text() == written  # not run again
    rows = measure.read_csv(tmp_path / fused_moe.LAYER_CSV)
    assert measure.sessions_in(rows) == 2 and {r["impl"] for r in rows} == {"grouped_mm", "ours", "ours_untuned"}
    assert all(r["first_call_s"] > 0 for r in rows)
    metrics = fused_moe.benchmark_metrics(tmp_path, allow_smoke=True)
    for cell in ("mixtral_8x7b_t8192_full", "olmoe_1b_7b_t8192_full"):
        assert metrics[f"{cell}_speedup_vs_grouped_mm"]["sessions"] == 2
        assert metrics[f"{cell}_ours_untuned_slowdown_vs_ours"]["n"] == 4
        assert metrics[f"{cell}_ours_first_call_s"] > 0
    assert metrics["panel_ours_first_call_max_s"] > 0 and metrics["panel_ours_untuned_slowdown_max"] > 0


def test_first_calls_known_to_be_tuned_cost_nothing_and_cold_ones_their_estimate(bench, tmp_path, monkeypatch):
    """The budget's estimate of a first call: the cold figure until the key is tuned in this process, or, for an
    implementation Triton's disk cache carries over, in an earlier session of the run (the ledger)."""
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    qwen3, qwen15 = fused_moe.LAYER_SHAPES["qwen3_30b_a3b"], fused_moe.LAYER_SHAPES["qwen1_5_moe_a2_7b"]
    ledger = tmp_path / bench.FIRST_CALL_LEDGER
    first = bench.FirstCalls(ledger)
    cold = bench.COLD_FIRST_CALL_S
    assert first.expected_s("liger", qwen3, "full") == cold["liger"] > 0
    first.record("liger", qwen3, "full", 5.0)
    first.record("ours_persistent", qwen3, "full", 3.0)
    assert first.expected_s("liger", qwen3, "full") == 0.0
    assert first.expected_s("liger", qwen15, "full") == cold["liger"]  # another (H, I): tuned again
    later = bench.FirstCalls(ledger)  # the next session of the run
    assert later.expected_s("liger", qwen3, "full") == 0.0
    assert later.expected_s("ours_persistent", qwen3, "full") == cold["ours_persistent"]  # tuned per process
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING")
    assert bench.FirstCalls(ledger).expected_s("liger", qwen3, "full") == cold["liger"]  # no disk cache: cold


def test_budget_skips_an_implementation_whose_first_call_does_not_fit_and_names_it(bench, monkeypatch, capsys):
    """--budget-s counts first calls: an implementation whose cold first call is expected to exceed what is left is
    a ``skipped`` row with the reason (the others are timed); when it is ours, the whole cell is skipped."""
    import time

    monkeypatch.setattr(bench, "COLD_FIRST_CALL_S", {"ours_persistent": 1e6, "ours": 0.0})
    shape = fused_moe.LAYER_SHAPES["qwen3_30b_a3b"].scaled(**bench.SMOKE_SHAPES["qwen3_30b_a3b"])
    args = argparse.Namespace(repetitions=2, eager_calls=1, warmup_ms=1.0, rep_ms=2.0, smoke=True, calls=1, warmup=0,
                              secondary=[])
    first = bench.FirstCalls()
    deadline = time.perf_counter() + 600
    rows = bench.bench_layer_cell(shape, 8, 8192, "full", ["grouped_mm", "ours", "ours_persistent"], args, None,
                                  torch.device("cpu"), torch.float32, first_calls=first, deadline=deadline)
    skipped = [r for r in rows if r["impl"] == "ours_persistent"]
    assert len(skipped) == 2 and all(r["status"] == "skipped" and r["ms"] is None for r in skipped)
    assert "first call" in skipped[0]["skip_reason"] and "ours_persistent skipped" in capsys.readouterr().out
    assert {r["impl"] for r in rows if r["status"] == "ok"} == {"grouped_mm", "ours"}
    assert first.skipped == {"ours_persistent"}

    monkeypatch.setattr(bench, "COLD_FIRST_CALL_S", {"ours": 1e6})
    rows = bench.bench_layer_cell(shape, 8, 8192, "lora", ["grouped_mm", "ours"], args, None, torch.device("cpu"),
                                  torch.float32, first_calls=first, deadline=deadline)
    assert rows and all(r["status"] == "skipped" and r["ms"] is None for r in rows)
    assert "skipped" in capsys.readouterr().out


def test_session_budgets_one_per_session_the_last_repeating(bench):
    args = argparse.Namespace(budget_s=[250.0, 60.0], session_index=None)
    assert bench.session_budget(args) == 250.0
    assert [bench.session_budget(argparse.Namespace(budget_s=[250.0, 60.0], session_index=k)) for k in (1, 2)] == [
        60.0, 60.0]
    assert bench.session_budget(argparse.Namespace(budget_s=None, session_index=1)) is None


def test_kgrouped_variant_is_opt_in_and_sets_the_weight_gradient_kernel(bench):
    for variant, engine in (("ours_kgrouped", "kgrouped"), ("ours_dw_grouped_mm", "grouped_mm"),
                            ("ours_per_tile", "per_tile")):
        assert variant in bench.ALL_IMPLS and variant not in bench.DEFAULT_RUN
        assert variant in bench.WEIGHT_GRAD_VARIANTS  # full fine-tuning cells only
        assert fused_moe.ours_config(variant, None).moe_weight_grad == engine
    assert fused_moe.ours_config("ours", KernelConfig()).moe_weight_grad == "auto"


def test_engine_variants_are_opt_in_and_force_their_engine(bench):
    for variant, engine in (("ours_gmm_engine", "grouped_mm"), ("ours_triton", "triton")):
        assert variant in bench.ALL_IMPLS and variant not in bench.DEFAULT_RUN
        assert fused_moe.ours_config(variant, None).moe_engine == engine
    # the persistent form is a form of the Triton kernels, whatever engine the rule picks for ours
    persistent = fused_moe.ours_config("ours_persistent", None)
    assert persistent.moe_engine == "triton" and persistent.moe_loads == "persistent"
    assert fused_moe.ours_config("ours", KernelConfig()).moe_engine == "auto"


@pytest.mark.slow
def test_kgrouped_variant_is_timed_beside_ours(tmp_path):
    """``--variants ours_kgrouped``: the K-grouped weight gradient timed in the same loop as ours, its ratio to ours
    among the metrics (smoke: tiny stand-in of the 30B-A3B-like layer, one session)."""
    env = {**os.environ, "MPLBACKEND": "Agg", "TQDM_DISABLE": "1"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--out", str(tmp_path), "--smoke",
           "--repetitions", "2", "--shapes", "qwen3_30b_a3b", "--tokens", "8192", "--modes", "full", "--no-e2e",
           "--variants", "ours_kgrouped"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = measure.read_csv(tmp_path / fused_moe.LAYER_CSV)
    assert {r["impl"] for r in rows} == {"grouped_mm", "ours", "ours_kgrouped"}
    assert all(r["ms"] is not None for r in rows)
    metrics = fused_moe.benchmark_metrics(tmp_path, allow_smoke=True)
    assert metrics["qwen3_30b_a3b_t8192_full_ours_kgrouped_speedup_vs_ours"]["n"] == 2


def test_a_finished_session_is_kept_only_for_this_code_and_these_arguments(bench, tmp_path, monkeypatch):
    """--sessions keeps a session folder that a run with the same arguments (whatever its --out, --sessions, and a
    child's --session-index / --first-call-ledger) finished with this code; anything else runs again."""
    part = tmp_path / "session0"
    part.mkdir()
    argv = ["--out", str(tmp_path), "--sessions", "2", "--repetitions", "5", "--budget-s", "420", "300"]
    child = ["--repetitions", "5", "--budget-s", "420", "300", "--out", str(part), "--session-index", "0",
             "--first-call-ledger", str(tmp_path / "first_calls.json")]
    bench.mark_session_complete(part, child, 0)
    assert not bench.session_complete(part, argv, 0)  # no layer CSV: not finished
    (part / fused_moe.LAYER_CSV).write_text("x\n")
    assert bench.session_complete(part, argv, 0)
    assert not bench.session_complete(part, argv, 1)  # another session's budget
    assert not bench.session_complete(part, [*argv[:5], "3", *argv[6:]], 0)  # other repetitions
    monkeypatch.setattr("lora_lab.lab.provenance.code_hash", lambda *a, **k: "other code")
    assert not bench.session_complete(part, argv, 0)  # other code
    monkeypatch.undo()
    (part / bench.SESSION_COMPLETE).write_text("{not json")
    assert not bench.session_complete(part, argv, 0)


NOTEBOOK_VARIANTS = ["eager", "liger", "ours_untuned", "ours_per_tile", "ours_down_triton", "ours_triton"]


def _parse(bench, *extra):
    return bench.build_parser().parse_args(["--out", "o", "--variants", *NOTEBOOK_VARIANTS, *extra])


def test_cells_option_runs_only_the_named_cells_graded_ones_first(bench):
    args = _parse(bench, "--cells", "olmoe_1b_7b_t8192_full", "qwen3_30b_a3b_t8192_lora")
    assert bench.layer_cells(args) == [("qwen3_30b_a3b", 8192, "lora"), ("olmoe_1b_7b", 8192, "full")]
    everything = bench.layer_cells(_parse(bench))
    assert len(everything) == len(fused_moe.PANEL_CELLS)  # without --cells: the whole panel
    notebook = bench.layer_cells(_parse(bench, "--cells", *fused_moe.NOTEBOOK_CELLS))
    assert {bench.cell_name(*c) for c in notebook} == set(fused_moe.NOTEBOOK_CELLS) < set(fused_moe.PANEL_CELLS)


def test_a_cell_name_outside_the_panel_is_refused_by_name(bench, tmp_path, capsys):
    for option in ("--cells", "--variant-cells"):
        with pytest.raises(SystemExit):
            bench.main(["--out", str(tmp_path), option, "qwen3_30b_a3b_t8192_full", "qwen3_30b_a3b_t4096_full"])
        err = capsys.readouterr().err
        assert "qwen3_30b_a3b_t4096_full is no cell" in err and "qwen3_30b_a3b_t8192_full is" not in err
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_variant_cells_limit_ours_variants_but_not_the_untuned_form(bench):
    impls = bench.chosen_variants(bench.build_parser(), _parse(bench), bench.ALL_IMPLS, ["grouped_mm", "ours"])
    limited = _parse(bench, "--variant-cells", *fused_moe.VARIANT_CELLS)
    cells = {(n, t, m): bench.cell_implementations(limited, impls, n, t, m) for n, t, m in bench.layer_cells(limited)}
    assert cells[("qwen3_30b_a3b", 8192, "full")] == ["eager", "grouped_mm", "ours", "ours_untuned", "ours_per_tile",
                                                      "ours_down_triton", "liger"]
    assert cells[("qwen3_30b_a3b", 8192, "lora")] == ["grouped_mm", "ours", "ours_untuned", "ours_triton"]
    assert cells[("qwen1_5_moe_a2_7b", 8192, "full")] == ["grouped_mm", "ours", "ours_untuned"]
    assert cells[("mixtral_8x7b", 8192, "lora")] == ["grouped_mm", "ours", "ours_untuned"]
    every = _parse(bench)  # without --variant-cells: each variant in every cell of its mode
    assert bench.cell_implementations(every, impls, "mixtral_8x7b", 8192, "lora") == [
        "grouped_mm", "ours", "ours_untuned", "ours_triton"]
    assert "ours_untuned" not in bench.CELL_LIMITED and "ours_per_tile" in bench.CELL_LIMITED


def _standing_predictions():
    from lora_lab.lab.predictions import load_predictions, superseded_ids

    predictions = load_predictions(ROOT / "predictions" / "predictions.yaml", notebooks_dir=ROOT / "notebooks")
    replaced = superseded_ids(predictions)
    return [p for p in predictions if p.notebook == "06_fused_moe" and p.id not in replaced]


def test_notebook_cells_hold_every_cell_a_standing_prediction_reads():
    """Notebook 06 times only fused_moe.NOTEBOOK_CELLS, and ours' variants only in VARIANT_CELLS: every layer cell
    that a prediction of the notebook (not superseded) names in its metric is among them, and so is every cell where
    it compares one of the variants the notebook times with ours."""
    standing = _standing_predictions()
    assert standing
    by_length = sorted(fused_moe.PANEL_CELLS, key=len, reverse=True)
    read = {p.id: next((c for c in by_length if p.metric.startswith(c + "_")), None) for p in standing}
    assert {c for c in read.values() if c} <= set(fused_moe.NOTEBOOK_CELLS)
    for p in standing:
        for variant in ("ours_per_tile", "ours_down_triton", "ours_triton"):
            if read[p.id] and p.metric.startswith(f"{read[p.id]}_{variant}_"):
                assert read[p.id] in fused_moe.VARIANT_CELLS, p.id
    assert set(fused_moe.GRADED_CELLS) <= set(fused_moe.NOTEBOOK_CELLS)
