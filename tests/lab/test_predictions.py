"""lora_lab.predictions: the schema, precise validation errors, comparators."""
from pathlib import Path

import pytest

from lora_lab.lab.cli import main
from lora_lab.lab.predictions import (
    COMPARATORS,
    PredictionError,
    load_predictions,
    parse_predictions_yaml,
    superseded_ids,
    validate_entries,
)

FIXTURES = Path(__file__).parent / "fixtures"
EVERY_COMPARATOR = FIXTURES / "predictions" / "every_comparator.yaml"
FIXTURE_NOTEBOOKS = FIXTURES / "notebooks"
KNOWN = {"01_records_metrics", "02_fails_at_known_cell", "03_records_after_failure"}

GOOD_ENTRY = """\
- id: p01-a
  notebook: 01_records_metrics
  claim: "a claim"
  metric: answer
  comparator: "<"
  threshold: 50
  profiles: [cpu]
  confidence: 0.9
  rationale: "why"
"""


def validate(text: str, known=KNOWN):
    entries, lines = parse_predictions_yaml(text, source="p.yaml")
    return validate_entries(entries, known, source="p.yaml", lines=lines)


def second_entry(**fields) -> str:
    """GOOD_ENTRY followed by a second entry (id p01-b) with ``fields`` replaced (None: dropped)."""
    values = {
        "id": "p01-b",
        "notebook": "01_records_metrics",
        "claim": '"another claim"',
        "metric": "ratio",
        "comparator": '">="',
        "threshold": "0.5",
        "profiles": "[cpu, gpu]",
        "confidence": "0.7",
        "rationale": '"because"',
    }
    values.update(fields)
    lines = [f"  {key}: {value}" for key, value in values.items() if value is not None]
    lines[0] = "-" + lines[0][1:]
    return GOOD_ENTRY + "\n".join(lines) + "\n"


def test_fixture_file_validates_against_the_fixture_notebooks():
    predictions = load_predictions(EVERY_COMPARATOR, notebooks_dir=FIXTURE_NOTEBOOKS)
    assert len(predictions) == 15
    assert {prediction.comparator for prediction in predictions} == set(COMPARATORS)
    assert superseded_ids(predictions) == {"p01-old": "p01-new"}
    by_id = {prediction.id: prediction for prediction in predictions}
    assert by_id["p03-total-in-range"].threshold == (5.0, 7.0)
    assert by_id["p01-ratio-ge"].threshold == 0.5
    assert by_id["p01-gpu-only"].profiles == ("gpu",)
    assert by_id["p01-answer-lt"].line == 5  # after the 4 comment lines


@pytest.mark.parametrize("text", ["", "[]\n", "# nothing registered yet\n[]\n"])
def test_an_empty_file_is_valid_even_without_notebooks(text):
    assert validate(text, known=set()) == []


@pytest.mark.parametrize(
    "comparator, threshold, value, expected",
    [
        ("<", 1.0, 0.999, True), ("<", 1.0, 1.0, False),
        ("<=", 1.0, 1.0, True), ("<=", 1.0, 1.001, False),
        (">", 1.0, 1.0, False), (">", 1.0, 1.5, True),
        (">=", 1.0, 1.0, True), (">=", 1.0, 0.5, False),
        ("==", 3, 3.0, True), ("==", 3, 3.1, False), ("==", True, True, True), ("==", True, False, False),
        ("in_range", (1.0, 2.0), 1.0, True), ("in_range", (1.0, 2.0), 2.0, True),
        ("in_range", (1.0, 2.0), 2.01, False), ("in_range", (1.0, 2.0), 0.99, False),
    ],
)
def test_comparators(comparator, threshold, value, expected):
    threshold_yaml = f"[{threshold[0]}, {threshold[1]}]" if isinstance(threshold, tuple) else str(threshold).lower()
    [_, prediction] = validate(second_entry(comparator=f'"{comparator}"', threshold=threshold_yaml))
    assert prediction.holds_for(value) is expected


def test_exponent_without_a_dot_is_a_number():
    [_, prediction] = validate(second_entry(threshold="1e-4"))
    assert prediction.threshold == pytest.approx(1e-4)


@pytest.mark.parametrize(
    "text, expected",
    [
        (second_entry(id="p01-a"),
         "entry #2 id 'p01-a' (line 10): field 'id': duplicate id 'p01-a': already used by entry #1"),
        (second_entry(notebook="09_nowhere"),
         "entry #2 id 'p01-b' (line 10): field 'notebook': unknown notebook '09_nowhere' (known: 01_records_metrics"),
        (second_entry(comparator='"=>"'),
         "entry #2 id 'p01-b' (line 10): field 'comparator': str '=>' is not one of < <= > >= == in_range"),
        (second_entry(comparator=">"), "field 'comparator': str '' is not one of < <= > >= == in_range (quote it"),
        (second_entry(comparator=">="),
         'not valid YAML: line 14, column 16: while scanning a block scalar; expected chomping'),
        (second_entry(threshold="[1, 2]"),
         "field 'threshold': comparator '>=' needs one finite number; got list [1, 2] (a [lo, hi] pair goes with "
         "comparator in_range)"),
        (second_entry(threshold='"0.5"'),
         "field 'threshold': comparator '>=' needs one finite number; got str '0.5' (write numbers without quotes)"),
        (second_entry(threshold="true"), "field 'threshold': comparator '>=' needs one finite number; got bool True"),
        (second_entry(threshold=".nan"), "field 'threshold': comparator '>=' needs one finite number; got float nan"),
        (second_entry(comparator="in_range", threshold="0.5"),
         "field 'threshold': in_range needs [lo, hi] with two finite numbers; got float 0.5"),
        (second_entry(comparator="in_range", threshold="[1, 2, 3]"),
         "field 'threshold': in_range needs [lo, hi] with two finite numbers; got list [1, 2, 3]"),
        (second_entry(comparator="in_range", threshold="[2, 1]"),
         "field 'threshold': in_range needs lo <= hi; got [2, 1]"),
        (second_entry(supersedes="p01-zz"),
         "entry #2 id 'p01-b' (line 10): field 'supersedes': supersedes unknown id 'p01-zz' (it must be an entry "
         "earlier in the file)"),
        (second_entry(supersedes="p01-b"), "field 'supersedes': an entry cannot supersede itself ('p01-b')"),
        (second_entry(supersedes="[p01-a, 3]"), "field 'supersedes': must be an id or a list of ids"),
        (second_entry(profiles="[cpu, tpu]"),
         "field 'profiles': unknown profile(s) ['tpu'] (allowed: cpu, gpu, gpu-24g, gpu-40g, gpu-sm80)"),
        (second_entry(profiles="gpu"),
         "field 'profiles': must be a non-empty list, a subset of [cpu, gpu, gpu-24g, gpu-40g, gpu-sm80]; "
         "got str 'gpu'"),
        (second_entry(profiles="[]"), "field 'profiles': must be a non-empty list"),
        (second_entry(confidence="1.5"), "field 'confidence': must be a probability between 0 and 1; got float 1.5"),
        (second_entry(confidence='"high"'),
         "field 'confidence': must be a probability between 0 and 1; got str 'high'"),
        (second_entry(rationale=None), "entry #2 id 'p01-b' (line 10): field 'rationale': missing"),
        (second_entry(claim='"  "'), "field 'claim': must be non-empty text"),
        (second_entry(treshold="1"), "field 'treshold': unknown field"),
        (second_entry(date="2025-01-01"),
         "field 'date': registration date and commit are derived from git; do not type them"),
        (second_entry(id="'has space'"), "field 'id': must be a word of letters"),
        (GOOD_ENTRY + "  threshold: 60\n",
         "not valid YAML: line 10, column 3: key 'threshold' appears twice in one entry (first on line 6)"),
        (GOOD_ENTRY + "- just text\n", "entry #2 (line 10): must be a mapping of fields, not str 'just text'"),
        ("id: p01-a\n", "the file must be a YAML list of entries (or []), not a dict"),
        ("[unclosed\n", "not valid YAML"),
    ],
)
def test_malformed_entries_are_rejected_with_a_precise_message(text, expected):
    with pytest.raises(PredictionError) as caught:
        validate(text)
    assert expected in str(caught.value), str(caught.value)
    assert str(caught.value).startswith("p.yaml:")


def test_duplicate_key_names_the_lines():
    with pytest.raises(PredictionError, match=r"key 'threshold' appears twice in one entry \(first on line 6\)"):
        validate(GOOD_ENTRY + "  threshold: 60\n")


def test_superseding_an_id_twice_or_a_later_entry_is_rejected():
    third = second_entry(supersedes="p01-a").replace("p01-b", "p01-c", 1)
    text = second_entry(supersedes="p01-a") + "\n".join(third.splitlines()[9:]) + "\n"
    with pytest.raises(PredictionError, match="'p01-a' is already superseded by 'p01-b'"):
        validate(text)
    forward = (GOOD_ENTRY.replace("  rationale", "  supersedes: p01-b\n  rationale")
               + "\n".join(second_entry().splitlines()[9:]) + "\n")
    with pytest.raises(PredictionError, match="supersedes unknown id 'p01-b' \\(it must be an entry earlier"):
        validate(forward)


def test_every_problem_is_listed_at_once():
    with pytest.raises(PredictionError) as caught:
        validate(second_entry(comparator='"~"', confidence="2", notebook="nope"))
    assert len(caught.value.problems) == 3
    assert str(caught.value).startswith("p.yaml: 3 problems")


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(PredictionError, match="file not found"):
        load_predictions(tmp_path / "absent.yaml", known=KNOWN)


def test_validate_command(tmp_path, capsys):
    assert main(["validate", "--predictions", str(EVERY_COMPARATOR), "--notebooks-dir", str(FIXTURE_NOTEBOOKS)]) == 0
    assert "15 valid prediction(s), 1 superseding" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(second_entry(comparator='"=>"'))
    assert main(["validate", "--predictions", str(bad), "--notebooks-dir", str(FIXTURE_NOTEBOOKS)]) == 2
    assert "entry #2 id 'p01-b' (line 10): field 'comparator'" in capsys.readouterr().err


def test_libyaml_reads_every_file_as_the_pure_python_loader_does():
    """parse_predictions_yaml reads through libyaml when PyYAML has it (verify reads every committed version of the
    file); the entries, their lines and the 1e-4-is-a-number resolver are PredictionsLoader's, on the project's file
    and on the fixtures."""
    import yaml

    from lora_lab.lab import predictions

    root = Path(__file__).resolve().parents[2]
    files = [root / "predictions" / "predictions.yaml", EVERY_COMPARATOR]
    for path in files:
        text = path.read_text(encoding="utf-8")
        pure = yaml.load(text, Loader=predictions.PredictionsLoader)  # noqa: S506 - a SafeLoader subclass
        lines = [item.start_mark.line + 1 for item in yaml.compose(text, Loader=predictions.PredictionsLoader).value]
        assert parse_predictions_yaml(text, source=path.name) == (pure, lines), path
    assert parse_predictions_yaml(GOOD_ENTRY.replace("50", "1e-4"))[0][0]["threshold"] == pytest.approx(1e-4)
    if getattr(yaml, "__with_libyaml__", False):
        assert issubclass(predictions._LibyamlPredictionsLoader, yaml.CSafeLoader)
