"""Label amendments (append-only relabelling) and the run history seeded from git (lora_lab.lab.history)."""
import json

import pytest
from test_predictions import GOOD_ENTRY, KNOWN, second_entry, validate
from test_verify import A, B, Repo

from lora_lab.lab.grading import grade_predictions
from lora_lab.lab.history import load_history, regenerate, runs_naming, seed_history
from lora_lab.lab.predictions import PredictionError, parse_predictions_yaml, validate_entries

AMEND = '- amends: {target}\n  informed_by: "a dev run gave 42"\n  reason: "the rationale quotes it"\n'


def test_an_amendment_relabels_an_earlier_entry_without_changing_what_it_predicts():
    text = second_entry(metric="answer_speedup_vs_x") + AMEND.format(target="p01-a") + (
        "- amends: p01-b\n  kind: speed_ratio\n  reason: a ratio of times\n")
    first, second = validate(text)
    assert first.informed_by == "a dev run gave 42" and not first.blind
    assert first.amended == "the rationale quotes it" and first.threshold == 50 and first.comparator == "<"
    assert second.kind == "speed_ratio" and second.is_speed_ratio and second.blind
    assert not first.is_speed_ratio
    assert validate(GOOD_ENTRY + "  kind: speed_ratio\n")[0].is_speed_ratio


@pytest.mark.parametrize("amendment, message", [
    (AMEND.format(target="p01-zz"), "field 'amends': must name an entry earlier in the file"),
    ('- amends: p01-a\n  informed_by: "x"\n', "field 'reason': must be non-empty text"),
    ("- amends: p01-a\n  reason: r\n", "changes nothing: give informed_by and/or kind"),
    ("- amends: p01-a\n  reason: r\n  threshold: 60\n", "field 'threshold': an amendment changes labels only"),
    ("- amends: p01-a\n  reason: r\n  kind: fast\n", "field 'kind': must be one of speed_ratio"),
    (AMEND.format(target="p01-a") * 2, "field 'informed_by': already amended by entry #2"),
])
def test_a_bad_amendment_is_refused_with_its_problem(amendment, message):
    with pytest.raises(PredictionError, match=message):
        validate(GOOD_ENTRY + amendment)


def test_an_amendment_before_its_entry_is_refused():
    entries, lines = parse_predictions_yaml(AMEND.format(target="p01-a") + GOOD_ENTRY)
    with pytest.raises(PredictionError, match="must name an entry earlier in the file"):
        validate_entries(entries, KNOWN, lines=lines)


def _metrics(repo: Repo, started: str, **values) -> None:
    payload = {"notebook": "01_demo", "profile": "cpu", "metrics": values,
               "provenance": {"status": "completed", "git_commit": "c" * 40, "code_hash": "h" * 64,
                              "started": started, "finished": started}}
    repo.write("outputs/cpu/01_demo.metrics.json", json.dumps(payload))


def test_the_history_seeded_from_git_keeps_every_published_run(tmp_path):
    from lora_lab.lab.predictions import load_predictions

    repo = Repo(tmp_path / "repo")
    repo.predictions(A)
    repo.commit("register A")
    _metrics(repo, "t1", loss=0.3)
    first = repo.commit("run 1: A hits")
    _metrics(repo, "t2", loss=0.7)
    repo.commit("run 2: A misses")
    repo.predictions(A, B)
    repo.commit("register B")
    _metrics(repo, "t2", loss=0.7)  # the same run again: not a new run
    _metrics(repo, "t3", loss=0.2, error=0.05)
    repo.commit("run 3")

    predictions = load_predictions(repo.root / "predictions" / "predictions.yaml", known={"01_demo"})
    runs = seed_history(repo.root, "cpu", predictions)
    assert [run["started"] for run in runs] == ["t1", "t2", "t3"]
    assert runs[0]["published_in"] == first and runs[0]["source"] == "git"
    assert [sorted(run["graded"]) for run in runs] == [["p01-a"], ["p01-a"], ["p01-a", "p01-b"]]
    assert [run["graded"]["p01-a"]["outcome"] for run in runs] == ["hit", "miss", "hit"]
    assert runs[2]["graded"]["p01-b"] == {"outcome": "hit", "value": 0.05, "ci95": None, "n": None,
                                          "sessions": None, "why": "", "one_session_outcome": ""}

    pending = {"notebook": "01_demo", "started": "t4", "git_commit": "d" * 40, "code_hash": "h" * 64, "graded": {}}
    (repo.root / "outputs" / "cpu" / "run_history.json").write_text(json.dumps({"runs": [runs[0], pending]}))
    regenerate(repo.root, "cpu", predictions, repo.root / "outputs" / "cpu")
    kept = load_history(repo.root / "outputs" / "cpu")
    assert [run["started"] for run in kept] == ["t1", "t2", "t3", "t4"]  # published, not committed: kept
    assert runs_naming(kept, "01_demo", "d" * 7, "h" * 64) == [pending]

    board = grade_predictions(predictions, "cpu", repo.root / "outputs" / "cpu")
    rows = {row.id: row for row in board.rows}
    assert rows["p01-a"].outcome == "hit" and rows["p01-a"].value == 0.3  # run 1 is A's registered test
    assert rows["p01-a"].unstable and [run["role"] for run in rows["p01-a"].history] == [
        "test", "replication", "replication"]
    assert rows["p01-b"].history[0]["role"] == "test" and not rows["p01-b"].unstable
