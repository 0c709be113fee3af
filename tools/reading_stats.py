"""How each notebook reads, at one or more commits: words per markdown cell and the verdict rows it shows.

    python tools/reading_stats.py [REV ...]          # default HEAD; e.g. an older commit beside HEAD

Per notebook: markdown cells, the median and the largest words per markdown cell (the largest outside an appendix:
a cell whose first line is an ``Appendix`` heading), how many cells outside an appendix have 400 words or more
(tests/test_notebook_prose.py holds HEAD to a median of at most 120 and none), and the gpu verdict rows: the rows of
its reader table (predictions/reader_tables.yaml) where the commit has one, else every gpu prediction of the
notebook that no later entry supersedes (what its full verdict table printed). Reads the commits through git, so
the working tree is never touched.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
APPENDIX = re.compile(r"^\s*#+\s*appendix\b", re.I)
LONG = 400


class StatsError(Exception):
    """Bad input; the message names it."""


def _show(rev: str, path: str) -> str | None:
    done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def _notebooks(rev: str) -> list[str]:
    done = subprocess.run(["git", "ls-tree", "--name-only", rev, "notebooks/"], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise StatsError(f"{rev}: no such commit here ({done.stderr.strip()})")
    return sorted(Path(p).stem for p in done.stdout.split() if re.fullmatch(r"notebooks/\d\d_.*\.ipynb", p))


def words(text: str) -> int:
    return len(text.split())


def is_appendix(text: str) -> bool:
    """Whether a markdown cell is an appendix: its first line an ``Appendix`` heading."""
    return bool(APPENDIX.match(text.splitlines()[0] if text.strip() else ""))


def markdown_words(notebook_text: str) -> list[tuple[int, bool]]:
    """(words, is an appendix) of each markdown cell of a notebook's JSON text."""
    cells = [c for c in json.loads(notebook_text)["cells"] if c["cell_type"] == "markdown"]
    texts = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]
    return [(words(text), is_appendix(text)) for text in texts]


def verdict_rows(stem: str, predictions: list[dict], tables: dict | None) -> tuple[int, str]:
    """(gpu verdict rows the notebook shows, where the count comes from)."""
    profiles = {p["id"]: p.get("profiles") or [] for p in predictions if isinstance(p, dict) and "id" in p}
    if tables and stem in tables:
        rows = (tables[stem] or {}).get("shown") or []
        return sum(1 for row in rows if "gpu" in profiles.get(row.get("id"), [])), "reader table"
    superseded = {p["supersedes"] for p in predictions if isinstance(p, dict) and p.get("supersedes")}
    return sum(1 for p in predictions if isinstance(p, dict) and p.get("notebook") == stem
               and "gpu" in (p.get("profiles") or []) and p.get("id") not in superseded), "every prediction"


def stats(rev: str) -> list[dict]:
    predictions = yaml.safe_load(_show(rev, "predictions/predictions.yaml") or "[]") or []
    if isinstance(predictions, dict):  # a file that keeps its entries under a key
        predictions = next((v for v in predictions.values() if isinstance(v, list)), [])
    tables_text = _show(rev, "predictions/reader_tables.yaml")
    tables = yaml.safe_load(tables_text) if tables_text else None
    rows = []
    for stem in _notebooks(rev):
        counts = markdown_words(_show(rev, f"notebooks/{stem}.ipynb") or '{"cells": []}')
        body = [n for n, appendix in counts if not appendix]
        verdicts, source = verdict_rows(stem, predictions, tables)
        rows.append({"notebook": stem, "markdown_cells": len(counts),
                     "median_words": statistics.median([n for n, _ in counts]) if counts else 0,
                     "max_words": max(body, default=0), "long_cells": sum(n >= LONG for n in body),
                     "verdict_rows": verdicts, "verdicts_from": source})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revs", nargs="*", default=["HEAD"], help="commits to read (default HEAD)")
    args = parser.parse_args(argv)
    try:
        for rev in args.revs:
            short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True,
                                   text=True).stdout.strip() or rev
            print(f"{rev} ({short})")
            print(f"  {'notebook':24s} {'md cells':>8s} {'median':>7s} {'max':>5s} {f'>={LONG}':>6s} "
                  f"{'verdict rows (gpu)':>19s}")
            for r in stats(rev):
                print(f"  {r['notebook']:24s} {r['markdown_cells']:8d} {r['median_words']:7.0f} {r['max_words']:5d} "
                      f"{r['long_cells']:6d} {r['verdict_rows']:6d} ({r['verdicts_from']})")
    except StatsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
