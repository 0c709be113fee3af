"""outputs/ holds what runs wrote (notebooks, metrics, CSVs, plots, logs, READMEs), never code: a diagnostic script
belongs in benchmarks/ (it measures) or tools/, where ruff and the README's layout table see it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_SUFFIXES = {".py", ".sh", ".ipy", ".pyx"}


def test_no_script_under_outputs():
    scripts = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "outputs").rglob("*")
                     if path.is_file() and path.suffix in CODE_SUFFIXES)
    assert scripts == [], f"move these to benchmarks/ or tools/: {scripts}"


def _tracked() -> list[str] | None:
    import subprocess

    try:
        done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines() if done.returncode == 0 and done.stdout else None


def test_no_tracked_path_names_a_working_session():
    """The tree is organised by what things are, not by when they were made: no file or folder named after a
    session (measurements live in outputs/<profile>/measurements.csv, scripts in tools/ by what they do)."""
    import pytest

    tracked = _tracked()
    if tracked is None:
        pytest.skip("not a git checkout")
    named = [path for path in tracked if "session" in path.lower()]
    assert named == [], f"rename or remove: {named}"


# a working session cited by number ("session N", "Sessions N and M") or the old log folders; a timing session's
# progress ("session k/n": k of n processes), the --sessions option and folder names such as session0 are measurement
# terms
WORKING_SESSION = re.compile(r"(?<!-)\bsessions? \d+(?!\s*/)|session" + "_logs", re.IGNORECASE)
TEXT_SUFFIXES = {".py", ".sh", ".md", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".txt", ".json"}


def test_code_cites_no_working_session():
    """Code, tests, benchmarks and tools speak of themselves: a measurement is cited by commit and ledger row."""
    found = []
    for folder in ("lora_lab", "tests", "benchmarks", "tools"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name == "Makefile") \
                    and "__pycache__" not in path.parts:
                for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                    if WORKING_SESSION.search(line):
                        found.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {line.strip()[:100]}")
    assert found == [], "cite the commit or the ledger instead:\n" + "\n".join(found)
