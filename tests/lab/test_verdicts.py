"""lora_lab.lab.verdicts: a notebook's own predictions graded against the run it just recorded."""
import json

from test_grading import EVERY_COMPARATOR

from lora_lab.lab import recording
from lora_lab.lab.verdicts import notebook_verdicts, verdicts_markdown


def test_a_notebook_renders_its_own_predictions_misses_first(tmp_path, monkeypatch):
    monkeypatch.setattr(recording, "_current", None)
    monkeypatch.chdir(tmp_path)  # outside the repo: the predictions path is given explicitly below
    metrics = tmp_path / "01_records_metrics.metrics.json"
    metrics.write_text(json.dumps({"notebook": "01_records_metrics", "profile": "cpu", "parameters": {},
                                   "metrics": {"answer": 42, "ratio": 0.5, "exact": True, "label": "base"},
                                   "notes": {}, "provenance": {"status": "completed"}}))
    monkeypatch.setattr("lora_lab.lab.verdicts.find_repo_root", lambda: EVERY_COMPARATOR.parents[1])
    rows, notes = notebook_verdicts("01_records_metrics", "cpu", metrics, predictions_path=EVERY_COMPARATOR)
    outcomes = [row.outcome for row in rows]
    assert outcomes[0] == "miss" and outcomes == sorted(outcomes, key=["miss", "inconclusive", "void", "hit"].index)
    assert "p01-old" not in {row.id for row in rows}  # superseded entries are not shown
    assert any("apply to other profiles" in note for note in notes)
    text = verdicts_markdown(rows, notes, "cpu")
    assert text.startswith("**Verdicts, profile `cpu`:**") and "| **MISS** | `p01-answer-le` |" in text
