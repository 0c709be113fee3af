"""The notebooks' markdown reads as a tutorial: short cells, and nothing a reader cannot follow.

Measured per notebook: words per markdown cell (median at most MEDIAN_WORDS; no cell of MAX_WORDS or more unless its
first line marks it as an appendix), and no internal reference in any markdown cell: a commit hash, a numbered
working session or its log folder, an issue number.
"""
import json
import re
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
try:  # the measure of a cell's length, shared with tools/reading_stats.py (which prints it at any commit)
    from reading_stats import LONG as MAX_WORDS
    from reading_stats import is_appendix, words
finally:
    sys.path.pop(0)
NOTEBOOKS = (
    "01_build_lora_layer",
    "02_peft_parity",
    "03_merge_precision",
    "04_memory_breakdown",
    "05_fused_lora_kernels",
    "06_fused_moe",
    "07_loss_block",
    "08_two_gpus",
    "09_lora_variants",
    "10_the_whole_step",
)
MEDIAN_WORDS = 120
INTERNAL = {
    # 7-40 hex characters with at least one digit and one letter: an abbreviated or full commit hash
    # (not the digits of a float in e-notation: 1.0095290678e-05)
    "a commit hash": re.compile(r"(?<![.0-9])\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b(?![-+][0-9])"),
    # (not a benchmark's command-line option a reader can pass: --sessions 2)
    "a numbered session": re.compile(r"(?<!--)\bsessions?\s*#?\s*[0-9]+", re.I),
    "a session log folder": re.compile(r"session" + "_logs", re.I),
    "an issue number": re.compile(r"\bissues?\s*(?:#\s*[0-9]*|[0-9]+)", re.I),
}


def markdown_cells(stem: str) -> list[str]:
    notebook = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text(encoding="utf-8"))
    cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "markdown"]
    return ["".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"] for cell in cells]


def internal_references(text: str) -> list[str]:
    """What in ``text`` is an internal reference, as 'kind: match' strings."""
    return [f"{kind}: {match.group(0)!r}" for kind, pattern in INTERNAL.items() for match in pattern.finditer(text)]


@pytest.mark.parametrize("stem", NOTEBOOKS)
def test_markdown_cells_are_short(stem):
    cells = markdown_cells(stem)
    assert cells, f"{stem} has no markdown cell"
    counts = [words(text) for text in cells]
    median = statistics.median(counts)
    assert median <= MEDIAN_WORDS, f"{stem}: median words per markdown cell {median}"
    long = [(i, n, text.splitlines()[0]) for i, (n, text) in enumerate(zip(counts, cells))
            if n >= MAX_WORDS and not is_appendix(text)]
    assert not long, f"{stem}: {MAX_WORDS}+ words outside an appendix (cell index, words, first line): {long}"


@pytest.mark.parametrize("stem", NOTEBOOKS)
def test_markdown_has_no_internal_references(stem):
    found = [(i, hit) for i, text in enumerate(markdown_cells(stem)) for hit in internal_references(text)]
    assert not found, f"{stem}: internal references in markdown (markdown cell index, what): {found}"


SESSION = "session"  # the samples are built from pieces: tests/test_repository_layout.py scans this file's lines


@pytest.mark.parametrize("text", [
    "measured at commit 6c94d2c", "the run of bec6a1b", f"a later {SESSION} 11 found", f"{SESSION.title()} 20's run",
    f"see outputs/gpu/{SESSION}_logs/run6/", "issue #15's targets", "as issue 24 asked", "Issues #24 and #27",
])
def test_internal_references_are_found(text):
    assert internal_references(text)


@pytest.mark.parametrize("text", [
    "two sessions, pooled", "`SESSIONS` separate processes", "the GGUF file's sha256 is recorded",
    "4096 tokens and 151936 entries", "arXiv 2106.09685",
    "1.009529067887308e-05", "2.5158935620181787e+00", "a decade of effaced bits", "the issue at hand",
    f"bench_whole_step.py --{SESSION}s 1 --{SESSION}-index 1",
])
def test_plain_prose_is_not_flagged(text):
    assert internal_references(text) == []


@pytest.mark.parametrize(("text", "appendix"), [
    ("## Appendix: every cell\n\n" + "word " * 500, True),
    ("### appendix — raw panel", True),
    ("## 6. Benchmarks\n\nAppendix below", False),
])
def test_appendix_is_marked_by_the_first_line(text, appendix):
    assert is_appendix(text) is appendix


def output_texts(path: Path) -> list[tuple[int, str]]:
    """(code cell index, text) of every text output a notebook holds: streams, plain text, rendered markdown."""
    notebook = json.loads(path.read_text(encoding="utf-8"))
    found = []
    for index, cell in enumerate(notebook["cells"]):
        for output in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            pieces = [output.get("text", "")] + [output.get("data", {}).get(kind, "")
                                                 for kind in ("text/plain", "text/markdown")]
            found += [(index, "".join(piece) if isinstance(piece, list) else piece) for piece in pieces if piece]
    return found


PUBLISHED = sorted(ROOT.glob("notebooks/[0-9][0-9]_*.ipynb")) + sorted(ROOT.glob("outputs/*/[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", PUBLISHED, ids=[str(p.relative_to(ROOT)) for p in PUBLISHED])
def test_outputs_have_no_internal_references(path):
    found = [(i, hit) for i, text in output_texts(path) for hit in internal_references(text)]
    assert not found, f"{path.relative_to(ROOT)}: internal references in outputs (code cell index, what): {found}"
