"""peer_comparison: the metric keys notebook 10 will record from bench_peers' rows and full-depth step rows,
computed on made-up rows whose ratios are known."""
from __future__ import annotations

import pytest

from lora_lab.experiments import peer_comparison as pc


def _op_rows(op, cells, times, reps=2, **extra):
    """``times``: {impl: ms or None (skipped)}; per cell, repetition ``rep`` adds ``rep`` ms to every time."""
    rows = []
    for c, scale in cells.items():
        for impl, ms in times.items():
            if ms is None:
                rows.append(dict(op=op, cell=c, impl=impl, rep=0, ms=None, status="skipped",
                                 error="ModuleNotFoundError: No module named 'x'", tried="import", **extra))
                continue
            rows += [dict(op=op, cell=c, impl=impl, rep=rep, ms=ms * scale + rep, status="ok", **extra)
                     for rep in range(reps)]
    return rows


def test_lora_worst_cell_is_the_largest_time_ratio_across_the_three_ops():
    rows = (_op_rows("lora_linear", {"a": 1.0, "b": 2.0}, {"ours": 8.0, "axolotl": 10.0, "unsloth": None})
            + _op_rows("lora_qkv", {"q": 1.0}, {"ours": 9.0, "axolotl": 10.0, "unsloth": None})
            + _op_rows("lora_mlp", {"m": 1.0}, {"ours": 6.0, "axolotl": 10.0, "unsloth": None}))
    m = pc.ops_metrics(rows)
    worst = m["peers_lora_worst_time_vs_axolotl"]
    assert worst["samples"] == pytest.approx([9 / 10, 10 / 11])  # the QKV cell in both repetitions
    # repetition 0: 0.8 in both cells; repetition 1: cell a's 9 / 11 above cell b's 17 / 21
    assert m["peers_lora_linear_worst_time_vs_axolotl"]["samples"] == pytest.approx([16 / 20, 9 / 11])
    assert "peers_lora_worst_time_vs_unsloth" not in m
    assert m["peers_lora_unsloth_cells_not_run"] == 4 and m["peers_lora_qkv_unsloth_cells_not_run"] == 1
    (status,) = [s for s in pc.peer_status(rows) if s["op"] == "lora_mlp"]
    assert status["peer"] == "unsloth" and status["error"].startswith("ModuleNotFoundError")


def test_moe_worst_speedup_is_the_smallest_peer_over_ours_and_loss_ratios_per_head():
    rows = _op_rows("moe_full", {"s1": 1.0, "s2": 3.0}, {"ours": 10.0, "sonicmoe": 11.0, "llamafactory": 20.0})
    rows += _op_rows("loss", {"l_t": 1.0}, {"ours": 70.0, "quack": 74.0}, head="trainable")
    rows += _op_rows("loss", {"l_f": 1.0}, {"ours": 50.0, "quack": 49.0}, head="frozen")
    m = pc.ops_metrics(rows)
    assert m["peers_moe_full_worst_speedup_vs_sonicmoe"]["samples"] == pytest.approx([11 / 10, 12 / 11])
    assert m["peers_moe_full_worst_speedup_vs_llamafactory"]["median"] > 1.9
    assert "peers_moe_full_worst_speedup_vs_veomni" not in m and m["peers_moe_full_veomni_cells_not_run"] == 2
    assert m["peers_loss_time_vs_quack_trainable"]["samples"] == pytest.approx([70 / 74, 71 / 75])
    assert m["peers_loss_worst_time_vs_quack"]["samples"] == pytest.approx([50 / 49, 51 / 50])


def test_step_metrics_pick_the_fastest_peer_that_ran():
    rows = []
    for impl, tps, peak in (("ours", 12000, 50), ("peft", 8000, 60), ("unsloth", 10000, 40), ("axolotl", None, None)):
        for rep in range(2):
            rows.append(dict(model="llama3_8b", checkpointing="off", impl=impl, rep=rep,
                             status="ok" if tps else "error", tokens_per_s=tps and tps + 100 * rep,
                             peak_bytes=peak))
    m = pc.step_metrics(rows)
    assert m["peers_step_llama3_8b_ckpt_off_fastest_peer"] == "unsloth"
    assert m["peers_step_llama3_8b_ckpt_off_speedup_vs_fastest_peer"]["samples"] == pytest.approx(
        [12000 / 10000, 12100 / 10100])
    assert m["peers_step_llama3_8b_ckpt_off_peak_vs_fastest_peer"] == pytest.approx(50 / 40)
    only_ours = [r for r in rows if r["impl"] == "ours"]
    assert pc.step_metrics(only_ours) == {"peers_step_llama3_8b_ckpt_off_peers_run": 0}


def test_benchmark_metrics_read_both_csvs_and_refuse_a_smoke_run(tmp_path):
    from lora_lab.lab import measure

    rows = _op_rows("loss", {"l_t": 1.0}, {"ours": 70.0, "quack": 74.0}, head="trainable")
    measure.write_csv([dict(r, smoke=False) for r in rows], tmp_path / pc.OPS_CSV)
    assert set(pc.benchmark_metrics(tmp_path)) == {"peers_loss_time_vs_quack_trainable",
                                                   "peers_loss_worst_time_vs_quack"}
    measure.write_csv([dict(r, smoke=True) for r in rows], tmp_path / pc.OPS_CSV)
    with pytest.raises(ValueError, match="--smoke run"):
        pc.benchmark_metrics(tmp_path)
    assert "peers_loss_worst_time_vs_quack" in pc.benchmark_metrics(tmp_path, allow_smoke=True)


def _step_rows(ckpt, speeds):
    return [dict(model="llama3_8b", checkpointing=ckpt, impl=impl, rep=rep, status="ok" if tps else "oom",
                 tokens_per_s=tps and tps + 100 * rep, peak_bytes=tps and 40 * 2**30,
                 error=None if tps else "OutOfMemoryError: CUDA out of memory. Tried to allocate 1 GiB")
            for impl, tps in speeds.items() for rep in range(2)]


def _results_folder(tmp_path):
    """The folders tools/peers_bench.sh writes: unsloth skipped in the main process and timed in its own; SonicMoE
    skipped in the main process and timed in its own; QuACK never loaded anywhere."""
    from lora_lab.lab import measure

    main = (_op_rows("lora_linear", {"a": 1.0}, {"ours": 8.0, "axolotl": 10.0, "unsloth": None})
            + _op_rows("moe_full", {"s": 1.0}, {"ours": 10.0, "llamafactory": 20.0, "sonicmoe": None})
            + _op_rows("loss", {"l": 1.0}, {"ours": 70.0, "quack": None}, head="trainable"))
    folders = {"ops": main,
               "ops_unsloth": _op_rows("lora_linear", {"a": 1.0}, {"ours": 9.0, "unsloth": 12.0}),
               "ops_sonicmoe": _op_rows("moe_full", {"s": 1.0}, {"ours": 11.0, "sonicmoe": 10.0}),
               "step_ckpt_off": _step_rows("off", {"ours": 12000, "unsloth": 10000, "peft": None,
                                                   "ours_cublas_base": 13000}),
               "step_ckpt_on": _step_rows("on", {"ours": 9000, "axolotl": 9500})}
    for folder, rows in folders.items():
        measure.write_csv([dict(r, smoke=False) for r in rows], tmp_path / folder / pc.RESULT_FOLDERS[folder])
    return tmp_path


def test_results_take_each_peer_from_the_process_it_ran_in(tmp_path):
    results = pc.read_results(_results_folder(tmp_path))
    assert set(results) == {"ops", "ops_unsloth", "ops_sonicmoe", "step_ckpt_off", "step_ckpt_on"}
    m = pc.results_metrics(results)
    # unsloth and SonicMoE: their own process, against ours timed there; their skips in the main process dropped
    assert m["peers_lora_worst_time_vs_unsloth"]["samples"] == pytest.approx([9 / 12, 10 / 13])
    assert m["peers_moe_full_worst_speedup_vs_sonicmoe"]["samples"] == pytest.approx([10 / 11, 11 / 12])
    assert "peers_lora_unsloth_cells_not_run" not in m and "peers_moe_full_sonicmoe_cells_not_run" not in m
    assert m["peers_lora_worst_time_vs_axolotl"]["samples"] == pytest.approx([8 / 10, 9 / 11])
    assert m["peers_loss_quack_cells_not_run"] == 1  # never loaded: counted where it was tried
    assert m["peers_step_llama3_8b_ckpt_off_fastest_peer"] == "unsloth"  # our other route is never a peer
    assert m["peers_step_llama3_8b_ckpt_off_cublas_base_speedup_vs_ours"]["samples"] == pytest.approx(
        [13000 / 12000, 13100 / 12100])
    assert "peers_step_llama3_8b_ckpt_on_cublas_base_speedup_vs_ours" not in m  # not run there
    assert m["peers_step_llama3_8b_ckpt_on_fastest_peer"] == "axolotl"
    assert m["peers_step_llama3_8b_ckpt_on_speedup_vs_fastest_peer"]["median"] < 1.0


def test_moe_peers_in_a_process_of_their_own_are_read(tmp_path):
    # peers_bench.sh call: the MoE peers beside ours in ops_moe, the LoRA ops in ops (no MoE rows there)
    from lora_lab.lab import measure

    folders = {"ops": _op_rows("lora_linear", {"a": 1.0}, {"ours": 8.0, "axolotl": 10.0}),
               "ops_moe": _op_rows("moe_full", {"s": 1.0}, {"ours": 10.0, "llamafactory": 20.0, "veomni": 15.0})}
    for folder, rows in folders.items():
        measure.write_csv([dict(r, smoke=False) for r in rows], tmp_path / folder / pc.RESULT_FOLDERS[folder])
    results = pc.read_results(tmp_path)
    assert set(results) == {"ops", "ops_moe"}
    m = pc.results_metrics(results)
    assert m["peers_moe_full_worst_speedup_vs_llamafactory"]["samples"] == pytest.approx([20 / 10, 21 / 11])
    assert m["peers_lora_worst_time_vs_axolotl"]["samples"] == pytest.approx([8 / 10, 9 / 11])
    assert {(r["op"], r["peer"]): r["process"] for r in pc.ops_table(results)}[("moe_full", "veomni")] == "ops_moe"


def test_tables_and_answer_lines_come_from_the_rows(tmp_path):
    from lora_lab.lab.answers import Figures

    results = pc.read_results(_results_folder(tmp_path))
    ops = {(r["op"], r["peer"]): r for r in pc.ops_table(results)}
    assert ops[("lora_linear", "unsloth")]["process"] == "ops_unsloth"
    assert ops[("lora_linear", "unsloth")]["ours_over_peer_max"] == pytest.approx(9.5 / 12.5)
    assert ("loss", "quack") not in ops  # it never ran
    failed = pc.not_run(results)  # unsloth and SonicMoE skipped in the main process but ran in their own: not listed
    assert [(r["op"], r["peer"], r["process"]) for r in failed] == [("loss", "quack", "ops")]
    assert failed[0]["error"].startswith("ModuleNotFoundError")
    steps = {(r["checkpointing"], r["impl"]): r for r in pc.step_table(results)}
    assert steps[("off", "ours")]["tokens_per_s"] == pytest.approx(12050) and steps[("off", "ours")]["peak_gib"] == 40
    assert steps[("off", "peft")]["status"] == "oom" and steps[("off", "peft")]["error"].startswith("OutOfMemory")
    assert len(pc.merged_rows(results, pc.OPS_CSV)) == sum(len(results[f]) for f in ("ops", "ops_unsloth",
                                                                                     "ops_sonicmoe"))
    tables = pc.tables_text(results)
    assert "llama3_8b      off  ours                 12050      40.0" in tables
    assert "lora_linear  unsloth           1  0.760 to 0.760" in tables
    assert "did not run: quack (loss, 1 of 1 cells): skipped: ModuleNotFoundError" in tables
    assert "did not run: peft (llama3_8b step, checkpointing off): oom: OutOfMemoryError" in tables
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_peak) = plt.subplots(1, 2)
    pc.plot_steps(pc.step_table(results), ax_speed, ax_peak)
    assert len(ax_speed.patches) == 5 and any(t.get_text() == "oom" for t in ax_speed.texts)  # peft: its status
    plt.close(fig)
    text = "\n".join(pc.answer_lines(Figures(pc.results_metrics(results))))
    assert "checkpointing off:** the recipe's tokens/s are 1.199× [1.198, 1.200]" in text
    assert "the fastest peer that ran, unsloth;" in text
    assert "ours takes 0.760× [0.750, 0.769] unsloth's time (ours faster)" in text and "QuACK" not in text
    assert "sonicmoe takes 0.913× [0.909, 0.917] our time (ours slower)" in text
    assert ("* **The recipe, big GEMMs by cuBLAS** (Llama-3-8B shape, 32 layers, checkpointing off): 1.083× "
            "[1.083, 1.083] the recipe's tokens/s (ours faster)") in text


def test_results_written_by_other_code_or_a_smoke_run_are_refused(tmp_path):
    from lora_lab.lab import measure

    rows = _op_rows("loss", {"l": 1.0}, {"ours": 70.0, "quack": 74.0}, head="trainable")
    measure.write_csv([dict(r, smoke=False) for r in rows], tmp_path / "ops" / pc.OPS_CSV, code_hash="0" * 64)
    with pytest.raises(measure.StaleResultError, match="written by other code"):
        pc.read_results(tmp_path)
    measure.write_csv([dict(r, smoke=True) for r in rows], tmp_path / "ops" / pc.OPS_CSV)
    with pytest.raises(ValueError, match="--smoke run"):
        pc.read_results(tmp_path)
    assert pc.read_results(tmp_path / "absent") == {}
