"""predictions/reader_tables.yaml: the verdicts each notebook shows its reader, checked on load and against the runs."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from lora_lab.lab.history import load_history
from lora_lab.lab.predictions import known_notebooks, load_predictions, superseded_ids
from lora_lab.lab.reader_tables import (
    MAX_ROWS,
    ReaderTableError,
    load_reader_tables,
    parse_reader_tables,
    reader_tables_path,
)
from lora_lab.lab.recording import PROFILES
from lora_lab.lab.verdicts import show_verdicts

ROOT = Path(__file__).resolve().parents[2]
PREDICTIONS = ROOT / "predictions" / "predictions.yaml"
GRADED = ("hit", "miss", "inconclusive")


def _entry(number: int, notebook: str = "01_demo", profiles=("cpu", "gpu"), **extra) -> dict:
    return {"id": f"p01-x{number}", "notebook": notebook, "claim": f"x{number} is at most 1", "metric": f"x{number}",
            "comparator": "<=", "threshold": 1, "profiles": list(profiles), "confidence": 0.5, "rationale": "r",
            **extra}


def _predictions(tmp_path: Path, entries: list[dict]) -> list:
    (tmp_path / "predictions").mkdir(exist_ok=True)
    path = tmp_path / "predictions" / "predictions.yaml"
    path.write_text(yaml.safe_dump(entries, sort_keys=False))
    return load_predictions(path, known={"01_demo", "02_other"})


def _problems(text: str, predictions) -> list[str]:
    with pytest.raises(ReaderTableError) as caught:
        parse_reader_tables(text, predictions, notebooks={"01_demo", "02_other"})
    return caught.value.problems


def test_a_good_table_loads_in_its_order(tmp_path):
    predictions = _predictions(tmp_path, [_entry(1), _entry(2)])
    tables = parse_reader_tables(
        "01_demo:\n  shown:\n    - {id: p01-x2, claim: '  x2 stays\n small '}\n    - {id: p01-x1, claim: 'x1 too'}\n",
        predictions, notebooks={"01_demo"})
    assert tables["01_demo"].ids == ["p01-x2", "p01-x1"]
    assert tables["01_demo"].rows[0].claim == "x2 stays small"


def test_the_loader_names_every_problem(tmp_path):
    predictions = _predictions(tmp_path, [_entry(1), _entry(2), _entry(3, notebook="02_other"),
                                          _entry(4, supersedes="p01-x1")])
    working = "session" + " 11"  # spelled apart: the repository's layout test refuses the phrase in code
    text = """
01_demo:
  shown:
    - {id: p01-nope, claim: "a prediction nobody registered"}
    - {id: p01-x3, claim: "a prediction of the other notebook"}
    - {id: p01-x1, claim: "replaced by a later entry"}
    - {id: p01-x2, claim: "  "}
    - {id: p01-x4, claim: "as p01-x2 said, see #27 and WORKING at abc1234f"}
    - {id: p01-x4, claim: "shown twice", note: "a field rows do not have"}
  not_shown:
    p01-x2: ""
    p01-gone: "left out"
03_missing:
  shown:
    - {id: p01-x2, claim: "x2 is small"}
""".replace("WORKING", working)
    problems = "\n".join(_problems(text, predictions))
    assert "unknown prediction id 'p01-nope'" in problems
    assert "(p01-x3): a prediction of notebook 02_other, not of 01_demo" in problems
    assert "(p01-x1): superseded by 'p01-x4'" in problems
    assert "(p01-x2): empty claim" in problems
    for what in ("a prediction id", "an issue", "a working session", "a commit hash"):
        assert f"(p01-x4): the claim names {what}" in problems
    assert "unknown field(s) note" in problems and "'p01-x4' is shown twice" in problems
    assert "not_shown 'p01-x2': it is also shown" in problems
    assert "not_shown 'p01-x2': the reason it is left out is missing" in problems
    assert "not_shown 'p01-gone': unknown prediction id" in problems
    assert "03_missing: no such notebook" in problems
    assert "03_missing, shown row 1 (p01-x2): a prediction of notebook 01_demo, not of 03_missing" in problems


def test_more_than_ten_rows_on_a_profile_is_refused(tmp_path):
    entries = [_entry(n) for n in range(1, MAX_ROWS + 2)] + [_entry(99, profiles=("gpu",))]
    predictions = _predictions(tmp_path, entries)
    rows = "".join(f"    - {{id: p01-x{n}, claim: 'x{n} is small'}}\n" for n in range(1, MAX_ROWS + 1))
    assert parse_reader_tables("01_demo:\n  shown:\n" + rows, predictions)  # ten rows: fine
    problems = _problems("01_demo:\n  shown:\n" + rows + "    - {id: p01-x99, claim: 'gpu only'}\n", predictions)
    assert problems == [f"01_demo: 11 rows on the gpu profile, more than {MAX_ROWS}"]  # the cpu profile has ten


def test_a_malformed_file_is_refused_with_its_name(tmp_path):
    predictions = _predictions(tmp_path, [_entry(1)])
    for text, expected in (("- a list\n", "must map notebook names to tables"),
                           ("01_demo: [p01-x1]\n", "needs 'shown'"),
                           ("01_demo:\n  shown: []\n", "'shown' is empty"),
                           ("01_demo: {shown: [{id: p01-x1, claim: a}], shown: []}\n", "not valid YAML")):
        path = tmp_path / "reader_tables.yaml"
        path.write_text(text)
        with pytest.raises(ReaderTableError) as caught:
            load_reader_tables(path, predictions)
        assert str(path) in str(caught.value) and expected in str(caught.value)


# ---- the repository's tables ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repository():
    predictions = load_predictions(PREDICTIONS, notebooks_dir=ROOT / "notebooks")
    # loading checks every id exists, belongs to its notebook, is live, and the row counts
    tables = load_reader_tables(reader_tables_path(PREDICTIONS), predictions,
                                notebooks=known_notebooks(ROOT / "notebooks"))
    return predictions, tables


def test_every_notebook_has_a_reader_table_with_gpu_rows(repository):
    predictions, tables = repository
    by_id = {prediction.id: prediction for prediction in predictions}
    for notebook in sorted(known_notebooks(ROOT / "notebooks")):
        assert notebook in tables, f"{notebook} has no reader table in predictions/reader_tables.yaml"
        assert any("gpu" in by_id[row.id].profiles for row in tables[notebook].rows), notebook


def _runs_by_prediction(profile: str) -> dict[str, list[str]]:
    """{prediction id: its outcome in each published run of the profile, oldest first}."""
    outcomes: dict[str, list[str]] = {}
    for run in load_history(ROOT / "outputs" / profile):
        for prediction_id, grade in run.get("graded", {}).items():
            outcomes.setdefault(prediction_id, []).append(grade["outcome"])
    return outcomes


def test_every_gpu_miss_is_shown_or_left_out_with_a_reason(repository):
    """A prediction whose registered test (its first graded run) or latest published run on the gpu profile is a
    miss is in its notebook's table, or under not_shown with the reason: leaving a miss out is written down."""
    predictions, tables = repository
    replaced = superseded_ids(predictions)
    runs = _runs_by_prediction("gpu")
    unaccounted = []
    for prediction in predictions:
        outcomes = runs.get(prediction.id, [])
        graded = [outcome for outcome in outcomes if outcome in GRADED]
        missed = (graded[:1] == ["miss"]) or (outcomes[-1:] == ["miss"])
        table = tables.get(prediction.notebook)
        if missed and prediction.id not in replaced and (
                table is None or (prediction.id not in table.ids and prediction.id not in table.not_shown)):
            unaccounted.append(f"{prediction.notebook}: {prediction.id}")
    assert not unaccounted, "gpu misses neither shown nor left out with a reason:\n" + "\n".join(unaccounted)


def test_a_shown_prediction_no_run_graded_says_so(repository):
    """A row whose prediction every published run of a profile it applies to left void (or never ran) carries
    'ungraded' with the reason; a row that says so of a graded prediction is out of date."""
    predictions, tables = repository
    by_id = {prediction.id: prediction for prediction in predictions}
    runs = {profile: _runs_by_prediction(profile) for profile in PROFILES}
    problems = []
    for table in tables.values():
        for row in table.rows:
            profiles = by_id[row.id].profiles
            graded = any(outcome in GRADED for profile in profiles for outcome in runs[profile].get(row.id, []))
            if not graded and not row.ungraded:
                problems.append(f"{table.notebook}: {row.id} is void or unrun on {', '.join(profiles)}, unsaid")
            if graded and row.ungraded:
                problems.append(f"{table.notebook}: {row.id} says it is ungraded, but a run graded it")
    assert not problems, "\n".join(problems)


# ---- what show_verdicts prints ----------------------------------------------------------------------------------


@pytest.fixture
def demo_run(tmp_path, monkeypatch):
    """A checkout with notebook 01_demo: 14 predictions (x1..x14 <= 1), a metrics file where x1 misses, x13 and x14
    are not recorded (void), and a reader table of ten rows."""
    from lora_lab.lab import recording

    monkeypatch.setattr(recording, "_current", None)
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_demo.ipynb").write_text("{}")
    _predictions(tmp_path, [_entry(n) for n in range(1, 15)])
    rows = "".join(f"    - {{id: p01-x{n}, claim: 'the plain claim of x{n}'}}\n" for n in range(1, 11))
    (tmp_path / "predictions" / "reader_tables.yaml").write_text("01_demo:\n  shown:\n" + rows)
    metrics = tmp_path / "01_demo.metrics.json"
    values = {f"x{n}": (2 if n == 1 else 0.5) for n in range(1, 13)}
    metrics.write_text(json.dumps({"notebook": "01_demo", "profile": "cpu", "parameters": {}, "metrics": values,
                                   "notes": {}, "provenance": {"status": "completed"}}))
    monkeypatch.setattr("lora_lab.lab.verdicts.find_repo_root", lambda: tmp_path)
    monkeypatch.chdir(tmp_path)
    return SimpleNamespace(notebook="01_demo", profile="cpu", name="cpu", path=metrics)


def test_show_verdicts_prints_the_reader_table_and_one_pointer_line(demo_run, capsys):
    rows = show_verdicts(demo_run)
    text = capsys.readouterr().out
    assert len(rows) == 14  # every live prediction is graded and returned
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0] == "| claim | measured (95% interval) | target | verdict |" and len(table) - 1 == 10
    assert table[1] == "| the plain claim of x1 | 2 | <= 1 | **miss** |"  # the table's order, misses as they come
    assert "p01-x" not in text  # no ids in the reader's table
    assert ("4 more predictions (2 void) in [outputs/cpu/scoreboard.md](scoreboard.md), "
            "each with its claim as registered, its runs and its provenance.") in text
    assert "9 hit, 1 miss, 0 inconclusive, 0 void" in text


def test_show_verdicts_full_prints_every_prediction(demo_run, capsys):
    show_verdicts(demo_run, full=True)
    text = capsys.readouterr().out
    assert sum(line.startswith("| **") for line in text.splitlines()) == 14
    assert "| **MISS** | `p01-x1` |" in text and "more predictions" not in text


def test_a_notebook_without_a_reader_table_shows_every_prediction(demo_run, capsys):
    (demo_run.path.parent / "predictions" / "reader_tables.yaml").write_text("")
    show_verdicts(demo_run)
    assert sum(line.startswith("| **") for line in capsys.readouterr().out.splitlines()) == 14
