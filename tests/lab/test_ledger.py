"""The measurement ledger: rows appended, checked before anything is written, read back typed; never rewritten."""
import pytest

from lora_lab.lab import ledger
from lora_lab.lab.ledger import COLUMNS, LedgerError, append_measurements, read_measurements

GIVEN = {"date": "2026-12-01", "commit": "abc1234", "code_hash": "0123456789abcdef", "device": "NVIDIA H200"}


def row(**changes):
    base = {**GIVEN, "benchmark": "loss", "cell": "shape=llama3-8b;tokens=16384;head=trainable",
            "method": "lora_lab", "statistic": "median", "value": 81.68, "unit": "ms", "n": 10, "sessions": 2,
            "published": True, "source": "07_loss_block_summary.csv"}
    return {**base, **changes}


def test_append_writes_the_header_once_and_reads_back_typed(tmp_path):
    path = tmp_path / "gpu" / "measurements.csv"
    append_measurements([row()], ledger=path)
    append_measurements([row(statistic="ci_low", value=80.37), row(statistic="ci_high", value=82.26, n=None)],
                        ledger=path)
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(COLUMNS) and len(lines) == 4
    rows = read_measurements(ledger=path)
    assert [r["statistic"] for r in rows] == ["median", "ci_low", "ci_high"]
    assert rows[0]["value"] == 81.68 and rows[0]["n"] == 10 and rows[0]["sessions"] == 2
    assert rows[0]["published"] is True and rows[2]["n"] is None
    assert [r["value"] for r in read_measurements(ledger=path, statistic="ci_high")] == [82.26]


def test_append_never_rewrites_what_is_there(tmp_path):
    path = tmp_path / "measurements.csv"
    append_measurements([row()], ledger=path)
    before = path.read_bytes()
    append_measurements([row(method="liger", value=92.26)], ledger=path)
    after = path.read_bytes()
    assert after.startswith(before) and len(after) > len(before)


def test_a_bad_row_writes_nothing_and_names_the_column(tmp_path):
    path = tmp_path / "measurements.csv"
    append_measurements([row()], ledger=path)
    before = path.read_bytes()
    with pytest.raises(LedgerError, match=r"row 1: value must be a finite number, got 'fast'"):
        append_measurements([row(), row(value="fast")], ledger=path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("changes, message", [
    ({"colour": "red"}, r"unknown column\(s\) 'colour'"),
    ({"benchmark": ""}, r"missing benchmark"),
    ({"value": float("nan")}, r"value must be a finite number"),
    ({"value": True}, r"value must be a finite number"),
    ({"n": 0}, r"n must be a whole number >= 1 or empty, got 0"),
    ({"sessions": 1.5}, r"sessions must be a whole number"),
    ({"date": "04.12.2026"}, r"date must be YYYY-MM-DD"),
    ({"date": "2026-02-30"}, r"no calendar day"),
    ({"commit": "HEAD"}, r"commit must be lowercase hex"),
    ({"code_hash": "xyz"}, r"code_hash must be lowercase hex"),
    ({"statistic": "Median 95%"}, r"statistic must be a lowercase name"),
    ({"published": "yes"}, r"published must be true or false"),
    ({"cell": "a\nb"}, r"cell must be one line"),
    ({"method": 3}, r"method must be text"),
])
def test_validation_errors_name_the_problem(tmp_path, changes, message):
    with pytest.raises(LedgerError, match=message):
        append_measurements([row(**changes)], ledger=tmp_path / "m.csv")
    assert not (tmp_path / "m.csv").exists()


def test_refuses_a_file_that_is_not_a_ledger(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("shape,ms\nx,1\n")
    with pytest.raises(LedgerError, match="not a measurement ledger"):
        append_measurements([row()], ledger=path)
    with pytest.raises(LedgerError, match="not a measurement ledger"):
        read_measurements(ledger=path)
    path.write_text(",".join(COLUMNS) + "\n2026-12-01,abc1234")  # cut mid-line
    with pytest.raises(LedgerError, match="unfinished"):
        append_measurements([row()], ledger=path)


def test_defaults_fill_provenance_from_the_running_code(tmp_path):
    from lora_lab.lab.provenance import code_hash, cpu_name

    bare = {k: v for k, v in row().items() if k not in GIVEN}
    append_measurements([bare], profile="cpu", ledger=tmp_path / "m.csv")
    (got,) = read_measurements(ledger=tmp_path / "m.csv")
    assert got["code_hash"] == code_hash() and got["device"] == cpu_name()
    assert len(got["date"]) == 10 and got["date"][4] == "-"


def test_ledger_path_is_per_profile(tmp_path):
    assert ledger.ledger_path("gpu", tmp_path) == tmp_path / "gpu" / "measurements.csv"
    with pytest.raises(LedgerError, match="profile must be one of cpu, gpu"):
        ledger.ledger_path("tpu", tmp_path)
    assert read_measurements("cpu", outputs_root=tmp_path) == []  # no ledger yet: no rows


def test_summary_figures_are_median_and_interval():
    from lora_lab.lab import measure

    summary = measure.summarize([1.0, 2.0, 3.0, 4.0, 5.0], sessions=2)
    rows = ledger.summary_figures(summary, benchmark="b", cell="c=1", method="ours", unit="ms", source="s.csv")
    assert [(r["statistic"], r["n"], r["sessions"]) for r in rows] == [("median", 5, 2), ("ci_low", 5, 2),
                                                                       ("ci_high", 5, 2)]
    assert rows[0]["value"] == 3.0


def test_table_figures_from_a_summary_table(tmp_path):
    table = [{"shape": "llama3-8b", "tokens": "16384", "head": "trainable", "method": "lora_lab", "status": "ok",
              "note": "a long description, with spaces", "ms": "81.68", "ms_ci95_low": "80.37",
              "ms_ci95_high": "82.26", "n": "10", "time_vs_liger": "0.884", "peak_extra_gib": "",
              "code_hash": "ab" * 32, "git_commit": "13cbd78", "git_dirty": "False"}]
    rows = ledger.table_figures(table, benchmark="loss", source="07_loss_block_summary.csv")
    got = {r["statistic"]: (r["value"], r["unit"]) for r in rows}
    assert got == {"median": (81.68, "ms"), "ci_low": (80.37, "ms"), "ci_high": (82.26, "ms"),
                   "time_vs_liger": (0.884, "ratio")}
    assert {r["cell"] for r in rows} == {"shape=llama3-8b;tokens=16384;head=trainable"}
    assert {(r["commit"], r["code_hash"], r["n"]) for r in rows} == {("13cbd78", "ab" * 32, "10")}
    path = append_measurements(rows, ledger=tmp_path / "m.csv")  # what it gives, the ledger takes
    assert len(read_measurements(ledger=path, method="lora_lab")) == 4


def test_cli_add_then_show(tmp_path, capsys):
    from lora_lab.lab.cli import main

    brought = tmp_path / "brought.csv"
    append_measurements([row(), row(benchmark="moe", method="ours")], ledger=brought)
    target = tmp_path / "gpu" / "measurements.csv"
    assert main(["ledger", "add", "--profile", "gpu", "--ledger", str(target), str(brought)]) == 0
    assert "2 rows" in capsys.readouterr().out
    assert main(["ledger", "show", "--profile", "gpu", "--ledger", str(target), "--benchmark", "moe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ",".join(COLUMNS) and len(lines) == 2 and ",moe," in lines[1]
    assert read_measurements(ledger=target) == read_measurements(ledger=brought)  # copied as they were
    assert main(["ledger", "add", "--profile", "gpu", "--ledger", str(target), str(tmp_path / "none.csv")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_table_figures_from_a_table_of_repetitions():
    table = [{"impl": "ours", "rep": "0", "shape": "qwen3_30b_a3b", "step_ms_each": "1.0 2.0", "loop_ms": "6.3",
              "samples_per_s": "28.4", "kernel": "void k<4>(int, float)"},
             {"impl": "ours", "rep": "1", "shape": "qwen3_30b_a3b", "step_ms_each": "1.5 2.5", "loop_ms": "6.4",
              "samples_per_s": "28.1", "kernel": "void k<4>(int, float)"}]
    rows = ledger.table_figures(table, benchmark="moe_host_profile", source="moe_host_profile.csv")
    assert [(r["cell"], r["statistic"], r["unit"]) for r in rows] == [
        ("shape=qwen3_30b_a3b;rep=0", "loop_ms", "ms"), ("shape=qwen3_30b_a3b;rep=0", "samples_per_s", "1/s"),
        ("shape=qwen3_30b_a3b;rep=1", "loop_ms", "ms"), ("shape=qwen3_30b_a3b;rep=1", "samples_per_s", "1/s")]
    assert all(r["n"] is None for r in rows)  # one repetition each: no sample count claimed


def test_the_committed_ledgers_hold_only_valid_rows():
    for profile in ledger.PROFILES:  # (a loop, not parameters: a test id naming the GPU profile is skipped on CPUs)
        path = ledger.ledger_path(profile)
        if not path.is_file():
            continue
        rows = read_measurements(ledger=path)
        assert rows, f"{path} holds no rows"
        for at, got in enumerate(rows):  # every row as the ledger would take it today
            ledger._clean(got, at, {})


def test_repetition_figures_summarise_each_cell_and_method(tmp_path):
    import csv

    path = tmp_path / "07_loss_block.csv"
    rows = [{"shape": "llama3-8b", "tokens": 16384, "method": m, "rep": r, "session": s, "ms": ms, "status": st,
             "git_commit": "13cbd78", "code_hash": "ab" * 32}
            for m, values in (("lora_lab", (80.0, 81.0, 82.0, 83.0)), ("liger", (90.0, 91.0, None, 93.0)))
            for r, (s, ms) in enumerate(zip((0, 0, 1, 1), values))
            for st in (("ok" if ms is not None else "oom"),)]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    got = ledger.csv_figures(path, published=True)
    assert {r["benchmark"] for r in got} == {"loss_block"} and {r["source"] for r in got} == {path.as_posix()}
    medians = {(r["method"], r["n"], r["sessions"]): r["value"] for r in got if r["statistic"] == "median"}
    assert medians == {("lora_lab", 4, 2): 81.5, ("liger", 3, 2): 91.0}  # the out-of-memory row gives no sample
    assert {r["cell"] for r in got} == {"shape=llama3-8b;tokens=16384"}
    assert all(r["published"] and r["commit"] == "13cbd78" for r in got)
    append_measurements(got, ledger=tmp_path / "m.csv")


def test_table_name_files_a_csv_under_its_table():
    assert ledger.table_name("out/07_loss_block_summary.csv") == "loss_block"
    assert ledger.table_name("moe_weight_grad.csv") == "moe_weight_grad"
