"""The measurement ledger: one append-only CSV per profile, ``outputs/<profile>/measurements.csv``, one row per
measured figure.

Every benchmark and diagnostic that records a figure appends it through :func:`append_measurements`; prose that
quotes a measured number cites a row of it. Columns, in this order (:data:`COLUMNS`):

* ``date`` (UTC, ``YYYY-MM-DD``), ``commit`` (git commit of the code, hex; empty when unknown), ``code_hash``
  (:func:`lora_lab.lab.provenance.code_hash`; empty when unknown), ``device`` — filled from the running code and
  machine when a row does not give them;
* ``benchmark`` (what measured it, e.g. ``loss``), ``cell`` (the configuration, ``key=value`` pairs joined by
  ``;``), ``method`` (what was timed: an implementation, or ``a/b`` for a ratio of two);
* ``statistic`` — which figure: ``median``, ``ci_low`` / ``ci_high`` (the 95% interval of the median), ``mean``,
  ``min``, ``max``, ``value`` (a single measurement), or a named quantity of the source table (e.g.
  ``peak_extra_gib``, ``time_vs_liger``); ``value`` (a finite number) and its ``unit``;
* ``n`` (samples behind the figure) and ``sessions`` (separate processes they came from), empty when not recorded;
* ``published`` — whether a published notebook run used the figure; ``source`` — the file or tool output it came
  from.

Rows are only ever appended: :func:`append_measurements` validates every row before it writes any, refuses a file
whose header is not :data:`COLUMNS`, and never rewrites what is there.
"""
from __future__ import annotations

import csv
import datetime as _dt
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lora_lab.lab.profiles import PROFILES  # noqa: F401 - a ledger per profile, the capped ones' too

__all__ = [
    "COLUMNS",
    "LEDGER_NAME",
    "LedgerError",
    "ledger_path",
    "append_measurements",
    "check_measurements",
    "read_measurements",
    "summary_figures",
    "table_figures",
    "repetition_figures",
    "csv_figures",
    "table_name",
]

COLUMNS = ("date", "commit", "code_hash", "device", "benchmark", "cell", "method", "statistic", "value", "unit",
           "n", "sessions", "published", "source")
LEDGER_NAME = "measurements.csv"
REQUIRED = ("benchmark", "cell", "method", "statistic", "value", "unit", "source")

_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_HEX = re.compile(r"^[0-9a-f]+$")
_STATISTIC = re.compile(r"^[a-z][a-z0-9_]*$")


class LedgerError(ValueError):
    """A row the ledger refuses, or a file that is not a ledger."""


def ledger_path(profile: str, outputs_root: Path | str | None = None) -> Path:
    """``<outputs_root>/<profile>/measurements.csv``; ``outputs_root`` defaults to the checkout's ``outputs/``."""
    if profile not in PROFILES:
        raise LedgerError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    if outputs_root is None:
        from lora_lab.lab.provenance import find_repo_root

        root = find_repo_root(Path(__file__).resolve().parent) or find_repo_root()
        if root is None:
            raise LedgerError("no lora_lab checkout around the package or the current directory: give ledger=PATH")
        outputs_root = root / "outputs"
    return Path(outputs_root) / profile / LEDGER_NAME


def _defaults(profile: str) -> dict[str, str]:
    from lora_lab.lab.provenance import code_hash, device_name, git_state

    return {"date": _dt.datetime.now(_dt.timezone.utc).date().isoformat(),
            "commit": git_state()["git_commit"] or "", "code_hash": code_hash(), "device": device_name(profile)}


def _count(row_at: str, column: str, value: Any) -> str:
    if value is None or value == "":
        return ""
    number = _number(value)
    if number is None or not number.is_integer() or number < 1:
        raise LedgerError(f"{row_at}: {column} must be a whole number >= 1 or empty, got {value!r}")
    return str(int(number))


def _clean(row: Mapping[str, Any], at: int, defaults: Mapping[str, str]) -> dict[str, str]:
    """``row`` with its defaults filled in, every cell as the text the file holds; a bad value raises."""
    row_at = f"measurement row {at}"
    if not isinstance(row, Mapping):
        raise LedgerError(f"{row_at}: a row must be a dict of columns, got {type(row).__name__}")
    unknown = [key for key in row if key not in COLUMNS]
    if unknown:
        raise LedgerError(f"{row_at}: unknown column(s) {', '.join(map(repr, unknown))} "
                          f"(columns: {', '.join(COLUMNS)})")
    missing = [key for key in REQUIRED if row.get(key) is None or str(row.get(key)).strip() == ""]
    if missing:
        raise LedgerError(f"{row_at}: missing {', '.join(missing)}")
    out = {key: row.get(key) for key in COLUMNS}
    for key in ("date", "commit", "code_hash", "device"):
        if out[key] is None:
            out[key] = defaults[key]
    for key in ("date", "commit", "code_hash", "device", "benchmark", "cell", "method", "statistic", "unit",
                "source"):
        text = out[key]
        if not isinstance(text, str):
            raise LedgerError(f"{row_at}: {key} must be text, got {text!r}")
        if text != text.strip() or "\n" in text or "\r" in text:
            raise LedgerError(f"{row_at}: {key} must be one line without surrounding spaces, got {text!r}")
    if not _DATE.match(out["date"]):
        raise LedgerError(f"{row_at}: date must be YYYY-MM-DD, got {out['date']!r}")
    try:
        _dt.date.fromisoformat(out["date"])
    except ValueError:
        raise LedgerError(f"{row_at}: date {out['date']!r} is no calendar day") from None
    for key, lengths in (("commit", range(7, 41)), ("code_hash", range(8, 65))):
        if out[key] and (not _HEX.match(out[key]) or len(out[key]) not in lengths):
            raise LedgerError(f"{row_at}: {key} must be lowercase hex ({lengths.start}-{lengths.stop - 1} digits) "
                              f"or empty, got {out[key]!r}")
    if not _STATISTIC.match(out["statistic"]):
        raise LedgerError(f"{row_at}: statistic must be a lowercase name such as median, ci_low, ci_high, mean, "
                          f"max, value, got {out['statistic']!r}")
    value = out["value"]
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise LedgerError(f"{row_at}: value must be a finite number, got {value!r}")
    out["value"] = repr(number) if isinstance(value, float) else str(value).strip()
    out["n"] = _count(row_at, "n", out["n"])
    out["sessions"] = _count(row_at, "sessions", out["sessions"])
    published = out["published"]
    if published is None:
        published = False
    if isinstance(published, str) and published.lower() in ("true", "false"):
        published = published.lower() == "true"
    if not isinstance(published, bool):
        raise LedgerError(f"{row_at}: published must be true or false, got {published!r}")
    out["published"] = "true" if published else "false"
    return out


def _check_header(path: Path) -> None:
    with open(path, newline="", encoding="utf-8") as handle:
        header = next(csv.reader(handle), None)
    if header is not None and tuple(header) != COLUMNS:
        raise LedgerError(f"{path}: not a measurement ledger (header {header}; a ledger's is {list(COLUMNS)})")


def check_measurements(rows: Iterable[Mapping[str, Any]], profile: str = "gpu") -> list[dict[str, str]]:
    """``rows`` as :func:`append_measurements` would write them (defaults filled in, every value as text), or
    :class:`LedgerError` naming the first bad row, column and value. Writes nothing."""
    rows = list(rows)
    needs_defaults = any(row.get(key) is None for row in rows if isinstance(row, Mapping)
                         for key in ("date", "commit", "code_hash", "device"))
    defaults = _defaults(profile) if needs_defaults else {}
    return [_clean(row, at, defaults) for at, row in enumerate(rows)]


def append_measurements(rows: Iterable[Mapping[str, Any]], profile: str = "gpu", ledger: Path | str | None = None,
                        outputs_root: Path | str | None = None, skip_present: bool = False) -> Path:
    """Append ``rows`` (dicts of :data:`COLUMNS`) to the ledger ``ledger`` (default :func:`ledger_path`).

    ``date``, ``commit``, ``code_hash`` and ``device`` a row leaves out come from the running code and the
    ``profile``'s device; ``published`` defaults to false. Every row is checked before any is written: a bad one
    raises :class:`LedgerError` naming the row, the column and the value, and the file is left as it was. Returns
    the ledger's path. ``skip_present``: a row equal in every column to one the ledger holds is not appended again
    (the same run published twice)."""
    path = Path(ledger) if ledger is not None else ledger_path(profile, outputs_root)
    cleaned = check_measurements(rows, profile)
    if path.is_file() and path.stat().st_size > 0:
        _check_header(path)
        with open(path, "rb") as handle:  # a file cut mid-line would glue the first new row onto it
            handle.seek(-1, 2)
            if handle.read(1) != b"\n":
                raise LedgerError(f"{path}: its last line is unfinished; mend the file before appending")
        new = False
        if skip_present:
            with open(path, newline="", encoding="utf-8") as handle:
                present = {tuple(row[c] for c in COLUMNS) for row in csv.DictReader(handle)}
            cleaned = [row for row in cleaned if tuple(row[c] for c in COLUMNS) not in present]
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        new = True
    with open(path, "a", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerows(cleaned)
    return path


def _typed(row: dict[str, str]) -> dict[str, Any]:
    return {**row, "value": float(row["value"]), "n": int(row["n"]) if row["n"] else None,
            "sessions": int(row["sessions"]) if row["sessions"] else None, "published": row["published"] == "true"}


def read_measurements(profile: str = "gpu", ledger: Path | str | None = None, outputs_root: Path | str | None = None,
                      **match: Any) -> list[dict[str, Any]]:
    """The ledger's rows (``value`` a float, ``n`` / ``sessions`` ints or None, ``published`` a bool), those whose
    columns equal ``match`` (e.g. ``benchmark="loss"``) only. A missing ledger has no rows."""
    unknown = [key for key in match if key not in COLUMNS]
    if unknown:
        raise LedgerError(f"unknown column(s) to match: {', '.join(unknown)} (columns: {', '.join(COLUMNS)})")
    path = Path(ledger) if ledger is not None else ledger_path(profile, outputs_root)
    if not path.is_file():
        return []
    _check_header(path)
    with open(path, newline="", encoding="utf-8") as handle:
        rows = [_typed(row) for row in csv.DictReader(handle)]
    return [row for row in rows if all(row[key] == value for key, value in match.items())]


def summary_figures(summary: Mapping[str, Any], *, benchmark: str, cell: str, method: str, unit: str,
                    source: str, **columns: Any) -> list[dict[str, Any]]:
    """Ledger rows of one :func:`lora_lab.lab.measure.summarize` result: its median and 95% interval, each with
    the summary's ``n`` and ``sessions``."""
    low, high = summary["ci95"]
    base = {"benchmark": benchmark, "cell": cell, "method": method, "unit": unit, "source": source,
            "n": summary.get("n"), "sessions": summary.get("sessions"), **columns}
    return [{**base, "statistic": name, "value": float(value)}
            for name, value in (("median", summary["median"]), ("ci_low", low), ("ci_high", high))]


# --- a benchmark's table as ledger rows -------------------------------------------------------------------------
METHOD_COLUMNS = ("method", "impl", "implementation", "variant", "kernel", "name", "component")
# provenance and bookkeeping columns: never a cell key, never a figure
META_COLUMNS = {"code_hash", "git_commit", "git_dirty", "version", "note", "status", "ms_each", "rep", "session",
                "smoke", "timing", "error", "fastest_baseline", "n", "sessions", "calls", "warmup", "seed"}
_PROSE = re.compile(r"(, |\(|\n)")  # a description or message, not a configuration value
_FIGURE_NAME = re.compile(r"(^ms$|_ms$|_us$|_s$|gib|bytes|tflops|gbs|_vs_|^vs_|speedup|slowdown|ratio|fraction|"
                          r"share|err|peak|loss|ci95)")


def _number(text: Any) -> float | None:
    if text is None or text == "" or isinstance(text, bool):
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _unit(column: str) -> str:
    name = column.removesuffix("_ci95_low").removesuffix("_ci95_high")
    for pattern, unit in ((r"(^ms$|_ms$)", "ms"), (r"_us$", "us"), (r"_per_s$", "1/s"), (r"_s$", "s"),
                          (r"gib", "GiB"),
                          (r"bytes", "bytes"), (r"tflops", "TFLOP/s"), (r"gbs", "GB/s"),
                          (r"(vs_|speedup|slowdown|ratio|fraction|share)", "ratio"), (r"err", "relative error")):
        if re.search(pattern, name):
            return unit
    return "1"


def _statistic(column: str, summarised: bool) -> str:
    for suffix, stat in (("_ci95_low", "ci_low"), ("_ci95_high", "ci_high")):
        if column.endswith(suffix):
            base = column.removesuffix(suffix)
            return stat if base == "ms" else f"{base}_{stat}"
    if column == "ms":
        return "median" if summarised else "value"
    return column


def table_figures(rows: Iterable[Mapping[str, Any]], *, benchmark: str, source: str,
                  published: bool = False) -> list[dict[str, Any]]:
    """Ledger rows of a benchmark's summary table (one row per cell and method, as the ``*_summary.csv`` files hold):
    every number of a figure column (``ms``, ``*_ms``, ``*_ci95_low``/``_high``, ``*_gib``, ``tflops``, ratios,
    errors, ...) becomes a row. The cell is the row's short text and whole-number columns (``key=value;...``), the
    method its ``method`` / ``impl`` / ``variant`` column; ``n``, ``sessions``, ``git_commit`` and ``code_hash``
    columns, where present, fill those of the ledger row."""
    rows = [dict(row) for row in rows]
    if not rows:
        return []
    columns = list(dict.fromkeys(key for row in rows for key in row))
    method_column = next((c for c in METHOD_COLUMNS if c in columns), None)
    summarised = "rep" not in columns and any(c in columns for c in ("n", "ms_ci95_low"))

    def is_cell(column: str) -> bool:
        if column in META_COLUMNS or column == method_column or _FIGURE_NAME.search(column) \
                or "verdict" in column or column.endswith("_each"):
            return False
        values = [row.get(column) for row in rows if row.get(column) not in (None, "")]
        return all(_number(v) is not None and float(v).is_integer() or
                   (_number(v) is None and isinstance(v, str) and not _PROSE.search(v) and len(v) <= 120)
                   for v in values)

    # a table of repetitions (no summary): the repetition and process are part of what identifies a row
    keys = [c for c in ("session", "rep") if c in columns and not summarised]
    cell_columns = [c for c in columns if is_cell(c)] + keys
    figure_columns = [c for c in columns if c not in cell_columns and c not in META_COLUMNS and c != method_column
                      and _FIGURE_NAME.search(c)]
    out = []
    for row in rows:
        cell = ";".join(f"{c}={row[c]}" for c in cell_columns if row.get(c) not in (None, ""))
        method = str(row.get(method_column) or "") if method_column else ""
        for column in figure_columns:
            value = _number(row.get(column))
            if value is None:
                continue
            entry = {"benchmark": benchmark, "cell": cell or "-", "method": method or "-",
                     "statistic": _statistic(column, summarised), "value": value, "unit": _unit(column),
                     "n": row.get("n") if summarised else None, "sessions": row.get("sessions") or None,
                     "published": published, "source": source}
            for ledger_key, table_key in (("commit", "git_commit"), ("code_hash", "code_hash")):
                if _HEX.match(str(row.get(table_key) or "")):
                    entry[ledger_key] = str(row[table_key])
            out.append(entry)
    return out


def repetition_figures(rows: Iterable[Mapping[str, Any]], *, benchmark: str, source: str,
                       published: bool = False) -> list[dict[str, Any]]:
    """Ledger rows of a table of repetitions (one row per cell, method and ``rep``, with ``ms``): per cell and
    method the median ``ms`` and its 95% interval (:func:`lora_lab.lab.measure.summarize`), ``n`` the repetitions
    and ``sessions`` the processes they came from. Rows without ``ms`` (skipped, out of memory) give no sample."""
    from lora_lab.lab import measure

    rows = [dict(row) for row in rows]
    if not rows:
        return []
    columns = list(dict.fromkeys(key for row in rows for key in row))
    method_column = next((c for c in METHOD_COLUMNS if c in columns), None)
    cell_columns = [c for c in columns if c not in META_COLUMNS and c != method_column
                    and not _FIGURE_NAME.search(c) and not c.endswith("_each")
                    and all(_number(v) is not None and float(v).is_integer()
                            or (_number(v) is None and isinstance(v, str) and not _PROSE.search(v) and len(v) <= 120)
                            for v in (row.get(c) for row in rows) if v not in (None, ""))]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if _number(row.get("ms")) is None:
            continue
        cell = ";".join(f"{c}={row[c]}" for c in cell_columns if row.get(c) not in (None, ""))
        groups.setdefault((cell or "-", str(row.get(method_column) or "-")), []).append(row)
    out = []
    for (cell, method), members in groups.items():
        summary = measure.summarize([float(r["ms"]) for r in members],
                                    sessions=measure.sessions_in({"session": r.get("session")} for r in members))
        provenance = {}
        for ledger_key, table_key in (("commit", "git_commit"), ("code_hash", "code_hash")):
            found = {str(r.get(table_key) or "") for r in members}
            if len(found) == 1 and _HEX.match(next(iter(found))):
                provenance[ledger_key] = next(iter(found))
        out += [{**row, "published": published}
                for row in summary_figures(summary, benchmark=benchmark, cell=cell, method=method, unit="ms",
                                           source=source, **provenance)]
    return out


def table_name(path: Path | str) -> str:
    """The benchmark a CSV's rows are filed under: its name without the notebook number and ``_summary``
    (``07_loss_block_summary.csv`` -> ``loss_block``)."""
    return re.sub(r"_summary$", "", re.sub(r"^\d\d_", "", Path(path).stem))


def csv_figures(path: Path | str, *, benchmark: str | None = None, source: str | None = None,
                published: bool = False) -> list[dict[str, Any]]:
    """Ledger rows of a benchmark CSV: :func:`repetition_figures` for a table of repetitions (``rep`` and ``ms``
    columns), else :func:`table_figures`. ``benchmark`` defaults to :func:`table_name`, ``source`` to the path."""
    path = Path(path)
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    figures = repetition_figures if rows and "rep" in rows[0] and "ms" in rows[0] else table_figures
    return figures(rows, benchmark=benchmark or table_name(path), source=source or path.as_posix(),
                   published=published)
