"""``lora-lab check-prose``: no measured number restated by hand in the notebooks' and READMEs' prose.

Why: every claim in the notebooks was registered before its run and every result is recorded by the run; a
number typed into markdown goes stale when the run changes, or contradicts it from the start. So every number
in the markdown cells of ``notebooks/NN_*.ipynb``, in ``README.md``, in ``benchmarks/README.md`` and in the pages
``docs/*.md`` must be

(a) **recorded**: rounding some value of the notebook (any number in its ``outputs/*/NN_*.metrics.json``
    metrics and parameters, the thresholds of its entries in ``predictions/predictions.yaml``, the literals of
    its ``parameters`` cell, or any number in ``lora_lab/configs/*.json``) to the precision printed gives the
    number; integers must be equal; a trailing ``%`` also accepts 100 times the value. The READMEs use the
    values of all notebooks and runs. Forms: ``2.41``, ``540,672``, ``0.11%``, ``1.15×``, ``3.35e-3``,
    ``3.35·10⁻³``, ``3.35·10^-3``, ``7.3\\cdot10^{-4}``, ``10^{-3}``; a unit after it is ignored.
(b) **cited**: its sentence names a link target defined in the same file (a line ``[article]: #sources "the
    original write-up"``, used as ``[article]`` or ``[text][article]``) or links to a web page
    (``[text](https://...)``). Sentences split at ". ", "; ", line ends and table cells.
A code span holding only figures, one of them with decimals (``0.957``, ``[0.949, 0.963]``), is a measured figure
and checked like prose. The values of a notebook are those of its published runs, never an earlier run's: a figure
quoted from the run before a republication is refused.
(c) **structure**, never checked: text in other code spans, fenced code, HTML comments, the table that
    ``lora-lab runs --matrix`` writes between its markers (generated from the run files, kept current by a test),
    tags and entities, link destinations, URLs, reference definitions, LaTeX command names and subscripts; digits
    inside a word or
    identifier (``fp32``, ``Qwen2.5-0.5B``, ``q_proj``, ``top-8``, ``r16``, versions such as ``3.12.3``);
    heading numbers and ordered-list markers; integers below 100 with no decimal point, no ``%`` and no
    ``×``/``x`` right after them (``2 layers`` is exempt, ``2×`` is checked).
"""

from __future__ import annotations

import ast
import bisect
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from lora_lab.lab.run_table import MATRIX_END, MATRIX_START

READMES = ("README.md", "benchmarks/README.md")
NOTEBOOK_NAME = re.compile(r"[0-9]{2}_.+\.ipynb")
CONTEXT_CHARS = 70
UNITS = {"x", "ms", "us", "ns", "s", "GB", "GiB", "MB", "MiB", "KB", "KiB", "TB", "TiB"}  # may touch the digits
WORDISH = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

# --- what is masked (blanked to spaces, so columns and line numbers stay put) ---------------------------------
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
HTML_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.S)
# a table `lora-lab runs --matrix` writes from the run files (tests/test_docs_runs_matrix.py keeps it current)
GENERATED = re.compile(re.escape(MATRIX_START) + r".*?" + re.escape(MATRIX_END), re.S)
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(?:[^\n]|\n(?![ \t]*\n))+?(?<!`)\1(?!`)")
REF_DEFINITION = re.compile(r"^ {0,3}\[(?!\^)([^\]\n]+)\]:[ \t]*\S.*$", re.M)
LINK_DESTINATION = re.compile(r"\](\((?:[^()\s]|\([^()\s]*\))*(?:\s+\"[^\"\n]*\")?\s*\))")
URL = re.compile(r"https?://[^\s<>()\[\]`]+")
HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9-]*(?:\s[^<>\n]*)?/?>")
HTML_ENTITY = re.compile(r"&#?[A-Za-z0-9]+;")
LATEX_COMMAND = re.compile(r"\\(?!(?:cdot|times)\s*10(?:\^|[⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺]))[A-Za-z]+")
LATEX_SUBSCRIPT = re.compile(r"_\{[^{}\n]*\}")
HEADING_NUMBER = re.compile(r"^ {0,3}#{1,6}[ \t]+([0-9]+(?:\.[0-9]+)*\.?)(?=\s|$)", re.M)
LIST_MARKER = re.compile(r"^[ \t]*([0-9]{1,9}[.)])(?=\s|$)", re.M)
BRACKETS = re.compile(r"\[([^\]\n]+)\]")

# --- numbers, sentences, citations ----------------------------------------------------------------------------
_POWER = r"10(?:\^\{?[-−+]?[0-9]+\}?|[⁻⁺]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+)"
NUMBER = re.compile(
    rf"(?P<mantissa>[0-9]+(?:\.[0-9]+)?)[ \t]*(?:·|⋅|\\cdot|×|\\times)[ \t]*(?P<power>{_POWER})"
    r"|(?P<e>[0-9]+(?:\.[0-9]+)?[eE][-+]?[0-9]+)"
    rf"|(?P<bare>{_POWER})"
    r"|(?P<plain>[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?)"
)
RANGE_LEFT = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?-)+")  # "644-" of 644-678: a range, not a word
RANGE_RIGHT = re.compile(r"(?:-[0-9]+(?:\.[0-9]+)?)+")
PERCENT = re.compile(r"[ \t]*\\?%")
SENTENCE_END = re.compile(r"[.;](?=\s)")
INLINE_EXTERNAL_LINK = re.compile(r"\]\(\s*<?https?://")
NUMERIC_TEXT = re.compile(r"\s*[-+]?[0-9.]+(?:[eE][-+]?[0-9]+)?(?:\s*,\s*[-+]?[0-9.]+(?:[eE][-+]?[0-9]+)?)*\s*")
# a code span holding only figures, one with decimals among them (`0.956`, `[0.948, 0.962]`, `2.43e-4`): a measured
# figure, checked like prose; a code span of integers (`4096`, `128,256`) is a shape or a setting, i.e. structure
MEASURED_SPAN = re.compile(r"[\s\[\](),;0-9eE+\-−×x%]*[0-9]\.[0-9][\s\[\](),;0-9.eE+\-−×x%]*")
BACKTICKS = re.compile(r"`+")
SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺−", "0123456789-+-")


@dataclass(frozen=True)
class Violation:
    path: str  # relative to the repository, with "/"
    cell: int | None  # index among all cells of the notebook; None for a README
    line: int  # 1-based, within the cell (notebooks) or the file (READMEs)
    number: str  # as written, with its %/× if any
    context: str

    def text(self) -> str:
        where = self.path if self.cell is None else f"{self.path} cell {self.cell}"
        return f"{where} line {self.line}: {self.number}  | {self.context}"


@dataclass
class ProseReport:
    violations: list[Violation] = field(default_factory=list)
    checked: int = 0  # numbers that were not structure, cited or not
    files: int = 0
    repo: str = ""  # the directory checked, named when nothing was found there

    @property
    def ok(self) -> bool:
        """No violation, and something was checked: a check that found no file proves nothing."""
        return not self.violations and self.files > 0

    def text(self) -> str:
        lines = [violation.text() for violation in self.violations]
        if self.files == 0:
            where = Path(self.repo) if self.repo else Path(".")
            missing = "" if where.is_dir() else " (no such directory)"
            lines.append(
                f"check-prose FAILED: nothing to check in {where}{missing}: no notebooks/NN_*.ipynb, "
                f"{' or '.join(READMES)}. Run it inside a lora_lab checkout or name one with --repo."
            )
        elif self.ok:
            lines.append(f"check-prose OK: {self.checked} numbers checked in {self.files} files")
        else:
            files = len({violation.path for violation in self.violations})
            lines.append(
                f"check-prose: {len(self.violations)} unchecked number(s) in {files} file(s); {self.checked} numbers "
                "checked. Prose must not restate a result by hand: record the number in the run (lora_lab.lab.record) "
                "and let a code cell print it, cite it ([label] in its sentence plus a line "
                '`[label]: URL "source"` in the same file), or drop it.'
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class ProseNumber:
    written: str
    value: Decimal
    integer: bool  # written without decimals or exponent: must equal a value exactly
    percent: bool
    ratio: bool  # × or x right after it


class Values:
    """Absolute values of recorded, registered and configured numbers, searched at a printed precision."""

    def __init__(self, numbers: Iterable[float]):
        self.sorted = sorted({abs(x) for x in numbers if math.isfinite(x)})

    def matches(self, number: ProseNumber) -> bool:
        exponent = number.value.as_tuple().exponent
        half = Decimal(0) if number.integer else Decimal(5).scaleb(exponent - 1)
        targets = [(number.value, half)] + ([(number.value / 100, half / 100)] if number.percent else [])
        return any(self._near(target, width) for target, width in targets)

    def _near(self, target: Decimal, half: Decimal) -> bool:
        low, high = float(target - half), float(target + half)
        start = bisect.bisect_left(self.sorted, low - 1e-9 * abs(low))
        stop = bisect.bisect_right(self.sorted, high + 1e-9 * abs(high))
        return any(abs(Decimal(repr(v)) - target) <= half for v in self.sorted[start:stop])


# --- the values a notebook may state --------------------------------------------------------------------------
def _numbers(obj: Any) -> Iterator[float]:
    """Every number in a JSON/YAML/literal structure; strings count only if they are numbers ("4096,8192")."""
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        try:
            yield float(obj)
        except OverflowError:
            return
    elif isinstance(obj, str):
        if NUMERIC_TEXT.fullmatch(obj):
            for part in re.split(r"[\s,]+", obj.strip()):
                try:
                    yield float(part)
                except ValueError:
                    pass
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _numbers(value)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from _numbers(value)


def _parameter_cell_numbers(notebook: dict) -> Iterator[float]:
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            try:
                tree = ast.parse(_source(cell))
            except SyntaxError:
                continue
            for node in tree.body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    try:
                        yield from _numbers(ast.literal_eval(node.value))
                    except (ValueError, TypeError):  # not a literal (an expression): nothing to print from it
                        pass


def _run_numbers(repo: Path, predictions: list, stem: str | None = None) -> list[float]:
    """Metrics and parameters of the published run of notebook ``stem`` (None: of all) on each profile (not of an
    earlier run: a figure quoted from one is stale), and its thresholds."""
    numbers: list[float] = []
    for path in sorted(repo.glob(f"outputs/*/{stem or '*'}.metrics.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            numbers += [*_numbers(data.get("metrics")), *_numbers(data.get("parameters"))]
    for entry in predictions:
        if isinstance(entry, dict) and stem in (None, entry.get("notebook")):
            numbers += _numbers(entry.get("threshold"))
    return numbers


def _shared_numbers(repo: Path) -> tuple[list[float], list]:
    """Numbers of the bundled architecture configs, and the predictions file's entries."""
    configs = [x for path in sorted(repo.glob("lora_lab/configs/*.json"))
               for x in _numbers(json.loads(path.read_text(encoding="utf-8")))]
    path = repo / "predictions" / "predictions.yaml"
    predictions = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    return configs, predictions if isinstance(predictions, list) else []


# --- markdown -------------------------------------------------------------------------------------------------
def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _blank(text: str) -> str:
    return re.sub(r"[^\n]", " ", text)


def _blank_group(pattern: re.Pattern, text: str, group: int = 0,
                 keep: Callable[[re.Match], bool] = lambda match: False) -> str:
    """``text`` with ``group`` of every match of ``pattern`` blanked, except where ``keep(match)``."""
    def blank(match: re.Match) -> str:
        if keep(match):
            return match.group(0)
        start, end = (i - match.start() for i in match.span(group))
        return match.group(0)[:start] + _blank(match.group(0)[start:end]) + match.group(0)[end:]
    return pattern.sub(blank, text)


def _mask_code(text: str) -> str:
    """Fenced code, HTML comments, generated tables and code spans blanked: what is left is prose (links still in
    place)."""
    lines, fence = [], ""
    for line in text.split("\n"):
        opening = FENCE.match(line)
        if fence:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence) \
                    and not opening.group(2).strip():
                fence = ""
            line = _blank(line)
        elif opening:
            fence, line = opening.group(1), _blank(line)
        lines.append(line)
    text = _blank_group(CODE_SPAN, _blank_group(HTML_COMMENT, _blank_group(GENERATED, "\n".join(lines))),
                        keep=lambda match: bool(MEASURED_SPAN.fullmatch(match.group(0).strip("`"))))
    return _blank_group(BACKTICKS, text)


def _label(text: str) -> str:
    return " ".join(text.lower().split())


def _mask_structure(prose: str, labels: set[str]) -> str:
    """``prose`` with links, URLs, markup, LaTeX commands, reference labels, heading and list numbers blanked."""
    text = _blank_group(REF_DEFINITION, prose)
    text = _blank_group(LINK_DESTINATION, text, 1)
    for pattern in (URL, HTML_TAG, HTML_ENTITY, LATEX_COMMAND, LATEX_SUBSCRIPT):
        text = _blank_group(pattern, text)
    text = _blank_group(BRACKETS, text, keep=lambda match: _label(match.group(1)) not in labels)
    return _blank_group(LIST_MARKER, _blank_group(HEADING_NUMBER, text, 1), 1)


def _segments(prose_line: str, masked_line: str) -> list[tuple[int, int]]:
    """Sentence spans of a line: split at ". ", "; " and, in table rows, at "|" (never inside [...])."""
    brackets = [match.span() for match in BRACKETS.finditer(prose_line)]
    cuts = [m.end() for m in SENTENCE_END.finditer(masked_line)]
    if masked_line.lstrip().startswith("|"):
        cuts += [i + 1 for i, char in enumerate(masked_line) if char == "|"]
    cuts = sorted(c for c in cuts if not any(start < c < end for start, end in brackets))
    bounds = [0, *cuts, len(masked_line)]
    return list(zip(bounds, bounds[1:]))


def _cites(segment: str, labels: set[str]) -> bool:
    return bool(INLINE_EXTERNAL_LINK.search(segment)) or any(
        _label(match.group(1)) in labels for match in BRACKETS.finditer(segment))


def _parse(match: re.Match, line: str) -> ProseNumber | None:
    """The number at ``match``, or None when it is structure (part of a word, or a small plain integer)."""
    start, end = match.span()
    left = start
    while left > 0 and line[left - 1] in WORDISH:
        left -= 1
    right = end
    while right < len(line) and line[right] in WORDISH:
        right += 1
    before, after = line[left:start].lstrip(".-"), line[end:right].rstrip(".-")
    if before and not RANGE_LEFT.fullmatch(before):
        return None
    if after and after not in UNITS and not RANGE_RIGHT.fullmatch(after):
        return None
    percent = PERCENT.match(line, end)
    ratio = (line[end:end + 1] == "×" and not line[end + 1:end + 2].isdigit()) or after == "x"  # 4096×4096: a shape
    if match.group("plain"):
        digits = match.group("plain").replace(",", "")
        integer = "." not in digits
        if integer and int(digits) < 100 and not percent and not ratio:
            return None
    elif match.group("e"):
        digits, integer = match.group("e"), False
    else:
        power = (match.group("power") or match.group("bare")).translate(SUPERSCRIPTS)
        exponent = re.sub(r"[^0-9+-]", "", power[2:])
        digits, integer = f"{match.group('mantissa') or '1'}e{exponent}", False
    suffix = "%" if percent else (line[end] if line[end] == "×" else "x") if ratio else ""
    return ProseNumber(line[start:end] + suffix, Decimal(digits), integer, bool(percent), ratio)


def _prose_numbers(prose: str, labels: set[str]) -> Iterator[tuple[int, int, ProseNumber, bool]]:
    """(line number, column, number, cited) for every number of the (code-masked) text that is not structure."""
    masked = _mask_structure(prose, labels)
    for line_no, (prose_line, masked_line) in enumerate(zip(prose.split("\n"), masked.split("\n")), start=1):
        segments = _segments(prose_line, masked_line)
        for match in NUMBER.finditer(masked_line):
            number = _parse(match, masked_line)
            if number is not None:
                start, end = next(s for s in segments if s[0] <= match.start() < s[1])
                yield line_no, match.start(), number, _cites(prose_line[start:end], labels)


def _context(line: str, column: int, width: int) -> str:
    start = max(0, column + width // 2 - CONTEXT_CHARS // 2)
    end = min(len(line), start + CONTEXT_CHARS)
    start = max(0, end - CONTEXT_CHARS)
    return ("…" if start else "") + " ".join(line[start:end].split()) + ("…" if end < len(line) else "")


def _check_file(report: ProseReport, path: str, cells: list[tuple[int | None, str]], values: Values) -> None:
    prose = [(index, source, _mask_code(source)) for index, source in cells]
    labels = {_label(m.group(1)) for _, _, text in prose for m in REF_DEFINITION.finditer(text)}
    report.files += 1
    for index, source, text in prose:
        raw_lines = source.split("\n")
        for line_no, column, number, cited in _prose_numbers(text, labels):
            report.checked += 1
            if not cited and not values.matches(number):
                context = _context(raw_lines[line_no - 1], column, len(number.written))
                report.violations.append(Violation(path, index, line_no, number.written, context))


def check_prose(repo: Path) -> ProseReport:
    """Every number in the notebooks' markdown cells and the two READMEs that is not recorded, cited or structure.

    A ``repo`` holding none of those files (a wrong ``--repo``, a run outside the checkout) checks nothing, and
    the report is not ok: passing on nothing would hide the mistake."""
    repo = Path(repo)
    if not repo.is_dir():
        return ProseReport(repo=str(repo))
    configs, predictions = _shared_numbers(repo)
    report, union = ProseReport(repo=str(repo)), [*configs, *_run_numbers(repo, predictions)]
    for path in sorted((repo / "notebooks").glob("*.ipynb")):
        if not NOTEBOOK_NAME.fullmatch(path.name):
            continue
        notebook = json.loads(path.read_text(encoding="utf-8"))
        numbers = [*_parameter_cell_numbers(notebook), *_run_numbers(repo, predictions, path.stem), *configs]
        union += numbers
        cells = [(i, _source(cell)) for i, cell in enumerate(notebook.get("cells", []))
                 if cell.get("cell_type") == "markdown"]
        _check_file(report, path.relative_to(repo).as_posix(), cells, Values(numbers))
    everything = Values(union)
    pages = sorted(path.relative_to(repo).as_posix() for path in (repo / "docs").glob("*.md"))
    for name in (*READMES, *pages):
        if (repo / name).is_file():
            _check_file(report, name, [(None, (repo / name).read_text(encoding="utf-8"))], everything)
    return report
