"""lora_lab.lab.prose on tiny repositories: prose may state only recorded, cited or structural numbers."""
import json
from pathlib import Path

import pytest

from lora_lab.lab.cli import main
from lora_lab.lab.prose import check_prose

METRICS = {
    "peft_time_vs_base": 2.4064,
    "trainable_share_percent": 0.1094,
    "trainable_share": 0.0011,
    "trainable_params": 540672,
    "drift": 7.3e-4,
    "time_vs_base": {"median": 1.1528, "ci95": [1.149, 1.157], "min": 1.147, "max": 1.16, "n": 3,
                     "samples": [1.147, 1.1528, 1.16]},
    "curve": {"q, v": [0.0137, 0.0274]},
}
PREDICTIONS = """\
- id: p01-share
  notebook: 01_demo
  metric: trainable_share_percent
  comparator: in_range
  threshold: [0.105, 0.115]
- id: p02-other
  notebook: 02_other
  metric: speed
  comparator: ">="
  threshold: 3.75
"""
PARAMETERS = 'PROFILE = "auto"\nTOKENS = 512\nLENGTHS = "4096,8192"\nLR = 1e-3\n'


def make_repo(root: Path, *cells: str, readme: str = "# demo\n", metrics: dict | None = None) -> Path:
    """A repo with notebooks/01_demo.ipynb (a parameters cell, then one markdown cell per argument)."""
    (root / "notebooks").mkdir(parents=True)
    notebook_cells = [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": PARAMETERS,
                       "outputs": [], "execution_count": None}]
    notebook_cells += [{"cell_type": "markdown", "metadata": {}, "source": text.splitlines(keepends=True)}
                       for text in cells]
    notebook = {"cells": notebook_cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (root / "notebooks" / "01_demo.ipynb").write_text(json.dumps(notebook))
    (root / "outputs" / "gpu").mkdir(parents=True)
    record = {"notebook": "01_demo", "profile": "gpu", "parameters": {"SEQ": 2048},
              "metrics": METRICS if metrics is None else metrics}
    (root / "outputs" / "gpu" / "01_demo.metrics.json").write_text(json.dumps(record))
    (root / "predictions").mkdir()
    (root / "predictions" / "predictions.yaml").write_text(PREDICTIONS)
    (root / "lora_lab" / "configs").mkdir(parents=True)
    (root / "lora_lab" / "configs" / "x.json").write_text(json.dumps({"hidden_size": 896, "rope_theta": 1e6}))
    (root / "README.md").write_text(readme)
    return root


def flagged(root: Path) -> list[str]:
    return [violation.number for violation in check_prose(root).violations]


@pytest.mark.parametrize("text", [
    "PEFT costs 2.41× the frozen layer.",
    "PEFT costs 2.4× the frozen layer, about 2.4x.",
    "The share is 0.11% of the base.",
    "The share is 0.1094 percent, i.e. 0.11%.",
    "It trains 540,672 parameters.",
    "It trains 540672 parameters.",
    "The drift was 7.3e-4, or $7.3\\cdot10^{-4}$, or 7.3·10⁻⁴, or 7.3·10^-4.",
    "The drift was $7.30 \\cdot 10^{-4}$.",
    "Registered range: 0.105 to 0.115.",
    "At 512 tokens, lengths 4096 and 8,192, lr $10^{-3}$ (1e-3); sequence 2,048.",
    "Hidden size 896 (config).",
    "Median 1.15×, interval 1.149–1.157, samples from 1.147 to 1.16.",
    "Curve 0.014 and 0.027.",
])
def test_recorded_numbers_at_printed_precision_pass(tmp_path, text):
    assert flagged(make_repo(tmp_path, text)) == []


@pytest.mark.parametrize("text, number", [
    ("PEFT costs about 1.6× here.", "1.6×"),
    ("PEFT costs 2.42× the frozen layer.", "2.42×"),
    ("It trains 540,673 parameters.", "540,673"),
    ("It trains 540672.0 parameters.", None),  # one decimal printed: 540672.0 is the value rounded
    ("The share is 0.13%.", "0.13%"),  # 0.12% would be the registered bound 0.115
    ("The drift was 7.4e-4.", "7.4e-4"),
    ("The drift was $7.4\\cdot10^{-4}$.", "7.4\\cdot10^{-4}"),
    ("A 2× gap.", "2×"),
    ("The other notebook's 3.75 is not ours.", "3.75"),
])
def test_hand_typed_numbers_fail(tmp_path, text, number):
    assert flagged(make_repo(tmp_path, text)) == ([number] if number else [])


def test_integers_match_only_exactly(tmp_path):
    assert flagged(make_repo(tmp_path, "About 2,406 of them.", metrics={"count": 2406.4})) == ["2,406"]


@pytest.mark.parametrize("text", [
    "The article [article] measured 1.6× and 14.6.",
    "The original write-up ([the article][article]) measured 1.6×.",
    "PEFT's docs [say so](https://huggingface.co/docs/peft) at 1.6×.",
])
def test_cited_numbers_pass(tmp_path, text):
    definition = '\n\n[article]: #sources "the original write-up"\n'
    assert flagged(make_repo(tmp_path, text + definition)) == []


def test_citation_covers_its_sentence_only(tmp_path):
    text = 'The article [article] measured 1.6×. We measured 1.7×; it said 1.8×\nand 1.9× [article].\n\n' \
           '[article]: #sources "the original write-up"\n'
    assert flagged(make_repo(tmp_path, text)) == ["1.7×", "1.8×"]


def test_undefined_reference_and_internal_link_do_not_cite(tmp_path):
    text = "The article [article] measured 1.6×; see [section](#sources) for 1.7×."
    assert flagged(make_repo(tmp_path, text)) == ["1.6×", "1.7×"]


def test_reference_defined_in_another_cell_of_the_notebook_cites(tmp_path):
    repo = make_repo(tmp_path, "As [article] says, 1.6×.", '[article]: https://example.com/post "the post"\n')
    assert flagged(repo) == []


def test_structure_is_not_checked(tmp_path):
    text = """\
## 3. Section 77.5 is content, 3 is its number
### 3.1 Sub

1. first item with `x = 1.6` in code
2. Qwen2.5-0.5B on an H200 in fp32 and bf16, q_proj, p05-single-worst-cell, sm_90, r16, top-8, x86
3. transformers 5.17.0, 4096x4096 shapes, 0x1F

```python
speedup = 1.6  # fenced
```

~~~
1234
~~~

<!-- 999.5 in a comment
spanning lines -->
Two layers, r = 8, 24 heads, 3 × 4 bytes. ![plot](outputs/gpu/123.png) <img width="640" src="a.png">
See [section](notes/1234.md) and https://example.com/777 &#8212; math $\\mathbb{R}^{d}$, $W_{4096}$.

[ref]: https://example.com/2023 "1999 cited"
"""
    assert flagged(make_repo(tmp_path, text)) == ["77.5"]


def test_small_integers_need_a_ratio_or_percent_sign_to_be_checked(tmp_path):
    assert flagged(make_repo(tmp_path, "2 layers, 6.0 copies, 5%, 7×, 9x, 100 steps.")) == \
        ["6.0", "5%", "7×", "9x", "100"]


def test_repeated_measurement_dicts_count(tmp_path):
    text = "Median 1.1528, interval [1.149, 1.157], min 1.147, max 1.160 over 3 runs."
    assert flagged(make_repo(tmp_path, text)) == []
    assert flagged(make_repo(tmp_path / "other", text, metrics={"time_vs_base": 1.1528})) == \
        ["1.149", "1.157", "1.147", "1.160"]


def test_readmes_use_the_union_of_all_notebooks(tmp_path):
    repo = make_repo(tmp_path, "Nothing here.", readme="# demo\n\nPEFT: 2.41×; other notebook 3.75; hand 4.56.\n")
    (repo / "benchmarks").mkdir()
    (repo / "benchmarks" / "README.md").write_text("| a | b |\n|---|---|\n| 0.11% | 9.99× |\n")
    report = check_prose(repo)
    assert [(v.path, v.cell, v.line, v.number) for v in report.violations] == [
        ("README.md", None, 3, "4.56"), ("benchmarks/README.md", None, 3, "9.99×")]


def test_docs_pages_are_checked_like_the_readmes(tmp_path):
    repo = make_repo(tmp_path, "Nothing here.")
    (repo / "docs").mkdir()
    (repo / "docs" / "kernels.md").write_text("# Kernels\n\nThe op runs at 2.41× PEFT, or 7.77× by hand.\n")
    report = check_prose(repo)
    assert [(v.path, v.line, v.number) for v in report.violations] == [("docs/kernels.md", 3, "7.77×")]


def test_the_generated_runs_table_is_structure_and_the_prose_around_it_is_checked(tmp_path):
    from lora_lab.lab.run_table import MATRIX_END, MATRIX_START

    repo = make_repo(tmp_path, "Nothing here.")
    (repo / "docs").mkdir()
    (repo / "docs" / "gpu.md").write_text(f"# GPU\n\n{MATRIX_START}\n| 05 | 579 s, 38.9 GiB |\n{MATRIX_END}\n\n"
                                          "After it, 7.77× by hand.\n")
    report = check_prose(repo)
    assert [(v.line, v.number) for v in report.violations] == [(7, "7.77×")]


def test_report_names_file_cell_line_and_number(tmp_path):
    repo = make_repo(tmp_path, "Fine: 2.41×.", "Intro.\nPEFT's layer costs about 1.6× at $M=32768$.\n")
    report = check_prose(repo)
    assert not report.ok
    assert len(report.violations) == 2
    violation = report.violations[0]
    where = ("notebooks/01_demo.ipynb", 2, 2, "1.6×")
    assert (violation.path, violation.cell, violation.line, violation.number) == where
    assert "costs about 1.6× at" in violation.context
    text = report.text()
    assert "notebooks/01_demo.ipynb cell 2 line 2: 1.6×" in text
    assert text.splitlines()[-1].startswith("check-prose: 2 unchecked number(s) in 1 file(s); 3 numbers checked")
    assert "32768" in text  # the other unrecorded number
    assert "cite it" in text and "record" in text


def test_clean_report(tmp_path):
    report = check_prose(make_repo(tmp_path, "PEFT costs 2.41× the frozen layer."))
    assert report.ok and report.checked == 1
    assert report.text() == "check-prose OK: 1 numbers checked in 2 files"


def test_missing_outputs_and_predictions_are_no_error(tmp_path):
    repo = make_repo(tmp_path, "At 512 tokens, 2.41×.")
    (repo / "predictions" / "predictions.yaml").unlink()
    (repo / "outputs" / "gpu" / "01_demo.metrics.json").unlink()
    assert flagged(repo) == ["2.41×"]


def test_cli_exit_codes(tmp_path, capsys):
    bad = make_repo(tmp_path / "bad", "PEFT costs about 1.6×.")
    assert main(["check-prose", "--repo", str(bad)]) == 1
    assert "notebooks/01_demo.ipynb cell 1 line 1: 1.6×" in capsys.readouterr().out
    clean = make_repo(tmp_path / "clean", "PEFT costs 2.41×.")
    assert main(["check-prose", "--repo", str(clean)]) == 0
    assert "check-prose OK" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["empty", "missing"])
def test_checking_nothing_fails_and_names_the_directory(tmp_path, capsys, where):
    """A bogus --repo (or a run outside the checkout) once printed "OK: 0 numbers checked in 0 files"."""
    repo = tmp_path / where
    if where == "empty":
        repo.mkdir()
    report = check_prose(repo)
    assert not report.ok and report.files == 0
    assert main(["check-prose", "--repo", str(repo)]) == 1
    out = capsys.readouterr().out
    assert f"nothing to check in {repo}" in out and "OK" not in out
    assert ("no such directory" in out) == (where == "missing")


# Notebook 07's "What this run found" as it stood after its republication: figures of the run before (0.956, 1.353,
# 81.652 and its interval) against the published run's metrics (0.957, 1.366, 81.681).
STALE_07 = """\
### What this run found

Against Liger its largest time ratio over the four cells was `0.956` (median over repetitions,
interval `[0.948, 0.962]`; at the Llama-3-8B head, frozen). Against its own three-GEMM floor the largest ratio
was `1.353`, at the Qwen2.5-0.5B head ($d$ `896`). At the Llama-3-8B head it took
`81.652` ms trainable (median, two sessions; interval `[80.762, 82.092]`), over the `75` ms targeted.
"""
RUN_07 = {  # the published run's medians and intervals (outputs/gpu/07_loss_block.metrics.json)
    "time_vs_liger_max": {"median": 0.9569327, "ci95": [0.9489168, 0.9634756], "n": 10},
    "time_vs_three_gemm_floor_max": {"median": 1.3658570, "ci95": [1.3144553, 1.3847740], "n": 10},
    "lora_lab_ms_llama3-8b_16384_trainable": {"median": 81.6806641, "ci95": [80.3726215, 82.2556648], "n": 10},
}


def test_a_figure_in_a_code_span_must_be_this_runs(tmp_path):
    root = make_repo(tmp_path, STALE_07, metrics=RUN_07)
    assert flagged(root) == ["0.956", "0.948", "0.962", "1.353", "81.652", "80.762", "82.092"]
    fixed = (STALE_07.replace("`0.956`", "`0.957`").replace("`[0.948, 0.962]`", "`[0.949, 0.963]`")
             .replace("`1.353`", "`1.366`").replace("`81.652`", "`81.681`")
             .replace("`[80.762, 82.092]`", "`[80.373, 82.256]`"))
    assert flagged(make_repo(tmp_path / "fixed", fixed, metrics=RUN_07)) == []


def test_integers_in_code_spans_stay_structure(tmp_path):
    assert flagged(make_repo(tmp_path, "A head of $V$ `128,256` and `16,384` tokens, `4096` wide.\n")) == []
