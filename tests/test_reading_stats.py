"""tools/reading_stats.py: words per markdown cell and verdict rows per notebook, read from a commit through git."""
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
try:
    import reading_stats
finally:
    sys.path.pop(0)

HAS_GIT = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode == 0


def test_markdown_words_counts_each_cell_and_marks_appendices():
    notebook = {"cells": [{"cell_type": "markdown", "source": ["# A question\n", "in five words here"]},
                          {"cell_type": "code", "source": "print(1)"},
                          {"cell_type": "markdown", "source": "## Appendix: the panel\n" + "w " * 500}]}
    assert reading_stats.markdown_words(json.dumps(notebook)) == [(7, False), (504, True)]


def test_verdict_rows_come_from_the_reader_table_else_every_unsuperseded_gpu_prediction():
    predictions = [{"id": "a", "notebook": "05_x", "profiles": ["gpu"]},
                   {"id": "b", "notebook": "05_x", "profiles": ["cpu"]},
                   {"id": "c", "notebook": "05_x", "profiles": ["cpu", "gpu"]},
                   {"id": "d", "notebook": "05_x", "profiles": ["gpu"], "supersedes": "a"},
                   {"id": "e", "notebook": "06_y", "profiles": ["gpu"]}]
    assert reading_stats.verdict_rows("05_x", predictions, None) == (2, "every prediction")  # c, d
    tables = {"05_x": {"shown": [{"id": "a"}, {"id": "b"}, {"id": "d"}]}}
    assert reading_stats.verdict_rows("05_x", predictions, tables) == (2, "reader table")  # a, d on gpu


@pytest.mark.skipif(not HAS_GIT, reason="reads the repository's history")
def test_head_agrees_with_the_working_notebooks_and_a_bad_commit_is_named(capsys):
    rows = {r["notebook"]: r for r in reading_stats.stats("HEAD")}
    committed = subprocess.run(["git", "ls-files", "notebooks/"], cwd=ROOT, capture_output=True, text=True).stdout
    assert set(rows) == {Path(p).stem for p in committed.split() if re.fullmatch(r"notebooks/\d\d_.*\.ipynb", p)}
    stem = "01_build_lora_layer"
    text = subprocess.run(["git", "show", f"HEAD:notebooks/{stem}.ipynb"], cwd=ROOT, capture_output=True,
                          text=True).stdout
    cells = [c for c in json.loads(text)["cells"] if c["cell_type"] == "markdown"]
    words = [len(("".join(c["source"]) if isinstance(c["source"], list) else c["source"]).split()) for c in cells]
    assert rows[stem]["markdown_cells"] == len(cells) and rows[stem]["median_words"] == statistics.median(words)
    assert all(r["verdict_rows"] <= 10 for r in rows.values())  # the reader tables' limit
    assert reading_stats.main(["no-such-commit-anywhere"]) == 2
    assert "no-such-commit-anywhere: no such commit here" in capsys.readouterr().err
