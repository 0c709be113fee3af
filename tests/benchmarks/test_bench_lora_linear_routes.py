"""bench_lora_linear's routes to the frozen layer's cost (the big GEMMs by cuBLAS, the graphed steps), in process:
the command line, a CPU pass over the variants (graphed ones recorded as skipped), and notebook 05's metrics of
them from a fixture CSV."""
from __future__ import annotations

import argparse
import csv
import importlib

import pytest
import torch

from lora_lab.experiments import fused_lora_kernels
from lora_lab.lab import measure

ROUTES_COMMAND = ["--out", "OUT", "--variants", "base,peft,fused,fused_cublas_base,fused_cublas_base_qdb,base_graphed,"
                  "fused_graphed,fused_cublas_base_graphed", "--sessions", "2", "--ledger", "FILE"]


@pytest.fixture
def bench(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    return importlib.import_module("bench_lora_linear")


def test_the_routes_command_line_parses(bench):
    args = bench.parse_args(ROUTES_COMMAND)
    assert args.variants == ["base", "peft", "fused", "fused_cublas_base", "fused_cublas_base_qdb", "base_graphed",
                             "fused_graphed", "fused_cublas_base_graphed"]  # only what was asked for
    assert (args.sessions, args.ledger, args.cells, args.back_to_back) == (2, "FILE", None, False)
    assert bench.parse_args([*ROUTES_COMMAND, "--no-back-to-back"]).back_to_back is False
    assert bench.parse_args([*ROUTES_COMMAND, "--back-to-back"]).back_to_back is True
    assert bench.parse_args(["--out", "o", "--variants", "routes"]).variants == [
        "base", "peft", "fused", *bench.ROUTES]
    assert bench.parse_args(["--out", "o"]).variants == bench.DEFAULT_VARIANTS  # the notebook's run is unchanged
    cells = bench.parse_args(["--out", "o", "--cells", "32k_4096x4096_r16,8k_12288x4096_r64"]).cells
    assert cells == ["32k_4096x4096_r16", "8k_12288x4096_r64"]


def test_the_default_run_times_what_notebook_05_grades_and_no_more(bench):
    """The notebook passes no --variants: its default run must time the shipped op against its references, the
    routes that are still contenders (every GEMM by cuBLAS, QuACK's route, the merged and stacked weights, graphed) and
    their references, and leave out the forms the changelog keeps as tried and slower (the persistent GEMM core, P / Q
    folded into it, the rank-r passes by cuBLAS around the Triton GEMMs, the big GEMMs by cuBLAS onto a Triton rank-r
    term, the widened reduction: graded by earlier runs, timed on request), and skip the do_bench column."""
    args = bench.parse_args(["--out", "o"])
    timed = set(args.variants)
    kept = {"fused_pure_cublas"}  # the all-cuBLAS op, the route rule's pick at large cells
    merged = set(fused_lora_kernels.MERGED_VARIANTS) - {"fused_merged_graphed"}
    for routes in (kept, fused_lora_kernels.QUACK_VARIANTS, merged):
        references = {fused_lora_kernels.ROUTE_VARIANTS.get(v) or fused_lora_kernels.QUACK_VARIANTS.get(v)
                      or fused_lora_kernels.MERGED_VARIANTS[v] for v in routes}
        assert set(routes) | references | {"base", "peft", "fused"} <= timed
    assert not {"fused_persistent", "fused_fold", "fused_torch_rank"} & timed
    assert not set(bench.DROPPED_FROM_DEFAULT) & timed
    dropped = set(bench.DROPPED_FROM_DEFAULT)
    # the graphed shipped and all-cuBLAS ops, and the graphed merged route, were graded by earlier runs; the graphed
    # stacked routes stand in for them
    assert dropped == set(fused_lora_kernels.WIDE_VARIANTS) | {v for v in fused_lora_kernels.ROUTE_VARIANTS
                                                               if v.startswith("fused_cublas_base")} \
        | {"fused_graphed", "fused_pure_cublas_graphed", "fused_merged_graphed"}
    assert {"fused_stacked_graphed", "fused_stacked_cublas_graphed", "base_graphed"} <= timed
    assert dropped <= set(bench.ROUTES) | set(bench.WIDE_ROUTES) | set(bench.MERGED_ROUTES)  # each timed on request
    assert args.back_to_back is False
    assert args.calls == bench.LOOP[False]["calls"] == 6


def test_an_unknown_cell_or_variant_is_named(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "o", "--cells", "32k_4096x4096_r32"])
    assert "32k_4096x4096_r32 not in the grid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "o", "--variants", "base,fused_grafed"])
    assert "unknown variants: fused_grafed" in capsys.readouterr().err


def test_routes_time_the_cublas_forms_and_graph_where_cuda_is(bench):
    """On a CPU the graphed variants are ``skipped`` rows naming why; on a GPU they run (no per-step peak: a graph's
    memory is its pool)."""
    cuda = torch.cuda.is_available()
    # one repetition and no autotuning keep the interpreter's time short (the shipped op has its own smoke run)
    args = argparse.Namespace(variants=["base", "peft", *bench.ROUTES], repetitions=1, warmup_ms=1.0,
                              rep_ms=2.0, forward=True, components="none")
    from lora_lab.kernels import KernelConfig

    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    rows, _ = bench.measure_cell("c", (16, 32, 32, 4), args, KernelConfig(autotune=False), dtype, device, not cuda)
    graphed = {"base_graphed", "fused_graphed", "fused_cublas_base_graphed"}
    skipped = {r["variant"]: r["error"] for r in rows if r["status"] == "skipped"}
    assert set(skipped) == (set() if cuda else graphed)
    assert all("CUDA graphs need a CUDA device" in reason for reason in skipped.values())
    ok = {r["variant"] for r in rows if r["status"] == "ok"}
    assert ok == {"base", "peft", "fused_cublas_base", "fused_cublas_base_qdb", "fused_pure_cublas"} | (
        graphed if cuda else set())
    assert all(r["host_ms"] > 0 and r["fwd_ms"] > 0 for r in rows if r["status"] == "ok")
    assert all((r["peak_bytes"] is None) == (r["variant"] in graphed or not cuda) for r in rows if r["status"] == "ok")
    summary = bench.summary_rows(rows)
    assert {s["variant"] for s in summary} == ok


def test_host_profile_writes_each_variants_host_side_events(bench, tmp_path):
    args = argparse.Namespace(variants=["base", "peft", "fused_pure_cublas"], repetitions=1, warmup_ms=1.0,
                              rep_ms=2.0, forward=False, components="none", host_profile=True, out=str(tmp_path))
    from lora_lab.kernels import KernelConfig

    for cell in ("c1", "c2"):  # the file grows cell by cell
        bench.measure_cell(cell, (16, 32, 32, 4), args, KernelConfig(autotune=False), torch.float32,
                           torch.device("cpu"), True)
    rows = measure.read_csv(tmp_path / bench.HOST_PROFILE_CSV)
    assert {(r["cell"], r["variant"]) for r in rows} == {(c, v) for c in ("c1", "c2") for v in args.variants}
    base = [r for r in rows if r["cell"] == "c1" and r["variant"] == "base"]
    assert any(r["event"] == "aten::mm" and r["per_call"] >= 1 for r in base)  # the frozen layer's products
    assert all(r["self_cpu_us"] >= 0 for r in rows)
    assert [r["self_cpu_us"] for r in base] == sorted((r["self_cpu_us"] for r in base), reverse=True)


def _row(cell, variant, rep, ms, host=0.1, session=None, status="ok"):
    M = 32768 if cell.startswith("32k") else 8192
    row = {"cell": cell, "M": M, "K": 4096, "N": 4096, "r": 16, "dtype": "bfloat16", "smoke": False,
           "variant": variant, "rep": rep, "status": status, "fwd_bwd_ms": ms if status == "ok" else None,
           "host_ms": host if status == "ok" else None, "peak_bytes": None}
    return row


def test_route_metrics_from_a_fixture_csv(tmp_path):
    t, small = fused_lora_kernels.TARGET_CELL, "8k_4096x4096_r16"
    times = {  # {variant: ({cell: ms per repetition}), host ms}
        "base": ({t: [3.0, 3.0], small: [1.0, 1.0]}, 0.4),
        "peft": ({t: [7.0, 7.0], small: [2.0, 2.0]}, 1.2),
        "fused": ({t: [3.6, 3.6], small: [1.5, 1.5]}, 1.7),
        "fused_cublas_base": ({t: [3.3, 3.6], small: [1.4, 1.2]}, 1.6),
        "base_graphed": ({t: [3.2, 3.2], small: [0.8, 0.8]}, 0.05),
        "fused_graphed": ({t: [3.52, 3.84], small: [0.96, 1.0]}, 0.07),
    }
    rows = [_row(cell, v, rep, ms[rep], host=host * (1 + (cell == small)))
            for v, (cells, host) in times.items() for cell, ms in cells.items() for rep in range(2)]
    rows += [_row(t, "fused_pure_cublas", 0, None, status="error")]  # failed: named, not graded
    measure.write_csv(rows, tmp_path / fused_lora_kernels.LINEAR_CSV)
    m = fused_lora_kernels.benchmark_metrics(tmp_path)
    assert m[f"lora_linear_fused_cublas_base_time_vs_base_{t}"]["samples"] == pytest.approx([1.1, 1.2])
    assert m["lora_linear_fused_cublas_base_worst_time_vs_base"]["samples"] == pytest.approx([1.4, 1.2])
    # graphed: over the frozen layer graphed, and over the plain one at the target cell
    assert m[f"lora_linear_fused_graphed_time_vs_base_graphed_{t}"]["samples"] == pytest.approx([1.1, 1.2])
    assert m[f"lora_linear_fused_graphed_time_vs_base_{t}"]["samples"] == pytest.approx([3.52 / 3, 1.28])
    assert m["lora_linear_fused_graphed_worst_time_vs_base_graphed"]["samples"] == pytest.approx([1.2, 1.25])
    # per repetition the better route's worst cell: min(1.4, 1.2) then min(1.2, 1.25)
    assert m["lora_linear_routes_best_worst_time_vs_base"]["samples"] == pytest.approx([1.2, 1.2])
    assert m["lora_linear_fused_graphed_worst_host_ms"]["samples"] == pytest.approx([0.14, 0.14])
    assert m[f"lora_linear_fused_graphed_host_ms_{t}"]["samples"] == pytest.approx([0.07, 0.07])
    assert m[f"lora_linear_base_graphed_time_vs_base_{t}"]["median"] == pytest.approx(3.2 / 3)
    assert f"lora_linear_fused_graphed_host_busy_ms_{t}" not in m  # no busy-device column in these rows
    assert m["lora_linear_fused_pure_cublas_failed_cells"] == 1


def test_host_time_behind_a_busy_device_is_recorded_beside_the_idle_one(tmp_path):
    t = fused_lora_kernels.TARGET_CELL
    rows = [{**_row(t, v, rep, ms), "host_ms": idle, "host_busy_ms": busy, "host_waits": 0}
            for v, ms, idle, busy in (("base", 3.0, 0.4, 0.1), ("peft", 7.0, 1.2, 0.6), ("fused", 3.6, 1.7, 0.9))
            for rep in range(2)]
    measure.write_csv(rows, tmp_path / fused_lora_kernels.LINEAR_CSV)
    m = fused_lora_kernels.benchmark_metrics(tmp_path)
    assert m[f"lora_linear_fused_host_ms_{t}"]["samples"] == pytest.approx([1.7, 1.7])
    assert m[f"lora_linear_fused_host_busy_ms_{t}"]["samples"] == pytest.approx([0.9, 0.9])
    assert m[f"lora_linear_base_host_busy_ms_{t}"]["median"] == pytest.approx(0.1)
    assert "lora_linear_fused_cublas_base_qdb_worst_time_vs_base" not in m  # not timed: no metric


def test_sessions_run_one_process_each_then_summarise_the_pooled_rows(bench, monkeypatch, tmp_path):
    """--sessions N: the script once per session (--out, --sessions and --ledger left to the parent), then the
    pooled rows' summary, figures and ledger figures once."""
    calls = []

    def sessions(script, args, out, names, sessions):
        calls.append((list(args), list(names), sessions))
        rows = [_row(cell, v, rep, ms, session=None) for cell in ("8k_4096x4096_r16", fused_lora_kernels.TARGET_CELL)
                for v, ms in (("base", 1.0), ("peft", 2.0), ("fused", 1.2)) for rep in range(4)]
        measure.write_csv(rows, out / bench.CSV)

    monkeypatch.setattr(bench.measure, "run_script_sessions", sessions)
    ledger = tmp_path / "ledger.csv"
    bench.main(["--out", str(tmp_path), "--variants", "base,peft,fused", "--sessions", "2", "--ledger", str(ledger),
                "--repetitions", "2"])
    assert calls == [(["--variants", "base,peft,fused", "--repetitions", "2"], [bench.CSV, bench.COMPONENTS_CSV], 2)]
    summary = measure.read_csv(tmp_path / bench.SUMMARY_CSV)
    assert {(s["variant"], s["n"]) for s in summary} == {("base", 4), ("peft", 4), ("fused", 4)}
    assert ledger.read_text().count("\n") > 1 and (tmp_path / "05_lora_linear_ratio.png").stat().st_size > 0


def test_components_medians_go_into_the_ledger_with_the_summary(bench, monkeypatch, tmp_path):
    """A components table (--components) comes back in the ledger file too, each component's median and 95%
    interval over the pooled repetitions, so a run whose folder is not packed still brings it back."""
    t = fused_lora_kernels.TARGET_CELL

    def sessions(script, args, out, names, sessions):
        rows = [_row(t, v, rep, ms, session=None) for v, ms in (("base", 3.0), ("peft", 7.0), ("fused", 3.6))
                for rep in range(4)]
        measure.write_csv(rows, out / bench.CSV)
        comps = [{"cell": t, "M": 32768, "K": 4096, "N": 4096, "r": 16, "dtype": "bfloat16", "smoke": False,
                  "component": name, "rep": rep, "ms": ms + 0.01 * rep, "session": rep % 2}
                 for name, ms in (("cublas_fwd_gemm", 1.5), ("quack_fwd_gemm", 1.6)) for rep in range(4)]
        measure.write_csv(comps, out / bench.COMPONENTS_CSV)

    monkeypatch.setattr(bench.measure, "run_script_sessions", sessions)
    ledger = tmp_path / "ledger.csv"
    bench.main(["--out", str(tmp_path), "--variants", "base,peft,fused", "--sessions", "2", "--ledger", str(ledger),
                "--components", "target"])
    with open(ledger, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["benchmark"] == "lora_linear_components"]
    medians = {r["method"]: float(r["value"]) for r in rows if r["statistic"] == "median"}
    assert medians == pytest.approx({"cublas_fwd_gemm": 1.515, "quack_fwd_gemm": 1.615})
    assert {r["statistic"] for r in rows} == {"median", "ci_low", "ci_high"}
    assert {(r["n"], r["sessions"]) for r in rows} == {("4", "2")}
    assert all("M=32768" in r["cell"] and r["source"] == bench.COMPONENTS_CSV for r in rows)


def test_a_run_without_components_leaves_no_earlier_components_table(bench, monkeypatch, tmp_path):
    (tmp_path / bench.COMPONENTS_CSV).write_text("cell,component,rep,ms\nx,stale,0,1.0\n")
    monkeypatch.setattr(bench, "check_device", lambda smoke: torch.device("cpu"))
    monkeypatch.setattr(bench, "grid_cells", lambda args: {})
    monkeypatch.setattr(bench, "plot", lambda *args: None)
    ledger = tmp_path / "ledger.csv"
    bench.main(["--out", str(tmp_path), "--variants", "base", "--ledger", str(ledger)])
    assert not (tmp_path / bench.COMPONENTS_CSV).exists()
    assert "stale" not in (ledger.read_text() if ledger.exists() else "")


def test_sessions_without_components_file_no_earlier_components_table(bench, monkeypatch, tmp_path):
    """The pooled run (--sessions) too: a components table left in the folder by an earlier run is not filed."""
    t = fused_lora_kernels.TARGET_CELL
    (tmp_path / bench.COMPONENTS_CSV).write_text("cell,component,rep,ms\nx,stale,0,1.0\n")

    def sessions(script, args, out, names, sessions):
        rows = [_row(t, v, rep, ms) for v, ms in (("base", 3.0), ("peft", 7.0), ("fused", 3.6)) for rep in range(4)]
        measure.write_csv(rows, out / bench.CSV)

    monkeypatch.setattr(bench.measure, "run_script_sessions", sessions)
    ledger = tmp_path / "ledger.csv"
    bench.main(["--out", str(tmp_path), "--variants", "base,peft,fused", "--sessions", "2", "--ledger", str(ledger)])
    assert not (tmp_path / bench.COMPONENTS_CSV).exists()
    assert "stale" not in ledger.read_text() and "lora_linear_components" not in ledger.read_text()


def test_calls_sets_the_timed_calls_of_both_loops(bench, monkeypatch):
    seen = []

    def loop(fn, calls, warmup):
        seen.append(calls)
        return [1.0] * calls

    monkeypatch.setattr(bench.measure, "loop_ms", loop)
    monkeypatch.setattr(bench.measure, "host_ms", loop)
    args = bench.parse_args(["--out", "o", "--calls", "4", "--variants", "base,peft"])
    args.variants = ["base", "peft"]
    bench.measure_cell("c", (8, 16, 16, 2), args, None, torch.float32, torch.device("cpu"), False)
    assert seen and set(seen) == {4}
    seen.clear()
    bench.measure_cell("c", (8, 16, 16, 2), args, None, torch.float32, torch.device("cpu"), True)
    assert set(seen) == {bench.LOOP[True]["calls"]}  # --smoke: the code path, in as few calls as it takes


def test_a_variant_missing_from_one_cell_is_a_dash_in_the_table_and_no_bar(bench, capsys, tmp_path):
    rows = [_row(cell, v, 0, 1.0) for cell in ("8k_4096x4096_r16", "32k_4096x4096_r16") for v in ("base", "peft")]
    rows.append(_row("8k_4096x4096_r16", "fused_graphed", 0, 1.1))  # failed (no row) in the other cell
    summary = bench.summary_rows(rows)
    bench.print_table(summary)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split("|")[1].split()[-1] == "-"
    bench.plot(summary, rows, tmp_path)
    assert (tmp_path / "05_lora_linear_ratio.png").stat().st_size > 0


def test_the_quack_route_is_a_skipped_row_naming_why_where_it_cannot_run(bench):
    """Never the Triton route timed under QuACK's name: off a Hopper GPU with QuACK, its rows are skipped."""
    args = argparse.Namespace(variants=["base", "peft", "fused_quack", "fused_quack_graphed"], repetitions=1,
                              warmup_ms=1.0, rep_ms=2.0, forward=False, components="none")
    from lora_lab.kernels import KernelConfig
    from lora_lab.kernels.lora import quack_gemm

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rows, _ = bench.measure_cell("c", (64, 32, 32, 4), args, KernelConfig(autotune=False), torch.bfloat16, device,
                                 not cuda)
    skipped = {r["variant"]: r["error"] for r in rows if r["status"] == "skipped"}
    reason = quack_gemm.unavailable_reason(64, 32, 32, 4, torch.bfloat16, device)
    if reason is None:
        assert not skipped
    else:
        assert skipped["fused_quack"] == reason
        assert "fused_quack_graphed" in skipped
    big = bench.skip_reason("fused_quack", device, (32768, 4096, 4096, 64), torch.bfloat16)
    assert "rank 64 is above" in big or "CUDA devices" in big or "cannot be imported" in big


def test_quack_route_metrics_need_only_the_target_cell_and_stay_out_of_the_best_route(tmp_path):
    t, r64 = fused_lora_kernels.TARGET_CELL, "32k_4096x4096_r64"
    rows = [_row(cell, v, rep, ms) for rep in range(2) for cell, v, ms in (
        (t, "base", 3.0), (t, "fused_cublas_base", 3.6), (t, "fused_quack", 3.3), (t, "fused_quack_qdb", 3.24),
        (t, "base_graphed", 3.0),
        (t, "fused_quack_graphed", 3.15), (r64, "base", 3.0), (r64, "fused_cublas_base", 3.9),
        (r64, "base_graphed", 3.0), (t, "peft", 7.0), (t, "fused", 3.6), (r64, "peft", 7.0), (r64, "fused", 3.7))]
    rows += [_row(r64, "fused_quack", 0, None, status="skipped"), _row(r64, "fused_quack_graphed", 0, None,
                                                                       status="skipped")]
    measure.write_csv(rows, tmp_path / fused_lora_kernels.LINEAR_CSV)
    m = fused_lora_kernels.benchmark_metrics(tmp_path)
    assert m[f"lora_linear_fused_quack_time_vs_base_{t}"]["samples"] == pytest.approx([1.1, 1.1])
    assert m[f"lora_linear_fused_quack_qdb_time_vs_base_{t}"]["samples"] == pytest.approx([1.08, 1.08])
    assert m[f"lora_linear_fused_quack_graphed_time_vs_base_graphed_{t}"]["samples"] == pytest.approx([1.05, 1.05])
    assert f"lora_linear_fused_quack_host_ms_{t}" in m
    assert "lora_linear_fused_quack_worst_time_vs_base" not in m  # not run in the r = 64 cell
    assert m["lora_linear_routes_best_worst_time_vs_base"]["samples"] == pytest.approx([1.3, 1.3])  # cuBLAS only


def test_wide_route_metrics_in_every_cell_and_out_of_the_best_route(tmp_path):
    t, r64 = fused_lora_kernels.TARGET_CELL, "32k_4096x4096_r64"
    rows = [_row(cell, v, rep, ms) for rep in range(2) for cell, v, ms in (
        (t, "base", 3.0), (t, "fused_cublas_base", 3.6), (t, "fused_wide", 3.39), (t, "base_graphed", 3.0),
        (t, "fused_wide_graphed", 3.3), (r64, "base", 3.0), (r64, "fused_cublas_base", 3.9), (r64, "fused_wide", 3.6),
        (r64, "base_graphed", 3.0), (r64, "fused_wide_graphed", 3.45), (t, "peft", 7.0), (t, "fused", 3.6),
        (r64, "peft", 7.0), (r64, "fused", 3.7))]
    measure.write_csv(rows, tmp_path / fused_lora_kernels.LINEAR_CSV)
    m = fused_lora_kernels.benchmark_metrics(tmp_path)
    assert m[f"lora_linear_fused_wide_time_vs_base_{t}"]["samples"] == pytest.approx([1.13, 1.13])
    assert m["lora_linear_fused_wide_worst_time_vs_base"]["samples"] == pytest.approx([1.2, 1.2])
    assert m[f"lora_linear_fused_wide_graphed_time_vs_base_graphed_{t}"]["samples"] == pytest.approx([1.1, 1.1])
    assert m["lora_linear_fused_wide_graphed_worst_time_vs_base_graphed"]["samples"] == pytest.approx([1.15, 1.15])
    assert f"lora_linear_fused_wide_host_ms_{t}" in m
    assert m["lora_linear_routes_best_worst_time_vs_base"]["samples"] == pytest.approx([1.3, 1.3])  # cuBLAS only


def test_merged_route_metrics_in_every_cell_and_out_of_the_best_route(tmp_path):
    t, r64 = fused_lora_kernels.TARGET_CELL, "32k_4096x4096_r64"
    rows = [_row(cell, v, rep, ms) for rep in range(2) for cell, v, ms in (
        (t, "base", 3.0), (t, "fused_cublas_base", 3.6), (t, "fused_merged", 3.3), (t, "fused_merged_qdb", 3.24),
        (t, "base_graphed", 3.0), (t, "fused_merged_graphed", 3.15), (r64, "base", 3.0),
        (r64, "fused_cublas_base", 3.9), (r64, "fused_merged", 3.6), (r64, "fused_merged_qdb", 3.45),
        (r64, "base_graphed", 3.0), (r64, "fused_merged_graphed", 3.3), (t, "peft", 7.0), (t, "fused", 3.6),
        (r64, "peft", 7.0), (r64, "fused", 3.7))]
    measure.write_csv(rows, tmp_path / fused_lora_kernels.LINEAR_CSV)
    m = fused_lora_kernels.benchmark_metrics(tmp_path)
    assert m[f"lora_linear_fused_merged_time_vs_base_{t}"]["samples"] == pytest.approx([1.1, 1.1])
    assert m[f"lora_linear_fused_merged_qdb_time_vs_base_{t}"]["samples"] == pytest.approx([1.08, 1.08])
    assert m["lora_linear_fused_merged_worst_time_vs_base"]["samples"] == pytest.approx([1.2, 1.2])
    assert m["lora_linear_fused_merged_qdb_worst_time_vs_base"]["samples"] == pytest.approx([1.15, 1.15])
    assert m[f"lora_linear_fused_merged_graphed_time_vs_base_graphed_{t}"]["samples"] == pytest.approx([1.05, 1.05])
    assert f"lora_linear_fused_merged_host_ms_{t}" in m
    assert m["lora_linear_routes_best_worst_time_vs_base"]["samples"] == pytest.approx([1.3, 1.3])  # cuBLAS only


def test_the_merge_component_is_the_merged_weight(bench):
    from lora_lab.kernels import KernelConfig

    gen = torch.Generator().manual_seed(0)
    M, K, N, r = 24, 40, 32, 4
    x, dy = torch.randn(M, K, generator=gen), torch.randn(M, N, generator=gen)
    w, a, b = torch.randn(N, K, generator=gen), torch.randn(r, K, generator=gen), torch.randn(N, r, generator=gen)
    A, B = torch.nn.Parameter(a), torch.nn.Parameter(b)
    parts = bench.components(x, dy, w, A, B, KernelConfig(autotune=False))
    torch.testing.assert_close(parts["merge_weight"](), w + 2.0 * b @ a)
    torch.testing.assert_close(parts["merge_weight_triton"](), w + 2.0 * b @ a)


def test_a_quack_route_skipped_at_the_target_cell_voids_its_predictions_naming_why(tmp_path):
    from lora_lab.lab import rules
    from lora_lab.memory import budget

    t = fused_lora_kernels.TARGET_CELL
    rows = [_row(t, v, rep, 3.0) for rep in range(2) for v in ("base", "peft", "fused")]
    rows += [{**_row(t, v, 0, None, status="skipped"), "error": "QuACK cannot be imported (ModuleNotFoundError)"}
             for v in fused_lora_kernels.QUACK_VARIANTS]
    measure.write_csv(rows, tmp_path / fused_lora_kernels.LINEAR_CSV)
    budget.clear_skipped()
    try:
        fused_lora_kernels.benchmark_metrics(tmp_path)
        payload = {"skipped_cells": budget.skipped_cells()}
    finally:
        budget.clear_skipped()
    cell, why = rules.skipped_cell_of(f"lora_linear_fused_quack_graphed_time_vs_base_{t}", payload)
    assert cell == "fused_quack_graphed" and "QuACK cannot be imported" in why
    assert rules.skipped_cell_of(f"lora_linear_fused_quack_host_ms_{t}", payload)[0] == "fused_quack"
    assert rules.skipped_cell_of(f"lora_linear_fused_quack_qdb_time_vs_base_{t}", payload)[0] == "fused_quack_qdb"


def test_host_busy_is_timed_in_the_cells_the_option_names(bench, monkeypatch):
    target, small = bench.scaled(bench.TARGET, False), (8192, 4096, 4096, 16)
    assert bench.host_busy_here("target", target, False) and not bench.host_busy_here("target", small, False)
    assert bench.host_busy_here("all", small, False) and not bench.host_busy_here("none", target, False)
    assert bench.host_busy_here("target", bench.scaled(bench.TARGET, True), True)  # --smoke: the scaled target
    assert bench.parse_args(["--out", "o"]).host_busy == "target"
    seen = []  # a CPU never times it, whatever the option
    monkeypatch.setattr(bench, "host_busy", lambda step, loop, measured: seen.append(measured) or
                        {"host_busy_ms": None, "host_waits": None})
    from lora_lab.kernels import KernelConfig

    args = argparse.Namespace(variants=["base", "peft"], repetitions=1, warmup_ms=1.0, rep_ms=2.0, forward=False,
                              components="none", host_busy="all")
    bench.measure_cell("c", (8, 16, 16, 2), args, KernelConfig(autotune=False), torch.float32, torch.device("cpu"),
                       True)
    assert seen and set(seen) == {False}


def test_the_widened_gemms_compute_the_lora_linear_and_its_dx(bench):
    """K-widening components: [X | P] · [W | B]ᵀ is the forward (P = s · X Aᵀ) and [dY | Q] · [W ; A] the input
    gradient (Q = s · dY B), each one GEMM with r more columns in its reduction (fp32, on the CPU)."""
    gen = torch.Generator().manual_seed(0)
    M, K, N, r, s = 24, 40, 32, 4, 2.0
    x, dy = torch.randn(M, K, generator=gen), torch.randn(M, N, generator=gen)
    w, a, b = torch.randn(N, K, generator=gen), torch.randn(r, K, generator=gen), torch.randn(N, r, generator=gen)
    p, q = s * x @ a.t(), s * dy @ b
    parts = bench._wide_components(x, dy, w, a, b, p, q)
    torch.testing.assert_close(parts["cublas_wide_fwd_gemm"](), x @ w.t() + s * (x @ a.t()) @ b.t())
    torch.testing.assert_close(parts["cublas_wide_dx_gemm"](), dy @ w + s * (dy @ b) @ a)
    assert parts["wide_dy_copy"]().shape == (M, N + r)
