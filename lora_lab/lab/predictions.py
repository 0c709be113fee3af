"""Pre-registered predictions: load, validate and evaluate ``predictions/predictions.yaml``.

The file is an append-only YAML list. One entry::

    - id: p05-fused-fwd-cosine        # stable, unique, never reused
      notebook: 05_fused_lora_kernels # stem of a notebook in notebooks/
      claim: "Fused forward matches the fp32 reference with cosine >= 0.99999 in bf16"
      metric: fwd_cosine_bf16          # a key the notebook records with lora_lab.lab.record
      comparator: ">="                 # < <= > >= == in_range   (quote it: a bare > starts a YAML block)
      threshold: 0.99999               # a number; [lo, hi] for in_range; true/false allowed for ==
      profiles: [gpu]                  # non-empty subset of lab.profiles.PROFILES (gpu covers gpu-24g, ...)
      confidence: 0.9                  # probability of a hit, in [0, 1]
      rationale: "why"
      supersedes: p05-old-id           # optional: an id (or list of ids) defined earlier in the file
      informed_by: "dev runs, ~4e-4"   # optional: the related result seen before registering (absent: blind)
      kind: speed_ratio                # optional: the metric is a ratio of times or throughputs (see below)

**Label amendments.** Entries are never edited, so a label found wrong later (a rationale that quotes a
measurement, yet no ``informed_by``) is corrected by a later list item that amends it::

    - amends: p05-grads-fp16-interpreter   # an id defined earlier in the file
      informed_by: "development runs gave ~4e-4 (quoted in its rationale)"   # and/or
      kind: speed_ratio
      reason: "why the label changes"

An amendment changes only labels (``informed_by``, ``kind``), never what is predicted, and the scoreboard shows
it. ``informed_by`` relabels every run; ``kind`` changes how the entry is graded, so it applies only to runs after
the commit that registered it (:mod:`lora_lab.lab.rules`). It is append-only like an entry.

**Speed ratios.** A prediction whose metric is a ratio of times or throughputs is graded only on an interval
pooled over >= 2 sessions (separate processes, see :mod:`lora_lab.lab.grading`). It is one when it says
``kind: speed_ratio`` (itself or through an amendment) or when its metric key names a timing ratio
(:data:`SPEED_RATIO_METRIC`: ``speedup``, ``time_vs`` or ``time_ratio`` in the key).

When an entry was registered (date and commit) is read from git (``lora_lab.lab.git_history``), never
typed. Validation collects every problem and names the entry (index, id, line) and the field.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from lora_lab.lab.profiles import profile_applies
from lora_lab.lab.recording import PROFILES, find_repo_root

DEFAULT_PREDICTIONS_PATH = Path("predictions") / "predictions.yaml"
DEFAULT_NOTEBOOKS_DIR = Path("notebooks")

REQUIRED_FIELDS = (
    "id", "notebook", "claim", "metric", "comparator", "threshold", "profiles", "confidence", "rationale",
)
OPTIONAL_FIELDS = ("supersedes", "informed_by", "kind")
AMENDMENT_FIELDS = ("amends", "informed_by", "kind", "reason")
KINDS = ("speed_ratio",)
SPEED_RATIO_METRIC = re.compile(r"speedup|time_vs|time_ratio")
DERIVED_FIELDS = ("date", "registered", "commit", "registration_date", "registration_commit")

COMPARATORS: dict[str, Callable[[float, Any], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "in_range": lambda value, bounds: bounds[0] <= value <= bounds[1],
}

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class PredictionError(ValueError):
    """The predictions file is malformed; ``problems`` lists every message."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = list(problems)
        count = len(self.problems)
        header = f"{source}: {count} problem{'s' if count != 1 else ''}"
        super().__init__(header + "\n" + "\n".join(f"  - {problem}" for problem in self.problems))


# --------------------------------------------------------------------------------------------
# YAML: strict about duplicate keys, and reads 1e-4 as a number (YAML 1.1 reads it as text)
# --------------------------------------------------------------------------------------------


class PredictionsLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys in a mapping and reads ``1e-4`` as a float."""


PredictionsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _construct_mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice in one entry (first on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


PredictionsLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_without_duplicates)


class _LibyamlPredictionsLoader(getattr(yaml, "CSafeLoader", PredictionsLoader)):
    """PredictionsLoader's resolvers and constructors over libyaml's parser when PyYAML has it: the same entries in
    about a fifth of the time (verify and grade read every committed version of the file). A file it refuses is
    read again by PredictionsLoader, so an error's message (and whether there is one) stays the pure-Python one's."""


_LibyamlPredictionsLoader.yaml_implicit_resolvers = {
    first: list(resolvers) for first, resolvers in PredictionsLoader.yaml_implicit_resolvers.items()}
_LibyamlPredictionsLoader.yaml_constructors = dict(PredictionsLoader.yaml_constructors)


def describe_yaml_error(error: yaml.YAMLError) -> str:
    """``line L, column C: what went wrong`` for a YAML error (1-based positions)."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        parts = [part for part in (error.context, error.problem) if part]
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        return where + "; ".join(parts)
    return str(error).replace("\n", " ")


def _load_and_compose(text: str, loader_class: type) -> tuple[Any, Any]:
    """The document's data and its node tree (for line numbers), from one parse: what ``yaml.load`` does, keeping
    the node."""
    loader = loader_class(text)  # SafeLoader subclasses
    try:
        root = loader.get_single_node()
        return (loader.construct_document(root) if root is not None else None), root
    finally:
        loader.dispose()


def parse_predictions_yaml(text: str, source: str = "predictions.yaml") -> tuple[list[Any], list[int | None]]:
    """The raw entries of a predictions file and the 1-based line where each starts.

    An empty file (or ``[]``) is an empty list. A YAML syntax error becomes a PredictionError.
    """
    try:
        try:
            data, root = _load_and_compose(text, _LibyamlPredictionsLoader)
        except yaml.YAMLError:
            data, root = _load_and_compose(text, PredictionsLoader)
    except yaml.YAMLError as error:
        message = describe_yaml_error(error)
        if "block scalar" in message or "chomping" in message:
            message += ' (a bare ">" or ">=" starts a YAML block: quote comparators, e.g. comparator: ">=")'
        raise PredictionError(source, [f"not valid YAML: {message}"]) from None
    if data is None:
        return [], []
    if not isinstance(data, list):
        raise PredictionError(source, [f"the file must be a YAML list of entries (or []), not a {type(data).__name__}"])
    lines: list[int | None] = [None] * len(data)
    if isinstance(root, yaml.SequenceNode):
        lines = [item.start_mark.line + 1 for item in root.value]
    return data, lines


# --------------------------------------------------------------------------------------------
# One prediction
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    id: str
    notebook: str
    claim: str
    metric: str
    comparator: str
    threshold: Any  # float | bool | tuple[float, float]
    profiles: tuple[str, ...]
    confidence: float
    rationale: str
    supersedes: tuple[str, ...] = ()
    informed_by: str = ""  # what related result was seen before registering it ("" = blind)
    index: int = 0  # position in the file, 0-based
    line: int | None = None
    kind: str = ""  # "speed_ratio" or "" (then inferred from the metric key, see is_speed_ratio)
    amended: str = ""  # the reasons of the label amendments applied to it ("" = none)
    # (amendment key "amends <id> #k", field, value before it) of each amendment that changes how it is graded
    grading_amendments: tuple[tuple[str, str, Any], ...] = ()

    @property
    def is_speed_ratio(self) -> bool:
        """True when the metric is a ratio of times or throughputs: declared, or named so by its key."""
        return self.kind == "speed_ratio" or bool(SPEED_RATIO_METRIC.search(self.metric))

    def applies_to(self, profile: str) -> bool:
        """Registered for ``profile``, or for ``gpu`` when ``profile`` is a capped gpu profile."""
        return profile_applies(self.profiles, profile)

    @property
    def blind(self) -> bool:
        return not self.informed_by

    def holds_for(self, value: Any) -> bool:
        """True iff the recorded ``value`` satisfies ``value <comparator> threshold``."""
        return bool(COMPARATORS[self.comparator](value, self.threshold))

    def outcome_for_interval(self, low: float, high: float) -> str:
        """``hit`` if every value of [low, high] satisfies the claim, ``miss`` if none does, else ``inconclusive``.

        Each comparator's set of satisfying values is an interval (a half-line, a range, a point), so checking
        the two ends and the overlap decides it.
        """
        if self.comparator == "in_range":
            lo, hi = self.threshold
            if lo <= low and high <= hi:
                return "hit"
            return "miss" if high < lo or low > hi else "inconclusive"
        if self.comparator == "==":
            if low == high == self.threshold:
                return "hit"
            return "inconclusive" if low <= self.threshold <= high else "miss"
        at_low, at_high = self.holds_for(low), self.holds_for(high)
        if at_low and at_high:
            return "hit"
        return "miss" if not (at_low or at_high) else "inconclusive"

    def threshold_text(self) -> str:
        if self.comparator == "in_range":
            return f"in [{format_number(self.threshold[0])}, {format_number(self.threshold[1])}]"
        return f"{self.comparator} {format_number(self.threshold)}"


def format_number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def validate_entries(
    entries: list[Any],
    known_notebooks: Iterable[str],
    source: str = "predictions.yaml",
    lines: list[int | None] | None = None,
) -> list[Prediction]:
    """Check every entry; return Predictions or raise one PredictionError listing all problems."""
    known = set(known_notebooks)
    lines = lines or [None] * len(entries)
    problems: list[str] = []
    predictions: list[Prediction] = []
    first_index_of_id: dict[str, int] = {}
    superseded_by: dict[str, str] = {}

    amendments: list[tuple[int, str, dict]] = []

    for index, entry in enumerate(entries):
        line = lines[index] if index < len(lines) else None
        where = f"entry #{index + 1}" + (f" (line {line})" if line else "")
        if not isinstance(entry, dict):
            problems.append(f"{where}: must be a mapping of fields, not {_describe(entry)}")
            continue
        if "amends" in entry:
            amendments.append((index, where, entry))
            continue
        entry_id = entry.get("id")
        if isinstance(entry_id, str) and entry_id:
            where = f"entry #{index + 1} id {entry_id!r}" + (f" (line {line})" if line else "")
        before = len(problems)

        def problem(field: str, message: str, where: str = where) -> None:
            problems.append(f"{where}: field '{field}': {message}")

        for field in entry:
            if field in DERIVED_FIELDS:
                problem(field, "registration date and commit are derived from git; do not type them")
            elif field not in REQUIRED_FIELDS + OPTIONAL_FIELDS:
                problem(field, f"unknown field (allowed: {', '.join(REQUIRED_FIELDS + OPTIONAL_FIELDS)})")
        for field in REQUIRED_FIELDS:
            if field not in entry:
                problem(field, "missing")

        if "id" in entry:
            if not isinstance(entry_id, str) or not ID_PATTERN.match(entry_id):
                problem("id", "must be a word of letters, digits, '.', '_' or '-' (e.g. p05-fused-fwd); "
                        f"got {_describe(entry_id)}")
            elif entry_id in first_index_of_id:
                problem("id", f"duplicate id {entry_id!r}: already used by entry #{first_index_of_id[entry_id] + 1} "
                        "(ids are never reused)")
            else:
                first_index_of_id[entry_id] = index

        notebook = entry.get("notebook")
        if "notebook" in entry:
            if not isinstance(notebook, str) or not notebook:
                problem("notebook", "must be a notebook stem such as '05_fused_lora_kernels'; "
                        f"got {_describe(notebook)}")
            elif notebook not in known:
                listing = ", ".join(sorted(known)) if known else "none: there are no notebooks yet"
                problem("notebook", f"unknown notebook {notebook!r} (known: {listing})")

        for field in ("claim", "metric", "rationale"):
            if field in entry and (not isinstance(entry[field], str) or not entry[field].strip()):
                problem(field, f"must be non-empty text; got {_describe(entry[field])}")

        comparator = entry.get("comparator")
        comparator_ok = isinstance(comparator, str) and comparator in COMPARATORS
        if "comparator" in entry and not comparator_ok:
            hint = ' (quote it: a bare ">" in YAML starts a text block)' if comparator in ("", None) else ""
            problem("comparator", f"{_describe(comparator)} is not one of {' '.join(COMPARATORS)}{hint}")

        threshold = entry.get("threshold")
        if "threshold" in entry and comparator_ok:
            if comparator == "in_range":
                if not (isinstance(threshold, list) and len(threshold) == 2
                        and all(_is_number(bound) for bound in threshold)):
                    problem("threshold", f"in_range needs [lo, hi] with two finite numbers; got {_describe(threshold)}")
                elif threshold[0] > threshold[1]:
                    problem("threshold", f"in_range needs lo <= hi; got [{threshold[0]}, {threshold[1]}]")
            elif comparator == "==" and isinstance(threshold, bool):
                pass
            elif not _is_number(threshold):
                hint = ""
                if isinstance(threshold, list):
                    hint = " (a [lo, hi] pair goes with comparator in_range)"
                elif isinstance(threshold, str):
                    hint = " (write numbers without quotes)"
                problem("threshold",
                        f"comparator {comparator!r} needs one finite number; got {_describe(threshold)}{hint}")

        profiles = entry.get("profiles")
        if "profiles" in entry:
            if not isinstance(profiles, list) or not profiles:
                problem("profiles", f"must be a non-empty list, a subset of [{', '.join(PROFILES)}]; "
                        f"got {_describe(profiles)}")
            else:
                unknown = [item for item in profiles if item not in PROFILES]
                if unknown:
                    problem("profiles", f"unknown profile(s) {unknown} (allowed: {', '.join(PROFILES)})")
                elif len(set(profiles)) != len(profiles):
                    problem("profiles", f"lists a profile twice: {profiles}")

        confidence = entry.get("confidence")
        if "confidence" in entry and not (_is_number(confidence) and 0.0 <= confidence <= 1.0):
            problem("confidence", f"must be a probability between 0 and 1; got {_describe(confidence)}")

        informed_by = entry.get("informed_by")
        if "informed_by" in entry and (not isinstance(informed_by, str) or not informed_by.strip()):
            problem("informed_by", "must be text saying what was seen before registering, e.g. "
                    f"'development interpreter runs, ~4e-4'; got {_describe(informed_by)}")
        if "kind" in entry and entry["kind"] not in KINDS:
            problem("kind", f"must be one of {', '.join(KINDS)}; got {_describe(entry['kind'])}")

        supersedes = entry.get("supersedes")
        superseded: list[str] = []
        if supersedes is not None:
            superseded = [supersedes] if isinstance(supersedes, str) else supersedes
            if (not isinstance(superseded, list) or not superseded
                    or not all(isinstance(item, str) for item in superseded)):
                problem("supersedes", f"must be an id or a list of ids; got {_describe(supersedes)}")
                superseded = []
            for old_id in superseded:
                if old_id == entry_id:
                    problem("supersedes", f"an entry cannot supersede itself ({old_id!r})")
                elif old_id not in first_index_of_id or first_index_of_id[old_id] >= index:
                    problem("supersedes", f"supersedes unknown id {old_id!r} (it must be an entry earlier in the file)")
                elif old_id in superseded_by:
                    problem("supersedes", f"{old_id!r} is already superseded by {superseded_by[old_id]!r}")
                else:
                    superseded_by[old_id] = entry_id

        if len(problems) == before:
            predictions.append(
                Prediction(
                    id=entry_id,
                    notebook=notebook,
                    claim=entry["claim"].strip(),
                    metric=entry["metric"],
                    comparator=comparator,
                    threshold=tuple(float(bound) for bound in threshold) if comparator == "in_range" else threshold,
                    profiles=tuple(profiles),
                    confidence=float(confidence),
                    rationale=entry["rationale"].strip(),
                    supersedes=tuple(superseded),
                    informed_by=(informed_by or "").strip() if isinstance(informed_by, str) else "",
                    index=index,
                    line=line,
                    kind=entry.get("kind", ""),
                )
            )

    predictions = apply_amendments(predictions, amendments, first_index_of_id, problems)
    if problems:
        raise PredictionError(source, problems)
    return predictions


def apply_amendments(predictions: list[Prediction], amendments: list[tuple[int, str, dict]],
                     first_index_of_id: dict[str, int], problems: list[str]) -> list[Prediction]:
    """Check the label amendments (``amends:`` items) and apply them; problems are appended to ``problems``."""
    by_id = {prediction.id: prediction for prediction in predictions}
    amended_fields: dict[tuple[str, str], int] = {}
    count: dict[str, int] = {}
    for index, where, entry in amendments:
        target = entry.get("amends")
        count[str(target)] = count.get(str(target), 0) + 1
        key = f"amends {target} #{count[str(target)]}"  # as lora_lab.lab.git_history.entries_by_id keys it
        where = f"{where} (amendment of {target!r})"
        before = len(problems)
        for field in entry:
            if field not in AMENDMENT_FIELDS:
                problems.append(f"{where}: field '{field}': an amendment changes labels only "
                                f"(allowed: {', '.join(AMENDMENT_FIELDS)})")
        if not isinstance(target, str) or target not in first_index_of_id or first_index_of_id[target] >= index:
            problems.append(f"{where}: field 'amends': must name an entry earlier in the file; got "
                            f"{_describe(target)}")
        reason = entry.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            problems.append(f"{where}: field 'reason': must be non-empty text saying why the label changes")
        labels = [field for field in ("informed_by", "kind") if field in entry]
        if not labels:
            problems.append(f"{where}: changes nothing: give informed_by and/or kind")
        informed_by = entry.get("informed_by")
        if "informed_by" in entry and (not isinstance(informed_by, str) or not informed_by.strip()):
            problems.append(f"{where}: field 'informed_by': must be text saying what was seen before registering")
        if "kind" in entry and entry["kind"] not in KINDS:
            problems.append(f"{where}: field 'kind': must be one of {', '.join(KINDS)}; got {_describe(entry['kind'])}")
        for field in labels if isinstance(target, str) else []:
            if (target, field) in amended_fields:
                problems.append(f"{where}: field '{field}': already amended by entry "
                                f"#{amended_fields[target, field] + 1}")
            amended_fields[(target, field)] = index
        if len(problems) != before or target not in by_id:
            continue
        old = by_id[target]
        by_id[target] = replace(
            old,
            informed_by=informed_by.strip() if "informed_by" in entry else old.informed_by,
            kind=entry["kind"] if "kind" in entry else old.kind,
            amended="; ".join(filter(None, [old.amended, reason.strip()])),
            grading_amendments=old.grading_amendments + tuple(
                (key, field, getattr(old, field)) for field in ("kind",) if field in entry),
        )
    return [by_id.get(prediction.id, prediction) for prediction in predictions]


# --------------------------------------------------------------------------------------------
# Files and notebooks
# --------------------------------------------------------------------------------------------


class RepositoryNotFound(ValueError):
    """No lora_lab checkout around the given path, the imported package or the current directory."""


def _package_dir() -> Path:
    return Path(__file__).resolve().parents[1]


def repository_root(start: Path | str | None = None) -> Path:
    """The lora_lab checkout to read predictions, notebooks and outputs from.

    The first of: the checkout at or above ``start`` (e.g. a notebook's path), the checkout the imported
    ``lora_lab`` package lives in (so the code that runs reads its own checkout's files wherever it is started
    from), the checkout at or above the current directory (a package installed elsewhere, run inside a clone).
    A checkout is a directory holding ``pyproject.toml`` and ``lora_lab/``. None of them: RepositoryNotFound.
    """
    candidates = ([Path(start)] if start is not None else []) + [_package_dir(), Path.cwd()]
    for candidate in candidates:
        root = find_repo_root(candidate)
        if root is not None:
            return root
    looked = ", ".join(str(Path(candidate).resolve()) for candidate in candidates)
    raise RepositoryNotFound(
        f"no lora_lab repository found (a directory with pyproject.toml and lora_lab/) at or above {looked}: "
        "run inside a clone of the repository, or give the paths explicitly (--predictions, --notebooks-dir, "
        "--outputs-dir)")


def default_predictions_path() -> Path:
    return repository_root() / DEFAULT_PREDICTIONS_PATH


def default_notebooks_dir() -> Path:
    return repository_root() / DEFAULT_NOTEBOOKS_DIR


def known_notebooks(notebooks_dir: Path | str | None = None) -> set[str]:
    """Stems of the ``*.ipynb`` files in ``notebooks_dir`` (default: ``<repo>/notebooks``)."""
    directory = Path(notebooks_dir) if notebooks_dir is not None else default_notebooks_dir()
    return {path.stem for path in directory.glob("*.ipynb")}


def load_predictions(
    path: Path | str | None = None,
    notebooks_dir: Path | str | None = None,
    known: Iterable[str] | None = None,
) -> list[Prediction]:
    """Read and validate a predictions file. ``known`` (notebook stems) overrides ``notebooks_dir``."""
    path = Path(path) if path is not None else default_predictions_path()
    if not path.is_file():
        raise PredictionError(str(path), ["file not found"])
    entries, lines = parse_predictions_yaml(path.read_text(encoding="utf-8"), source=str(path))
    known_set = set(known) if known is not None else known_notebooks(notebooks_dir)
    return validate_entries(entries, known_set, source=str(path), lines=lines)


def superseded_ids(predictions: Iterable[Prediction]) -> dict[str, str]:
    """``{old id: id of the entry that supersedes it}``."""
    return {old_id: prediction.id for prediction in predictions for old_id in prediction.supersedes}
