"""outputs/ holds what runs wrote (notebooks, metrics, CSVs, plots, logs, READMEs), never code: a diagnostic script
belongs in benchmarks/ (it measures) or tools/, where ruff and the README's layout table see it."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_SUFFIXES = {".py", ".sh", ".ipy", ".pyx"}


def test_no_script_under_outputs():
    scripts = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "outputs").rglob("*")
                     if path.is_file() and path.suffix in CODE_SUFFIXES)
    assert scripts == [], f"move these to benchmarks/ or tools/: {scripts}"
